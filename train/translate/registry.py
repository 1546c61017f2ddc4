"""Translation models by name: the Transformer and the seq2seq baselines, with their presets.

`build_model_config(name, preset, vocab_size=V, overrides={...})` makes the model's frozen
config for a run preset ('tiny' for tests, 'cpu' the small default, 'base' the paper-sized
one, 'wmt14_base' / 'wmt14_big' the paper's WMT14 models, Transformer only);
`get(name).module_cls(config)` builds the flax module. Every model follows the
translation-model protocol of `transformer_jax.decoding.decode`. Source and target share one joint
SentencePiece vocabulary, so both vocabulary sizes are V.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from transformer_jax.baselines.registry import BASELINES
from transformer_jax.baselines.seq2seq import RNNSeq2SeqConfig
from transformer_jax.config import TransformerConfig
from transformer_jax.model import Transformer


@dataclasses.dataclass(frozen=True)
class TranslationModel:
    name: str
    config_cls: type
    module_cls: type
    # run preset -> (vocab_size, **overrides) -> config
    presets: Mapping[str, Callable[..., Any]]
    # The run defaults this family trains with (see train.translate.config.TranslateConfig).
    run_defaults: Mapping[str, Any]
    # A term the training loss must add to the cross-entropy, by its name in
    # transformer_jax.losses: 'hard_attention_surrogate' (REINFORCE for hard attention; the
    # model's `logits_and_attention` gives its inputs, its baseline is carried as `extra`).
    aux_loss: str | None = None
    # Whether the decoder can be fed its own predictions in training (a teacher-forcing
    # ratio below 1): the recurrent models.
    free_running: bool = False


def _transformer() -> TranslationModel:
    def sized(base: Callable, **fields):
        def make(vocab_size: int, **overrides):
            kw = dict(fields, src_vocab_size=vocab_size, tgt_vocab_size=vocab_size)
            return base(**{**kw, **overrides})

        return make

    return TranslationModel(
        name="transformer",
        config_cls=TransformerConfig,
        module_cls=Transformer,
        presets={
            "tiny": sized(TransformerConfig.tiny, dropout=0.0),
            # Small enough for a 2-core CPU to see about two epochs of Multi30k in 8 minutes;
            # pre-LN trains stably at a constant 1e-3 from step 0; no dropout: in under two
            # epochs it only slows learning (benchmarks/README.md).
            "cpu": sized(
                TransformerConfig.base,
                d_model=256,
                n_heads=4,
                d_ff=512,
                n_encoder_layers=3,
                n_decoder_layers=3,
                dropout=0.0,
                norm_first=True,
            ),
            # One GPU, ten minutes: IWSLT widths for a corpus of 29k pairs, dropout 0.3 (a GPU
            # sees ~100 epochs in the time), pre-LN, bf16; XLA attention (cuDNN's fused kernel
            # gains nothing at these lengths: benchmarks/README.md).
            "gpu": sized(
                TransformerConfig.base,
                d_ff=1024,
                n_heads=4,
                dropout=0.3,
                norm_first=True,
                dtype="bfloat16",
                attention_impl="xla",
            ),
            "base": sized(TransformerConfig.base),
            # The paper's two WMT14 models as they are (train.translate.config's wmt14_*
            # presets): source and target embeddings and the output projection share one table
            # (the config's default), post-LN, float32 unless --dtype says otherwise.
            "wmt14_base": sized(TransformerConfig.base),
            "wmt14_big": sized(TransformerConfig.big),
        },
        run_defaults={"optimizer": "noam", "label_smoothing": 0.1},
    )


def _baseline(name: str) -> TranslationModel:
    entry = BASELINES[name]
    # The tiny run pads to 64 and decodes 8 positions more; ConvS2S's unit-test table (32
    # positions) is too short for that.
    run_sizes = {"tiny": {"max_positions": 128}} if name == "convs2s" else {}

    def sized(preset: str):
        def make(vocab_size: int, **overrides):
            return getattr(entry.config_cls, preset)(
                src_vocab_size=vocab_size,
                tgt_vocab_size=vocab_size,
                **{**entry.defaults, **run_sizes.get(preset, {}), **overrides},
            )

        return make

    # The tutorials these baselines come from: Adam 1e-3, clip 1, plain cross-entropy.
    return TranslationModel(
        name=name,
        config_cls=entry.config_cls,
        module_cls=entry.model_cls,
        presets={
            "tiny": sized("tiny"),
            "cpu": sized("tutorial"),
            "gpu": sized("tutorial"),
            "base": sized("tutorial"),
        },
        run_defaults={
            "optimizer": "adam",
            "learning_rate": 1e-3,
            "clip_norm": 1.0,
            "label_smoothing": 0.0,
        },
        aux_loss="hard_attention_surrogate" if name == "hard_attention" else None,
        free_running=entry.config_cls is RNNSeq2SeqConfig,
    )


def names() -> list[str]:
    return ["transformer", *sorted(BASELINES)]


def get(name: str) -> TranslationModel:
    if name == "transformer":
        return _transformer()
    if name not in names():
        raise ValueError(f"model: expected one of {names()}, got {name!r}")
    return _baseline(name)


def build_model_config(
    name: str, preset: str, *, vocab_size: int, overrides: Mapping[str, Any] = ()
) -> Any:
    """The model config for `preset` (a run preset of `train.translate.config.PRESETS`, which
    checks the name), with the joint vocabulary size and field overrides."""
    overrides = dict(overrides)
    for key in ("src_vocab_size", "tgt_vocab_size"):
        if key in overrides and overrides[key] != vocab_size:
            raise ValueError(
                f"model.{key}: set by the tokenizer's vocab_size ({vocab_size}); "
                f"change --vocab_size instead"
            )
        overrides.pop(key, None)
    spec = get(name)
    fields = {f.name for f in dataclasses.fields(spec.config_cls)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ValueError(f"model {name!r} has no config field(s) {unknown}")
    if preset not in spec.presets:
        raise ValueError(
            f"preset: model {name!r} has no sizes for preset {preset!r} (it has "
            f"{sorted(spec.presets)})"
        )
    return spec.presets[preset](vocab_size, **overrides)
