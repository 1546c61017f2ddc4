"""Where a profiled step's time went: `jax.profiler` (Chrome/Perfetto) trace events summed
per op and per category (matmul, fused attention, collectives, copies, the rest)."""

from __future__ import annotations

import glob
import gzip
import json
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

# XLA:CPU's intra-op thread pool (the threads that run a CPU program's ops).
POOL_THREAD = "XLAEigen"
# The entry for that pool's work while no op event runs (`pool_work_outside_ops`).
UNATTRIBUTED = "(pool work while no op event runs)"

# Op categories of a profile, first match wins; matched against `_op_text`: the event's name
# and, from the HLO instruction XLA puts in its args, the opcode, a custom call's target and a
# fusion's called computation (not the operands: a fusion reading a %dot is no matmul).
OP_CATEGORIES = (
    ("pool work, no op (asynchronous library calls)", re.compile(re.escape(UNATTRIBUTED))),
    ("attention (fused)", re.compile(r"fmha|flash|cudnn", re.IGNORECASE)),
    # nvjet_*: cuBLAS's newer GEMM kernels (seen with jax 0.11 on an H100).
    (
        "matmul",
        re.compile(r"gemm|cublas|nvjet|^dot|\bdot\b|matmul|xmma|gmma|convolution", re.IGNORECASE),
    ),
    ("collective", re.compile(r"all-reduce|all-gather|reduce-scatter|nccl", re.IGNORECASE)),
    ("copy", re.compile(r"copy|memcpy|memset|transpose", re.IGNORECASE)),
)


