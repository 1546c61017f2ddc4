"""Decoding a Transformer: the KV cache against the full forward pass, greedy and beam search."""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax import Transformer, TransformerConfig, beam_search, greedy_decode

V = 13
PAD, BOS, EOS = 0, 1, 2


def _model(seed=0, **overrides):
    cfg = TransformerConfig.tiny(
        **{
            **dict(src_vocab_size=V, tgt_vocab_size=V, d_model=32, n_heads=4, d_ff=64, max_len=12),
            **overrides,
        }
    )
    model = Transformer(cfg)
    src = jnp.array([[5, 6, 7, 8, 2, 0], [9, 3, 2, 0, 0, 0], [4, 4, 4, 4, 4, 2]], jnp.int32)
    params = model.init(jax.random.PRNGKey(seed), src, src[:, :4])["params"]
    return model, params, src


@pytest.mark.parametrize(
    "overrides",
    [
        dict(norm_first=False),
        dict(norm_first=True),
        dict(positional="learned"),
        dict(positional="sinusoidal_concat", share_embeddings=False, tie_output=False),
        # Marian's options: decoding starts from pad, so no target position is masked as pad.
        dict(
            bos_id=PAD,
            activation="swish",
            layer_norm_eps=1e-5,
            scale_embeddings=False,
            positional="sinusoidal_concat",
            output_bias=True,
        ),
    ],
)
def test_cached_steps_equal_full_forward_at_every_step(overrides):
    model, params, src = _model(**overrides)
    tgt = jnp.array(
        [[1, 7, 8, 9, 3, 2, 0, 0], [1, 3, 3, 2, 0, 0, 0, 0], [1, 10, 11, 12, 3, 4, 5, 6]], jnp.int32
    )  # pad inside too
    tgt = tgt.at[:, 0].set(model.config.bos_id)
    full = model.apply({"params": params}, src, tgt)  # [B, T, V]
    step = jax.jit(
        lambda tok, cache, i: model.apply(
            {"params": params}, tok, cache, index=i, method="decode_step"
        )
    )
    cache = model.apply({"params": params}, src, max_len=tgt.shape[1], method="init_decode_cache")
    for leaf in jax.tree_util.tree_leaves(cache):
        assert leaf.shape[0] == src.shape[0], "every cache leaf must lead with the batch axis"
    for t in range(tgt.shape[1]):
        logits, cache = step(tgt[:, t], cache, jnp.int32(t))
        chex.assert_shape(logits, (3, V))
        chex.assert_trees_all_close(logits, full[:, t], atol=1e-4, rtol=1e-4)


def _np_greedy_by_full_forward(model, params, src, max_len):
    """The slow reference: rerun the whole model on the growing prefix at every step."""
    b_ = src.shape[0]
    prefix = np.full((b_, 1), BOS, np.int32)
    done = np.zeros(b_, bool)
    for _ in range(max_len):
        logits = np.array(model.apply({"params": params}, src, jnp.asarray(prefix))[:, -1])
        logits[:, [PAD, BOS]] = -np.inf
        tok = np.where(done, PAD, np.argmax(logits, axis=-1))
        prefix = np.concatenate([prefix, tok[:, None].astype(np.int32)], axis=1)
        done |= tok == EOS
    return prefix[:, 1:]


@pytest.mark.parametrize("seed", [0, 1])
def test_greedy_decode_equals_greedy_by_full_forward(seed):
    model, params, src = _model(seed)
    got = np.asarray(greedy_decode(model, params, src, max_len=7))
    chex.assert_shape(got, (3, 7))
    np.testing.assert_array_equal(got, _np_greedy_by_full_forward(model, params, src, 7))


def _assert_well_formed(rows):
    rows = np.asarray(rows).reshape(-1, rows.shape[-1])
    assert not np.any(rows == BOS)
    for row in rows:
        if EOS in row:
            e = list(row).index(EOS)
            assert np.all(row[e + 1 :] == PAD), row
            assert not np.any(row[:e] == PAD), row
        else:
            assert not np.any(row == PAD), row


