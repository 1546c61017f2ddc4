"""Devices to compile for without having them: GPU targets described to XLA, TPU topologies.

`compile_only_devices(target, n)` gives `n` abstract devices of a named target (an H200, an
H100, an A100; or a TPU topology such as 'v5e:2x2'); a mesh over them and
`jax.jit(...).lower(...).compile()` give the program that device would run, its kernels and
its memory, on a CPU-only host. Nothing is run and nothing is autotuned (GEMM tiles are XLA's
defaults, not the device's choices).

GPU targets need JAX's CUDA plugin of the installed jax's version without the CUDA libraries
(`pip install "attention-jax[gpu-target]"`, i.e. `jax[cuda12-local]`); TPU topologies need
libtpu (`jax[tpu]`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from collections.abc import Iterator

import jax


@dataclasses.dataclass(frozen=True)
class GpuTarget:
    """One GPU model, in the figures XLA's compiler reads (its `GpuTargetConfigProto`).

    Facts from the vendors' datasheets, as XLA records them for the same devices
    (openxla/xla, `xla/backends/gpu/target_config/specs/`).

    Attributes:
      name: the target's flag value ('h200').
      device_name: the device kind the compiled devices report.
      compute_capability: (major, minor).
      sm_count, clock_ghz: streaming multiprocessors and their boost clock.
      memory_bytes: device memory XLA may plan with.
      memory_bandwidth: bytes/s of device memory (datasheet).
      l2_bytes, smem_per_sm, smem_per_block_optin: caches and shared memory.
      bf16_peak: the datasheet's dense bf16 matrix rate, FLOP/s.
      cudnn: the cuDNN version the program is compiled against (major, minor, patch).
    """

    name: str
    device_name: str
    compute_capability: tuple[int, int]
    sm_count: int
    clock_ghz: float
    memory_bytes: int
    memory_bandwidth: float
    l2_bytes: int
    smem_per_sm: int
    smem_per_block_optin: int
    bf16_peak: float
    cudnn: tuple[int, int, int] = (9, 10, 0)
    platform: str = "gpu"

    @property
    def cudnn_version(self) -> int:
        """cuDNN's own integer form (9.10.0 -> 91000), as `cudnnGetVersion` returns it."""
        major, minor, patch = self.cudnn
        return major * 10000 + minor * 100 + patch

    def spec_text(self) -> str:
        """The `GpuTargetConfigProto` text XLA's GPU compiler takes in place of a device."""
        major, minor = self.compute_capability
        dnn_major, dnn_minor, dnn_patch = self.cudnn
        return f"""gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: {self.smem_per_sm}
  threads_per_core_limit: 2048
  core_count: {self.sm_count}
  fpus_per_core: {128 if major >= 9 else 64}
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {int(self.memory_bandwidth)}
  l2_cache_size: {self.l2_bytes}
  clock_rate_ghz: {self.clock_ghz}
  device_memory_size: {self.memory_bytes}
  shared_memory_per_block_optin: {self.smem_per_block_optin}
  cuda_compute_capability {{ major: {major} minor: {minor} }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: {dnn_major} minor: {dnn_minor} patch: {dnn_patch} }}
device_description_str: "{self.device_name}"
"""


@dataclasses.dataclass(frozen=True)
class TpuTarget:
    """A TPU slice by libtpu's topology name ('v5e:2x2'); its chips are libtpu's to describe.

    Attributes:
      name: the topology name, also the flag value.
      memory_bytes: HBM per chip (datasheet).
      bf16_peak: dense bf16 FLOP/s per chip (datasheet).
      memory_bandwidth: HBM bytes/s per chip (datasheet).
    """

    name: str
    memory_bytes: int
    bf16_peak: float
    memory_bandwidth: float
    platform: str = "tpu"

    @property
    def device_name(self) -> str:
        return self.name


GIB = 1024**3

GPU_TARGETS = {
    t.name: t
    for t in (
        GpuTarget(
            name="h200",
            device_name="NVIDIA H200",
            compute_capability=(9, 0),
            sm_count=132,
            clock_ghz=1.98,
            memory_bytes=151_397_597_184,
            memory_bandwidth=4.8e12,
            l2_bytes=50 * 1024**2,
            smem_per_sm=233_472,
            smem_per_block_optin=232_448,
            bf16_peak=989.4e12,
        ),
        GpuTarget(
            name="h100",
            device_name="NVIDIA H100 80GB HBM3",
            compute_capability=(9, 0),
            sm_count=132,
            clock_ghz=1.98,
            memory_bytes=84_942_979_072,
            memory_bandwidth=3.35232e12,
            l2_bytes=50 * 1024**2,
            smem_per_sm=233_472,
            smem_per_block_optin=232_448,
            bf16_peak=989.4e12,
        ),
        GpuTarget(
            name="a100",
            device_name="NVIDIA A100-SXM4-80GB",
            compute_capability=(8, 0),
            sm_count=108,
            clock_ghz=1.41,
            memory_bytes=85_100_068_864,
            memory_bandwidth=2.03904e12,
            l2_bytes=40 * 1024**2,
            smem_per_sm=167_936,
            smem_per_block_optin=166_912,
            bf16_peak=312e12,
        ),
    )
}

