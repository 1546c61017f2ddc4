"""Measuring: timed calls (alone or interleaved), the matrix rate, compiled memory, MFU."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp

# Datasheet dense bf16 peaks (FLOP/s), matched in order against `device_kind`.
NOMINAL_BF16_PEAK = (
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989.4e12),  # SXM ("NVIDIA H100 80GB HBM3")
    ("H200", 989.4e12),
    ("A100", 312e12),
    ("L4", 121e12),
)


def time_calls(call: Callable[[], Any], *, warmup: int, repeats: int) -> list[float]:
    """Seconds of each of `repeats` calls of `call` (after `warmup` untimed ones), each timed
    to `block_until_ready` of what it returns."""
    for _ in range(warmup):
        jax.block_until_ready(call())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(call())
        times.append(time.perf_counter() - start)
    return times


def time_interleaved(
    arms: Mapping[str, Callable[[int], Any]], *, warmup: int, steps: int
) -> dict[str, list[float]]:
    """Seconds of each timed step of every arm, the arms taking turns step by step (so a change
    in the machine's load falls on all of them alike). `arm(i)` runs step i to its end (it
    blocks on its own results); steps 0 .. warmup - 1 are untimed."""
    times: dict[str, list[float]] = {name: [] for name in arms}
    for i in range(warmup + steps):
        for name, arm in arms.items():
            start = time.perf_counter()
            arm(i)
            if i >= warmup:
                times[name].append(time.perf_counter() - start)
    return times


def measure_matmul_rate(n: int, dtype: Any, *, repeats: int, warmup: int = 2) -> dict[str, Any]:
    """The achievable matrix rate: the median time of an [n, n] x [n, n] product in `dtype`
    (random inputs, output in `dtype`, accumulation left to the backend) -> 2 n^3 / median."""
    dtype = jnp.dtype(dtype)
    ka, kb = jax.random.split(jax.random.PRNGKey(0))
    a = jax.random.normal(ka, (n, n), jnp.float32).astype(dtype)
    b = jax.random.normal(kb, (n, n), jnp.float32).astype(dtype)
    product = jax.jit(lambda x, y: jnp.matmul(x, y, preferred_element_type=dtype))
    times = time_calls(lambda: product(a, b), warmup=warmup, repeats=repeats)
    median = statistics.median(times)
    flops = 2.0 * n**3
    return {
        "n": n,
        "dtype": dtype.name,
        "flops": flops,
        "median_s": median,
        "times_s": times,
        "rate": flops / median,
    }


def nominal_bf16_peak(device_kind: str) -> float | None:
    """The datasheet dense bf16 rate of a known device, else None."""
    for name, peak in NOMINAL_BF16_PEAK:
        if name.lower() in device_kind.lower():
            return peak
    return None


def compiled_memory(compiled) -> dict[str, int] | None:
    """Byte counts of a compiled program from XLA's buffer assignment, None where the backend
    gives none. footprint = arguments + outputs + temporaries - aliased (donated inputs reuse
    their buffers for outputs, so they count once), or the reported peak where larger (a TPU
    program's temporaries are in its peak only)."""
    try:
        stats = compiled.memory_analysis()
    except Exception:  # noqa: BLE001 - some backends raise instead of returning None
        return None
    if stats is None:
        return None
    names = ("argument", "output", "temp", "alias", "generated_code")
    out = {name: int(getattr(stats, f"{name}_size_in_bytes", 0) or 0) for name in names}
    out["footprint"] = out["argument"] + out["output"] + out["temp"] - out["alias"]
    peak = getattr(stats, "peak_memory_in_bytes", None)
    if peak:
        out["peak_reported"] = int(peak)
        # XLA:TPU reports no temporaries (0) but the peak of what is live at once, which
        # holds them; a GPU's peak sits at or below its buffers' sum. The larger is the fit.
        out["footprint"] = max(out["footprint"], int(peak))
    return out


def device_peak_bytes(device: jax.Device) -> int | None:
    """The allocator's peak since the process started (GPU/TPU), None where unknown (CPU)."""
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001
        return None
    return int(stats["peak_bytes_in_use"]) if stats and "peak_bytes_in_use" in stats else None


def utilisation(flops: float, seconds: float, rate: float | None) -> float | None:
    """Model FLOPs utilisation: flops / seconds / rate (None without a rate)."""
    return flops / seconds / rate if rate else None