def test_eos_is_followed_only_by_pad():
    # A model whose output bias makes EOS likely, so sequences end at different steps.
    model, params, src = _model(2, share_embeddings=False, tie_output=False)
    params = jax.tree_util.tree_map(lambda x: x, params)
    params["output"]["bias"] = params["output"]["bias"].at[EOS].set(1.5)
    greedy = greedy_decode(model, params, src, max_len=8)
    tokens, _ = beam_search(model, params, src, beam_size=4, max_len=8)
    assert np.any(np.asarray(greedy) == EOS) and np.any(np.asarray(tokens) == EOS)
    _assert_well_formed(greedy)
    _assert_well_formed(tokens)


@pytest.mark.parametrize("seed", [0, 3])
def test_beam_size_one_equals_greedy(seed):
    model, params, src = _model(seed)
    greedy = greedy_decode(model, params, src, max_len=8)
    tokens, scores = beam_search(model, params, src, beam_size=1, max_len=8)
    chex.assert_shape(tokens, (3, 1, 8))
    np.testing.assert_array_equal(np.asarray(tokens[:, 0]), np.asarray(greedy))


def test_beam_scores_are_normalised_log_probs_of_the_returned_sequences():
    model, params, src = _model(4)
    alpha = 0.6
    tokens, scores = beam_search(model, params, src, beam_size=3, max_len=6, length_penalty=alpha)
    chex.assert_shape(scores, (3, 3))
    assert np.all(np.diff(np.asarray(scores), axis=1) <= 1e-6), "best first"
    _assert_well_formed(tokens)
    for b in range(3):
        for w in range(3):
            seq = [int(t) for t in np.asarray(tokens[b, w]) if t != PAD]
            tgt = jnp.array([[BOS] + seq[:-1]], jnp.int32)
            logits = np.asarray(model.apply({"params": params}, src[b : b + 1], tgt), np.float64)[0]
            logits[:, [PAD, BOS]] = -np.inf  # decoding renormalises over emittable tokens
            m = logits.max(-1, keepdims=True)
            log_p = logits - m - np.log(np.exp(logits - m).sum(-1, keepdims=True))
            total = sum(log_p[t, tok] for t, tok in enumerate(seq))
            expected = total / ((5 + len(seq)) / 6) ** alpha
            np.testing.assert_allclose(float(scores[b, w]), expected, rtol=1e-4, atol=1e-4)
    # The best beam is at least as good as the greedy sequence under the same score.
    greedy = np.asarray(greedy_decode(model, params, src, max_len=6))
    greedy_beam, greedy_scores = beam_search(
        model, params, src, beam_size=1, max_len=6, length_penalty=alpha
    )
    np.testing.assert_array_equal(np.asarray(greedy_beam[:, 0]), greedy)
    assert np.all(np.asarray(scores[:, 0]) >= np.asarray(greedy_scores[:, 0]) - 1e-5)


def test_one_compiled_search_serves_every_length_penalty():
    # The penalty is an argument of the compiled search, not a constant of it: three alphas,
    # one compilation, and the alphas still rank differently (the scores are divided by it).
    # (The search compiles a few programs, `decode._PROGRAMS`: the first alpha compiles them,
    # the other two nothing.)
    from transformer_jax.decoding import decode

    def compiled():
        return sum(program._cache_size() for program in decode._PROGRAMS)

    model, params, src = _model(5, share_embeddings=False, tie_output=False)
    compiled_before = compiled()
    scores = []
    for a in (0.0, 0.6, 2.0):
        scores.append(
            np.asarray(beam_search(model, params, src, beam_size=2, max_len=6, length_penalty=a)[1])
        )
        if a == 0.0:
            compiled_first = compiled()
    assert compiled_first > compiled_before
    assert compiled() == compiled_first
    assert not np.array_equal(scores[0], scores[2])


@pytest.mark.parametrize("alpha", [0.0, 0.6, 1.3, 2.0])
@pytest.mark.parametrize("beam_size", [2, 4])
def test_best_only_beam_equals_the_full_searchs_best(alpha, beam_size):
    # A random tiny model with EOS made likely (one example more than the others), so the
    # sentences end at different steps; the early-stopping search must return the same best.
    model, params, src = _model(5, share_embeddings=False, tie_output=False)
    params = jax.tree_util.tree_map(lambda x: x, params)
    params["output"]["bias"] = params["output"]["bias"].at[EOS].set(1.0)
    src = jnp.concatenate([src, src[:1] * 0 + jnp.array([[3, 3, 3, 2, 0, 0]])])
    tokens, scores = beam_search(
        model, params, src, beam_size=beam_size, max_len=10, length_penalty=alpha
    )
    best, best_scores = beam_search(
        model, params, src, beam_size=beam_size, max_len=10, length_penalty=alpha, best_only=True
    )
    assert np.any(np.asarray(tokens[:, 0]) == EOS)
    np.testing.assert_array_equal(np.asarray(best[:, 0]), np.asarray(tokens[:, 0]))
    np.testing.assert_array_equal(np.asarray(best_scores[:, 0]), np.asarray(scores[:, 0]))


