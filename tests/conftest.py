"""Test-wide JAX set-up: 8 fake CPU devices, so data parallelism is tested on any machine.

This must run before JAX initialises its backends, which is why it lives in conftest.py and
touches only configuration (importing jax is fine; creating an array is not).
"""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Older jax versions read the flag; newer ones the config option. Setting both is harmless.
os.environ["XLA_FLAGS"] = (
      os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()

import jax  # noqa: E402

try:
    jax.config.update("jax_num_cpu_devices", 8)
except AttributeError:  # pragma: no cover - jax without the option: the XLA flag applies.
    pass


import gc  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs():
    """Drop JAX's compiled programs after each test module.

    Every XLA:CPU executable holds memory mappings of its own code until it is freed, and JAX's
    caches keep every executable a module built alive. Over the whole suite one process held
    more than Linux's default vm.max_map_count (65,530) mappings, and the next compilation
    crashed the interpreter (a segfault or abort inside backend_compile_and_load, near the end
    of the suite, on 2026-11-25). No test reuses another module's compilations.
    """
    yield
    jax.clear_caches()
    gc.collect()
