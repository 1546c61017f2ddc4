"""Recurrent baselines (GRU/LSTM, Bahdanau, Luong global / local-p / local-m, hard attention)
against a slow NumPy reference.

Every model is checked for: equality with a float64 NumPy re-implementation written from the
papers' equations (loops over sentences and steps, no padding at all); attention weights that
sum to 1 and skip pads; padding invariance; cached decode_step == teacher-forced pass; greedy
and beam decoding consistent with the teacher-forced pass; overfitting a tiny batch; rng-driven
teacher forcing; the local-p and local-m windows; stacked GRU/LSTM layers.
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

from transformer_jax.baselines.registry import BASELINES, make_baseline
from transformer_jax.baselines.seq2seq import (
    BahdanauSeq2Seq,
    GRUSeq2Seq,
    HardAttentionSeq2Seq,
    LuongLocalMSeq2Seq,
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
    "luong_local_m": ("luong_local_m", {"local_window": 1}),
    "hard_attention": ("hard_attention", {}),
    "hard_attention_expectation": ("hard_attention", {"hard_inference": "expectation"}),
    # Stacked layers and LSTM cells, with and without a bridge.
    "gru_lstm_2layers": ("gru", {"cell": "lstm", "n_layers": 2}),
    "bahdanau_lstm_2layers": ("bahdanau", {"cell": "lstm", "n_layers": 2}),
    "luong_gru_2layers_bidirectional": (
        "luong",
        {"n_layers": 2, "bidirectional": True, "luong_score": "general"},
    ),
}
ATTENTION_CASES = [name for name in CASES if not name.startswith("gru")]
# One case per model class, for the slower decoding and training checks.
MAIN_CASES = [
    "gru",
    "bahdanau",
    "luong_dot",
    "luong_local",
    "luong_local_m",
    "hard_attention",
    "bahdanau_lstm_2layers",
]


def build(case: str):
    name, overrides = CASES[case]
    return make_baseline(
        name, src_vocab_size=VOCAB, tgt_vocab_size=VOCAB, preset="tiny", **overrides
    )


@functools.cache
def model_and_params(case: str):
    model = build(case)
    return model, random_params(model, SRC, TGT)


@functools.cache
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


def lstm_cell(p, state, x):
    """flax's LSTMCell: input kernels without bias, recurrent kernels with; state (c, h)."""
    c, h = state
    gate = {g: dense(p["i" + g], x) + dense(p["h" + g], h) for g in "ifgo"}
    c = sigmoid(gate["f"]) * c + sigmoid(gate["i"]) * np.tanh(gate["g"])
    return c, sigmoid(gate["o"]) * np.tanh(c)


def cell_step(config, p, state, x):
    """-> (new state, output h); a GRU state is h, an LSTM state (c, h)."""
    if config.cell == "lstm":
        state = lstm_cell(p, state, x)
        return state, state[1]
    state = gru_cell(p, state, x)
    return state, state


def layer_key(base, layer):
    return base if layer == 0 else f"{base}_{layer}"


def ref_encoder(p, tokens, config):
    """tokens: the real tokens of one sentence -> outputs [n, enc_out], per-layer final states
    (h [enc_out], or (c, h) for an LSTM)."""
    xs = p["embed"]["embedding"][tokens]
    h_size = config.enc_hidden
    zero = (np.zeros(h_size), np.zeros(h_size)) if config.cell == "lstm" else np.zeros(h_size)

    def run(cell, xs):
        state, outs = zero, []
        for x in xs:
            state, h = cell_step(config, cell, state, x)
            outs.append(h)
        return np.stack(outs), state

    finals = []
    for layer in range(config.n_layers):
        if not config.bidirectional:
            xs, final = run(p[layer_key("cell", layer)], xs)
        else:
            fwd, f_last = run(p[layer_key("forward_cell", layer)], xs)
            bwd, b_last = run(p[layer_key("backward_cell", layer)], xs[::-1])
            xs = np.concatenate([fwd, bwd[::-1]], axis=-1)
            final = jax.tree_util.tree_map(lambda f, b: np.concatenate([f, b]), f_last, b_last)
        finals.append(final)
    return xs, finals


def ref_stack(config, d, states, x):
    """One decoder step up the layer stack -> new states, top h."""
    new = []
    for layer, state in enumerate(states):
        state, x = cell_step(config, d[layer_key("cell", layer)], state, x)
        new.append(state)
    return new, x