# Per chip, from Google Cloud's TPU datasheets.
TPU_CHIPS = {
    "v5e": dict(memory_bytes=16 * GIB, bf16_peak=197e12, memory_bandwidth=819e9),
    "v5p": dict(memory_bytes=95 * GIB, bf16_peak=459e12, memory_bandwidth=2765e9),
    "v6e": dict(memory_bytes=32 * GIB, bf16_peak=918e12, memory_bandwidth=1640e9),
}


def get_target(name: str) -> GpuTarget | TpuTarget:
    """A target by its flag value: a GPU ('h200', 'h100', 'a100') or a TPU topology
    ('v5e:2x2', 'v5p:2x2x1', 'v6e:4x4', ...)."""
    key = name.lower()
    if key in GPU_TARGETS:
        return GPU_TARGETS[key]
    chip = key.split(":", 1)[0]
    if ":" in key and chip in TPU_CHIPS:
        return TpuTarget(name=key, **TPU_CHIPS[chip])
    raise ValueError(
        f"target: unknown {name!r}; choose a GPU ({', '.join(GPU_TARGETS)}) or a TPU topology "
        f"({', '.join(c + ':2x2' for c in TPU_CHIPS)}, ...)"
    )


def target_for_device_kind(kind: str) -> GpuTarget | None:
    """The GPU target of a device's `device_kind` ('NVIDIA H200' -> h200), None if unknown."""
    for target in GPU_TARGETS.values():
        if kind.lower().startswith(target.device_name.lower()):
            return target
    return None


class TargetUnavailable(RuntimeError):
    """The compiler for a target is not installed (JAX's CUDA plugin, or libtpu)."""


@functools.cache
def _topology_devices(name: str) -> tuple[jax.Device, ...]:
    from jax.experimental import topologies  # the experimental API, only for deviceless work

    target = get_target(name)
    try:
        if isinstance(target, GpuTarget):
            topology = topologies.get_topology_desc(
                platform="cuda",
                topology_name="",
                target_config=target.spec_text(),
                topology="1x1x1",
            )
        else:
            # Compile-only: no chip is opened, so a second process compiling for a TPU at the
            # same time (a test beside a bench) need not wait on libtpu's one-process lock.
            os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
            topology = topologies.get_topology_desc(target.name, "tpu")
    except (NotImplementedError, RuntimeError) as e:
        extra = "gpu-target" if isinstance(target, GpuTarget) else "tpu"
        raise TargetUnavailable(
            f"target {name}: JAX cannot compile for it here ({e}); install its compiler with "
            f'pip install "attention-jax[{extra}]" (the version of the installed jax)'
        ) from e
    return tuple(topology.devices)


def compile_only_devices(name: str, count: int | None = None) -> list[jax.Device]:
    """`count` compile-only devices of target `name` (default: all the topology has; a GPU
    target has one, and more are refused: a multi-GPU host is not described here)."""
    devices = list(_topology_devices(name))
    if count is None:
        return devices
    if count > len(devices):
        raise ValueError(
            f"target {name}: {count} devices asked for, the topology has {len(devices)}"
        )
    return devices[:count]


@contextlib.contextmanager
def compiling_for(target: GpuTarget | TpuTarget) -> Iterator[None]:
    """Lets JAX's cuDNN wrapper build its kernels for `target` on a host without cuDNN.

    `jax.nn.dot_product_attention(implementation="cudnn")` asks the process's cuDNN library
    for its version while tracing, to choose the kernel's variant; this host has none, so the
    version is the target's for the duration (the program is the target's, compiled against
    that version). The model code needs nothing: it chooses its kernels from the devices the
    step is compiled for (`transformer_jax.platform.compile_platform`). Pallas' Triton
    lowering already falls back to compute capability 9.0 without a GPU (the Hopper targets').
    """
    if not isinstance(target, GpuTarget) or jax.default_backend() == "gpu":
        yield
        return
    from jax._src.cudnn import fused_attention_stablehlo as cudnn_attention

    original = cudnn_attention.check_cudnn_version
    cudnn_attention.check_cudnn_version = lambda: target.cudnn_version
    try:
        yield
    finally:
        cudnn_attention.check_cudnn_version = original
