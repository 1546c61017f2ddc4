"""Transformer-XL memory as explicit, fixed-shape state, and the attention mask it implies.

Shapes (transformer_jax/shapes.py): B batch, T segment (query) length, M memory length, S = M + T
key length, D model width, L layers.

The reference (kimiyoung/transformer-xl, time-major) grows its memory from an empty tensor and
slices `cat(mems, hids)[beg:end]`; every new memory length is a new shape, hence a recompile
under `jit`. Here the memory always has M slots and a per-row count `valid` of how many of the
most recent slots hold real positions; slots not yet filled are masked out of attention, so the
first segments behave exactly as the reference's shorter memories.
"""

from __future__ import annotations

from collections.abc import Sequence

import flax.struct
import jax
import jax.numpy as jnp

from xl_jax.config import TransformerXLConfig

Array = jax.Array


@flax.struct.dataclass
class Memory:
    """Per-layer cached inputs of the last M positions.

    Attributes:
      hidden: L arrays [B, M, D]: the input of layer l (layer 0: the embedded tokens) at the M
        positions before the current segment, oldest first.
      valid: [B] int32, how many of the last slots of `hidden` are real positions (0 <= valid
        <= M); slots [0, M - valid) are padding.
    Every leaf has the batch as its leading axis, so one PartitionSpec shards all of it.
    """

    hidden: tuple[Array, ...]
    valid: Array

    @property
    def length(self) -> int:
        """M, static (from the shape)."""
        return self.hidden[0].shape[1]


def init_memory(config: TransformerXLConfig, batch_size: int, mem_len: int | None = None) -> Memory:
    """An empty memory of `mem_len` slots (default `config.mem_len`).

    Use a different `mem_len` at evaluation than in training (the reference's
    `reset_length`): the model reads M from the memory's shape, so each length compiles once.
    """
    mem_len = config.mem_len if mem_len is None else mem_len
    if mem_len < 0:
        raise ValueError(f"mem_len must be >= 0, got {mem_len}")
    zeros = jnp.zeros((batch_size, mem_len, config.d_model), config.dtype)
    return Memory(
        hidden=tuple(zeros for _ in range(config.n_layers)),
        valid=jnp.zeros((batch_size,), jnp.int32),
    )


def reset_rows(memory: Memory, reset: Array) -> Memory:
    """The memory with the rows where `reset` [B] bool is True emptied (as `init_memory`'s);
    the reference starts each training epoch with an empty memory."""
    return Memory(
        hidden=tuple(jnp.where(reset[:, None, None], jnp.zeros_like(h), h) for h in memory.hidden),
        valid=jnp.where(reset, 0, memory.valid),
    )


def update_memory(memory: Memory, hiddens: Sequence[Array]) -> Memory:
    """Keep the last M positions of concat(memory, hiddens), without gradient.

    Args:
      memory: the memory the segment was computed with.
      hiddens: L arrays [B, T, D], the input of each layer over the current segment.
    Returns:
      a Memory of the same shapes, with `valid` grown by T (at most M).
    """
    m = memory.length
    t = hiddens[0].shape[1]
    # Explicit start index: a slice like [-m:] would keep everything when m == 0.
    new = tuple(
        jax.lax.stop_gradient(jnp.concatenate([old, h.astype(old.dtype)], axis=1)[:, t : t + m])
        for old, h in zip(memory.hidden, hiddens, strict=True)
    )
    return Memory(hidden=new, valid=jnp.minimum(memory.valid + t, m).astype(jnp.int32))


def attention_mask(valid: Array, *, q_len: int, mem_len: int, same_length: bool) -> Array:
    """Which keys of concat(memory, segment) each query may attend to.

    Query i sits at position M + i of the S = M + T keys; its distance to key j is
    d = M + i - j. A key is visible when

      * d >= 0 (causal, offset by the memory length),
      * j >= M - valid (the memory slot holds a real position), and
      * with `same_length`, d < M.

    The last rule is the reference's `same_length` mask written in distances: there, with
    `mlen` real memory positions and its configured `mem_len`, query i sees keys
    (i - shift, i + mlen] with shift = mem_len - mlen when mlen + T > mem_len, else T.
    Both cases reduce to d < mem_len (in the second, every causal key already has
    d < mlen + T <= mem_len). So each query sees its last `mem_len` positions, itself
    included: fewer near the start of the stream, and not "all queries see klen - T + 1 keys".
    Here the configured memory length is M, the length of the memory passed in.

    Args:
      valid: [B] int32, the memory's valid count.
    Returns:
      [B, 1, T, S] bool, True = attend.
    """
    s = mem_len + q_len
    i = jnp.arange(q_len)[:, None]
    j = jnp.arange(s)[None, :]
    dist = mem_len + i - j  # [T, S]
    visible = dist >= 0
    if same_length:
        visible = visible & (dist < mem_len)
    filled = j[None] >= (mem_len - valid)[:, None, None]  # [B, 1, S]
    return (visible[None] & filled)[:, None]