def test_cache_stages_double_from_16_up_to_the_output_length():
    from transformer_jax import cache_stages

    assert cache_stages(80) == (16, 32, 64, 80)
    assert cache_stages(64) == (16, 32, 64)
    assert cache_stages(16) == (16,) and cache_stages(5) == (5,)
    assert cache_stages(20, first=4) == (4, 8, 16, 20)


def test_stages_must_rise_to_max_len_and_a_cache_never_shrinks():
    model, params, src = _model()
    for stages in ((8, 4, 10), (4, 8), ()):
        with pytest.raises(ValueError, match="stages must rise to max_len"):
            greedy_decode(model, params, src, max_len=10, stages=stages)
    cache = model.apply({"params": params}, src, max_len=8, method="init_decode_cache")
    with pytest.raises(ValueError, match="cannot shrink"):
        model.apply({"params": params}, cache, max_len=4, method="grow_decode_cache")
    # Grown, the cache is what a longer one would hold: the new positions empty.
    grown = model.apply({"params": params}, cache, max_len=12, method="grow_decode_cache")
    longer = model.apply({"params": params}, src, max_len=12, method="init_decode_cache")
    chex.assert_trees_all_equal(grown, longer)


@functools.cache  # five tests use it; building runs two searches over 64 sentences
def _ragged_model(others_run_on: bool = False):
    """A tiny random Transformer (sharp: embeddings at scale 8, EOS's row boosted) and 16
    sources of which 13 end within 4 tokens, greedily and in every beam of 3, and 3 run to the
    limit (chosen from 64 by their outputs), so a search that drops finished sentences shrinks
    its batch. With `others_run_on`, the 13 end within 4 tokens in beam 0 (and greedily) while
    another of their beams runs to the limit."""
    v = 48
    cfg = TransformerConfig.tiny(
        src_vocab_size=v, tgt_vocab_size=v, d_model=32, n_heads=4, d_ff=64, max_len=32
    )
    model = Transformer(cfg)
    rng = np.random.default_rng(0)
    pool = rng.integers(3, v, size=(64, 8)).astype(np.int32)
    pool[:, -1] = EOS
    params = model.init(jax.random.PRNGKey(0), jnp.asarray(pool), jnp.asarray(pool[:, :4]))
    params = jax.tree_util.tree_map_with_path(
        lambda path, x: x * 8.0 if "embedding" in jax.tree_util.keystr(path) else x,
        params["params"],
    )
    table = params["tgt_embed"]["embedding"]
    params["tgt_embed"]["embedding"] = table.at[EOS].multiply(3.0)
    greedy = np.sum(np.asarray(greedy_decode(model, params, pool, max_len=30)) != PAD, axis=-1)
    beams = beam_search(model, params, pool, beam_size=3, max_len=30)[0]
    beams = np.sum(np.asarray(beams) != PAD, axis=-1)  # [64, 3]
    others = beams[:, 1:].max(axis=1)
    short = (greedy <= 4) & (beams[:, 0] <= 4) & (others == 30 if others_run_on else others <= 4)
    short = np.flatnonzero(short)
    long = np.flatnonzero((greedy == 30) & (beams[:, 0] == 30))
    assert len(short) >= 13 and len(long) >= 3, (greedy, beams)
    order = rng.permutation(np.concatenate([short[:13], long[:3]]))
    return model, params, jnp.asarray(pool[order])


@pytest.fixture
def shrunk(monkeypatch):
    """(batch, kept) of every `_keep_rows` call the searches make: whether, and to what, a
    search shrank its batch."""
    from transformer_jax.decoding import decode

    calls = []
    keep_rows = decode._keep_rows

    def counting_keep_rows(state, keep):
        calls.append((state[1].shape[0], keep.shape[0]))
        return keep_rows(state, keep)

    monkeypatch.setattr(decode, "_keep_rows", counting_keep_rows)
    return calls


