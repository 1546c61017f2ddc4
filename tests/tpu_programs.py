"""Compiles tiny training and decoding steps for a TPU slice this host does not have, and
prints what each program holds as one JSON line. Run by tests/test_target.py in a process
that has libtpu on its path (`python tests/tpu_programs.py v5e:2x2`); not a test itself."""

from __future__ import annotations

import dataclasses
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from train.bench import deviceless, train_steps
from train.bench.options import config_from_options, parse_options
from train.bench.targets import compile_only_devices, compiling_for, get_target
from train.bench.timing import compiled_memory
from transformer_jax import Transformer, TransformerConfig, greedy_decode
from xl_jax import TransformerXLConfig


def main(name: str) -> None:
    target = get_target(name)
    config = dataclasses.replace(
        config_from_options(parse_options(["--quick", "true"])),
        dtype="bfloat16",
        transformer=TransformerConfig.tiny(dtype="bfloat16"),
        transformer_batch=16,
        transformer_len=16,
    )
    xl = TransformerXLConfig.tiny(dtype="bfloat16")
    benches = {
        "transformer": lambda: train_steps.transformer_train_setup(config),
        "xl": lambda: train_steps.xl_train_setup("xl (tiny)", xl, 8, config),
    }
    out = {"devices": len(compile_only_devices(name)), "platform": target.platform}
    for model, setup in benches.items():
        for sharding in ("replicated", "fsdp"):
            compiled, _, _ = deviceless.compile_for_target(setup(), target, sharding=sharding)
            out[f"train_{model}_{sharding}"] = {
                "memory": compiled_memory(compiled),
                "text_has_all_reduce": "all-reduce" in compiled.as_text(),
            }

    # One greedy search over a batch split across the slice, the weights replicated.
    mesh = Mesh(np.asarray(compile_only_devices(name)), ("data",))
    model = Transformer(TransformerConfig.tiny(dtype="bfloat16"))
    params = jax.eval_shape(
        lambda: model.init(
            jax.random.PRNGKey(0), jnp.ones((1, 8), jnp.int32), jnp.ones((1, 8), jnp.int32)
        )["params"]
    )
    replicated = NamedSharding(mesh, PartitionSpec())
    params = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated), params
    )
    src = jax.ShapeDtypeStruct(
        (8, 16), jnp.int32, sharding=NamedSharding(mesh, PartitionSpec("data"))
    )
    with compiling_for(target):
        compiled = (
            jax.jit(lambda p, s: greedy_decode(model, p, s, max_len=12))
            .lower(params, src)
            .compile()
        )
    out["greedy_decode"] = {"memory": compiled_memory(compiled)}
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1])
