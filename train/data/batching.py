"""Translation batching: token-budget batches in a small fixed set of shapes, seeded and resumable.

Shapes: N rows, L positions. Every batch is a dict of int32 arrays padded with `pad_id`:
  src:     [N, L]  the source ids as given (append an eos yourself if the model wants one)
  tgt_in:  [N, L]  bos + target ids   (decoder input, teacher forcing)
  tgt_out: [N, L]  target ids + eos   (what the decoder must predict)

A pair goes to the smallest bucket length L >= max(len(src), len(tgt) + 1): source and target
are bucketed jointly, so one L serves all three arrays and there is one shape per bucket. A
bucket of length L has N = tokens_per_batch // L rows, rounded down to a multiple of
`num_devices` so the batch splits evenly over a `data` mesh axis; N * L never exceeds the
token budget. `jit` therefore compiles once per bucket (at most len(buckets) times), not once
per batch.

Training (`TokenBatcher`): each epoch shuffles the pairs within each bucket, cuts them into batches
of N rows (the last one of a bucket is filled up with all-pad rows, so the shape stays fixed; an
all-pad row has zero loss weight when weights come from tgt_out != pad), and shuffles the order of
all batches. The shuffle depends only on (seed, epoch), and every epoch has the same number of
batches, so global step k always maps to the same batch: `iterate(k)` resumes a stream exactly where
an uninterrupted run would be. Past one process every process plans the same batches and packs only
its own rows of each (`iterate(k, rows=dp.local_rows)`). Pairs longer than the largest bucket are
dropped (counted in `num_dropped`): with the default buckets that is none of Multi30k.

Evaluation (`eval_batches`): no shuffling, nothing dropped, original order, fixed row count;
`index` [N] gives each row's position in the input (-1 for fill rows) so outputs can be
written in order.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from train.data.tokenizers import BOS_ID, EOS_ID, PAD_ID

# Multi30k pieces per sentence (8k joint BPE): median 14, 99th percentile 32, max 55. Steps of
# 4 where most pairs are keep ~83% of the batch real tokens (uniform steps of 8: ~75%), and
# Multi30k fills only 7 of these 8 buckets, so jit compiles 7 shapes.
DEFAULT_BUCKETS = (12, 16, 20, 24, 32, 48, 64, 96)

Pair = tuple[Sequence[int], Sequence[int]]


def _check_buckets(buckets: Sequence[int]) -> tuple[int, ...]:
    buckets = tuple(int(b) for b in buckets)
    if not buckets or buckets[0] < 2 or any(a >= b for a, b in zip(buckets, buckets[1:])):
        raise ValueError(f"buckets must be strictly increasing lengths >= 2, got {buckets}")
    return buckets


def pair_length(src: Sequence[int], tgt: Sequence[int]) -> int:
    """Positions a pair needs: the source, or the target plus its bos/eos shift."""
    return max(len(src), len(tgt) + 1)


def _pack(
    pairs: Sequence[Pair], length: int, *, pad_id: int, bos_id: int, eos_id: int, fill_rows: int = 0
) -> dict[str, np.ndarray]:
    """The padded [len(pairs) + fill_rows, length] arrays of `pairs` (fill rows: all pad)."""
    rows = len(pairs) + fill_rows
    src = np.full((rows, length), pad_id, dtype=np.int32)
    tgt_in = np.full((rows, length), pad_id, dtype=np.int32)
    tgt_out = np.full((rows, length), pad_id, dtype=np.int32)
    for r, (s, t) in enumerate(pairs):
        src[r, : len(s)] = s
        tgt_in[r, 0] = bos_id
        tgt_in[r, 1 : len(t) + 1] = t
        tgt_out[r, : len(t)] = t
        tgt_out[r, len(t)] = eos_id
    return {"src": src, "tgt_in": tgt_in, "tgt_out": tgt_out}


@dataclasses.dataclass(frozen=True)
class PairArrays:
    """Encoded pairs as two flat token streams and their offsets: pair i is
    (src[src_offsets[i]:src_offsets[i + 1]], tgt[tgt_offsets[i]:tgt_offsets[i + 1]]).

    The arrays may be memory-mapped (`train.data.token_cache`): lengths come from the offsets
    alone, and a batch reads only its own rows' tokens, so a corpus of any size trains without
    being loaded.
    """

    src: np.ndarray  # [S] every source's ids, concatenated (any integer dtype)
    src_offsets: np.ndarray  # [P + 1] int64, from 0 to S
    tgt: np.ndarray  # [T] every target's ids (no bos or eos)
    tgt_offsets: np.ndarray  # [P + 1] int64, from 0 to T

    @classmethod
    def from_pairs(cls, pairs: Sequence[Pair]) -> PairArrays:
        def flat(side: int):
            lengths = np.fromiter((len(p[side]) for p in pairs), np.int64, len(pairs))
            offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
            ids = itertools.chain.from_iterable(p[side] for p in pairs)
            return np.fromiter(ids, np.int64, int(offsets[-1])), offsets

        (src, src_offsets), (tgt, tgt_offsets) = flat(0), flat(1)
        return cls(src, src_offsets, tgt, tgt_offsets)

    def __len__(self) -> int:
        return len(self.src_offsets) - 1

    def lengths(self) -> tuple[np.ndarray, np.ndarray]:
        """(source lengths [P], target lengths [P]), int64."""
        return np.diff(self.src_offsets), np.diff(self.tgt_offsets)

    def pack(
        self, index: np.ndarray, length: int, *, pad_id: int, bos_id: int, eos_id: int
    ) -> dict[str, np.ndarray]:
        """The [N, length] arrays of the pairs `index` [N] (-1: an all-pad fill row), as
        `_pack` builds them, reading only those pairs' tokens."""
        index = np.asarray(index, np.int64)
        real = index >= 0
        at = np.where(real, index, 0)
        src = _rows_of(self.src, self.src_offsets, at, real, length, pad_id)
        tgt = _rows_of(self.tgt, self.tgt_offsets, at, real, length, pad_id)
        n_tgt = np.where(real, self.tgt_offsets[at + 1] - self.tgt_offsets[at], 0)
        tgt_out = tgt.copy()
        tgt_out[real, n_tgt[real]] = eos_id  # fits: the bucket holds the target plus one
        tgt_in = np.full_like(tgt, pad_id)
        tgt_in[:, 1:] = tgt[:, :-1]
        tgt_in[real, 0] = bos_id
        return {"src": src, "tgt_in": tgt_in, "tgt_out": tgt_out}


