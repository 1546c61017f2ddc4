"""ConvS2S against a slow NumPy reference, plus its invariants.

The reference is written from Gehring et al. 2017 one sentence at a time over its real tokens
only (so it knows nothing of padding), with explicit loops for the convolutions and attention.
"""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import matmul_dtypes
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

from transformer_jax.baselines.convs2s import ConvS2S, ConvS2SConfig
from transformer_jax.baselines.registry import make_baseline

VOCAB = 32


# kernel 3 is the tutorial's; kernel 5 makes the decoder window longer than one step back.
CASES = {"k3": {}, "k5": {"kernel_size": 5, "enc_layers": 1}}


def build(case: str = "k3", **overrides) -> ConvS2S:
    return make_baseline(
        "convs2s",
        src_vocab_size=VOCAB,
        tgt_vocab_size=VOCAB,
        preset="tiny",
        **{**CASES[case], **overrides},
    )


@functools.cache
def model_and_params(case: str):
    model = build(case)
    return model, random_params(model, SRC, TGT)


@functools.cache
def forward(case: str):
    """(logits [B, T, V], {'weights': [B, L, T, S]}) on SRC, TGT."""
    model, params = model_and_params(case)
    return jit_apply(model, params, SRC, TGT, method="logits_and_attention")


# ---------------------------------------------------------------------------------------------
# The NumPy reference.

SQRT_HALF = np.sqrt(0.5)


def dense(p, x):
    return x @ p["kernel"] + p["bias"]


def conv_glu(p, padded, out_len):
    """Valid 1-D convolution by explicit windows, then GLU: [out_len + k - 1, D] -> [out_len,
    D]."""
    k = p["kernel"].shape[0]
    y = np.stack(
        [sum(padded[i + j] @ p["kernel"][j] for j in range(k)) + p["bias"] for i in range(out_len)]
    )
    a, b = np.split(y, 2, axis=-1)
    return a / (1.0 + np.exp(-b))


def embed(p, tokens):
    return p["tokens"]["embedding"][tokens] + p["positions"]["embedding"][np.arange(len(tokens))]


