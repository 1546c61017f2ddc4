"""Recurrent baselines (GRU, Bahdanau, Luong global / local-p) against a slow NumPy reference.

Every model is checked for: equality with a float64 NumPy re-implementation written from the
papers' equations (loops over sentences and steps, no padding at all); attention weights that
sum to 1 and skip pads; padding invariance; cached decode_step == teacher-forced pass; greedy
and beam decoding consistent with the teacher-forced pass; overfitting a tiny batch; rng-driven
teacher forcing; the local-p window.
"""
from __future__ import annotations

import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.errors import InvalidRngError
from translation_checks import (
    PAD,
    SRC,
    TGT,
    check_greedy_and_beam,
    check_padding_invariance,
    jit_apply,
    overfit_losses,
    random_params,
    run_cached,
)

from transformer_jax.baselines import BASELINES, make_baseline
from transformer_jax.seq2seq import (
    BahdanauSeq2Seq,
    GRUSeq2Seq,
    LuongLocalSeq2Seq,
    LuongSeq2Seq,
    RNNSeq2SeqConfig,
)

VOCAB = 32

# name -> (registry name, config overrides). Between them they cover both encoder directions,
# the bridge and every score.
CASES = {
    "gru": ("gru", {}),
    "gru_bidirectional": ("gru", {"bidirectional": True}),
    "bahdanau": ("bahdanau", {}),
    "luong_dot": ("luong", {}),
    "luong_general_bidirectional": ("luong", {"luong_score": "general", "bidirectional": True}),
    "luong_concat": ("luong", {"luong_score": "concat"}),
    "luong_local": ("luong_local", {}),
    "luong_local_concat": ("luong_local", {"luong_score": "concat", "enc_hidden": 12}),
}
ATTENTION_CASES = [name for name in CASES if not name.startswith("gru")]
# One case per model class, for the slower decoding and training checks.
MAIN_CASES = ["gru", "bahdanau", "luong_dot", "luong_local"]



def build(case: str):
    name, overrides = CASES[case]
    return make_baseline(name, src_vocab_size=VOCAB, tgt_vocab_size=VOCAB, preset="tiny",
                         **overrides)


@functools.lru_cache(maxsize=None)
def model_and_params(case: str):
    model = build(case)
    return model, random_params(model, SRC, TGT)


@functools.lru_cache(maxsize=None)
def forward(case: str):
    """Teacher-forced (logits [B, T, V], attention maps) on SRC, TGT, one compile per case."""
    model, params = model_and_params(case)
    return jit_apply(model, params, SRC, TGT, method="logits_and_attention")


# ---------------------------------------------------------------------------------------------
# The NumPy reference: one sentence at a time, real tokens only, float64.


def _np(tree):
    return jax.tree_util.tree_map(lambda x: np.asarray(x, np.float64), tree)


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


def dense(p, x):
    return x @ p["kernel"] + p.get("bias", 0.0)


def gru_cell(p, h, x):
    """The GRU of flax's documentation: r, z gates; n with the reset applied to W_hn h + b_hn."""
    r = sigmoid(dense(p["ir"], x) + h @ p["hr"]["kernel"])
    z = sigmoid(dense(p["iz"], x) + h @ p["hz"]["kernel"])
    n = np.tanh(dense(p["in"], x) + r * dense(p["hn"], h))
    return (1.0 - z) * n + z * h


def ref_encoder(p, tokens, config):
    """tokens: the real tokens of one sentence -> outputs [n, enc_out], final [enc_out]."""
    emb = p["embed"]["embedding"][tokens]
    h_size = config.enc_hidden

    def run(cell, xs):
        h, outs = np.zeros(h_size), []
        for x in xs:
            h = gru_cell(cell, h, x)
            outs.append(h)
        return np.stack(outs), h

    if not config.bidirectional:
        return run(p["cell"], emb)
    fwd, f_last = run(p["forward_cell"], emb)
    bwd, b_last = run(p["backward_cell"], emb[::-1])
    return np.concatenate([fwd, bwd[::-1]], axis=-1), np.concatenate([f_last, b_last])


def ref_score(p, config, query, enc):
    """Scores of one query against enc [n, X]: [n]."""
    score = config.luong_score
    if score == "dot":
        return enc @ query
    if score == "general":
        return (enc @ p["w_a"]["kernel"]) @ query
    energy = np.tanh(dense(p["w_keys"], enc) + query @ p["w_query"]["kernel"])
    return (energy @ p["v"]["kernel"])[:, 0]