def _rows_of(tokens, offsets, at, real, length: int, pad_id: int) -> np.ndarray:
    """int32 [N, length]: row r holds the ids of sequence at[r] (when real[r]), then pad."""
    start = offsets[at]
    count = np.where(real, offsets[at + 1] - start, 0)
    positions = np.arange(length)
    inside = positions[None, :] < count[:, None]  # [N, length]
    out = np.full(inside.shape, pad_id, np.int32)
    out[inside] = tokens[(start[:, None] + positions[None, :])[inside]]
    return out


def rows_for(length: int, *, tokens_per_batch: int, num_devices: int) -> int:
    """The rows of a batch of bucket `length`: as many as `tokens_per_batch` holds, rounded
    down to a multiple of `num_devices` so each device gets as many; a named error if not one
    row a device fits."""
    rows = tokens_per_batch // length // num_devices * num_devices
    if rows < 1:  # a budget of zero or less included
        raise ValueError(
            f"tokens_per_batch={tokens_per_batch} is too small for bucket length {length} on "
            f"{num_devices} devices: it needs at least {length * num_devices}"
        )
    return rows


class TokenBatcher:
    """Seeded, resumable token-budget batches of translation pairs (see module docstring)."""

    def __init__(
        self,
        pairs: Sequence[Pair] | PairArrays,
        *,
        tokens_per_batch: int = 4096,
        buckets: Sequence[int] = DEFAULT_BUCKETS,
        num_devices: int = 1,
        seed: int = 0,
        pad_id: int = PAD_ID,
        bos_id: int = BOS_ID,
        eos_id: int = EOS_ID,
    ):
        """Args:
        pairs: encoded (src_ids, tgt_ids) pairs, without bos/eos on the target; or the same
          as `PairArrays` (memory-mapped from a token cache: the batches are the same).
        tokens_per_batch: the budget N * L of each array of a batch.
        buckets: the allowed lengths L, increasing.
        num_devices: N is a multiple of this (the size of the data-parallel axis).
        seed: the shuffle seed; (seed, epoch) fixes an epoch's batches and their order.
        pad_id, bos_id, eos_id: the special ids (the tokenizer's).
        """
        if num_devices < 1:
            raise ValueError(f"num_devices must be >= 1, got {num_devices}")
        self.buckets = _check_buckets(buckets)
        self.tokens_per_batch = tokens_per_batch
        self.num_devices = num_devices
        self.seed = seed
        self._special = dict(pad_id=pad_id, bos_id=bos_id, eos_id=eos_id)
        self.pairs = pairs if isinstance(pairs, PairArrays) else PairArrays.from_pairs(pairs)
        # Each pair's bucket from the lengths alone (no token read): the smallest L >=
        # pair_length; past the largest, dropped. Members keep the input order.
        src_len, tgt_len = self.pairs.lengths()
        which = np.searchsorted(np.asarray(self.buckets), np.maximum(src_len, tgt_len + 1))
        self.num_dropped = int(np.count_nonzero(which == len(self.buckets)))
        members = {L: np.flatnonzero(which == i) for i, L in enumerate(self.buckets)}
        self.bucket_counts = {L: len(m) for L, m in members.items() if len(m)}
        if not self.bucket_counts:
            raise ValueError(
                f"no pair fits the largest bucket ({self.buckets[-1]}); "
                f"{self.num_dropped} pairs dropped"
            )
        # Rows only for buckets in use: an empty long bucket must not reject a small budget.
        self.rows = {
            L: rows_for(L, tokens_per_batch=tokens_per_batch, num_devices=num_devices)
            for L in self.bucket_counts
        }
        # Member `count` of each bucket is -1, the all-pad row that fills up its last batch.
        self._members = {L: np.append(members[L], -1).astype(np.int64) for L in self.bucket_counts}
        self.num_batches = sum(math.ceil(n / self.rows[L]) for L, n in self.bucket_counts.items())

    @property
    def num_examples(self) -> int:
        return sum(self.bucket_counts.values())

    def shape_set(self) -> list[tuple[int, int]]:
        """The (N, L) shapes batches can have (one per non-empty bucket), by increasing L."""
        return [(self.rows[L], L) for L in sorted(self.bucket_counts)]

    def example_batches(
        self, rows: Callable[[int], slice] | None = None
    ) -> list[dict[str, np.ndarray]]:
        """One batch of each shape of `shape_set()`, in its order, as `iterate(..., rows)`
        builds them (all fill rows, so all pad): what a trainer compiles its step for ahead."""
        out = []
        for L in sorted(self.bucket_counts):
            members = np.full(self.rows[L], self.bucket_counts[L])  # the all-pad fill row
            out.append(self._gather(L, members if rows is None else members[rows(len(members))]))
        return out

    def _epoch_plan(self, epoch: int) -> list[tuple[int, np.ndarray]]:
        """The epoch's batches as (L, row indices [N]) in order."""
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        rng = np.random.default_rng([self.seed, epoch])
        plan = []
        for L in sorted(self.bucket_counts):
            count, rows = self.bucket_counts[L], self.rows[L]
            order = rng.permutation(count)
            order = np.concatenate([order, np.full(-count % rows, count)])  # fill rows
            plan.extend((L, chunk) for chunk in order.reshape(-1, rows))
        return [plan[i] for i in rng.permutation(len(plan))]

    def _gather(self, L: int, rows: np.ndarray) -> dict[str, np.ndarray]:
        """The batch of bucket L's members `rows` (packed now: only these pairs are read)."""
        return self.pairs.pack(self._members[L][rows], L, **self._special)

    def iterate(
        self, start_step: int = 0, rows: Callable[[int], slice] | None = None
    ) -> Iterator[dict[str, np.ndarray]]:
        """The endless training stream from global step `start_step` (0-based) on.

        Step k is batch k % num_batches of epoch k // num_batches, so the stream resumed at k
        equals the uninterrupted stream with its first k batches removed.

        rows: N -> the rows of each [N, L] batch to build (`DataParallel.local_rows`: this
          process's share); by default all of them. Only those rows are packed.
        """
        if start_step < 0:
            raise ValueError(f"start_step must be >= 0, got {start_step}")
        epoch, offset = divmod(start_step, self.num_batches)
        while True:
            for L, members in self._epoch_plan(epoch)[offset:]:
                yield self._gather(L, members if rows is None else members[rows(len(members))])
            epoch, offset = epoch + 1, 0