def top(state):
    return state[1] if isinstance(state, tuple) else state


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
    enc, finals = ref_encoder(p["encoder"], tokens, c)
    d = p["decoder"]
    bridged = c.bidirectional or c.enc_hidden != c.dec_hidden
    states = finals
    if bridged:
        states = []
        for layer, final in enumerate(finals):

            def bridge(name, x, layer=layer):
                return np.tanh(dense(d[layer_key(name, layer)], x))

            states.append(
                (bridge("bridge_c", final[0]), bridge("bridge", final[1]))
                if c.cell == "lstm"
                else bridge("bridge", final)
            )
    context_vector = top(finals[-1])
    feed = np.zeros(c.dec_hidden)
    n = len(tokens)
    logits, weights = [], []
    for t, y in enumerate(tgt_row):
        emb = d["embed"]["embedding"][y]
        if isinstance(model, GRUSeq2Seq):
            states, h = ref_stack(c, d, states, np.concatenate([emb, context_vector]))
            logits.append(dense(d["out"], np.concatenate([emb, h, context_vector])))
        elif isinstance(model, BahdanauSeq2Seq):
            c_config = dataclasses.replace(c, luong_score="concat")
            a = softmax(ref_score(d["score"], c_config, top(states[-1]), enc))
            context = a @ enc
            states, h = ref_stack(c, d, states, np.concatenate([emb, context]))
            logits.append(dense(d["out"], np.concatenate([h, context, emb])))
            weights.append(a)
        else:
            states, h = ref_stack(c, d, states, np.concatenate([emb, feed]))
            scores = ref_score(d.get("score", {}), c, h, enc)
            if isinstance(model, LuongLocalMSeq2Seq):
                centre = min(t, n - 1)
                window = np.abs(np.arange(n) - centre) <= c.local_window
                a = np.zeros(n)
                a[window] = softmax(scores[window])
            elif isinstance(model, HardAttentionSeq2Seq):
                a = softmax(scores)
            elif isinstance(model, LuongLocalSeq2Seq):
                centre = n * sigmoid(np.tanh(h @ d["w_p"]["kernel"]) @ d["v_p"]["kernel"])[0]
                s = np.arange(n)
                window = np.abs(s - centre) <= c.local_window
                align = np.zeros(n)
                align[window] = softmax(scores[window])
                sigma = c.local_window / 2
                a = align * np.exp(-((s - centre) ** 2) / (2 * sigma**2))
            else:
                a = softmax(scores)
            context = a @ enc
            if isinstance(model, HardAttentionSeq2Seq) and c.hard_inference == "argmax":
                context = enc[np.argmax(a)]  # deterministic: the most probable position
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
    with pytest.raises(ValueError, match="cell"):
        RNNSeq2SeqConfig.tiny(cell="rnn")
    with pytest.raises(ValueError, match="n_layers"):
        RNNSeq2SeqConfig.tiny(n_layers=0)
    with pytest.raises(ValueError, match="hard_inference"):
        RNNSeq2SeqConfig.tiny(hard_inference="sample")
    with pytest.raises(ValueError, match="name"):
        make_baseline("lstm", src_vocab_size=8, tgt_vocab_size=8)
    with pytest.raises(ValueError, match="preset"):
        make_baseline("gru", src_vocab_size=8, tgt_vocab_size=8, preset="huge")


def test_registry_builds_tutorial_sizes():
    expected = {
        "gru": GRUSeq2Seq,
        "bahdanau": BahdanauSeq2Seq,
        "luong": LuongSeq2Seq,
        "luong_local": LuongLocalSeq2Seq,
        "luong_local_m": LuongLocalMSeq2Seq,
        "hard_attention": HardAttentionSeq2Seq,
    }
    for name, cls in expected.items():
        model = make_baseline(name, src_vocab_size=100, tgt_vocab_size=90)
        assert type(model) is cls and BASELINES[name].model_cls is cls
        c = model.config
        assert (c.emb_dim, c.enc_hidden, c.dec_hidden, c.dropout) == (256, 512, 512, 0.5)
        assert (c.src_vocab_size, c.tgt_vocab_size) == (100, 90)
    assert make_baseline("bahdanau", src_vocab_size=9, tgt_vocab_size=9).config.bidirectional
    assert not make_baseline("luong", src_vocab_size=9, tgt_vocab_size=9).config.bidirectional
    assert (
        make_baseline("gru", src_vocab_size=9, tgt_vocab_size=9, dropout=0.1).config.dropout == 0.1
    )


@pytest.mark.parametrize("case", CASES)
def test_matches_numpy_reference(case):
    model, params = model_and_params(case)
    logits, maps = forward(case)
    chex.assert_shape(logits, (3, 6, VOCAB))
    assert logits.dtype == jnp.float32
    for b in range(len(SRC)):
        ref_logits, ref_weights = ref_forward(model, params, SRC[b], TGT[b])
        chex.assert_trees_all_close(logits[b], ref_logits.astype(np.float32), atol=2e-5, rtol=2e-5)
        if ref_weights is not None:
            n = ref_weights.shape[1]
            chex.assert_trees_all_close(
                maps["weights"][b, :, :n], ref_weights.astype(np.float32), atol=2e-6
            )


