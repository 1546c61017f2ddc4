"""Translation batching: token budget, fixed shapes, content, determinism, resume, eval order.

Pairs are synthetic and self-identifying: pair i's source starts with token 10 + i, so every
row of a batch can be traced back to its pair and compared with padding done by hand.
"""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest
from helpers import epoch_batches

from train.data.batching import (
    DEFAULT_BUCKETS,
    PairArrays,
    TokenBatcher,
    _pack,
    eval_batches,
    pair_length,
    rows_for,
)

BUCKETS = (8, 12, 16, 24)
PAD, BOS, EOS = 0, 1, 2


def make_pairs(n: int, *, seed: int = 0, max_len: int = 30) -> list[tuple[list[int], list[int]]]:
    rng = np.random.default_rng(seed)
    pairs = []
    for i in range(n):
        src_len, tgt_len = rng.integers(1, max_len, size=2)
        src = [10 + i] + rng.integers(4, 50, size=src_len - 1).tolist()
        tgt = rng.integers(4, 50, size=tgt_len).tolist()
        pairs.append((src, tgt))
    return pairs


def expected_rows(src: list[int], tgt: list[int], length: int) -> dict[str, list[int]]:
    """Padding by hand."""
    pad = lambda ids: ids + [PAD] * (length - len(ids))  # noqa: E731
    return {"src": pad(src), "tgt_in": pad([BOS] + tgt), "tgt_out": pad(tgt + [EOS])}


def smallest_bucket(src, tgt) -> int | None:
    need = max(len(src), len(tgt) + 1)
    fitting = [b for b in BUCKETS if b >= need]
    return fitting[0] if fitting else None


@pytest.fixture(scope="module")
def pairs():
    return make_pairs(700)


@pytest.fixture(scope="module")
def batcher(pairs):
    return TokenBatcher(pairs, tokens_per_batch=200, buckets=BUCKETS, num_devices=4, seed=3)


