"""train.core.host_memory: the commands' glibc malloc setting, which lets a CPU step reuse the
memory of its temporaries instead of faulting in fresh pages every step."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import jax
import pytest

from train.core import host_memory
from train.core.host_memory import KEEP_ENV, computes_on_cpu, keep_host_memory

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or host_memory._glibc() is None,
    reason="glibc's malloc on Linux only",
)

# A fresh process: set (or not) the allocator, then run a jitted function whose temporary (a
# [65536, 512] float32 array, 128 MB: more than a worker thread's malloc arena holds) is
# allocated anew by every call, and print the page faults of each call after the first.
FAULTS_PER_CALL = textwrap.dedent(
    """
    import resource
    from train.core.host_memory import keep_host_memory
    print(keep_host_memory())
    import jax, jax.numpy as jnp
    x = jax.random.normal(jax.random.PRNGKey(0), (65536, 512))
    w = jnp.ones((512, 8))
    f = jax.jit(lambda x, w: jnp.sum(jnp.sin(x) @ w))
    f(x, w).block_until_ready()
    for _ in range(8):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        f(x, w).block_until_ready()
        print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    """
)


def _faults_per_call(keep: str) -> tuple[str, list[int]]:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
    env.update({KEEP_ENV: keep, "JAX_PLATFORMS": "cpu"})
    out = subprocess.run(
        [sys.executable, "-c", FAULTS_PER_CALL],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    ).stdout.split()
    return out[0], [int(n) for n in out[1:]]


def test_a_kept_heap_serves_a_call_without_new_pages():
    # Off: every call maps its 128 MB temporary afresh (32,768 pages of 4 KiB). Kept: the
    # memory freed by one call serves the next. A busy machine can still make the heap grow
    # for a few calls (a block freed while a small allocation sits next to it is too short
    # for the next request), so the kept side is asserted on its best call.
    said_off, faults_off = _faults_per_call("off")
    said_kept, faults_kept = _faults_per_call("on")
    assert (said_off, said_kept) == ("off", "kept")
    assert min(faults_off) > 16_000
    assert min(faults_kept) < 1_000


def test_too_late_once_xla_threads_run():
    jax.devices()  # this process's backend is running
    assert host_memory.xla_threads_started()
    assert keep_host_memory({}) == "too late"


def test_off_and_not_the_cpu_leave_the_allocator_alone():
    assert keep_host_memory({KEEP_ENV: "off"}) == "off"
    assert keep_host_memory({KEEP_ENV: "0"}) == "off"
    assert keep_host_memory({"JAX_PLATFORMS": "cuda"}) == "not the CPU"


@pytest.mark.parametrize(
    "platforms, on_cpu",
    [("cpu", True), ("CPU", True), ("cpu,cuda", True), ("cuda,cpu", False), ("tpu", False)],
)
def test_computes_on_cpu_reads_jax_platforms_first_entry(platforms, on_cpu):
    assert computes_on_cpu({"JAX_PLATFORMS": platforms}) is on_cpu
