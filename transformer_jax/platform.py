"""Which kind of device a computation is compiled for, so kernels follow the target.

A program can be compiled for devices this process does not drive: `jax.jit(...).lower(...)`
over the compile-only devices of `jax.experimental.topologies` gives an H200's or a TPU's
program on a CPU host. `jax.default_backend()` answers for the process ("cpu" there), so a
kernel chosen by it would be the CPU's choice inside the GPU's program. The arrays being traced
know better: their abstract values carry the mesh of the devices they are placed on, and that
mesh names its devices' platform.
"""

from __future__ import annotations

import jax

PLATFORMS = ("cpu", "gpu", "tpu")


def _mesh_platform(mesh) -> str | None:
    device = getattr(mesh, "abstract_device", None)
    return getattr(device, "platform", None)


def _traced_mesh(x):
    """The mesh `x`'s traced value is placed on (None where it names none)."""
    return getattr(getattr(getattr(x, "aval", None), "sharding", None), "mesh", None)


def compile_platform(*arrays) -> str:
    """'cpu', 'gpu' or 'tpu': the platform the computation over `arrays` is compiled for.

    In order: the mesh set by `jax.sharding.use_mesh`/`set_mesh`; the mesh of the first array
    whose sharding names one (a traced value inside `jit` with sharded arguments, or a
    placed `jax.Array`); else the process's default backend (plain `jit` on host values, or
    `pmap`, which run where the process runs). Costs nothing at run time: it reads
    trace-time metadata only.
    """
    platform = _mesh_platform(jax.sharding.get_abstract_mesh())
    for x in arrays:
        if platform is not None:
            break
        platform = _mesh_platform(_traced_mesh(x))
        if platform is None and isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
            platform = next(iter(x.devices())).platform
    platform = platform or jax.default_backend()
    # ROCm and CUDA devices both answer "gpu" through jax.Device.platform; the names a
    # PJRT plugin may give ("cuda", "rocm") are folded into it.
    return "gpu" if platform in ("cuda", "rocm") else platform


def compile_devices(*arrays) -> int:
    """How many devices the computation over `arrays` is compiled for: the set mesh's size,
    else that of the first array whose traced value names a mesh (1 where none does: plain
    `jit` on one device, or inside `pmap`)."""
    mesh = jax.sharding.get_abstract_mesh()
    for x in arrays:
        if not mesh.empty:
            break
        traced = _traced_mesh(x)
        mesh = mesh if traced is None else traced
    return getattr(mesh, "size", 0) or 1


def keep_placement(out: jax.Array, like: jax.Array) -> jax.Array:
    """`out` placed as `like` where `like`'s traced value names a mesh and `out`'s does not.

    A Pallas call's outputs carry no mesh, so `compile_platform` of what is computed from them
    would fall back to the process's backend (a GPU program compiled on a CPU host would take
    the CPU's choices after the first kernel). A sharding constraint equal to the input's
    puts the mesh back; on one device it compiles to nothing.
    """
    mesh = _traced_mesh(like)
    if mesh is None or mesh.empty or out.shape != like.shape:
        return out
    if not getattr(_traced_mesh(out), "empty", True):
        return out
    return jax.lax.with_sharding_constraint(out, like.aval.sharding)
