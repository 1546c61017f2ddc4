"""CPU samples of a `perf record` of the training step, summed by what the code is.

    perf record -F 999 -g -p PID -o perf.data -- sleep 8   # PID: a process taking steps
    python benchmarks/cpu_vs_torch_2026-11-28c_amd25/perf_categories.py perf.data STEP_MS CORES

Sampling sees every thread's CPU time, where the jax profiler's trace sees op events and pool
regions; STEP_MS (the step's wall time in that run) times CORES turns shares into CPU ms per
step. Code XLA generated at run time has no symbol and shows as `[JIT]`: the step's fusions,
and the JIT-compiled matrix kernel of XLA's Eigen contractions, which is one hot page (Eigen's
packing routines, named, run beside it).
"""

from __future__ import annotations

import collections
import subprocess
import sys


def category(dso: str, symbol: str) -> str:
    if "ynn::dot" in symbol or "run_dot" in symbol:
        return "YNNPACK products"
    if "gemm_pack" in symbol or "Contraction" in symbol:
        return "Eigen contraction: packing"
    if "ynn::" in symbol:
        return "YNNPACK elementwise, reductions, transposes"
    if any(s in symbol for s in ("malloc", "free", "unlink_chunk", "consolidate", "memalign")):
        return "glibc malloc"
    if "python" in dso:
        return "Python"
    if "kernel" in dso:
        return "Linux kernel"
    return "other"


def main(path: str, step_ms: float, cores: int) -> None:
    flags = ["--no-children", "--sort", "dso,sym", "--stdio", "-g", "none"]
    report = subprocess.run(
        ["perf", "report", "-i", path, *flags],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    shares, jit_pages = collections.Counter(), collections.Counter()
    for line in report.splitlines():
        fields = line.split()
        if line.startswith("#") or len(fields) < 4 or not fields[0].endswith("%"):
            continue
        share, dso, symbol = float(fields[0][:-1]), fields[1], " ".join(fields[3:])
        if dso == "[JIT]":
            jit_pages[int(fields[-1], 16) >> 12] += share
        else:
            shares[category(dso, symbol)] += share
    pages = sorted(jit_pages.values(), reverse=True)
    shares["[JIT] hottest two pages: Eigen contraction's matrix kernel"] = sum(pages[:2])
    shares["[JIT] the rest: XLA's fusions"] = sum(pages[2:])
    for name, share in shares.most_common():
        print(f"{share:6.2f}%  {share * step_ms * cores / 100:7.1f} ms/step  {name}")


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]), int(sys.argv[3]))
