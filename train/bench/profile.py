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

# and, from the HLO instruction XLA puts in its args, the opcode, a custom call's target and a
# fusion's called computation (not the operands: a fusion reading a %dot is no matmul).
OP_CATEGORIES = (
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
    events: Sequence[Mapping[str, Any]], *, steps: int, top: int = 12
) -> dict[str, Any] | None:
    """Where the time of `steps` profiled steps went, from Chrome/Perfetto trace events.

    Device time only: on a GPU the device process's "XLA Ops" line (one event per HLO op) if
    present, else its stream lines (one per kernel); on a CPU the ops on the host threads that
    execute the program (not the Python thread, not the runtime's enclosing scopes). Returns the
    busy time per step, the `top` ops by time (name, microseconds per step, share, category, calls
    per step) and the share of each category; None if the trace has no such events.
    """
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
        entry = per_op.setdefault(e["name"], [0.0, 0, _op_text(e)])
        entry[0] += float(e["dur"])
        entry[1] += 1
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
        "source": where,
        "busy_us_per_step": total / steps,
        "top": ops[:top],
        "categories": dict(sorted(categories.items(), key=lambda kv: -kv[1])),
    }


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


def profile_summary(trace_dir: str, *, steps: int) -> dict[str, Any] | None:
    """`summarize_trace_events` of the newest perfetto trace `jax.profiler.trace` wrote
    under `trace_dir` (None if there is none)."""
    paths = glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True)
    if not paths:
        return None
    with gzip.open(max(paths, key=os.path.getmtime), "rt") as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    return summarize_trace_events(events, steps=steps)
