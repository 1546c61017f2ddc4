"""The project's Transformer train step (the cpu preset's model, dropout off, as
`train.bench --only cpu_vs_torch`) built twice in one process: once under a variant's patches,
once from the working tree; steps taken in turn, the speed the median of per-round ratios.

    python benchmarks/cpu_vs_torch_2026-11-28_amd25/ab.py 64 32 prev 16

Variants (each the code before, or a counterfactual, against the working tree):
  flax_ln            flax's nn.LayerNorm instead of transformer_jax.layers.LayerNorm
  old_softmax        autodiff's masked softmax instead of attention.masked_softmax
  prev               both of the above: the step as it was at 1aad2e8
  fake_no_transpose  attention that reads the projections as [B, H, T, K] without moving them:
                     wrong maths, the cost of the step with no head transposes at all
  barrier_kgrad      kernel gradients as materialised x^T @ g (a YNNPACK product) instead of
                     Eigen's contraction over the rows
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import time
from unittest import mock

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

import transformer_jax.attention as A
import transformer_jax.layers as L
import transformer_jax.model as M
from train.bench.config import BenchConfig
from train.bench.cpu_vs_torch import _project_arm, transformer_problem


def _flax_layer_norm(config, **kw):
    return nn.LayerNorm(epsilon=config.layer_norm_eps, dtype=config.dtype, **kw)


@contextlib.contextmanager
def flax_ln():
    with (
        mock.patch.object(L, "layer_norm", _flax_layer_norm),
        mock.patch.object(M, "layer_norm", _flax_layer_norm),
    ):
        yield


def _autodiff_softmax(s, m):
    return jnp.where(m, jax.nn.softmax(jnp.where(m, s, A._MASK_VALUE), -1), 0.0)


def old_softmax():
    return mock.patch.object(A, "masked_softmax", _autodiff_softmax)


@contextlib.contextmanager
def prev():
    with flax_ln(), old_softmax():
        yield


def _no_transpose_attention(query, key, value, *, mask=None, **_):
    b, t, h, k = query.shape
    q, kk, v = (x.reshape(b, h, x.shape[1], k) for x in (query, key, value))
    w = A.attention_weights(jnp.einsum("bhtk,bhsk->bhts", q, kk) * k**-0.5, mask=mask)
    return jnp.einsum("bhts,bhsk->bhtk", w, v).reshape(b, t, h, k)


def fake_no_transpose():
    return mock.patch.object(L, "dot_product_attention", _no_transpose_attention)


def _barrier_bwd(saved, grad):
    x, kernel = saved
    rows = grad.reshape(-1, grad.shape[-1])
    d_x = (rows @ kernel.T).reshape(x.shape)
    d_kernel = lax.optimization_barrier(x.reshape(-1, x.shape[-1]).T) @ rows
    return d_x, d_kernel


def _barrier_tied_bwd(saved, grad):
    y, table = saved
    d_y = jnp.einsum("...v,vd->...d", grad, table)
    rows = grad.reshape(-1, grad.shape[-1])
    return d_y, (lax.optimization_barrier(y.reshape(-1, y.shape[-1]).T) @ rows).T


@contextlib.contextmanager
def barrier_kgrad():
    L.dense_product.defvjp(L._dense_product_fwd, _barrier_bwd)
    L.tied_logits.defvjp(L._tied_logits_fwd, _barrier_tied_bwd)
    try:
        yield
    finally:
        L.dense_product.defvjp(L._dense_product_fwd, L._dense_product_bwd)
        L.tied_logits.defvjp(L._tied_logits_fwd, L._tied_logits_bwd)


def main(b: int, t: int, variant: str, rounds: int) -> None:
    # The bench's own model and project arm (`train.bench.cpu_vs_torch`), so that the step
    # built here is the one `--only cpu_vs_torch` times.
    def build(patch):
        with patch():  # the model is traced at the first call, under the patch
            _, _, loss_fn, init_state, batches = transformer_problem(BenchConfig.quick(), b, t, 8)
            arm, _, last_loss, *_ = _project_arm(
                loss_fn, init_state, batches, jax.devices("cpu")[0]
            )
            arm(0)
        losses = [last_loss()]

        def one(i):
            arm(i)
            losses.append(last_loss())  # after the arm has blocked: a scalar read

        return one, losses

    arms = {"variant": build(globals()[variant]), "tree": build(contextlib.nullcontext)}
    for i in (1, 2):
        for one, _ in arms.values():
            one(i)
    times = {k: [] for k in arms}
    for r in range(rounds):
        order = list(arms.items()) if r % 2 else list(arms.items())[::-1]
        for name, (one, _) in order:
            start = time.perf_counter()
            one(r + 3)
            times[name].append(time.perf_counter() - start)
    speed = statistics.median(v / w for v, w in zip(times["variant"], times["tree"]))
    lv, lt = arms["variant"][1], arms["tree"][1]
    print(
        f"{b}x{t} {variant}: variant {statistics.median(times['variant']) * 1e3:.1f} ms, "
        f"tree {statistics.median(times['tree']) * 1e3:.1f} ms; "
        f"tree's speed / variant's {speed:.3f}; "
        f"largest relative loss difference over {len(lt)} steps "
        f"{max(abs(a - c) / abs(a) for a, c in zip(lv, lt)):.1e}"
    )
    print("by step:", " ".join(f"{abs(a - c) / abs(a):.0e}" for a, c in zip(lv, lt)))


if __name__ == "__main__":
    b, t, variant = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    main(b, t, variant, int(sys.argv[4]) if len(sys.argv) > 4 else 12)
