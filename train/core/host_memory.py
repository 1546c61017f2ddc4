"""The commands' host memory setting: on a CPU, each training step's buffers come from memory
the process keeps, instead of fresh pages that the kernel maps and zeroes on every step.

XLA:CPU allocates the temporaries of each execution as one block, with `posix_memalign` on one
of its worker threads. For the 64 x 32 Transformer step of `python -m train.bench --only
cpu_vs_torch`, the block is 367 MB. glibc serves a block that large from a new `mmap` and
returns it with `munmap` when the step ends. A worker thread's arena cannot hold more than
64 MB, so no malloc threshold changes this. Every step therefore faults in all its pages again,
a third of a step's time in the kernel, and the first write to each page lands inside a matrix
product (`benchmarks/cpu_vs_torch_2026-11-27_intel207/`).

`keep_host_memory()` tells glibc to serve every thread from the main heap (`M_ARENA_MAX` 1),
never from `mmap` (`M_MMAP_MAX` 0), and to keep freed memory rather than give it back
(`M_TRIM_THRESHOLD`). The block is then reused from step to step, with no page faults. The
numbers a step computes do not change.

The costs:
- the process keeps its peak host memory until it exits, and a freed block with a small
  allocation next to it can be too short for the next request, so the heap grows by a few
  blocks before it settles, then stays stable
  (`benchmarks/cpu_vs_torch_2026-11-27_intel207/`);
- all threads share one malloc arena. glibc's per-thread caches still serve small
  allocations without its lock.

It applies only where it can act and is wanted:
- on Linux with glibc;
- before XLA's CPU threads exist, since a thread takes its arena at its first allocation. The
  commands call it first thing in `train.core.cli.start`; importing the library changes
  nothing;
- when JAX will compute on the CPU: $JAX_PLATFORMS names cpu first, or no accelerator plugin
  is installed. A GPU or TPU step keeps its buffers on the device, and the host allocator is
  left as it is;
- unless $ATTENTION_JAX_KEEP_HOST_MEMORY is `off`.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.metadata
import importlib.util
import os
import sys
from collections.abc import Mapping

import jax

KEEP_ENV = "ATTENTION_JAX_KEEP_HOST_MEMORY"
OFF = ("0", "off", "false", "no", "none")

# mallopt's parameter numbers (glibc's malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
M_ARENA_MAX = -8
# Freed memory at the top of the heap is given back only above this (mallopt takes an int):
# in effect never.
KEEP_BYTES = 2**31 - 1


def xla_threads_started() -> bool:
    """Whether XLA's CPU thread pool is running in this process (its threads are named
    tf_XLAEigen on Linux): after that, `keep_host_memory` can no longer move its threads'
    allocations."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return False
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                if f.read().startswith("tf_XLA"):
                    return True
        except OSError:  # the thread ended meanwhile
            continue
    return False


def accelerator_installed() -> bool:
    """Whether JAX can find a GPU or TPU plugin here, without starting a backend."""
    if importlib.util.find_spec("libtpu") is not None:
        return True
    if importlib.metadata.entry_points(group="jax_plugins"):
        return True
    return importlib.util.find_spec("jax_plugins") is not None


def computes_on_cpu(environ: Mapping[str, str] | None = None) -> bool:
    """Whether JAX's default backend will be the CPU: $JAX_PLATFORMS (or
    `jax.config.jax_platforms`) names cpu first, or, unset, no accelerator plugin is
    installed."""
    environ = os.environ if environ is None else environ
    platforms = environ.get("JAX_PLATFORMS") or jax.config.jax_platforms or ""
    if platforms.strip():
        return platforms.split(",")[0].strip().lower() == "cpu"
    return not accelerator_installed()


def _glibc():
    """The process's glibc, or None (another C library, or not Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version  # noqa: B018  (only glibc has it)
        libc.mallopt  # noqa: B018
    except (OSError, AttributeError):
        return None
    return libc


def keep_host_memory(environ: Mapping[str, str] | None = None) -> str:
    """Sets glibc's malloc for a CPU training process (see the module docstring) -> what it
    did: 'kept', or why not: 'off' ($ATTENTION_JAX_KEEP_HOST_MEMORY), 'not the CPU',
    'not glibc', 'too late' (XLA's threads already run)."""
    environ = os.environ if environ is None else environ
    if environ.get(KEEP_ENV, "").strip().lower() in OFF:
        return "off"
    if not computes_on_cpu(environ):
        return "not the CPU"
    libc = _glibc()
    if libc is None:
        return "not glibc"
    if xla_threads_started():
        return "too late"
    libc.mallopt(M_ARENA_MAX, 1)
    libc.mallopt(M_MMAP_MAX, 0)
    libc.mallopt(M_TRIM_THRESHOLD, KEEP_BYTES)
    return "kept"