def summarize_trace_events(
    events: Sequence[Mapping[str, Any]],
    *,
    steps: int,
    top: int = 12,
    hlo_text: str | None = None,
) -> dict[str, Any] | None:
    """Where the time of `steps` profiled steps went, from Chrome/Perfetto trace events.

    Device time only: on a GPU the device process's "XLA Ops" line (one event per HLO op) if
    present, else its stream lines (one per kernel); on a CPU the ops on the host threads that
    execute the program (not the Python thread, not the runtime's enclosing scopes), plus the
    thread pool's work outside op events (`pool_work_outside_ops`). Returns the busy time per
    step (and, of it, the op events' time), the `top` ops by time (name, microseconds per step,
    share, category, calls per step) and the share of each category; None if the trace has no
    such events.

    hlo_text: the profiled program's optimized HLO (`compiled.as_text()`). With it, an op is
    also categorised by what its called computation runs. That matters on a CPU, where the
    trace names only the op: XLA:CPU hands its matrix products to YNNPACK as `ynn_fusion.N`
    (jax 0.10), and without the HLO they read as elementwise work, most of a CPU step's busy
    time mislabelled (`benchmarks/cpu_vs_torch_2026-11-26_intel207_profile/`).
    """
    kinds = hlo_op_kinds(hlo_text) if hlo_text else {}
    procs, threads = {}, {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            procs[e["pid"]] = e["args"]["name"]
        elif e.get("ph") == "M" and e.get("name") == "thread_name":
            threads[(e["pid"], e["tid"])] = e["args"]["name"]
    timed = [e for e in events if "dur" in e and e.get("ph", "X") == "X"]
    devices = {pid for pid, name in procs.items() if "/device:" in name}
    if devices:
        lines = {key: name for key, name in threads.items() if key[0] in devices}
        chosen = {key for key, name in lines.items() if name == "XLA Ops"} or {
            key for key, name in lines.items() if name.lower().startswith("stream")
        }
        where = "device: " + (
            "XLA Ops" if any(lines[k] == "XLA Ops" for k in chosen) else "streams"
        )
    else:
        chosen = {key for key, name in threads.items() if name != "python"}
        where = "host threads, summed over threads"
    # Left out: Python frames ('$file:line name') and the CPU runtime's C++ scopes
    # ('ThunkExecutor::Execute'), which enclose the ops rather than being ones.
    picked = [
        e
        for e in timed
        if (e.get("pid"), e.get("tid")) in chosen
        and not str(e.get("name", "")).startswith("$")
        and (devices or "::" not in str(e.get("name", "")))
    ]
    if not picked:
        return None
    per_op: dict[str, list] = {}
    for e in picked:
        entry = per_op.setdefault(e["name"], [0.0, 0, f"{_op_text(e)} {kinds.get(e['name'], '')}"])
        entry[0] += float(e["dur"])
        entry[1] += 1
    op_events = sum(v[0] for v in per_op.values())
    pool = None if devices else pool_work_outside_ops(events, threads, picked)
    if pool:
        helped, unattributed = pool
        for name, dur in helped.items():
            per_op[name][0] += dur
        if unattributed > 0:
            per_op[UNATTRIBUTED] = [unattributed, 0, UNATTRIBUTED]
    total = sum(v[0] for v in per_op.values())
    categories: dict[str, float] = {}
    ops = []
    for name, (dur, calls, text) in sorted(per_op.items(), key=lambda kv: -kv[1][0]):
        category = next(
            (c for c, pattern in OP_CATEGORIES if pattern.search(text)),
            "other (elementwise, reductions)",
        )
        categories[category] = categories.get(category, 0.0) + dur / total
        ops.append(
            {
                "name": name,
                "us_per_step": dur / steps,
                "share": dur / total,
                "category": category,
                "calls_per_step": calls / steps,
            }
        )
    return {
        "source": where + (", with the pool's work outside op events" if pool else ""),
        "busy_us_per_step": total / steps,
        "op_events_us_per_step": op_events / steps,
        "top": ops[:top],
        "categories": dict(sorted(categories.items(), key=lambda kv: -kv[1])),
    }


def pool_work_outside_ops(
    events: Sequence[Mapping[str, Any]],
    threads: Mapping[tuple, str],
    ops: Sequence[Mapping[str, Any]],
) -> tuple[dict[str, float], float] | None:
    """The work XLA:CPU's thread pool does outside the op events -> ({op name: microseconds
    credited to it}, microseconds while no op event runs anywhere), or None if the trace has
    no pool regions.

    An op event covers only the thread that runs the op. A library product spreads its work
    over the other pool threads too (YNNPACK's parallel loops), and Eigen's contractions (XLA's
    `dot` ops) return before their tasks finish; both run as pool work ('ThreadpoolListener'
    StartRegion .. StopRegion) with no op event on that thread. A pool thread's region time
    outside its own ops is credited to the ops that other pool threads run meanwhile (split
    evenly), else to UNATTRIBUTED. The trace does not say whose task a region runs, so a
    contraction's tasks that overlap another op are credited to that op: the busy total is
    exact, the split between ops an estimate. On a CPU training step the pool's work outside
    op events was a large share of its busy time (`benchmarks/cpu_vs_torch_2026-11-28b_amd25/`)."""
    pool = {key for key, name in threads.items() if POOL_THREAD in name}
    marks = []  # (time, order, thread, change): order puts ends before starts at one time
    for e in events:
        key = (e.get("pid"), e.get("tid"))
        name = str(e.get("name", ""))
        if key in pool and name.startswith("ThreadpoolListener::") and "Region" in name:
            start = name.endswith("StartRegion")
            marks.append((float(e["ts"]), 1 if start else 0, key, +1 if start else -1))
    if not marks:
        return None
    for e in ops:
        key = (e.get("pid"), e.get("tid"))
        if key in pool:
            marks.append((float(e["ts"]), 1, key, e["name"]))
            marks.append((float(e["ts"]) + float(e["dur"]), 0, key, None))
    marks.sort(key=lambda m: (m[0], m[1]))
    depth = dict.fromkeys(pool, 0)
    running: dict[tuple, str | None] = dict.fromkeys(pool)
    helped: dict[str, float] = {}
    unattributed = 0.0
    last = marks[0][0]
    for t, _, key, change in marks:
        dt = t - last
        if dt > 0:
            for k in pool:
                if depth[k] > 0 and running[k] is None:  # pool work, not in an op of its own
                    others = [op for k2, op in running.items() if k2 != k and op is not None]
                    for op in others:
                        helped[op] = helped.get(op, 0.0) + dt / len(others)
                    if not others:
                        unattributed += dt
        last = t
        if isinstance(change, int):
            depth[key] = max(0, depth[key] + change)
        else:
            running[key] = change
    return helped, unattributed


def _op_text(event: Mapping[str, Any]) -> str:
    """An event's name, plus the opcode, custom-call target and called computation of the HLO
    instruction in its args (e.g. 'long_name': '%f = bf16[8] fusion(%a), calls=%gemm_1')."""
    parts = [str(event.get("name", ""))]
    for value in (event.get("args") or {}).values():
        text = str(value)
        opcode = re.search(r"=\s*\S+\s+([\w-]+)\(", text)
        if opcode:
            parts.append(opcode.group(1))
        parts += re.findall(r'custom_call_target="([^"]*)"', text)
        parts += re.findall(r"calls=%?([\w.-]+)", text)
    return " ".join(parts)


_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.-]+)\s.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s+(?:ROOT\s+)?%?([\w.-]+)\s*=\s*.*?\s([\w-]+)\(")
_CALLS = re.compile(r"(?:calls|to_apply|body)=%?([\w.-]+)")


def hlo_op_kinds(hlo_text: str) -> dict[str, str]:
    """{instruction name: what it runs} of a compiled program's HLO text (`as_text()`): its
    opcode, then the opcodes of the computation it calls, and of those that one calls (a
    fusion, a call, a library fusion such as `ynn_fusion.3`, whose computation holds a `dot`).
    The opcodes are space-separated, so the categories' patterns match them as words."""
    computations: dict[str, list[tuple[str, str, list[str]]]] = {}
    body: list | None = None
    for line in hlo_text.splitlines():
        head = _COMPUTATION.match(line)
        if head and not line[:1].isspace():
            body = computations.setdefault(head.group(1), [])
            continue
        inst = _INSTRUCTION.match(line)
        if inst and body is not None:
            body.append((inst.group(1), inst.group(2), _CALLS.findall(line)))

    def runs(computation: str, depth: int) -> list[str]:
        out = []
        for _, opcode, calls in computations.get(computation, ()):
            if opcode not in ("parameter", "constant", "bitcast", "tuple", "get-tuple-element"):
                out.append(opcode)
            if depth:
                for called in calls:
                    out += runs(called, depth - 1)
        return out

    return {
        name: " ".join([opcode, *(op for called in calls for op in runs(called, 2))])
        for body in computations.values()
        for name, opcode, calls in body
    }


def profile_summary(
    trace_dir: str, *, steps: int, hlo_text: str | None = None
) -> dict[str, Any] | None:
    """`summarize_trace_events` of the newest perfetto trace `jax.profiler.trace` wrote
    under `trace_dir` (None if there is none); hlo_text: see there."""
    paths = glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True)
    if not paths:
        return None
    with gzip.open(max(paths, key=os.path.getmtime), "rt") as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    return summarize_trace_events(events, steps=steps, hlo_text=hlo_text)
