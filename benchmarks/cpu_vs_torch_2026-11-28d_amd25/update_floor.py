"""The optimizer update alone on the bench's 131-leaf, 4.98M-parameter tree, three ways:

    python benchmarks/cpu_vs_torch_2026-11-28d_amd25/update_floor.py

- make_optimizer's chain (clip with the norm given, Adam, the parameter average), as the
  train step's branch runs it;
- the same maths written out per leaf, each leaf's update one expression;
- that, forced leaf by leaf by an optimization_barrier chain (each leaf's inputs wait for the
  previous leaf's average), so a leaf's new moments are read back while still in cache.
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import optax
from jax import lax

from train.bench.config import BenchConfig
from train.bench.cpu_vs_torch import transformer_problem
from train.core.host_memory import keep_host_memory
from transformer_jax.optim import OptimizerConfig, make_optimizer


def written_out(in_order: bool):
    def update(p, m, v, e, g, scale, bc1, bc2, d):
        out, previous = [], None
        for pi, mi, vi, ei, gi in zip(p, m, v, e, g):
            if in_order and previous is not None:
                pi, mi, vi, ei, gi, _ = lax.optimization_barrier((pi, mi, vi, ei, gi, previous))
            x = gi * scale
            mi = 0.9 * mi + 0.1 * x
            vi = 0.999 * vi + 0.001 * x * x
            pi = pi - 1e-3 * (mi / bc1) / (jnp.sqrt(vi / bc2) + 1e-8)
            ei = d * ei + (1 - d) * pi
            out.append((pi, mi, vi, ei))
            previous = ei
        return [list(t) for t in zip(*out)]

    return jax.jit(update, donate_argnums=(0, 1, 2, 3))


def main(rounds: int = 40) -> None:
    keep_host_memory()  # as the commands and the bench do
    _, _, _, init_state, _ = transformer_problem(BenchConfig.quick(), 32, 16, 1)
    params = init_state().params
    leaves = jax.tree.leaves(params)
    grads = [jnp.full_like(x, 1e-3) for x in leaves]
    tx, _ = make_optimizer(OptimizerConfig(learning_rate=1e-3, clip_norm=1.0, ema_decay=0.99))

    def chain(params, opt_state, g, norm):
        updates, opt_state = tx.update(g, opt_state, params, global_norm=norm)
        return optax.apply_updates(params, updates), opt_state

    chained = jax.jit(chain, donate_argnums=(0, 1))
    scalars = (jnp.float32(0.5), jnp.float32(0.1), jnp.float32(0.001), jnp.float32(0.9))
    g_tree = jax.tree.unflatten(jax.tree.structure(params), grads)
    states = {
        "make_optimizer's chain": (jax.tree.map(jnp.copy, params), tx.init(params)),
        "written out per leaf": [[x + 0 for x in leaves] for _ in range(4)],
        "written out, leaf by leaf": [[x + 0 for x in leaves] for _ in range(4)],
    }
    free, in_order = written_out(False), written_out(True)
    arms = {
        "make_optimizer's chain": lambda s: chained(*s, g_tree, jnp.float32(2.0)),
        "written out per leaf": lambda s: free(*s, grads, *scalars),
        "written out, leaf by leaf": lambda s: in_order(*s, grads, *scalars),
    }
    times = {k: [] for k in arms}
    for r in range(rounds + 1):
        for k, f in arms.items():
            start = time.perf_counter()
            states[k] = jax.block_until_ready(f(states[k]))
            if r:
                times[k].append(time.perf_counter() - start)
    for k, v in times.items():
        print(f"{k}: {statistics.median(v) * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
