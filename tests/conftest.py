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
