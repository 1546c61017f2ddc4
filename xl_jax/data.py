"""Language-model batches from one token stream, batch-major, as the reference's
`LMOrderedIterator` (there time-major).

Shapes (transformer_jax/shapes.py): B batch (rows), T segment length (`tgt_len`), N tokens in the
stream.

The stream is cut into B contiguous rows of n = N // B tokens (the remainder N mod B is
dropped); row b holds tokens [b n, (b + 1) n). Batch i is the columns [i T, i T + T) of the rows
as inputs and the same columns shifted by one as targets, so consecutive batches continue each
row where the last one stopped (what the memory needs). There are ceil((n - 1) / T) batches;
the last one is shorter when T does not divide n - 1 (kept, as the reference).

    batches = lm_batches(tokens, batch_size=32, tgt_len=70)
    len(batches)                      # how many
    batches[i]                        # (inputs [B, T], targets [B, T]) int32
    for inputs, targets in batches.iter_from(start): ...   # exact resume after `start`
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np


class LMBatches(Sequence):
    """A deterministic, indexable sequence of (inputs, targets) NumPy int32 pairs [B, T]."""

    def __init__(self, tokens, *, batch_size: int, tgt_len: int, drop_last: bool = False):
        tokens = np.asarray(tokens)
        if tokens.ndim != 1:
            raise ValueError(f"tokens must be a 1-D stream, got shape {tokens.shape}")
        if batch_size < 1 or tgt_len < 1:
            raise ValueError(f"batch_size and tgt_len must be >= 1, got {batch_size}, {tgt_len}")
        n = tokens.shape[0] // batch_size
        if n < 2:
            raise ValueError(
                f"{tokens.shape[0]} tokens are too few for batch_size {batch_size}"
                " (each row needs an input and a target)"
            )
        # [B, n], a view: a memory-mapped stream stays on disk, and a batch reads (and casts to
        # int32) only its own columns of the rows asked for.
        self.rows = tokens[: n * batch_size].reshape(batch_size, n)
        self.tgt_len = tgt_len
        # Positions that have a next token to predict: 0 .. n - 2.
        self._predictable = n - 1
        self._len = num_lm_batches(
            tokens.shape[0], batch_size=batch_size, tgt_len=tgt_len, drop_last=drop_last
        )

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        return self.batch(i)

    def batch(self, i: int, rows: slice = slice(None)) -> tuple[np.ndarray, np.ndarray]:
        """Batch i (`self[i]`), only its `rows` (a process's share: contiguous parts of the
        stream, the only tokens read) -> (inputs [b, T], targets [b, T]) int32."""
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(f"batch {i} of {len(self)}")
        start = i * self.tgt_len
        stop = min(start + self.tgt_len, self._predictable)
        window = np.asarray(self.rows[rows, start : stop + 1], np.int32)  # [b, T + 1]
        return window[:, :-1], window[:, 1:]

    def __iter__(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        return self.iter_from(0)

    def iter_from(self, start: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Batches start, start + 1, ...: resuming at the batch a checkpoint stopped before."""
        for i in range(start, len(self)):
            yield self[i]


def lm_batches(tokens, *, batch_size: int, tgt_len: int, drop_last: bool = False) -> LMBatches:
    """The batches of a 1-D token stream; see the module docstring. `drop_last` drops a final
    shorter batch (fixed shapes under jit)."""
    return LMBatches(tokens, batch_size=batch_size, tgt_len=tgt_len, drop_last=drop_last)


def num_lm_batches(
    num_tokens: int, *, batch_size: int, tgt_len: int, drop_last: bool = False
) -> int:
    """len(lm_batches(...)) from the stream length alone."""
    predictable = num_tokens // batch_size - 1
    full, rest = divmod(max(predictable, 0), tgt_len)
    return full if drop_last or rest == 0 else full + 1