@pytest.mark.parametrize("case", ATTENTION_CASES)
def test_attention_weights_sum_to_one_and_skip_pads(case):
    weights = forward(case)[1]["weights"]
    chex.assert_shape(weights, (3, 6, SRC.shape[1]))
    pads = (SRC == PAD)[:, None, :]
    assert np.all(np.where(pads, weights, 0.0) == 0.0)
    assert np.all(weights >= 0.0)
    totals = weights.sum(-1)
    if CASES[case][0] == "luong_local":
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
    chex.assert_trees_all_close(run_cached(model, params, SRC, TGT), forward(case)[0], atol=1e-5)


@pytest.mark.slow
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
        return jit_apply(
            model, params, SRC, TGT, teacher_forcing=ratio, rngs={"sample": jax.random.key(key)}
        )

    # Ratio 1 feeds the target at every step whatever the coins: the teacher-forced output.
    chex.assert_trees_all_close(run(3, ratio=1.0), forward(case)[0], atol=1e-6)
    assert not np.allclose(run(3), forward(case)[0])  # some steps fed a guess
    assert any(not np.allclose(run(3), run(k)) for k in (4, 5, 6))  # other keys differ
    with pytest.raises(InvalidRngError):  # a ratio below 1 without the rng stream fails
        model.apply({"params": params}, SRC, TGT, teacher_forcing=0.5)
    with pytest.raises(ValueError, match="teacher_forcing"):
        model.apply({"params": params}, SRC, TGT, teacher_forcing=1.5)

    # Ratio 0: after BOS every input is the model's own argmax of the step before: a hand-run
    # of decode_step feeding back its (unmasked) argmax.
    free = run(3, ratio=0.0)
    fed = np.concatenate([TGT[:, :1], np.argmax(free, axis=-1)[:, :-1]], axis=1)
    chex.assert_trees_all_close(
        free, run_cached(model, params, SRC, fed.astype(np.int32)), atol=1e-5
    )


def test_dropout_needs_rng_and_is_off_when_deterministic():
    model = make_baseline(
        "bahdanau", src_vocab_size=VOCAB, tgt_vocab_size=VOCAB, preset="tiny", dropout=0.5
    )
    params = model_and_params("bahdanau")[1]  # same shapes: dropout has no parameters
    chex.assert_trees_all_close(jit_apply(model, params, SRC, TGT), forward("bahdanau")[0])

    def noisy(key):
        return jit_apply(
            model, params, SRC, TGT, deterministic=False, rngs={"dropout": jax.random.key(key)}
        )

    assert not np.allclose(noisy(1), forward("bahdanau")[0])
    assert not np.allclose(noisy(1), noisy(2))  # the masks come from the key
    with pytest.raises(InvalidRngError, match="dropout"):
        model.apply({"params": params}, SRC, TGT, deterministic=False)


def test_local_window_is_around_the_predicted_centre():
    model = make_baseline(
        "luong_local", src_vocab_size=VOCAB, tgt_vocab_size=VOCAB, preset="tiny", local_window=2
    )
    src = np.array(
        [[3 + i for i in range(14)] + [2, 0, 0, 0], [5, 6, 7, 8, 9, 2] + [0] * 12], np.int32
    )
    tgt = np.array([[1, 4, 5, 6, 7, 8, 9, 10]] * 2, np.int32)
    params = random_params(model, src, tgt)
    # Spread the predicted centres over the sentence: a large v_p makes sigmoid(.) vary.
    params["decoder"]["v_p"]["kernel"] = params["decoder"]["v_p"]["kernel"] * 8.0
    maps = jit_apply(model, params, src, tgt, method="logits_and_attention")[1]
    weights, centre = np.asarray(maps["weights"]), np.asarray(maps["centre"])
    lengths = (src != PAD).sum(-1)
    chex.assert_shape(centre, (2, tgt.shape[1]))
    assert np.all(centre >= 0.0) and np.all(centre <= lengths[:, None])
    assert np.ptp(centre[0]) > 2.0, centre  # the centres really move, so the test means it
    s = np.arange(src.shape[1])
    inside = (np.abs(s[None, None, :] - centre[..., None]) <= 2) & (
        s[None, None, :] < lengths[:, None, None]
    )
    assert np.all(weights[~inside] == 0.0)
    assert np.all(weights[inside] > 0.0)
    # Dividing out the Gaussian (sigma = D / 2 = 1) leaves a softmax over the window.
    gauss = np.exp(-((s[None, None, :] - centre[..., None]) ** 2) / (2 * 1.0**2))
    align = np.where(inside, weights / gauss, 0.0)
    chex.assert_trees_all_close(align.sum(-1), np.ones(align.shape[:2]), atol=1e-5)


