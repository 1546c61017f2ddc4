"""Invariants over whole spaces of inputs, with hypothesis: XL's masks and rel_shift over
shapes, memory lengths and `same_length`; the translation batches (each pair once an epoch,
for any buckets and process count); the token cache (any ids below the vocabulary size);
beam search of one beam (greedy decoding, on random models and sources).

Derandomized: CI runs the same examples every time, and the number of examples keeps the
file within a few seconds a test.
"""

from __future__ import annotations

import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from train.data.batching import TokenBatcher, pair_length
from train.data.token_cache import ids_dtype, stream_cache
from transformer_jax import Transformer, TransformerConfig, beam_search, greedy_decode
from xl_jax.attention import rel_shift
from xl_jax.memory import attention_mask

FIXED = settings(derandomize=True, deadline=None, max_examples=40)


@FIXED
@given(
    lead=st.lists(st.integers(1, 3), max_size=2),
    t=st.integers(1, 9),
    m=st.integers(0, 9),
    seed=st.integers(0, 2**16),
)
def test_rel_shift_aligns_each_query_to_its_keys_distances(lead, t, m, seed):
    """out[i, j] is the score of distance (M + i) - j, read from x's column S - 1 - d, for
    every key j a query may see (j <= M + i)."""
    s = t + m
    x = np.random.default_rng(seed).standard_normal((*lead, t, s)).astype(np.float32)
    out = np.asarray(rel_shift(jnp.asarray(x)))
    i, j = np.nonzero(np.arange(s)[None, :] <= m + np.arange(t)[:, None])
    distance = m + i - j
    np.testing.assert_array_equal(out[..., i, j], x[..., i, s - 1 - distance])


@FIXED
@given(
    t=st.integers(1, 8),
    m=st.integers(0, 8),
    valid=st.lists(st.integers(0, 8), min_size=1, max_size=3),
    same_length=st.booleans(),
)
def test_each_query_sees_its_own_past_within_the_memory_it_has(t, m, valid, same_length):
    """Query i (position M + i) sees only keys at or before it, only filled memory slots, and
    so valid + i + 1 keys; with same_length its last M of them (at least itself)."""
    valid = np.minimum(np.asarray(valid, np.int32), m)
    mask = np.asarray(
        attention_mask(jnp.asarray(valid), q_len=t, mem_len=m, same_length=same_length)
    )
    assert mask.shape == (len(valid), 1, t, m + t)
    i = np.arange(t)[:, None]
    j = np.arange(m + t)[None, :]
    for b, filled in enumerate(valid):
        seen = mask[b, 0]
        assert not np.any(seen & (j > m + i)), "a key in the query's future"
        assert not np.any(seen & (j < m - filled)), "an empty memory slot"
        count = filled + np.arange(t) + 1
        if same_length and m:
            count = np.minimum(count, m)
        np.testing.assert_array_equal(seen.sum(-1), count)
        assert np.all(seen[np.arange(t), m + np.arange(t)]), "each query sees itself"


@FIXED
@given(
    lengths=st.lists(st.tuples(st.integers(1, 30), st.integers(0, 30)), min_size=1, max_size=40),
    buckets=st.lists(st.integers(2, 40), min_size=1, max_size=4, unique=True),
    processes=st.sampled_from([1, 2, 4]),
    seed=st.integers(0, 100),
    epoch=st.integers(0, 2),
)
def test_every_pair_that_fits_is_trained_on_once_an_epoch(lengths, buckets, processes, seed, epoch):
    """For any buckets and process count, the processes' rows of an epoch's batches hold each
    pair that fits the largest bucket exactly once (the rest are all-pad fill rows)."""
    buckets = sorted(buckets)
    # Pair k's source starts with token 3 + k: its identity in the packed batch.
    pairs = [([3 + k] * src, [5] * tgt) for k, (src, tgt) in enumerate(lengths)]
    fits = [k for k, (s, t) in enumerate(pairs) if pair_length(s, t) <= buckets[-1]]
    if not fits:
        return  # the batcher refuses: tested elsewhere
    batcher = TokenBatcher(
        pairs, tokens_per_batch=4 * buckets[-1] * processes, buckets=buckets,
        num_devices=processes, seed=seed,
    )  # fmt: skip
    seen = []
    stream = [batcher.iterate(epoch * batcher.num_batches, rows=_rows(p, processes))
              for p in range(processes)]  # fmt: skip
    for _ in range(batcher.num_batches):
        for process in stream:
            src = next(process)["src"]
            seen += [int(row[0]) - 3 for row in src if row[0] != 0]
    assert sorted(seen) == fits


def _rows(process: int, processes: int):
    def rows(n: int) -> slice:
        share = n // processes
        return slice(process * share, (process + 1) * share)

    return rows


@FIXED
@given(
    vocab_size=st.sampled_from([2, 255, 256, 257, 65_535, 65_536, 65_537, 2**31 - 1]),
    chunk_sizes=st.lists(st.integers(0, 50), max_size=6),
    seed=st.integers(0, 2**16),
)
def test_the_token_cache_returns_any_ids_below_the_vocabulary_size(vocab_size, chunk_sizes, seed):
    rng = np.random.default_rng(seed)
    chunks = [rng.integers(0, vocab_size, n, dtype=np.int64) for n in chunk_sizes]
    chunks.append(np.asarray([0, vocab_size - 1]))  # both ends of the range
    dtype = ids_dtype(vocab_size)
    assert np.iinfo(dtype).max >= vocab_size - 1
    with tempfile.TemporaryDirectory() as root:
        ids = stream_cache(root, lambda: chunks, dtype=dtype, vocab=vocab_size, seed=seed)
        assert ids.dtype == dtype
        np.testing.assert_array_equal(np.asarray(ids, np.int64), np.concatenate(chunks))


V, PAD, BOS, EOS = 13, 0, 1, 2
_MODEL = Transformer(
    TransformerConfig.tiny(
        src_vocab_size=V, tgt_vocab_size=V, d_model=32, n_heads=4, d_ff=64, max_len=12,
        share_embeddings=False, tie_output=False,
    )
)  # fmt: skip


@settings(derandomize=True, deadline=None, max_examples=12)
@given(
    seed=st.integers(0, 2**16),
    eos_bias=st.floats(0.0, 3.0),
    lengths=st.lists(st.integers(1, 6), min_size=3, max_size=3),
    length_penalty=st.floats(0.0, 2.0),
)
def test_beam_search_of_one_beam_is_greedy_decoding(seed, eos_bias, lengths, length_penalty):
    """On random models (an EOS bias makes outputs end at different steps) and sources of any
    length: one beam is the greedy search, whatever the length penalty."""
    rng = np.random.default_rng(seed)
    src = np.zeros((3, 6), np.int32)
    for row, n in enumerate(lengths):
        src[row, : n - 1] = rng.integers(3, V, n - 1)
        src[row, n - 1] = EOS
    src = jnp.asarray(src)
    params = _MODEL.init(jax.random.PRNGKey(seed), src, src[:, :4])["params"]
    params["output"]["bias"] = params["output"]["bias"].at[EOS].add(eos_bias)
    greedy = greedy_decode(_MODEL, params, src, max_len=8)
    tokens, _ = beam_search(
        _MODEL, params, src, beam_size=1, max_len=8, length_penalty=length_penalty
    )
    np.testing.assert_array_equal(np.asarray(tokens[:, 0]), np.asarray(greedy))
