"""Compiles the Mosaic relative-attention kernels (xl_jax.fused_attention_tpu), forward and
backward, for a TPU slice this host does not have, and prints one JSON line of what was
compiled. Run by tests/test_xl_fused_attention_tpu.py in a process that has libtpu on its
path (`python tests/tpu_xl_attention_programs.py v6e:2x2`); not a test itself.

Interpret mode runs operations that Mosaic cannot lower (a per-row gather does), so only this
compile shows that the kernels are TPU programs."""

from __future__ import annotations

import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from train.bench.targets import compile_only_devices
from xl_jax import fused_attention

# Tiny shapes at the smallest TPU block: T = M = one 128-row block, the enwik8 head width.
B_PER_DEVICE, H, K, T, M = 1, 2, 64, 128, 128


def main(name: str) -> None:
    devices = compile_only_devices(name)
    mesh = Mesh(np.asarray(devices), ("data",))
    b, s = B_PER_DEVICE * len(devices), T + M
    rows = NamedSharding(mesh, PartitionSpec("data"))
    whole = NamedSharding(mesh, PartitionSpec())

    def arguments(dtype):
        return [
            jax.ShapeDtypeStruct((b, T, H, K), dtype, sharding=rows),
            jax.ShapeDtypeStruct((b, T, H, K), dtype, sharding=rows),
            jax.ShapeDtypeStruct((b, s, H, K), dtype, sharding=rows),
            jax.ShapeDtypeStruct((b, s, H, K), dtype, sharding=rows),
            jax.ShapeDtypeStruct((s, H, K), dtype, sharding=whole),
            jax.ShapeDtypeStruct((b,), jnp.int32, sharding=rows),
        ]

    def attention(qu, qv, k, v, r, valid):
        # The dispatcher, as the model calls it: the program's platform picks the kernel.
        return fused_attention.relative_attention(
            qu,
            qv,
            k,
            v,
            r,
            valid,
            mem_len=M,
            same_length=True,
            scale=K**-0.5,
            dropout_rate=0.1,
            dropout_rng=jax.random.PRNGKey(0),
        )

    def loss(*a):
        return jnp.sum(attention(*a).astype(jnp.float32))

    out = {"devices": len(devices)}
    grad = jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4))
    # bfloat16 as a model trains; float32's backward takes a full-precision product of its own.
    for part, fn, dtype in (
        ("forward", attention, jnp.bfloat16),
        ("backward", grad, jnp.bfloat16),
        ("backward_float32", grad, jnp.float32),
    ):
        start = time.perf_counter()
        compiled = jax.jit(fn).lower(*arguments(dtype)).compile()
        text = compiled.as_text()
        out[part] = {
            "seconds": round(time.perf_counter() - start, 1),
            "mosaic_calls": text.count('custom_call_target="tpu_custom_call"'),
        }
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1])
