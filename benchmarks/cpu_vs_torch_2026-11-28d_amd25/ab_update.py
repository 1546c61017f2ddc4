"""The bench's Transformer step with the update before this change (HEAD~: the gradient
divided leaf by leaf, finiteness checked leaf by leaf, optax's clipping computing its own norm
inside the update branch) against `train.core.step.make_train_step` as it is now, in one
process, steps interleaved; then the same two updates alone on the model's gradient tree:

    python benchmarks/cpu_vs_torch_2026-11-28d_amd25/ab_update.py 32 16 [ROUNDS]

Both arms start from the same state and read the same batches; the losses are printed so the
two can be compared.
"""

from __future__ import annotations

import statistics
import sys
import time

import jax
import jax.numpy as jnp
import optax
from jax import lax

from train.bench.config import BenchConfig
from train.bench.cpu_vs_torch import transformer_problem
from train.core.host_memory import keep_host_memory
from train.core.step import make_train_step
from transformer_jax.optim import params_ema


def before_step(loss_fn):
    """HEAD~'s train step (single device, no schedule metric), with HEAD~'s optimizer."""
    tx = optax.chain(
        optax.clip_by_global_norm(1.0), optax.adam(optax.constant_schedule(1e-3)), params_ema(0.99)
    )

    def step(state, batch):
        state = state.replace(tx=tx)

        def objective(params):
            loss_sum, sums, extra = loss_fn(
                params, batch, rng=state.step_rng(), extra=state.extra, deterministic=False
            )
            return loss_sum, (sums, extra)

        (loss_sum, (sums, extra)), grads = jax.value_and_grad(objective, has_aux=True)(state.params)
        n_tokens = jnp.maximum(sums["n_tokens"], 1.0)
        grads = jax.tree.map(lambda g: g / n_tokens, grads)
        grad_norm = optax.tree.norm(grads)
        finite = jnp.isfinite(loss_sum) & jnp.all(
            jnp.stack([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)])
        )
        new_state = lax.cond(
            finite,
            lambda s: s.apply_gradients(grads, extra=extra),
            lambda s: s.replace(step=s.step + 1),
            state,
        )
        return new_state, dict(sums, loss_sum=loss_sum, grad_norm=grad_norm)

    return step


def update_only(step, n_tokens=500.0):
    """`step` whose batch is the gradient of its summed loss (the forward and backward become
    one product of the parameters with that batch): what the update costs."""

    def loss_fn(params, batch, *, rng, extra, deterministic):
        leaves = zip(jax.tree.leaves(params), jax.tree.leaves(batch))
        s = sum(jnp.vdot(lax.stop_gradient(g), p) for p, g in leaves)
        return s - lax.stop_gradient(s), {"n_tokens": jnp.float32(n_tokens)}, extra

    return step(loss_fn)


def interleave(arms, states, batches, rounds):
    times = {k: [] for k in arms}
    losses = {k: [] for k in arms}
    for r in range(rounds + 1):
        for k, f in arms.items():
            for i in range(4):
                start = time.perf_counter()
                states[k], m = f(states[k], batches[(4 * r + i) % len(batches)])
                jax.block_until_ready(states[k])
                if r:
                    times[k].append(time.perf_counter() - start)
                losses[k].append(float(m["loss_sum"]))
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}, losses


def main(b: int, t: int, rounds: int) -> None:
    keep_host_memory()  # as the commands and the bench do
    _, _, loss_fn, init_state, batches = transformer_problem(BenchConfig.quick(), b, t, 8)
    batches = [jax.device_put(x) for x in batches]
    arms = {
        "before": jax.jit(before_step(loss_fn), donate_argnums=0),
        "after": jax.jit(make_train_step(loss_fn), donate_argnums=0),
    }
    ms, losses = interleave(arms, {k: init_state() for k in arms}, batches, rounds)
    drift = max(abs(a - c) / abs(c) for a, c in zip(losses["after"], losses["before"]))
    print(
        f"{b} x {t} step: before {ms['before']:.1f} ms, after {ms['after']:.1f} ms "
        f"({ms['before'] / ms['after']:.3f}x); losses of the first 4 steps "
        f"{losses['before'][:4]} / {losses['after'][:4]}; largest relative difference over "
        f"{len(losses['after'])} steps {drift:.1e}"
    )
    alone = {
        "before": jax.jit(update_only(before_step), donate_argnums=0),
        "after": jax.jit(update_only(make_train_step), donate_argnums=0),
    }
    grads = jax.tree.map(lambda p: jnp.full_like(p, 1.5), init_state().params)
    ms, _ = interleave(alone, {k: init_state() for k in alone}, [grads], 2 * rounds)
    print(
        f"the update alone ({len(jax.tree.leaves(init_state().params))} leaves): "
        f"before {ms['before']:.2f} ms, after {ms['after']:.2f} ms"
    )


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else 15)
