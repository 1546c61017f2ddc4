"""XLA:CPU settings for the test suite and the docs build, whose time goes mostly to compiling
hundreds of tiny programs that then run a few times each.

- `--xla_backend_optimization_level=0`: LLVM's lowest optimisation level. The programs (HLO,
  fusion, buffers) are XLA's usual ones; only their machine code is less tuned.
- `--xla_cpu_use_fusion_emitters=false`: XLA:CPU's older (elemental IR) fusion emitters
  instead of its MLIR ones, which take longer to compile such programs. Both routes ship with
  XLA; the same computation fused differently may differ in the last bits of a float32 result.
  XLA is retiring that route.
- `--xla_cpu_parallel_codegen_split_count=1`: each program's LLVM module compiled as one part.
  XLA:CPU splits it into up to 32 parts by default, to compile a large program on many
  threads; for a tiny program each part is mostly fixed overhead, and the suite's two
  workers already keep both cores busy. The machine code is the same kernels.

Each of the last two is added only where this XLA knows it (XLA stops a process on a flag it
does not know). What each saves: benchmarks/ci_time_2026-11-29/. None of the three is for
training or decoding in earnest, where tuned machine code pays.
"""

from __future__ import annotations

import os
import subprocess
import sys

OPT_LEVEL = "--xla_backend_optimization_level=0"
LEGACY_EMITTERS = "--xla_cpu_use_fusion_emitters=false"
ONE_CODEGEN_PART = "--xla_cpu_parallel_codegen_split_count=1"
OPTIONAL = (LEGACY_EMITTERS, ONE_CODEGEN_PART)
# The probes' answer (the optional flags this XLA knows), in the environment: pytest-xdist's
# workers, the notebooks' kernels and the runs tests start inherit it rather than probing again.
_KNOWN = "_FAST_COMPILE_KNOWN_FLAGS"


def _accepted(flags: str) -> bool:
    probe = subprocess.run(
        [sys.executable, "-c", "import jax; jax.numpy.zeros(1).block_until_ready()"],
        env=dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=flags),
        capture_output=True,
        timeout=120,
    )
    return probe.returncode == 0


def xla_flags() -> str:
    """The XLA_FLAGS words above that this jaxlib accepts: one probe process for all the
    optional flags, then one per flag only if they are refused together; once per test run or
    docs build."""
    if _KNOWN not in os.environ:
        known = OPTIONAL if _accepted(" ".join(OPTIONAL)) else tuple(filter(_accepted, OPTIONAL))
        os.environ[_KNOWN] = " ".join(known)
    return " ".join([OPT_LEVEL, *os.environ[_KNOWN].split()])
