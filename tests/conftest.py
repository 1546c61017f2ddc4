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
    """Drop JAX's compiled programs after each test module: every XLA:CPU executable holds
    memory mappings of its own code until it is freed, and over the whole suite one process
    would hold more than Linux's vm.max_map_count allows, crashing the next compilation. No
    test reuses another module's compilations."""
    yield
    jax.clear_caches()
    gc.collect()


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory):
    """One TFDS data directory for the whole session, with PTB (word and character level) and
    Multi30k prepared once, before any run reads it: runs only read it, so subprocesses never
    build a dataset concurrently. A test that damages a dataset copies it first."""
    # Lazy: importing TFDS takes seconds, and most test modules never need it.
    from train.data.datasets import load_multi30k, load_ptb
    path = tmp_path_factory.mktemp("tfds")
    for level in ("word", "char"):
        load_ptb(level, "train", data_dir=path)
    load_multi30k("train", data_dir=path)
    return path