def ref_forward(params, config, src_row, tgt_row):
    """Logits [T, V] and attention weights [L, T, n] of one pair (n real source tokens)."""
    p = jax.tree_util.tree_map(lambda x: np.asarray(x, np.float64), params)
    k = config.kernel_size
    src = src_row[src_row != PAD]
    n = len(src)

    enc = p["encoder"]
    e = embed(enc["embed"], src)
    x = dense(enc["emb_to_hid"], e)
    for i in range(config.enc_layers):
        zeros = np.zeros(((k - 1) // 2, x.shape[1]))
        x = (conv_glu(enc[f"conv_{i}"], np.concatenate([zeros, x, zeros]), n) + x) * SQRT_HALF
    z = dense(enc["hid_to_emb"], x)  # attention keys [n, E]
    values = (z + e) * SQRT_HALF  # [n, E]

    dec = p["decoder"]
    g = embed(dec["embed"], tgt_row)  # [T, E]
    t_len = len(tgt_row)
    x = dense(dec["emb_to_hid"], g)
    all_weights = []
    for i in range(config.dec_layers):
        layer = dec[f"layer_{i}"]
        padded = np.concatenate([np.zeros((k - 1, x.shape[1])), x])  # causal: left only
        h = conv_glu(layer["conv"], padded, t_len)
        weights = np.zeros((t_len, n))
        for t in range(t_len):
            d = (dense(layer["attn_in"], h[t]) + g[t]) * SQRT_HALF
            scores = z @ d
            a = np.exp(scores - scores.max())
            weights[t] = a / a.sum()
            h[t] = (h[t] + dense(layer["attn_out"], weights[t] @ values)) * SQRT_HALF
        x = (h + x) * SQRT_HALF
        all_weights.append(weights)
    logits = dense(dec["out"], dense(dec["hid_to_emb"], x))
    return logits, np.stack(all_weights)


# ---------------------------------------------------------------------------------------------


def test_config_validation_names_the_field():
    with pytest.raises(ValueError, match="kernel_size"):
        ConvS2SConfig.tiny(kernel_size=4)
    with pytest.raises(ValueError, match="dec_layers"):
        ConvS2SConfig.tiny(dec_layers=0)
    with pytest.raises(ValueError, match="dropout"):
        ConvS2SConfig.tiny(dropout=-0.1)
    with pytest.raises(ValueError, match="dtype"):
        ConvS2SConfig.tiny(dtype=jnp.int32)
    with pytest.raises(ValueError, match="pad_id"):
        ConvS2SConfig.tiny(pad_id=2)


def test_registry_builds_tutorial_sizes():
    model = make_baseline("convs2s", src_vocab_size=100, tgt_vocab_size=90)
    assert type(model) is ConvS2S
    c = model.config
    assert (c.emb_dim, c.hid_dim, c.enc_layers, c.dec_layers, c.kernel_size, c.dropout) == (
        256,
        512,
        10,
        10,
        3,
        0.25,
    )


@pytest.mark.parametrize("case", CASES)
def test_matches_numpy_reference(case):
    model, params = model_and_params(case)
    logits, weights = forward(case)[0], forward(case)[1]["weights"]
    chex.assert_shape(logits, (3, 6, VOCAB))
    chex.assert_shape(weights, (3, 2, 6, SRC.shape[1]))
    assert logits.dtype == jnp.float32
    for b in range(len(SRC)):
        ref_logits, ref_weights = ref_forward(params, model.config, SRC[b], TGT[b])
        chex.assert_trees_all_close(logits[b], ref_logits.astype(np.float32), atol=5e-5, rtol=5e-5)
        n = ref_weights.shape[-1]
        chex.assert_trees_all_close(weights[b, ..., :n], ref_weights.astype(np.float32), atol=5e-6)


def test_attention_weights_sum_to_one_and_skip_pads():
    weights = forward("k3")[1]["weights"]  # [B, L, T, S]
    pads = (SRC == PAD)[:, None, None, :]
    assert np.all(np.where(pads, weights, 0.0) == 0.0)
    chex.assert_trees_all_close(weights.sum(-1), np.ones(weights.shape[:-1]), atol=1e-6)


@pytest.mark.parametrize("case", CASES)
def test_padding_invariance(case):
    model, params = model_and_params(case)
    check_padding_invariance(model, params, forward(case)[0])


@pytest.mark.parametrize("case", CASES)
def test_decoder_is_causal(case):
    model, params = model_and_params(case)
    logits = forward(case)[0]
    for t in range(TGT.shape[1] - 1):
        changed = TGT.copy()
        changed[:, t + 1 :] = (changed[:, t + 1 :] + 7) % (VOCAB - 3) + 3
        out = jit_apply(model, params, SRC, changed)
        chex.assert_trees_all_close(out[:, : t + 1], logits[:, : t + 1], atol=1e-6)
        # ...while the changed positions do see the change (so the check can fail).
        assert not np.allclose(out[:, t + 1], logits[:, t + 1], atol=1e-3)


@pytest.mark.parametrize("case", CASES)
def test_decode_step_matches_teacher_forcing(case):
    model, params = model_and_params(case)
    chex.assert_trees_all_close(run_cached(model, params, SRC, TGT), forward(case)[0], atol=1e-5)


def test_greedy_and_beam_agree_with_teacher_forcing():
    model, params = model_and_params("k3")
    check_greedy_and_beam(model, params, SRC)


def test_overfits_tiny_batch():
    first, last = overfit_losses(build("k3"), steps=150)
    assert first > 2.0 and last < 0.05, (first, last)


def test_lengths_beyond_the_position_table_fail_at_trace_time():
    model, params = model_and_params("k3")  # max_positions 32
    with pytest.raises(ValueError, match="max_positions"):
        model.apply({"params": params}, SRC, np.ones((3, 33), np.int32))
    with pytest.raises(ValueError, match="max_len"):
        model.apply({"params": params}, SRC, max_len=40, method="init_decode_cache")


def test_dropout_and_bfloat16():
    model, params = model_and_params("k3")
    noisy = build("k3", dropout=0.3)

    def run(key):
        return jit_apply(
            noisy, params, SRC, TGT, deterministic=False, rngs={"dropout": jax.random.key(key)}
        )

    assert not np.allclose(run(1), forward("k3")[0])
    assert not np.allclose(run(1), run(2))  # the masks come from the key
    chex.assert_trees_all_close(jit_apply(noisy, params, SRC, TGT), forward("k3")[0])

    half_model = build("k3", dtype=jnp.bfloat16)
    half = jit_apply(half_model, params, SRC, TGT)
    assert half.dtype == jnp.float32
    chex.assert_trees_all_close(half, forward("k3")[0], atol=0.1, rtol=0.05)
    # The closeness above would also pass a model that ignored `dtype`: every product of the
    # bf16 program must take bf16 operands, as many as the float32 program has.
    full_dots = matmul_dtypes(lambda p: model.apply({"params": p}, SRC, TGT), params)
    half_dots = matmul_dtypes(lambda p: half_model.apply({"params": p}, SRC, TGT), params)
    assert {d[:2] for d in full_dots} == {("float32", "float32")}
    assert len(half_dots) == len(full_dots)
    assert {d[:2] for d in half_dots} == {("bfloat16", "bfloat16")}
    assert not np.array_equal(half, forward("k3")[0])  # and the rounding shows
