"""The attention-map protocol: every translation model answers
`attention_maps(src, tgt) -> {kind: [B, layers, H, T, S]}`, and train.plots reads it."""

from __future__ import annotations

import numpy as np
import pytest
from translation_checks import PAD, SRC, TGT, jit_apply, random_params

from train import plots
from transformer_jax import Transformer, TransformerConfig
from transformer_jax.baselines.registry import make_baseline

VOCAB = 32
B, S, T = SRC.shape[0], SRC.shape[1], TGT.shape[1]


def build(name):
    if name == "transformer":
        return Transformer(
            TransformerConfig.tiny(src_vocab_size=VOCAB, tgt_vocab_size=VOCAB, dropout=0.0)
        )
    return make_baseline(name, src_vocab_size=VOCAB, tgt_vocab_size=VOCAB, preset="tiny")


# name -> {kind: (layers, heads, queries, keys)} (tiny Transformer: 2 + 2 layers, 4 heads).
EXPECTED = {
    "transformer": {
        "encoder_self": (2, 4, S, S),
        "decoder_self": (2, 4, T, T),
        "cross": (2, 4, T, S),
    },
    "gru": {},
    "bahdanau": {"cross": (1, 1, T, S)},
    "luong": {"cross": (1, 1, T, S)},
    "luong_local": {"cross": (1, 1, T, S)},
    "luong_local_m": {"cross": (1, 1, T, S)},
    "hard_attention": {"cross": (1, 1, T, S)},
    "convs2s": {"cross": (2, 1, T, S)},
}
NOT_SOFTMAX = {"luong_local"}  # softmax over the window times a Gaussian: rows sum to <= 1


@pytest.mark.parametrize("name", EXPECTED)
def test_every_model_answers_the_protocol(name):
    model = build(name)
    params = random_params(model, SRC, TGT)
    maps = jit_apply(model, params, SRC, TGT, method="attention_maps")
    assert {k: v.shape for k, v in maps.items()} == {k: (B, *v) for k, v in EXPECTED[name].items()}
    src_real, tgt_real = SRC != PAD, TGT != PAD
    for kind, w in maps.items():
        w = np.asarray(w)
        assert w.dtype == np.float32 and np.all(w >= 0.0)
        keys = tgt_real if kind == "decoder_self" else src_real  # [B, keys]
        assert np.all(w * ~keys[:, None, None, None, :] == 0.0)  # pads get nothing
        queries = src_real if kind == "encoder_self" else tgt_real  # [B, queries]
        totals = w.sum(-1)[np.broadcast_to(queries[:, None, None, :], w.shape[:-1])]
        if name in NOT_SOFTMAX:
            assert np.all(totals <= 1.0 + 1e-6) and np.all(totals > 0.0)
        else:
            np.testing.assert_allclose(totals, 1.0, atol=1e-5)


def test_transformer_maps_are_causal_and_plots_read_them():
    model = build("transformer")
    params = random_params(model, SRC, TGT)
    maps = plots.attention_maps(model, params, SRC[:1], TGT[:1])
    assert set(maps) == {"encoder_self", "decoder_self", "cross"}
    assert maps["cross"].shape == (2, 4, T, S)  # one sentence: no batch
    upper = np.triu(np.ones((T, T), bool), k=1)
    assert np.all(maps["decoder_self"][..., upper] == 0.0)  # no query sees the future
    assert (
        plots.attention_maps(build("gru"), random_params(build("gru"), SRC, TGT), SRC[:1], TGT[:1])
        == {}
    )
