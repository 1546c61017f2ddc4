"""XLA:CPU settings for the test suite and the docs build, whose time goes mostly to compiling
hundreds of tiny programs that then run a few times each.

- `--xla_backend_optimization_level=0`: LLVM's lowest optimisation level. The programs (HLO,
  fusion, buffers) are XLA's usual ones; only their machine code is less tuned.
- `--xla_cpu_use_fusion_emitters=false`: XLA:CPU's older (elemental IR) fusion emitters
  instead of its MLIR ones, which take longer to compile such programs. Both routes ship with
  XLA; the same computation fused differently may differ in the last bits of a float32 result.
  Added only where this XLA knows the flag: XLA stops a process on a flag it does not know, and
  it is retiring that route.

What each saves: benchmarks/ci_time_2026-11-29/. Neither is for training or decoding in
earnest, where tuned machine code pays.
"""

from __future__ import annotations

import os
import subprocess
import sys

OPT_LEVEL = "--xla_backend_optimization_level=0"
LEGACY_EMITTERS = "--xla_cpu_use_fusion_emitters=false"
# The probe's answer, in the environment: pytest-xdist's workers, the notebooks' kernels and
# the runs tests start inherit it rather than probing again.
_KNOWN = "_FAST_COMPILE_LEGACY_EMITTERS"


def xla_flags() -> str:
    """The XLA_FLAGS words above that this jaxlib accepts (a probe process, once)."""
    if _KNOWN not in os.environ:
        probe = subprocess.run(
            [sys.executable, "-c", "import jax; jax.numpy.zeros(1).block_until_ready()"],
            env=dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=LEGACY_EMITTERS),
            capture_output=True,
            timeout=120,
        )
        os.environ[_KNOWN] = "1" if probe.returncode == 0 else "0"
    return OPT_LEVEL + (f" {LEGACY_EMITTERS}" if os.environ[_KNOWN] == "1" else "")