def test_shapes_budget_and_shape_set(batcher, pairs):
    # Rows per bucket: 200 // L rounded down to a multiple of 4 devices.
    used = sorted({smallest_bucket(*p) for p in pairs} - {None})
    assert batcher.shape_set() == [((200 // L) // 4 * 4, L) for L in used]
    assert len(batcher.shape_set()) <= len(BUCKETS)
    for epoch in (0, 1):
        batches = list(epoch_batches(batcher, epoch))
        assert len(batches) == batcher.num_batches
        for batch in batches:
            assert set(batch) == {"src", "tgt_in", "tgt_out"}
            shape = batch["src"].shape
            assert shape in batcher.shape_set()
            assert shape[0] * shape[1] <= 200 and shape[0] % 4 == 0
            for v in batch.values():
                assert v.dtype == np.int32 and v.shape == shape


def test_each_epoch_holds_every_fitting_pair_once_padded_by_hand(batcher, pairs):
    too_long = [i for i, p in enumerate(pairs) if smallest_bucket(*p) is None]
    assert batcher.num_dropped == len(too_long) > 0
    assert batcher.num_examples == len(pairs) - len(too_long)
    for epoch in (0, 5):
        seen = []
        for batch in epoch_batches(batcher, epoch):
            length = batch["src"].shape[1]
            for r in range(batch["src"].shape[0]):
                if batch["src"][r, 0] == PAD:  # a fill row: nothing but padding
                    assert not any(batch[k][r].any() for k in batch)
                    continue
                i = int(batch["src"][r, 0]) - 10
                seen.append(i)
                assert smallest_bucket(*pairs[i]) == length  # the smallest bucket that fits
                for key, row in expected_rows(*pairs[i], length).items():
                    np.testing.assert_array_equal(batch[key][r], row)
        assert sorted(seen) == sorted(set(range(len(pairs))) - set(too_long))


def test_same_seed_and_epoch_give_the_same_batches(pairs, batcher):
    twin = TokenBatcher(pairs, tokens_per_batch=200, buckets=BUCKETS, num_devices=4, seed=3)
    for a, b in zip(epoch_batches(batcher, 2), epoch_batches(twin, 2), strict=True):
        for key in a:
            np.testing.assert_array_equal(a[key], b[key])

    def first_tokens(b: TokenBatcher, epoch: int) -> list[list[int]]:
        return [batch["src"][:, 0].tolist() for batch in epoch_batches(b, epoch)]

    assert first_tokens(batcher, 0) != first_tokens(batcher, 1)  # reshuffled per epoch
    other_seed = TokenBatcher(pairs, tokens_per_batch=200, buckets=BUCKETS, num_devices=4, seed=4)
    assert first_tokens(batcher, 0) != first_tokens(other_seed, 0)


def test_iterate_resumes_exactly_where_an_uninterrupted_run_is(batcher):
    n = batcher.num_batches
    uninterrupted = list(itertools.islice(batcher.iterate(), 2 * n + 5))
    epochs = list(epoch_batches(batcher, 0)) + list(epoch_batches(batcher, 1))
    for a, b in zip(uninterrupted, epochs):
        np.testing.assert_array_equal(a["src"], b["src"])
    for start in (1, n - 2, n, n + 7, 2 * n):
        resumed = list(itertools.islice(batcher.iterate(start), 5))
        for a, b in zip(resumed, uninterrupted[start : start + 5], strict=True):
            for key in a:
                np.testing.assert_array_equal(a[key], b[key])


def test_each_process_builds_only_its_rows_of_the_same_global_batches(batcher):
    # Four devices on two processes: each packs the rows of its two devices, and together the
    # shares are the one-process batches (nothing depends on the process count).
    whole = list(itertools.islice(batcher.iterate(3), 6))
    shares = [
        list(
            itertools.islice(
                batcher.iterate(3, rows=lambda n, p=p: slice(p * n // 2, (p + 1) * n // 2)), 6
            )
        )
        for p in (0, 1)
    ]
    for full, first, second in zip(whole, *shares, strict=True):
        for key in full:
            assert first[key].shape[0] == second[key].shape[0] == full[key].shape[0] // 2
            np.testing.assert_array_equal(np.concatenate([first[key], second[key]]), full[key])


def test_eval_batches_keep_every_pair_in_order():
    pairs = make_pairs(53, seed=1, max_len=30)
    pairs.append(([10 + 53] + [5] * 40, [6] * 3))  # longer than the largest bucket: kept
    batches = eval_batches(pairs, batch_size=8, buckets=BUCKETS, num_devices=4)
    assert len(batches) == 7
    order = []
    for batch in batches:
        rows, length = batch["src"].shape
        assert rows == 8
        real = batch["index"] >= 0
        chunk = [pairs[i] for i in batch["index"][real]]
        need = max(pair_length(s, t) for s, t in chunk)
        assert length == (min(b for b in BUCKETS if b >= need) if need <= 24 else 48)
        for r, i in enumerate(batch["index"]):
            if i < 0:
                assert not batch["src"][r].any() and not batch["tgt_out"][r].any()
                continue
            order.append(int(i))
            for key, row in expected_rows(*pairs[i], length).items():
                np.testing.assert_array_equal(batch[key][r], row)
    assert order == list(range(len(pairs)))
    assert batches[-1]["index"].tolist() == [48, 49, 50, 51, 52, 53, -1, -1]


def test_eval_batches_sorted_by_length_keep_every_pair_and_its_position():
    pairs = make_pairs(53, seed=2, max_len=30)
    batches = eval_batches(pairs, batch_size=8, buckets=BUCKETS, num_devices=4, sort_by_length=True)
    seen, lengths = [], []
    for batch in batches:
        for r, i in enumerate(batch["index"]):
            if i < 0:
                assert not batch["src"][r].any()
                continue
            seen.append(int(i))
            lengths.append(pair_length(*pairs[i]))
            for key, row in expected_rows(*pairs[i], batch["src"].shape[1]).items():
                np.testing.assert_array_equal(batch[key][r], row)
    assert sorted(seen) == list(range(len(pairs)))
    assert lengths == sorted(lengths)
    # Stable: pairs of equal length keep their input order.
    for a, b in zip(seen, seen[1:]):
        if pair_length(*pairs[a]) == pair_length(*pairs[b]):
            assert a < b
    # Shortest first pads the early batches to short buckets.
    assert [b["src"].shape[1] for b in batches] == sorted(b["src"].shape[1] for b in batches)


def test_bad_batching_options(pairs):
    with pytest.raises(ValueError, match="tokens_per_batch=40 is too small for bucket length 12"):
        TokenBatcher(pairs, tokens_per_batch=40, buckets=BUCKETS, num_devices=4)
    with pytest.raises(ValueError, match="buckets must be strictly increasing"):
        TokenBatcher(pairs, buckets=(16, 8))
    with pytest.raises(ValueError, match="no pair fits"):
        TokenBatcher([([5] * 30, [6])], buckets=BUCKETS)
    with pytest.raises(ValueError, match="multiple of num_devices"):
        eval_batches(pairs, batch_size=6, num_devices=4)
    with pytest.raises(ValueError, match="start_step"):
        next(TokenBatcher(pairs, buckets=BUCKETS).iterate(-1))


# ------------------------------------------------------- what the mutation run of issue 67 found


def test_default_buckets_budget_and_devices_give_the_documented_shapes():
    # One pair of every length up to the largest default bucket: every default bucket in use.
    pairs = [([10] * n, [11] * (n - 1)) for n in range(1, 97)]
    batcher = TokenBatcher(pairs)
    lengths = (12, 16, 20, 24, 32, 48, 64, 96)
    assert batcher.buckets == DEFAULT_BUCKETS == lengths
    assert batcher.tokens_per_batch == 4096 and batcher.num_devices == 1
    assert batcher.shape_set() == [(4096 // L, L) for L in lengths]


def test_bucket_lists_are_checked():
    assert TokenBatcher([([5], [6])], buckets=(2, 4)).buckets == (2, 4)  # 2 is the least
    assert TokenBatcher([([5], [6])], buckets=[3]).buckets == (3,)
    for bad in [(), (1, 4), (0,), (4, 4), (8, 4, 16)]:
        with pytest.raises(ValueError, match="buckets must be strictly increasing lengths >= 2"):
            TokenBatcher([([5], [6])], buckets=bad)


def test_a_target_as_long_as_a_bucket_goes_to_the_next_one():
    # The target needs one more position (bos in tgt_in, eos in tgt_out); odd lengths too.
    buckets = (3, 4, 5, 6, 7, 8)
    for n in range(1, 8):
        batcher = TokenBatcher([([5], [6] * n)], tokens_per_batch=64, buckets=buckets)
        (L,) = batcher.bucket_counts
        assert L == max(3, n + 1), n
        (batch,) = epoch_batches(batcher, 0)
        np.testing.assert_array_equal(batch["tgt_out"][0], [6] * n + [EOS] + [PAD] * (L - n - 1))


def test_pair_arrays_hold_each_pair_and_pack_it_with_fill_rows():
    # A short first pair and a long second one: offsets must start at 0 and lengths come from
    # differences, not from any other arithmetic that agrees on later pairs.
    pairs = [([7], [8, 9]), ([20 + i for i in range(9)], [30, 31, 32]), ([40, 41], [])]
    arrays = PairArrays.from_pairs(pairs)
    assert len(arrays) == 3
    assert arrays.src_offsets.tolist() == [0, 1, 10, 12]
    assert arrays.tgt_offsets.tolist() == [0, 2, 5, 5]
    src_len, tgt_len = arrays.lengths()
    assert src_len.tolist() == [1, 9, 2] and tgt_len.tolist() == [2, 3, 0]
    packed = arrays.pack(np.array([1, -1, 0, 2]), 10, pad_id=PAD, bos_id=BOS, eos_id=EOS)
    by_hand = _pack([pairs[1], pairs[0], pairs[2]], 10, pad_id=PAD, bos_id=BOS, eos_id=EOS)
    for key in ("src", "tgt_in", "tgt_out"):
        want = np.insert(by_hand[key], 1, PAD, axis=0)  # the fill row, all pad
        np.testing.assert_array_equal(packed[key], want)
    # One pair and a fill row: the fill row reads no pair's offsets.
    single = PairArrays.from_pairs([([7, 7], [8])])
    packed = single.pack(np.array([0, -1]), 4, pad_id=PAD, bos_id=BOS, eos_id=EOS)
    np.testing.assert_array_equal(packed["tgt_in"], [[BOS, 8, PAD, PAD], [PAD] * 4])
    assert len(PairArrays.from_pairs([])) == 0


def test_pack_by_hand_takes_keywords_and_no_fill_rows_by_default():
    packed = _pack([([5, 6], [7])], 4, pad_id=PAD, bos_id=BOS, eos_id=EOS)
    assert packed["src"].tolist() == [[5, 6, PAD, PAD]]
    with pytest.raises(TypeError):
        _pack([([5], [7])], 4, PAD, BOS, EOS)  # the special ids are keyword-only
    with pytest.raises(TypeError):
        rows_for(12, 4096, 1)
    with pytest.raises(TypeError):
        TokenBatcher([([5], [6])], 4096)


def test_rows_for_names_the_least_budget_and_refuses_none():
    assert rows_for(12, tokens_per_batch=100, num_devices=4) == 8
    assert rows_for(12, tokens_per_batch=24, num_devices=2) == 2  # one row a device
    for budget in (23, 0, -4096):
        with pytest.raises(ValueError, match="bucket length 12 on 2 devices: it needs at least 24"):
            rows_for(12, tokens_per_batch=budget, num_devices=2)


def test_errors_name_the_largest_bucket_and_a_negative_epoch():
    with pytest.raises(
        ValueError, match=r"no pair fits the largest bucket \(24\); 1 pairs dropped"
    ):
        TokenBatcher([([5] * 30, [6])], buckets=BUCKETS)
    batcher = TokenBatcher([([5], [6])], buckets=BUCKETS)
    with pytest.raises(ValueError, match="epoch must be >= 0, got -1"):
        batcher._epoch_plan(-1)


def test_eval_batches_defaults_sizes_and_lengths_past_the_largest_bucket():
    pairs = [([10 + i] * 3, [5]) for i in range(5)]
    batches = eval_batches(pairs, batch_size=4, buckets=BUCKETS)  # one device by default
    assert [b["src"].shape for b in batches] == [(4, 8), (4, 8)]
    assert batches[1]["index"].tolist() == [4, -1, -1, -1]  # three fill rows
    # A pair needing exactly a bucket's length pads to it; past the largest, to its multiple.
    for need, length in [(12, 12), (13, 16), (48, 48), (49, 72)]:
        (batch,) = eval_batches([([5] * need, [6])], batch_size=1, buckets=BUCKETS)
        assert batch["src"].shape == (1, length), need
    for size, devices in [(0, 1), (4, 3), (-2, 1)]:
        with pytest.raises(ValueError, match="batch_size must be a positive multiple"):
            eval_batches(pairs, batch_size=size, num_devices=devices)


def test_pair_length_counts_the_target_s_shift_for_odd_and_even_targets():
    assert pair_length([5], [6, 6, 6]) == 4
    assert pair_length([5], [6, 6]) == 3
    assert pair_length([5] * 9, [6]) == 9
    # eval_batches pads to it: an odd target at a bucket's length goes to the next bucket.
    (batch,) = eval_batches([([5], [6] * 11)], batch_size=1, buckets=BUCKETS)
    assert batch["src"].shape == (1, 12)
    (batch,) = eval_batches([([5], [6] * 12)], batch_size=1, buckets=BUCKETS)
    assert batch["src"].shape == (1, 16)


def test_keyword_only_options_of_packing_and_eval_batches():
    arrays = PairArrays.from_pairs([([5], [6])])
    with pytest.raises(TypeError):
        arrays.pack(np.array([0]), 4, PAD, BOS, EOS)
    with pytest.raises(TypeError):
        eval_batches([([5], [6])], 4)


def test_pair_arrays_are_frozen():
    arrays = PairArrays.from_pairs([([5], [6])])
    with pytest.raises(dataclasses.FrozenInstanceError):
        arrays.src = np.zeros(1, np.int64)


def test_example_batches_give_one_all_pad_batch_of_each_shape(batcher):
    whole = batcher.example_batches()
    assert [b["src"].shape for b in whole] == batcher.shape_set()
    assert not any(b[key].any() for b in whole for key in b)
    half = batcher.example_batches(rows=lambda n: slice(0, n // 2))
    assert [b["src"].shape for b in half] == [(n // 2, L) for n, L in batcher.shape_set()]


def test_the_stream_is_endless_and_the_default_seed_is_0(batcher, pairs):
    n = batcher.num_batches
    assert len(list(itertools.islice(batcher.iterate(), 2 * n + 5))) == 2 * n + 5
    assert len(list(itertools.islice(batcher.iterate(n + 3), 4))) == 4
    default = TokenBatcher(pairs, tokens_per_batch=200, buckets=BUCKETS, num_devices=4)
    seed0 = TokenBatcher(pairs, tokens_per_batch=200, buckets=BUCKETS, num_devices=4, seed=0)
    for a, b in zip(epoch_batches(default, 0), epoch_batches(seed0, 0), strict=True):
        np.testing.assert_array_equal(a["src"], b["src"])


def test_device_counts_below_one_are_refused_and_eval_batches_hold_64_rows():
    with pytest.raises(ValueError, match="num_devices must be >= 1, got 0"):
        TokenBatcher([([5], [6])], num_devices=0)
    batches = eval_batches([([10 + i], [5]) for i in range(70)])
    assert [b["src"].shape[0] for b in batches] == [64, 64]
    assert batches[1]["index"].tolist() == list(range(64, 70)) + [-1] * 58
