"""The training state: everything a step reads and writes, as one pytree.

`TrainState` holds the step counter, the float32 parameters, the optimizer state, the base PRNG
key and optional `extra` state a model carries from step to step (the Transformer-XL memory).
It is what `train_step` takes and returns, what the checkpoints store and what a resumed run
restores, so a resumed run continues bit for bit: the per-step key is derived from `rng` and
`step` (`jax.random.fold_in`), never from a Python-side counter.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import struct

PyTree = Any


class TrainState(struct.PyTreeNode):
    """step: int32 scalar; params: float32 'params' collection; opt_state: the optimizer's state;
    rng: a raw uint32[2] key (raw, not a typed key, so checkpoints store it as a plain array);
    extra: state carried between steps (XL memory, every leaf with leading axis B) or None.

    `tx` is static (not a pytree node): it is rebuilt from the config, never checkpointed.
    """

    step: jax.Array
    params: PyTree
    opt_state: PyTree
    rng: jax.Array
    extra: PyTree = None
    tx: optax.GradientTransformation = struct.field(pytree_node=False, default=None)

    @classmethod
    def create(
        cls,
        *,
        params: PyTree,
        tx: optax.GradientTransformation,
        rng: jax.Array,
        extra: PyTree = None,
    ) -> TrainState:
        return cls(
            step=jnp.zeros((), jnp.int32),
            params=params,
            opt_state=tx.init(params),
            rng=rng,
            extra=extra,
            tx=tx,
        )

    def apply_gradients(
        self, grads: PyTree, *, grad_norm: jax.Array | None = None, **changes
    ) -> TrainState:
        """One optimizer update; `changes` replaces other fields (e.g. extra=new_memory).

        grad_norm: the global norm of `grads`, when the caller has it: passed on as the
        optimizer's `global_norm` extra argument, which `transformer_jax.optim`'s clipping
        reads instead of computing it again. Only a tx that takes extra arguments gets it
        (`optax.chain` drops it for the transformations in it that take none).
        """
        extra_args = {}
        if grad_norm is not None and isinstance(self.tx, optax.GradientTransformationExtraArgs):
            extra_args["global_norm"] = grad_norm
        updates, opt_state = self.tx.update(grads, self.opt_state, self.params, **extra_args)
        params = optax.apply_updates(self.params, updates)
        return self.replace(step=self.step + 1, params=params, opt_state=opt_state, **changes)

    def step_rng(self) -> jax.Array:
        """The key of the current step: a pure function of (rng, step), so resume is exact."""
        return jax.random.fold_in(self.rng, self.step)


def count_params(params: PyTree) -> int:
    return int(sum(x.size for x in jax.tree.leaves(params)))