def eval_batches(
    pairs: Sequence[Pair],
    *,
    batch_size: int = 64,
    buckets: Sequence[int] = DEFAULT_BUCKETS,
    num_devices: int = 1,
    pad_id: int = PAD_ID,
    bos_id: int = BOS_ID,
    eos_id: int = EOS_ID,
    sort_by_length: bool = False,
) -> list[dict[str, np.ndarray]]:
    """Every pair, in order, in batches of `batch_size` consecutive rows (unshuffled).

    With `sort_by_length` the pairs are taken shortest first (stable) instead: a batch's rows
    then need about the same length, so it pads to a short bucket, and a decoder's loop over
    it ends when its similar-length rows do. `index` still gives each row's input position.

    Each batch is padded to the smallest bucket that fits its longest pair; a pair longer than
    the largest bucket B is kept and its batch padded to the next multiple of B (rare, and still
    a bounded set of shapes). The last batch is filled up with all-pad rows.

    Returns:
      dicts with src, tgt_in, tgt_out [N, L] as in training batches, and index [N] int32:
      the input position of each row, -1 for fill rows.
    """
    buckets = _check_buckets(buckets)
    if batch_size < 1 or batch_size % num_devices:
        raise ValueError(
            f"batch_size must be a positive multiple of num_devices "
            f"({num_devices}), got {batch_size}"
        )
    order = np.arange(len(pairs), dtype=np.int32)
    if sort_by_length:
        order = order[np.argsort([pair_length(s, t) for s, t in pairs], kind="stable")]
    batches = []
    for start in range(0, len(pairs), batch_size):
        positions = order[start : start + batch_size]
        chunk = [pairs[i] for i in positions]
        need = max(pair_length(s, t) for s, t in chunk)
        L = next((b for b in buckets if b >= need), -(-need // buckets[-1]) * buckets[-1])
        batch = _pack(
            chunk, L, pad_id=pad_id, bos_id=bos_id, eos_id=eos_id, fill_rows=batch_size - len(chunk)
        )
        index = np.full(batch_size, -1, dtype=np.int32)
        index[: len(chunk)] = positions
        batch["index"] = index
        batches.append(batch)
    return batches
