"""The bench's Transformer step timed two ways in one process, three rounds alternating: blocked
after every step (as the bench's arm runs it) and with two steps in flight (as
`train.core.loop.Interval` runs training: step n + 1 is dispatched before waiting for step n):

    python benchmarks/cpu_vs_torch_2026-11-28e_amd25/in_flight.py 64 32 8
"""

from __future__ import annotations

import resource
import sys
import time

from train.core.host_memory import keep_host_memory

keep_host_memory()

import jax  # noqa: E402

from train.bench.config import BenchConfig  # noqa: E402
from train.bench.cpu_vs_torch import transformer_problem  # noqa: E402
from train.core.parallel import DataParallel  # noqa: E402


def faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def main(b: int, t: int, n: int) -> None:
    _, _, loss_fn, init_state, batches = transformer_problem(BenchConfig.quick(), b, t, 4)
    dp = DataParallel("jit", devices=[jax.devices("cpu")[0]])
    state = dp.put_state(dp.init_state(init_state))
    placed = [dp.put_batch(x) for x in batches]
    step = dp.compile_train_step(loss_fn, state)
    for i in range(3):
        state, metrics = step(state, placed[i % 4])
        jax.block_until_ready((state, metrics))
    for _ in range(3):
        start, f0 = time.perf_counter(), faults()
        for i in range(n):
            state, metrics = step(state, placed[i % 4])
            jax.block_until_ready((state, metrics))
        blocked, f1 = (time.perf_counter() - start) / n, faults()
        start, pending = time.perf_counter(), []
        for i in range(n):
            state, metrics = step(state, placed[i % 4])
            pending.append(metrics)
            if len(pending) >= 2:
                jax.block_until_ready(pending[-2]["loss_sum"])
        jax.block_until_ready((state, metrics))
        in_flight, f2 = (time.perf_counter() - start) / n, faults()
        print(
            f"{b} x {t}: blocked {blocked * 1e3:.1f} ms ({(f1 - f0) / n:.0f} page faults a step), "
            f"two in flight {in_flight * 1e3:.1f} ms ({(f2 - f1) / n:.0f})"
        )


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
