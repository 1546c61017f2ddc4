"""lm_batches against the tutorial's time-major batching (view(B, -1).t(), then bptt slices)."""

from __future__ import annotations

import numpy as np
import pytest

from xl_jax import lm_batches, num_lm_batches


def _tutorial_batches(stream, bsz, bptt):
    n = len(stream) // bsz
    data = np.asarray(stream[: n * bsz]).reshape(bsz, n).T  # [n, B], column b = row b
    out = []
    for i in range(0, n - 1, bptt):
        seq_len = min(bptt, n - 1 - i)
        out.append((data[i : i + seq_len].T, data[i + 1 : i + 1 + seq_len].T))
    return out


@pytest.mark.parametrize("n_tokens,bsz,tgt", [(103, 4, 5), (100, 4, 3), (41, 2, 4), (9, 4, 7)])
def test_matches_tutorial_batching(n_tokens, bsz, tgt):
    stream = np.arange(1000, 1000 + n_tokens)
    batches = lm_batches(stream, batch_size=bsz, tgt_len=tgt)
    want = _tutorial_batches(stream, bsz, tgt)
    assert len(batches) == len(want) == num_lm_batches(n_tokens, batch_size=bsz, tgt_len=tgt)
    for (x, y), (wx, wy) in zip(batches, want, strict=True):
        assert x.dtype == np.int32 and y.dtype == np.int32
        np.testing.assert_array_equal(x, wx)
        np.testing.assert_array_equal(y, wy)
    # Each row continues where the previous batch stopped, targets are the next tokens.
    rows = np.concatenate([x for x, _ in batches], axis=1)
    np.testing.assert_array_equal(rows[:, 1:], np.concatenate([y for _, y in batches], 1)[:, :-1])


def test_last_partial_kept_or_dropped_and_resume():
    stream = np.arange(103)  # rows of 25: 24 predictable positions
    kept = lm_batches(stream, batch_size=4, tgt_len=5)
    assert len(kept) == 5 and kept[-1][0].shape == (4, 4)
    dropped = lm_batches(stream, batch_size=4, tgt_len=5, drop_last=True)
    assert len(dropped) == 4 == num_lm_batches(103, batch_size=4, tgt_len=5, drop_last=True)
    assert all(x.shape == (4, 5) for x, _ in dropped)
    resumed = list(kept.iter_from(2))
    assert len(resumed) == 3
    for (x, y), (wx, wy) in zip(resumed, list(kept)[2:]):
        np.testing.assert_array_equal(x, wx)
        np.testing.assert_array_equal(y, wy)


def test_rejects_bad_input():
    with pytest.raises(ValueError, match="1-D"):
        lm_batches(np.zeros((2, 3)), batch_size=1, tgt_len=2)
    with pytest.raises(ValueError, match="too few"):
        lm_batches(np.arange(5), batch_size=4, tgt_len=2)
    with pytest.raises(IndexError):
        lm_batches(np.arange(20), batch_size=2, tgt_len=4)[3]
