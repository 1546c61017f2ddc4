"""The pure train and eval steps, shared by every model.

A model plugs in through one loss function::

    loss_fn(params, batch, *, rng, extra, deterministic) -> (loss_sum, sums, new_extra)

  loss_sum: float32 scalar SUMMED over the target tokens of this batch (the part on this device
    under pmap): the quantity differentiated.
  sums: dict of float32 scalars also summed over tokens; it must hold 'n_tokens' (the number of
    non-pad targets) and may hold more (e.g. 'nll_sum', the unsmoothed negative log-likelihood;
    'loss_sum', the loss to report when it differs from the differentiated one).
  new_extra: the state carried to the next step (XL memory), or None.

The step normalises by the GLOBAL token count after summing over devices, so one step on eight
devices computes the same update as one step on one device, whatever the padding per shard.
`jit` / `pmap` and shardings are applied by `train.core.parallel`, not here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import lax

from train.core.state import TrainState
from transformer_jax.optim import find_schedule_horizon
from transformer_jax.platform import compile_platform

PyTree = Any
Array = jax.Array
LossFn = Callable[..., tuple[Array, dict[str, Array], PyTree]]


def make_train_step(
    loss_fn: LossFn,
    *,
    lr_schedule: optax.Schedule | None = None,
    axis_name: str | None = None,
    whole_gradient: bool = True,
):
    """-> train_step(state, batch) -> (state, metrics).

    metrics: the summed `sums` plus 'loss_sum', 'grad_norm' (of the normalised gradient, before
    clipping), 'lr' (the rate this step used: lr_schedule(step), or lr_schedule(step, horizon)
    when the optimizer state keeps the schedule's length) and 'nonfinite' (1.0 when the loss or the
    gradient was NaN or infinite, or the gradient's norm overflowed: that update was not
    applied); all scalars, left on device.
    axis_name: set under `pmap`: gradients and sums are psummed over that axis.
    whole_gradient: every device holds every gradient leaf whole (False when the parameters
    are split over devices, fsdp); a GPU's or TPU's program then treats the gradient as one
    vector (`_scaled_gradient`).
    """

    def train_step(state: TrainState, batch: dict[str, Array]):
        rng = state.step_rng()
        if axis_name is not None:
            # pmap: each device draws its own dropout masks (the same key everywhere would drop
            # the same positions on every shard). The jit path needs nothing: one global draw.
            rng = jax.random.fold_in(rng, lax.axis_index(axis_name))

        def objective(params):
            loss_sum, sums, extra = loss_fn(
                params, batch, rng=rng, extra=state.extra, deterministic=False
            )
            return loss_sum, (sums, extra)

        (loss_sum, (sums, extra)), grads = jax.value_and_grad(objective, has_aux=True)(state.params)
        # A loss_fn may report a 'loss_sum' of its own: the objective without a term that is
        # only there for its gradient (hard attention's REINFORCE surrogate).
        sums = {"loss_sum": loss_sum, **sums}
        if axis_name is not None:
            grads, sums = lax.psum((grads, sums), axis_name)
        # The mean over the global batch: the gradient of the summed loss divided by the token
        # count of every device together, identical to a single-device step. A product with
        # one reciprocal, written where it is read (the norm's reduction here, the update in
        # the branch), so XLA fuses it into those reads instead of writing out a divided copy
        # of every leaf (benchmarks/README.md).
        inv_tokens = 1.0 / jnp.maximum(sums["n_tokens"], 1.0)
        # The platform from the parameters, the step's arguments (whose abstract values carry
        # their mesh; values made by autodiff's transpose may not).
        platform = compile_platform(*jax.tree.leaves(state.params))
        # One vector over the whole gradient only where each device holds all of it: split
        # leaves (fsdp) would be gathered into it.
        as_one = platform != "cpu" and whole_gradient
        grad_norm, mean_grads = _scaled_gradient(
            grads, inv_tokens, as_one=as_one, update_reads_it=platform == "gpu"
        )
        # A non-finite loss or gradient never reaches the parameters: the step counter moves
        # on (the next step reads the next batch), everything else stays as it was. The flag
        # travels with the metrics, so the host learns of it without an extra transfer. The
        # norm is NaN or infinite when any gradient element is (or when the sum of squares
        # overflows float32, a norm above 1.8e19), and the clipping reads this same norm, so
        # one reduction over the gradient serves the flag, the metric and the clipping.
        finite = jnp.isfinite(loss_sum) & jnp.isfinite(grad_norm)
        # A cond, not a select per leaf of the state: XLA fuses the chain of per-leaf checks
        # into each select, which multiplies compile time (benchmarks/README.md), and a
        # skipped step does no optimizer work.
        new_state = lax.cond(
            finite,
            lambda s: s.apply_gradients(mean_grads(), grad_norm=grad_norm, extra=extra),
            lambda s: s.replace(step=s.step + 1),
            state,
        )
        metrics = dict(
            sums, grad_norm=grad_norm, nonfinite=jnp.float32(1.0) - finite.astype(jnp.float32)
        )
        if lr_schedule is not None:
            # A schedule whose length the run chose reads it from the optimizer state.
            horizon = find_schedule_horizon(state.opt_state)
            lr = lr_schedule(state.step) if horizon is None else lr_schedule(state.step, horizon)
            metrics["lr"] = jnp.asarray(lr, jnp.float32)
        return new_state, metrics

    return train_step


def _scaled_gradient(
    tree: PyTree, scale: Array, *, as_one: bool, update_reads_it: bool
) -> tuple[Array, Callable[[], PyTree]]:
    """(the global L2 norm of `tree` with every leaf multiplied by `scale`, a function that
    returns that scaled tree), as `optax.tree.norm` and a `jax.tree.map` compute them when
    not `as_one` (a CPU's program, or leaves split over devices). The scaled tree is made
    where the update reads it, so XLA fuses the product into those reads instead of writing
    out a scaled copy of every leaf (benchmarks/README.md).

    `as_one` (compiled for a GPU or TPU, every leaf whole on each device): the leaves are
    concatenated into one float32 vector [P], written once, and the norm is one reduction
    over it; with `update_reads_it` (a GPU), the update reads each leaf as a slice of it. A
    reduction per leaf is a kernel or two each, and an update per leaf a kernel each; the
    update's kernels reading slices of one buffer are siblings XLA:GPU merges into a kernel
    per leaf shape (benchmarks/target_h200_2026-12-02/: the Transformer base step 1,569 ->
    1,300 kernels for the norm, 1,300 -> 1,068 for the update). The same sums in another
    order, the same scaled values.
    """
    leaves, treedef = jax.tree.flatten(tree)

    def per_leaf() -> PyTree:
        return jax.tree.map(lambda g: g * scale.astype(g.dtype), tree)

    if not leaves or not as_one:
        return optax.tree.norm(per_leaf()), per_leaf
    flat = jnp.concatenate([jnp.ravel(x).astype(jnp.float32) for x in leaves])
    # Kept whole: XLA's simplifier would turn the sum of a concatenation back into a sum per
    # leaf. Writing it out costs one pass over the gradient (a few hundred MB on an H200's
    # 4.8 TB/s) against hundreds of launches.
    flat = lax.optimization_barrier(flat)
    scaled = flat * scale
    norm = jnp.sqrt(jnp.sum(scaled * scaled))

    if not update_reads_it:  # a TPU launches no kernel per leaf
        return norm, per_leaf

    def scaled_tree() -> PyTree:
        out, start = [], 0
        for leaf in leaves:
            # Sliced before it is scaled, so each update's kernel reads only its part of the
            # shared buffer.
            part = lax.slice_in_dim(flat, start, start + leaf.size) * scale
            out.append(part.reshape(leaf.shape).astype(leaf.dtype))
            start += leaf.size
        return jax.tree.unflatten(treedef, out)

    return norm, scaled_tree


def make_eval_step(loss_fn: LossFn, *, axis_name: str | None = None):
    """-> eval_step(params, batch, extra) -> (sums, new_extra), deterministic, summed over the
    batch (and over devices under pmap) so a caller adds them up over an evaluation set."""

    def eval_step(params: PyTree, batch: dict[str, Array], extra: PyTree):
        loss_sum, sums, extra = loss_fn(params, batch, rng=None, extra=extra, deterministic=True)
        sums = dict(sums, loss_sum=loss_sum)
        if axis_name is not None:
            sums = lax.psum(sums, axis_name)
        return sums, extra

    return eval_step