def ref_forward(model, params, src_row, tgt_row):
    """Teacher-forced logits [T, V] and attention weights [T, n] of one sentence pair."""
    c = model.config
    p = _np(params)
    tokens = src_row[src_row != PAD]
    enc, final = ref_encoder(p["encoder"], tokens, c)
    d = p["decoder"]
    bridged = c.bidirectional or c.enc_hidden != c.dec_hidden
    h = np.tanh(dense(d["bridge"], final)) if bridged else final
    feed = np.zeros(c.dec_hidden)
    n = len(tokens)
    logits, weights = [], []
    for y in tgt_row:
        emb = d["embed"]["embedding"][y]
        if isinstance(model, GRUSeq2Seq):
            h = gru_cell(d["cell"], h, np.concatenate([emb, final]))
            logits.append(dense(d["out"], np.concatenate([emb, h, final])))
        elif isinstance(model, BahdanauSeq2Seq):
            c_config = dataclasses.replace(c, luong_score="concat")
            a = softmax(ref_score(d["score"], c_config, h, enc))
            context = a @ enc
            h = gru_cell(d["cell"], h, np.concatenate([emb, context]))
            logits.append(dense(d["out"], np.concatenate([h, context, emb])))
            weights.append(a)
        else:
            h = gru_cell(d["cell"], h, np.concatenate([emb, feed]))
            scores = ref_score(d.get("score", {}), c, h, enc)
            if isinstance(model, LuongLocalSeq2Seq):
                centre = n * sigmoid(np.tanh(h @ d["w_p"]["kernel"]) @ d["v_p"]["kernel"])[0]
                s = np.arange(n)
                window = np.abs(s - centre) <= c.local_window
                align = np.zeros(n)
                align[window] = softmax(scores[window])
                sigma = c.local_window / 2
                a = align * np.exp(-((s - centre) ** 2) / (2 * sigma ** 2))
            else:
                a = softmax(scores)
            context = a @ enc
            feed = np.tanh(np.concatenate([context, h]) @ d["w_c"]["kernel"])
            logits.append(dense(d["out"], feed))
            weights.append(a)
    return np.stack(logits), (np.stack(weights) if weights else None)


# ---------------------------------------------------------------------------------------------


def test_config_validation_names_the_field():
    with pytest.raises(ValueError, match="emb_dim"):
        RNNSeq2SeqConfig.tiny(emb_dim=0)
    with pytest.raises(ValueError, match="dropout"):
        RNNSeq2SeqConfig.tiny(dropout=1.0)
    with pytest.raises(ValueError, match="luong_score"):
        RNNSeq2SeqConfig.tiny(luong_score="bilinear")
    with pytest.raises(ValueError, match="luong_score='dot'"):
        RNNSeq2SeqConfig.tiny(luong_score="dot", bidirectional=True)
    with pytest.raises(ValueError, match="bos_id"):
        RNNSeq2SeqConfig.tiny(bos_id=0)
    with pytest.raises(ValueError, match="eos_id"):
        RNNSeq2SeqConfig.tiny(eos_id=40)
    with pytest.raises(ValueError, match="name"):
        make_baseline("lstm", src_vocab_size=8, tgt_vocab_size=8)
    with pytest.raises(ValueError, match="preset"):
        make_baseline("gru", src_vocab_size=8, tgt_vocab_size=8, preset="huge")


def test_registry_builds_tutorial_sizes():
    expected = {"gru": GRUSeq2Seq, "bahdanau": BahdanauSeq2Seq, "luong": LuongSeq2Seq,
                "luong_local": LuongLocalSeq2Seq}
    for name, cls in expected.items():
        model = make_baseline(name, src_vocab_size=100, tgt_vocab_size=90)
        assert type(model) is cls and BASELINES[name].model_cls is cls
        c = model.config
        assert (c.emb_dim, c.enc_hidden, c.dec_hidden, c.dropout) == (256, 512, 512, 0.5)
        assert (c.src_vocab_size, c.tgt_vocab_size) == (100, 90)
    assert make_baseline("bahdanau", src_vocab_size=9, tgt_vocab_size=9).config.bidirectional
    assert not make_baseline("luong", src_vocab_size=9, tgt_vocab_size=9).config.bidirectional
    assert make_baseline("gru", src_vocab_size=9, tgt_vocab_size=9, dropout=0.1).config.dropout \
        == 0.1


@pytest.mark.parametrize("case", CASES)
def test_matches_numpy_reference(case):
    model, params = model_and_params(case)
    logits, maps = forward(case)
    chex.assert_shape(logits, (3, 6, VOCAB))
    assert logits.dtype == jnp.float32
    for b in range(len(SRC)):
        ref_logits, ref_weights = ref_forward(model, params, SRC[b], TGT[b])
        chex.assert_trees_all_close(logits[b], ref_logits.astype(np.float32), atol=2e-5,
                                    rtol=2e-5)
        if ref_weights is not None:
            n = ref_weights.shape[1]
            chex.assert_trees_all_close(maps["weights"][b, :, :n],
                                        ref_weights.astype(np.float32), atol=2e-6)


@pytest.mark.parametrize("case", ATTENTION_CASES)
def test_attention_weights_sum_to_one_and_skip_pads(case):
    weights = forward(case)[1]["weights"]
    chex.assert_shape(weights, (3, 6, SRC.shape[1]))
    pads = (SRC == PAD)[:, None, :]
    assert np.all(np.where(pads, weights, 0.0) == 0.0)
    assert np.all(weights >= 0.0)
    totals = weights.sum(-1)
    if "local" in case:
        # Softmax over the window times a Gaussian <= 1: the paper's weights do not sum to 1.
        assert np.all(totals <= 1.0 + 1e-6) and np.all(totals > 0.0)
    else:
        chex.assert_trees_all_close(totals, np.ones_like(totals), atol=1e-6)


