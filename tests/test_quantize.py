"""int8 inference (`transformer_jax.int8`): the quantization itself, the params
it writes against the quantized model's own, and int8 decoding against float32 within stated
bounds."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax import Transformer, TransformerConfig, beam_search, greedy_decode
from transformer_jax.int8 import int8_matmul, quantize_params, quantize_rows

V = 40


def test_rows_round_trip_within_half_a_step_and_zero_rows_stay_zero():
    x = np.random.default_rng(0).normal(size=(5, 33)).astype(np.float32)
    x[2] = 0.0
    q, scale = quantize_rows(x)
    assert q.dtype == jnp.int8 and scale.shape == (5,)
    np.testing.assert_array_equal(np.abs(np.asarray(q)).max(axis=1)[[0, 1, 3, 4]], 127)
    err = np.abs(np.asarray(q, np.float32) * np.asarray(scale)[:, None] - x)
    assert (err <= np.asarray(scale)[:, None] / 2 + 1e-7).all()
    assert float(scale[2]) == 1.0 and not np.asarray(q[2]).any()
    # Per column (axis 0): a kernel's scale per output channel.
    q, scale = quantize_rows(x.T, axis=0)
    assert scale.shape == (5,)


@pytest.mark.parametrize("transposed", [False, True])
def test_int8_product_is_the_float_product_within_the_quantization_bound(transposed):
    rng = np.random.default_rng(1)
    x = rng.normal(size=(3, 7, 64)).astype(np.float32)
    w = rng.normal(size=(64, 48)).astype(np.float32)
    q, scale = quantize_rows(w.T if transposed else w, axis=1 if transposed else 0)
    got = np.asarray(int8_matmul(x, q, scale, transposed=transposed))
    want = x @ w
    # Each operand is off by at most half its step: |dx| <= sx / 2, |dw| <= sw / 2, so
    # |x.w - x'.w'| <= sum |x| sw / 2 + |w'| sx / 2 (+ the float32 rounding).
    _, sx = quantize_rows(x)
    bound = (
        np.abs(x).sum(-1, keepdims=True) * np.asarray(scale) / 2
        + np.asarray(sx)[..., None] * np.abs(w).sum(0) / 2 * 1.01
        + 1e-4
    )
    assert (np.abs(got - want) <= bound).all()
    assert np.abs(got - want).max() < 0.05 * np.abs(want).max()


def _model(**overrides):
    cfg = TransformerConfig.tiny(
        **{
            **dict(src_vocab_size=V, tgt_vocab_size=V, d_model=32, n_heads=4, d_ff=64),
            **overrides,
        }
    )
    src = jnp.asarray(np.random.default_rng(2).integers(3, V, size=(6, 9)), jnp.int32)
    src = src.at[:, -1].set(cfg.eos_id).at[3:, 5:].set(cfg.pad_id)
    params = Transformer(cfg).init(jax.random.PRNGKey(0), src, src[:, :4])["params"]
    return cfg, params, src


@pytest.mark.parametrize(
    "overrides",
    [{}, dict(share_embeddings=False, tie_output=False), dict(output_bias=True, bos_id=0)],
    ids=["tied", "untied", "marian_like"],
)
def test_quantized_params_are_the_int8_models_own(overrides):
    cfg, params, src = _model(**overrides)
    qparams = quantize_params(params)
    qcfg = cfg.replace(quantize="int8")
    own = Transformer(qcfg).init(jax.random.PRNGKey(0), src, src[:, :4])["params"]
    shapes = jax.tree_util.tree_map(lambda x: (x.shape, jnp.dtype(x.dtype)), own)
    assert jax.tree_util.tree_map(lambda x: (x.shape, jnp.dtype(x.dtype)), qparams) == shapes
    kernels = [
        leaf
        for path, leaf in jax.tree_util.tree_flatten_with_path(qparams)[0]
        if path[-1].key in ("kernel", "embedding")
    ]
    assert kernels and all(k.dtype == np.int8 for k in kernels)
    with pytest.raises(ValueError, match="int8 already"):
        quantize_params(qparams)


def test_quantize_must_be_a_known_scheme():
    with pytest.raises(ValueError, match="quantize"):
        TransformerConfig.tiny(quantize="int4")


@pytest.mark.parametrize("norm_first", [False, True])
def test_int8_decoding_agrees_with_float32_within_the_stated_tolerance(norm_first):
    """The tolerance, on tiny random models (6 sentences of up to 9 tokens): teacher-forced
    next-token probabilities within 0.02 of float32's and log-probs within 0.05; so int8's
    greedy choice can differ from float32's only where float32 saw a near-tie, its two
    log-probs within 2 x 0.05; beam 0's score within 0.5 (at most 10 tokens off by 0.05)."""
    cfg, params, src = _model(norm_first=norm_first)
    model, qmodel = Transformer(cfg), Transformer(cfg.replace(quantize="int8"))
    qparams = quantize_params(params)
    tokens = np.asarray(greedy_decode(model, params, src, max_len=10))
    tgt = jnp.concatenate([jnp.full((src.shape[0], 1), cfg.bos_id), tokens[:, :-1]], axis=1)
    logp = jax.nn.log_softmax(model.apply({"params": params}, src, tgt))
    qlogp = jax.nn.log_softmax(qmodel.apply({"params": qparams}, src, tgt))
    assert float(jnp.abs(jnp.exp(logp) - jnp.exp(qlogp)).max()) < 0.02
    taken = jnp.asarray(tokens)[..., None]
    assert float(jnp.abs(jnp.take_along_axis(logp - qlogp, taken, -1)).max()) < 0.05
    qtokens = np.asarray(greedy_decode(qmodel, qparams, src, max_len=10))
    assert (qtokens == tokens).all(axis=1).mean() >= 0.5
    for row in np.flatnonzero((qtokens != tokens).any(axis=1)):
        t = int(np.argmax(qtokens[row] != tokens[row]))  # first difference; same prefix
        gap = float(logp[row, t, tokens[row, t]] - logp[row, t, qtokens[row, t]])
        assert 0.0 <= gap <= 0.1, (row, t, gap)
    _, scores = beam_search(model, params, src, beam_size=3, max_len=10)
    _, qscores = beam_search(qmodel, qparams, src, beam_size=3, max_len=10)
    assert float(jnp.abs(qscores[:, 0] - scores[:, 0]).max()) < 0.5