@pytest.mark.parametrize("search", ["greedy", "beam", "beam_best_only"])
def test_dropping_finished_sentences_returns_what_the_whole_batch_search_returns(search, shrunk):
    model, params, src = _ragged_model()
    shrunk.clear()  # building the model (a greedy search over 64 sentences) may have shrunk
    # Cache stages of 4, 8 and 30 positions, and the default stages (16, 30): the search looks
    # at which sentences have ended every `_CHECK_EVERY` steps and at each stage's end.
    for kwargs in (dict(max_len=30, stages=(4, 8, 30)), dict(max_len=30)):
        if search == "greedy":
            whole = greedy_decode(model, params, src, drop_finished=False, **kwargs)
            dropping = greedy_decode(model, params, src, **kwargs)
            chex.assert_trees_all_equal(dropping, whole)
            continue
        kwargs.update(beam_size=3, length_penalty=0.6, best_only=search == "beam_best_only")
        whole = beam_search(model, params, src, drop_finished=False, **kwargs)
        dropping = beam_search(model, params, src, **kwargs)
        # The same tokens, every beam, best_only too; the scores to float32 rounding (a
        # smaller batch's products may round a last bit differently).
        np.testing.assert_array_equal(np.asarray(dropping[0]), np.asarray(whole[0]))
        np.testing.assert_allclose(dropping[1], whole[1], rtol=1e-5, atol=1e-6)
        lengths = np.sum(np.asarray(whole[0][:, 0]) != PAD, axis=-1)
        assert lengths.min() <= 4 and lengths.max() > 16, lengths
    # The batch did shrink (to a power of two at most half of it), so the equality above
    # compared the dropping search with the whole one, not the whole search with itself.
    assert shrunk and all(after <= before // 2 for before, after in shrunk), shrunk


def test_returning_only_the_best_beam_lets_a_sentence_leave_once_its_best_is_final(shrunk):
    # 13 sentences whose beam 0 ends within 4 tokens while another beam runs to the limit.
    model, params, src = _ragged_model(others_run_on=True)
    shrunk.clear()  # building the model may have shrunk a search of its own
    for kwargs in (dict(max_len=30, stages=(4, 8, 30)), dict(max_len=30)):
        kwargs.update(beam_size=3, length_penalty=0.6)
        whole = beam_search(model, params, src, drop_finished=False, **kwargs)
        # All beams returned: a sentence waits for its last beam, so none leaves.
        beam_search(model, params, src, best_only=True, **kwargs)
        assert not shrunk
        best = beam_search(model, params, src, best_only=True, return_beams=1, **kwargs)
        assert best[0].shape == (16, 1, 30) and best[1].shape == (16, 1)
        # The search as one program (under jit, on split sources) returns the same beam.
        one = beam_search(
            model, params, src, best_only=True, return_beams=1, drop_finished=False, **kwargs
        )
        np.testing.assert_array_equal(np.asarray(one[0]), np.asarray(best[0]))
        np.testing.assert_array_equal(np.asarray(best[0][:, 0]), np.asarray(whole[0][:, 0]))
        np.testing.assert_allclose(best[1][:, 0], whole[1][:, 0], rtol=1e-5, atol=1e-6)
        # ... and the sentences did leave: the batch shrank to half or less.
        assert shrunk and all(after <= before // 2 for before, after in shrunk), shrunk
        shrunk.clear()
    # Without best_only, beam 0 is not final before the search has ended; return_beams only
    # trims the outputs. Out of range, it is refused.
    kwargs = dict(beam_size=3, max_len=12, length_penalty=0.6)
    two = beam_search(model, params, src, return_beams=2, **kwargs)
    every = beam_search(model, params, src, **kwargs)
    chex.assert_trees_all_equal(two, (every[0][:, :2], every[1][:, :2]))
    for bad in (0, 4):
        with pytest.raises(ValueError, match="return_beams must be in"):
            beam_search(model, params, src, return_beams=bad, **kwargs)


def test_only_a_search_on_cpus_drops_finished_sentences_by_default(shrunk, monkeypatch):
    from transformer_jax.decoding import decode

    # drop_finished=None drops on CPUs only: on an accelerator the syncs with the host and the
    # programs of each batch size cost more than the rows it saves (decode's H200 figures).
    assert decode._drops_by_default(["cpu"]) and decode._drops_by_default(("cpu", "cpu"))
    for platforms in (["gpu"], ["cuda"], ["tpu"], ["cpu", "gpu"], []):
        assert not decode._drops_by_default(platforms), platforms
    model, params, src = _ragged_model()
    shrunk.clear()
    dropping = greedy_decode(model, params, src, max_len=30)
    assert shrunk  # on this CPU, the default dropped finished sentences
    # The default asks about the devices holding the source; answered "no", the search is one
    # program (no shrink) and returns the same tokens.
    asked = []

    def on_accelerator(platforms):
        asked.append(list(platforms))
        return False

    monkeypatch.setattr(decode, "_drops_by_default", on_accelerator)
    shrunk.clear()
    whole = greedy_decode(model, params, np.asarray(src), max_len=30)
    assert asked == [["cpu"]] and not shrunk
    chex.assert_trees_all_equal(whole, dropping)
    # An explicit drop_finished is not second-guessed.
    greedy_decode(model, params, src, max_len=30, drop_finished=True)
    assert asked == [["cpu"]] and shrunk


def test_greedy_argmax_is_jnps_first_maximum():
    from transformer_jax.decoding.search import _argmax

    x = np.array(jax.random.normal(jax.random.PRNGKey(0), (6, 50)), np.float32)
    x[1, [3, 7, 40]] = 9.0  # a tie: the first index wins
    x[2] = -np.inf  # nothing allowed: index 0, as jnp.argmax
    x[3, [5, 9]] = np.nan  # NaN counts as the maximum
    x[4, -1] = 9.0
    got = _argmax(jnp.asarray(x))
    assert got.dtype == jnp.int32
    np.testing.assert_array_equal(got, jnp.argmax(jnp.asarray(x), axis=-1))
    assert list(np.asarray(got)[1:5]) == [3, 0, 5, 49]


@pytest.mark.parametrize("v, w", [(2000, 4), (1000, 1), (999, 5), (64, 4), (101, 3), (40, 4)])
def test_a_beam_steps_selection_is_lax_top_k_of_every_candidate(v, w):
    """`_beam_candidates` scores only the best chunks; it returns what `lax.top_k` over every
    candidate's score returns: the same indices and log-probs, ties to the lower index."""
    from jax import lax

    from transformer_jax.decoding.search import _beam_candidates

    b, bos_id = 6, 1
    pad_id = v - 1 if v % 2 else 7  # in a last, shorter chunk (OPUS-MT's pad is its last id)
    rng = np.random.default_rng(v + w)
    logits = np.round(rng.normal(size=(b, w, v))).astype(np.float32)  # ties everywhere
    logits[0, :, [3, v - 1, v // 2]] = 9.0  # tied best, far apart, in every beam
    logits[1] = -5.0  # a tie between a better chunk's second best and a worse, earlier chunk
    logits[1, 0, [v - 2, v - 3, 5]] = [9.0, 7.0, 7.0]
    log_prob = np.round(rng.normal(size=(b, w)) - 3.0, 1).astype(np.float32)
    log_prob[2, 1:] = -np.inf  # the first step: only beam 0 may expand
    log_prob[3] = np.round(log_prob[3, 0], 1)  # beams tied on their log-prob
    finished = rng.random((b, w)) < 0.3
    finished[4] = True  # every hypothesis has ended: each offers only itself
    finished[5, 0] = True
    finished[1] = False
    log_prob[5, 1:] = -np.inf  # one finished, the rest dead: fewer than w possible
    lengths = rng.integers(1, 20, (b, w))
    penalty = ((5.0 + lengths.astype(np.float32)) / 6.0) ** np.float32(0.6)

    got = jax.jit(lambda *a: _beam_candidates(*a, k=w, pad_id=pad_id, bos_id=bos_id))(
        jnp.asarray(logits.reshape(b * w, v)), log_prob, finished, penalty
    )

    # The reference: every candidate scored, as the search did before.
    x = np.where(np.isin(np.arange(v), [pad_id, bos_id]), -np.inf, logits)
    step = jax.nn.log_softmax(jnp.asarray(x), axis=-1)
    stay = jnp.where(jnp.arange(v) == pad_id, log_prob[..., None], -jnp.inf)
    cand = jnp.where(finished[..., None], stay, log_prob[..., None] + step).reshape(b, w * v)
    _, flat = lax.top_k(cand / jnp.repeat(penalty, v, axis=1), w)
    np.testing.assert_array_equal(got[1], flat)
    np.testing.assert_array_equal(got[0], jnp.take_along_axis(cand, flat, axis=1))
    assert got[1].dtype == jnp.int32


def test_float_order_and_top_k_order_rank_as_lax_top_k():
    from jax import lax

    from transformer_jax.decoding.search import _float_order, _top_k_order

    x = np.array(
        [-np.inf, -3e38, -1.5, -1e-30, -0.0, 0.0, 1e-30, 1.0, 1.0, 3e38, np.inf], np.float32
    )
    order = np.asarray(_float_order(jnp.asarray(x)))
    assert order.dtype == np.int32
    # The same order, -0.0 and 0.0 equal, and room below -inf.
    assert np.all(np.diff(order) >= 0) and order[4] == order[5] and order[7] == order[8]
    assert np.sum(np.diff(order) == 0) == 2 and order[0] > np.iinfo(np.int32).min
    rows = np.round(np.random.default_rng(0).normal(size=(5, 300)), 1).astype(np.float32)
    rows[1, ::7] = -np.inf
    for k in (1, 4, 9):
        np.testing.assert_array_equal(
            _top_k_order(_float_order(jnp.asarray(rows)), k), lax.top_k(rows, k)[1]
        )


def test_beam_search_with_a_chunked_top_k_equals_plain_top_k(monkeypatch):
    from transformer_jax.decoding import search

    model, params, src = _ragged_model()
    kwargs = dict(beam_size=3, max_len=30, length_penalty=0.6)
    # Chunks of 4: the tiny model's vocabulary of 48 takes the chunked path (at the default
    # width, only vocabularies of 2 * 32 = 64 or more do).
    outputs = []
    for width in (4, 10**6):
        monkeypatch.setattr(search, "_TOP_K_CHUNK", width)
        jax.clear_caches()  # the width is read when a search is traced
        outputs.append(beam_search(model, params, src, **kwargs))
    jax.clear_caches()
    (tokens, scores), (plain_tokens, plain_scores) = outputs
    # The same hypotheses, token for token. Their scores are the same arithmetic in two
    # programs that XLA fuses differently, so they agree to float32 rounding (bitwise with
    # XLA:CPU's default emitters; a few ulps apart with the legacy ones the suite compiles
    # with, conftest.py).
    chex.assert_trees_all_equal(tokens, plain_tokens)
    chex.assert_trees_all_close(scores, plain_scores, rtol=1e-5, atol=0)


def test_the_batch_a_search_shrinks_to():
    from transformer_jax.decoding.decode import _smaller_batch

    # A power of two at most half the current batch, never below a sixteenth of the first
    # one (8 of 128): the last few sentences of a batch of 128 go on in 8 rows.
    alive = (0, 1, 2, 3, 8, 9, 17, 32, 33, 64, 65, 100)
    assert [_smaller_batch(n, 128, 128) for n in alive] == [
        8,
        8,
        8,
        8,
        8,
        16,
        32,
        32,
        64,
        64,
        128,
        128,
    ]
    # Shrunk already, from 128 to 16 rows: to 8 and no further.
    assert [_smaller_batch(n, 16, 128) for n in (1, 5, 8, 9)] == [8, 8, 8, 16]
    assert _smaller_batch(1, 8, 128) == 8
    # The bench's batch of 32 goes down to 2; batches under 16 have no floor.
    assert [_smaller_batch(n, 32, 32) for n in (1, 2, 3, 16, 17)] == [2, 2, 4, 16, 32]
    assert _smaller_batch(2, 3, 3) == 3 and _smaller_batch(1, 3, 3) == 1
    assert _smaller_batch(1, 2, 2) == 1


def test_a_search_under_jit_or_on_several_devices_is_one_program():
    from transformer_jax.decoding import decode

    model, params, src = _ragged_model()
    expected = greedy_decode(model, params, src, max_len=12)
    jitted = jax.jit(lambda p, s: greedy_decode(model, p, s, max_len=12))
    chex.assert_trees_all_equal(jitted(params, src), expected)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("data",))
    split = jax.device_put(
        src, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    )
    whole_before = decode._whole_search._cache_size()
    tokens, _ = beam_search(model, params, split, beam_size=2, max_len=12)
    assert decode._whole_search._cache_size() == whole_before + 1
    beam, _ = beam_search(model, params, src, beam_size=2, max_len=12)
    chex.assert_trees_all_equal(np.asarray(tokens), np.asarray(beam))
