"""One core's rate for the step's product shapes, jax (jit, XLA:CPU) against torch (eager,
one thread): the forward product x @ w and the kernel gradient x^T @ g. Run on one core:

    taskset -c 0 python benchmarks/cpu_vs_torch_2026-11-28b_amd25/product_rates.py
"""

import statistics

import jax
import jax.numpy as jnp
import numpy as np
import torch

from train.bench.timing import time_calls

torch.set_num_threads(1)


def median_seconds(f, *args):
    # One untimed call, then 30 timed (jax.block_until_ready passes torch's tensors through).
    return statistics.median(time_calls(lambda: f(*args), warmup=1, repeats=30))


rng = np.random.default_rng(0)
forward = jax.jit(lambda a, b: a @ b)
kernel_grad = jax.jit(lambda a, b: jax.lax.dot_general(a, b, (((0,), (0,)), ((), ()))))
for m, k, n in [
    (2048, 256, 256),
    (2048, 256, 1024),
    (2048, 1024, 256),
    (2048, 256, 4000),
    (2048, 4000, 256),
]:
    x = rng.standard_normal((m, k), np.float32)
    w = rng.standard_normal((k, n), np.float32)
    g = rng.standard_normal((m, n), np.float32)
    gflop = 2 * m * k * n / 1e9
    jx, jw, jg = map(jnp.asarray, (x, w, g))
    tx, tw, tg = map(torch.from_numpy, (x, w, g))
    rates = [
        gflop / median_seconds(forward, jx, jw),
        gflop / median_seconds(kernel_grad, jx, jg),
        gflop / median_seconds(lambda a, b: a @ b, tx, tw),
        gflop / median_seconds(lambda a, b: a.T @ b, tx, tg),
    ]
    print(
        f"{m}x{k}x{n}: jax forward {rates[0]:.0f}, kernel grad {rates[1]:.0f}; "
        f"torch forward {rates[2]:.0f}, kernel grad {rates[3]:.0f} GFLOP/s"
    )
