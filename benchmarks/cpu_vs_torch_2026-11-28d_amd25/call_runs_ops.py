"""How long a jitted call takes to return, against the whole run of the program, for
programs of different kinds (XLA:CPU, the thunk runtime of jax 0.10):

    python benchmarks/cpu_vs_torch_2026-11-28d_amd25/call_runs_ops.py

A call that returns only once most of the program has run has executed the program's ops on
the calling thread: its time is work, not dispatch overhead.
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp

from train.core.host_memory import keep_host_memory


def call_and_total(f, args, n=30):
    """-> medians (ms) of the call's return and of the result being ready."""
    calls, totals = [], []
    for _ in range(n):
        start = time.perf_counter()
        out = f(*args)
        returned = time.perf_counter()
        jax.block_until_ready(out)
        calls.append(returned - start)
        totals.append(time.perf_counter() - start)
    return statistics.median(calls[3:]) * 1e3, statistics.median(totals[3:]) * 1e3


def main() -> None:
    keep_host_memory()  # as the commands and the bench do
    small = [jnp.full((64, 64), i, jnp.float32) for i in range(529)]

    def eight_ops_each(xs):  # 4 x (a reduction, an elementwise fusion) on each input
        for _ in range(4):
            xs = [x * 1.0001 + jnp.sum(x) * 1e-9 for x in xs]
        return xs

    m = jnp.ones((1024, 1024), jnp.float32)
    cases = {
        "529 [64, 64] inputs, 8 small ops on each": (jax.jit(eight_ops_each), (small,)),
        "one elementwise fusion over [4096, 4096]": (
            jax.jit(lambda x: jnp.tanh(x) * 2 + 1),
            (jnp.ones((4096, 4096), jnp.float32),),
        ),
        "two [1024, 1024] products in a row": (jax.jit(lambda x: (x @ x) @ x), (m,)),
    }
    for name, (f, args) in cases.items():
        call, total = call_and_total(f, args)
        print(f"{name}: the call returns after {call:.2f} ms, the result is ready at {total:.2f}")


if __name__ == "__main__":
    main()