@pytest.mark.parametrize("case", CASES)
def test_padding_invariance(case):
    model, params = model_and_params(case)
    # The sentence-alone check compiles once more per case: once per model class is enough.
    check_padding_invariance(model, params, forward(case)[0], alone=case in MAIN_CASES)


@pytest.mark.parametrize("case", CASES)
def test_decode_step_matches_teacher_forcing(case):
    model, params = model_and_params(case)
    chex.assert_trees_all_close(run_cached(model, params, SRC, TGT), forward(case)[0],
                                atol=1e-5)


@pytest.mark.parametrize("case", MAIN_CASES)
def test_greedy_and_beam_agree_with_teacher_forcing(case):
    model, params = model_and_params(case)
    check_greedy_and_beam(model, params, SRC)


@pytest.mark.parametrize("case", MAIN_CASES)
def test_overfits_tiny_batch(case):
    first, last = overfit_losses(build(case), steps=150)
    assert first > 2.0 and last < 0.05, (first, last)


@pytest.mark.parametrize("case", ["bahdanau", "luong_local"])
def test_teacher_forcing_ratio_draws_from_rng(case):
    model, params = model_and_params(case)

    def run(key, ratio=0.5):
        return jit_apply(model, params, SRC, TGT, teacher_forcing=ratio,
                         rngs={"sample": jax.random.key(key)})

    chex.assert_trees_all_close(run(3), run(3))                     # same key, same output
    assert any(not np.allclose(run(3), run(k)) for k in (4, 5, 6))  # other keys differ
    with pytest.raises(InvalidRngError):  # a ratio below 1 without the rng stream fails
        model.apply({"params": params}, SRC, TGT, teacher_forcing=0.5)
    with pytest.raises(ValueError, match="teacher_forcing"):
        model.apply({"params": params}, SRC, TGT, teacher_forcing=1.5)

    # Ratio 0: after BOS every input is the model's own argmax of the step before: a hand-run
    # of decode_step feeding back its (unmasked) argmax.
    free = run(3, ratio=0.0)
    fed = np.concatenate([TGT[:, :1], np.argmax(free, axis=-1)[:, :-1]], axis=1)
    chex.assert_trees_all_close(free, run_cached(model, params, SRC, fed.astype(np.int32)),
                                atol=1e-5)


def test_dropout_needs_rng_and_is_off_when_deterministic():
    model = make_baseline("bahdanau", src_vocab_size=VOCAB, tgt_vocab_size=VOCAB,
                          preset="tiny", dropout=0.5)
    params = model_and_params("bahdanau")[1]  # same shapes: dropout has no parameters
    chex.assert_trees_all_close(jit_apply(model, params, SRC, TGT), forward("bahdanau")[0])

    def noisy(key):
        return jit_apply(model, params, SRC, TGT, deterministic=False,
                         rngs={"dropout": jax.random.key(key)})

    assert not np.allclose(noisy(1), forward("bahdanau")[0])
    chex.assert_trees_all_close(noisy(1), noisy(1))


def test_local_window_is_around_the_predicted_centre():
    model = make_baseline("luong_local", src_vocab_size=VOCAB, tgt_vocab_size=VOCAB,
                          preset="tiny", local_window=2)
    src = np.array([[3 + i for i in range(14)] + [2, 0, 0, 0],
                    [5, 6, 7, 8, 9, 2] + [0] * 12], np.int32)
    tgt = np.array([[1, 4, 5, 6, 7, 8, 9, 10]] * 2, np.int32)
    params = random_params(model, src, tgt)
    # Spread the predicted centres over the sentence: a large v_p makes sigmoid(.) vary.
    params["decoder"]["v_p"]["kernel"] = params["decoder"]["v_p"]["kernel"] * 8.0
    maps = jit_apply(model, params, src, tgt, method="attention_maps")
    weights, centre = np.asarray(maps["weights"]), np.asarray(maps["centre"])
    lengths = (src != PAD).sum(-1)
    chex.assert_shape(centre, (2, tgt.shape[1]))
    assert np.all(centre >= 0.0) and np.all(centre <= lengths[:, None])
    assert np.ptp(centre[0]) > 2.0, centre  # the centres really move, so the test means it
    s = np.arange(src.shape[1])
    inside = ((np.abs(s[None, None, :] - centre[..., None]) <= 2)
              & (s[None, None, :] < lengths[:, None, None]))
    assert np.all(weights[~inside] == 0.0)
    assert np.all(weights[inside] > 0.0)
    # Dividing out the Gaussian (sigma = D / 2 = 1) leaves a softmax over the window.
    gauss = np.exp(-((s[None, None, :] - centre[..., None]) ** 2) / (2 * 1.0 ** 2))
    align = np.where(inside, weights / gauss, 0.0)
    chex.assert_trees_all_close(align.sum(-1), np.ones(align.shape[:2]), atol=1e-5)