def test_default_cell_and_layers_keep_the_single_gru_parameter_tree():
    """gru / 1 layer is the tree these models always had; layer l > 0 and LSTM gates add to
    it under their own names."""

    def tree(name, **overrides):
        params = jax.eval_shape(build_named(name, **overrides).init, jax.random.key(0), SRC, TGT)[
            "params"
        ]
        return {
            "/".join(str(k.key) for k in path)
            for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]
        }

    gru = tree("bahdanau")
    assert "encoder/forward_cell/hn/kernel" in gru and "decoder/cell/hn/kernel" in gru
    assert "decoder/bridge/kernel" in gru and not any("_1" in k for k in gru)
    stacked = tree("bahdanau", n_layers=2)
    assert gru < stacked
    assert {k for k in stacked - gru} >= {
        "encoder/forward_cell_1/hn/kernel",
        "decoder/cell_1/hn/kernel",
        "decoder/bridge_1/kernel",
    }
    lstm = tree("luong", cell="lstm")
    assert "decoder/cell/ii/kernel" in lstm and "encoder/cell/hf/bias" in lstm


def build_named(name, **overrides):
    return make_baseline(
        name, src_vocab_size=VOCAB, tgt_vocab_size=VOCAB, preset="tiny", **overrides
    )


def _encoder_outputs(module, src, *, deterministic):
    return module.encoder(src, deterministic=deterministic)[0]  # [B, S, enc_out]


def _first_decoder_step(module, src, tgt, *, deterministic):
    """Logits [B, V] of one decoder step after a deterministic encoder."""
    memory, state = module.encode(src)
    return module.decoder(state, tgt[:, 0], memory, deterministic=deterministic)[1]


def test_dropout_between_layers_only_when_stacked():
    """With every embedding zero the embeddings' dropout has nothing to drop (0 / keep = 0), so
    what dropout changes is the dropout between stacked layers: in the encoder, in the decoder,
    and nowhere with one layer."""
    rngs = {"dropout": jax.random.key(1)}
    for n_layers in (1, 2):
        model = build_named("luong", n_layers=n_layers, dropout=0.5)
        params = random_params(model, SRC, TGT)
        for side in ("encoder", "decoder"):
            params[side]["embed"]["embedding"] = jnp.zeros_like(params[side]["embed"]["embedding"])
        for method, args in (
            (_encoder_outputs, (SRC,)),
            (_first_decoder_step, (SRC, TGT)),
            (None, (SRC, TGT)),
        ):
            clean = jit_apply(model, params, *args, method=method, deterministic=True)
            noisy = jit_apply(model, params, *args, method=method, deterministic=False, rngs=rngs)
            if n_layers == 1:
                chex.assert_trees_all_close(noisy, clean, atol=1e-6)
            else:
                assert not np.allclose(noisy, clean, atol=1e-3), method


def test_local_m_window_is_centred_on_the_decoder_step():
    model = build_named("luong_local_m", local_window=1)
    src = np.array([[3, 4, 5, 6, 7, 8, 2, 0]], np.int32)  # 7 real tokens
    tgt = np.array([[1, 4, 5, 6, 7, 8, 9, 10, 11, 12]], np.int32)  # longer than the source
    params = random_params(model, src, tgt)
    aux = jit_apply(model, params, src, tgt, method="logits_and_attention")[1]
    weights, centre = np.asarray(aux["weights"][0]), np.asarray(aux["centre"][0])
    np.testing.assert_array_equal(centre, np.minimum(np.arange(10), 6))  # p_t = t, clamped
    s = np.arange(src.shape[1])
    inside = np.abs(s[None, :] - centre[:, None]) <= 1
    assert np.all(weights[~inside] == 0.0) and np.all(weights[inside & (s < 7)] > 0.0)
    chex.assert_trees_all_close(weights.sum(-1), np.ones(10), atol=1e-6)


def test_train_registry_builds_the_new_models_and_stacked_cells():
    from train.translate import registry
    from transformer_jax import losses

    assert {"luong_local_m", "hard_attention"} <= set(registry.names())
    config = registry.build_model_config(
        "gru", "cpu", vocab_size=100, overrides={"cell": "lstm", "n_layers": 2}
    )
    assert (config.cell, config.n_layers, config.bidirectional) == ("lstm", 2, False)
    hard = registry.get("hard_attention")
    assert hard.module_cls is HardAttentionSeq2Seq
    assert callable(getattr(losses, hard.aux_loss))
    assert registry.get("luong").aux_loss is None
