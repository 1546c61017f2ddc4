"""Registry of the pre-Transformer baselines, so training code builds them by name::

    model = make_baseline("bahdanau", src_vocab_size=8000, tgt_vocab_size=6000)
    model = make_baseline("convs2s", src_vocab_size=64, tgt_vocab_size=64, preset="tiny",
                          dropout=0.1)

Each entry is (config class, module class, defaults): `defaults` are the config fields that make
the model what its paper describes (e.g. Luong's unidirectional encoder and score), applied
before the caller's overrides.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

from flax import linen as nn

from transformer_jax.baselines.convs2s import ConvS2S, ConvS2SConfig
from transformer_jax.baselines.seq2seq import (
    BahdanauSeq2Seq,
    GRUSeq2Seq,
    HardAttentionSeq2Seq,
    LuongLocalMSeq2Seq,
    LuongLocalSeq2Seq,
    LuongSeq2Seq,
    RNNSeq2SeqConfig,
)


class Baseline(NamedTuple):
    config_cls: type
    model_cls: type
    defaults: Mapping[str, Any]


BASELINES: dict[str, Baseline] = {
    # Cho et al. 2014 / bentrevett tutorial 2: one-directional GRU, no attention.
    "gru": Baseline(RNNSeq2SeqConfig, GRUSeq2Seq, {"bidirectional": False}),
    # Bahdanau et al. 2015 / bentrevett tutorial 3: bidirectional encoder, additive score.
    "bahdanau": Baseline(RNNSeq2SeqConfig, BahdanauSeq2Seq, {"bidirectional": True}),
    # Luong et al. 2015: one-directional encoder; `dot` was their best global score,
    # `general` their best local-p score.
    "luong": Baseline(
        RNNSeq2SeqConfig, LuongSeq2Seq, {"bidirectional": False, "luong_score": "dot"}
    ),
    "luong_local": Baseline(
        RNNSeq2SeqConfig, LuongLocalSeq2Seq, {"bidirectional": False, "luong_score": "general"}
    ),
    "luong_local_m": Baseline(
        RNNSeq2SeqConfig, LuongLocalMSeq2Seq, {"bidirectional": False, "luong_score": "general"}
    ),
    # Xu et al. 2015's stochastic attention on Luong's decoder; trained with REINFORCE
    # (transformer_jax.losses.hard_attention_surrogate).
    "hard_attention": Baseline(
        RNNSeq2SeqConfig, HardAttentionSeq2Seq, {"bidirectional": False, "luong_score": "general"}
    ),
    # Gehring et al. 2017 / bentrevett tutorial 5.
    "convs2s": Baseline(ConvS2SConfig, ConvS2S, {}),
}

PRESETS = ("tutorial", "tiny")


def make_baseline(
    name: str,
    *,
    src_vocab_size: int,
    tgt_vocab_size: int,
    preset: str = "tutorial",
    **overrides: Any,
) -> nn.Module:
    """Builds baseline `name` with `preset` sizes; `overrides` replace config fields.

    The config is `model.config`. Raises ValueError for an unknown name, preset or field value.
    """
    if name not in BASELINES:
        raise ValueError(f"name must be one of {sorted(BASELINES)}, got {name!r}")
    if preset not in PRESETS:
        raise ValueError(f"preset must be one of {PRESETS}, got {preset!r}")
    entry = BASELINES[name]
    config = getattr(entry.config_cls, preset)(
        src_vocab_size=src_vocab_size,
        tgt_vocab_size=tgt_vocab_size,
        **{**entry.defaults, **overrides},
    )
    return entry.model_cls(config)
