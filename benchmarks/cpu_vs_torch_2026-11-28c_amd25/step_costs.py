"""Two costs of the `cpu_vs_torch` Transformer step (the cpu preset's model, dropout off, as
`python -m train.bench --only cpu_vs_torch` builds it), measured apart from the step:

    python benchmarks/cpu_vs_torch_2026-11-28c_amd25/step_costs.py products 64 32
    python benchmarks/cpu_vs_torch_2026-11-28c_amd25/step_costs.py dispatch 32 16
    python benchmarks/cpu_vs_torch_2026-11-28c_amd25/step_costs.py ops 0 0
    python benchmarks/cpu_vs_torch_2026-11-28c_amd25/step_costs.py steps 64 32 &  # for perf

products  every `dot` of the step's optimized HLO, each compiled alone (same operand shapes and
          dimension numbers) and timed alone on all of XLA's threads: the products' time if
          each ran by itself, one after another.
ops       the same call for programs of 529 [64, 64] inputs and k = 0, 1, 2, 4 small ops
          (a reduction and an elementwise fusion) on each. (XLA:CPU runs such programs' ops
          on the calling thread, so this times their work, not dispatch per op:
          ../cpu_vs_torch_2026-11-28d_amd25/call_runs_ops.py.)
steps     60 steps after 3, each blocked on, then the wall time a step: the process for
          `perf record -p PID` (perf_categories.py).
dispatch  the wall and main-thread CPU time of the call that starts a step (it returns before
          the step has run), against a jitted identity over the same donated state.
"""

from __future__ import annotations

import collections
import functools
import os
import re
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from train.bench.config import BenchConfig
from train.bench.cpu_vs_torch import transformer_problem
from train.bench.timing import time_calls
from train.core.host_memory import keep_host_memory
from train.core.parallel import DataParallel, batch_signature


def build(b: int, t: int):
    """-> (step, state, placed batches): the bench's project arm, unwrapped."""
    _, _, loss_fn, init_state, batches = transformer_problem(BenchConfig.quick(), b, t, 8)
    dp = DataParallel("jit", devices=[jax.devices("cpu")[0]])
    state = dp.put_state(dp.init_state(init_state))
    return dp.compile_train_step(loss_fn, state), state, [dp.put_batch(x) for x in batches]


_INSTRUCTION = re.compile(r"\s*(?:ROOT )?%([\w.\-]+) = \w+\[([\d,]*)\]\S* (\w[\w\-]*)\((.*)")


def hlo_dots(hlo: str) -> collections.Counter:
    """(lhs shape, rhs shape, dimension numbers) of each `dot` in `hlo` -> how many."""
    shapes, dots = {}, collections.Counter()
    for line in hlo.split("\n"):
        m = _INSTRUCTION.match(line)
        if not m:
            continue
        name, dims, op, rest = m.groups()
        shapes[name] = tuple(int(d) for d in dims.split(",") if d)
        if op != "dot":
            continue

        def dims_of(key, rest=rest):
            found = re.search(key + r"=\{([\d,]*)\}", rest)
            return tuple(int(d) for d in found.group(1).split(",") if d) if found else ()

        lhs, rhs = re.findall(r"%([\w.\-]+)", rest.split(")")[0])[:2]
        numbers = (
            (dims_of("lhs_contracting_dims"), dims_of("rhs_contracting_dims")),
            (dims_of("lhs_batch_dims"), dims_of("rhs_batch_dims")),
        )
        dots[(shapes[lhs], shapes[rhs], numbers)] += 1
    return dots


def products(b: int, t: int) -> None:
    step, state, placed = build(b, t)
    state, _ = step(state, placed[0])
    hlo = step.executables[batch_signature(placed[0])].as_text()
    rows, total_s, total_gflop = [], 0.0, 0.0
    for (lhs, rhs, numbers), n in hlo_dots(hlo).items():
        f = jax.jit(lambda x, y, numbers=numbers: lax.dot_general(x, y, numbers))
        x, y = jnp.ones(lhs, jnp.float32), jnp.ones(rhs, jnp.float32)
        s = statistics.median(time_calls(lambda f=f, x=x, y=y: f(x, y), warmup=2, repeats=15))
        out = f.eval_shape(x, y).shape
        gflop = 2 * np.prod(out) * np.prod([lhs[i] for i in numbers[0][0]]) / 1e9
        rows.append((s * n, n, lhs, rhs, numbers[0], gflop / s))
        total_s, total_gflop = total_s + s * n, total_gflop + gflop * n
    for s, n, lhs, rhs, contracting, rate in sorted(rows, reverse=True):
        print(f"{s * 1e3:7.2f} ms  {n:3d} x {lhs} . {rhs} over {contracting}  {rate:6.1f} GFLOP/s")
    print(f"{b} x {t}: {total_gflop:.1f} GFLOP, {total_s * 1e3:.1f} ms alone one after another")


def timed_calls(f, state, batches, n=20):
    """n calls state = f(state, batch) after 3 -> (state, medians in ms of the call's wall
    time, its main-thread CPU time and the call's wall time until its result is ready)."""
    walls, cpus, steps = [], [], []
    for i in range(n + 3):
        start, cpu = time.perf_counter(), time.thread_time()
        state = f(state, batches[i % len(batches)])
        walls.append(time.perf_counter() - start)
        cpus.append(time.thread_time() - cpu)
        jax.block_until_ready(state)
        steps.append(time.perf_counter() - start)
    return state, [statistics.median(v[3:]) * 1e3 for v in (walls, cpus, steps)]


def dispatch(b: int, t: int) -> None:
    step, state, placed = build(b, t)
    timed = functools.partial(timed_calls, batches=placed)

    state, (wall, cpu, whole) = timed(lambda s, x: step(s, x)[0], state)
    print(f"{b} x {t} step: call {wall:.2f} ms (main thread CPU {cpu:.2f}), step {whole:.1f} ms")
    identity = jax.jit(lambda s, x: s, donate_argnums=0)
    _, (wall, cpu, _) = timed(identity, state)
    leaves = len(jax.tree.leaves(state))
    print(f"identity over the same {leaves}-leaf state: call {wall:.2f} ms (CPU {cpu:.2f})")


def ops(*_) -> None:
    inputs = [jnp.full((64, 64), i, jnp.float32) for i in range(529)]
    for k in (0, 1, 2, 4):

        def program(xs, _, k=k):
            for _ in range(k):  # a reduction and an elementwise fusion on each input
                xs = [x * 1.0001 + jnp.sum(x) * 1e-9 for x in xs]
            return xs

        f = jax.jit(program, donate_argnums=0)
        _, (wall, cpu, _) = timed_calls(f, [x + 0 for x in inputs], [None])
        print(f"529 inputs, {2 * k} ops on each: call {wall:.2f} ms (CPU {cpu:.2f})")


def steps(b: int, t: int, n: int = 60) -> None:
    step, state, placed = build(b, t)
    for i in range(3):
        state = jax.block_until_ready(step(state, placed[i % len(placed)])[0])
    print("PID", os.getpid(), "warm", flush=True)
    start = time.perf_counter()
    for i in range(n):
        state = jax.block_until_ready(step(state, placed[i % len(placed)])[0])
    print(f"{b} x {t}: {(time.perf_counter() - start) / n * 1e3:.1f} ms a step")


if __name__ == "__main__":
    keep_host_memory()  # as the commands and the bench do
    commands = {"products": products, "dispatch": dispatch, "ops": ops, "steps": steps}
    command = commands[sys.argv[1]]
    command(int(sys.argv[2]), int(sys.argv[3]))
