"""Where a translation run's model starts: from scratch, or from an OPUS-MT / Marian folder
(`--pretrained DIR`). Chosen once, by `model_origin`, from the run's `pretrained` field.

The origin owns what differs between the two:

- the model's config: the preset's sizes (the registry), or the folder's config.json with only
  regularisation overridable (`MARIAN_MAY_CHANGE`);
- the vocabulary: SentencePiece trained on the run's data, or the folder's own tokenizer,
  copied into the run so that it no longer needs the folder;
- the initial parameters: random, or the folder's weights;
- the baseline: a fine-tuning run scores the folder's model before its first step, so the
  end's BLEU shows the gain; a model trained from scratch starts random and has none.

No other code asks whether `pretrained` is set: it asks the origin.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

# What fine-tuning may change of a Marian model's config: regularisation and how it is
# computed, never its architecture.
MARIAN_MAY_CHANGE = ("dropout", "attention_dropout", "dtype", "attention_impl")


@dataclasses.dataclass(frozen=True)
class FromScratch:
    """A model of the preset's sizes with random initial weights and its own tokenizer."""

    trains_tokenizer = True  # SentencePiece on the run's data: vocab_size is the run's choice
    has_baseline = False  # random weights: nothing to measure before the first step

    def check(self, model: str, preset: str) -> None:
        if preset == "finetune":  # no model sizes: a folder's config.json gives them
            raise ValueError("preset: 'finetune' fine-tunes a model: give its folder, --pretrained")

    def model_config(
        self, model: str, preset: str, fields: dict[str, Any], overrides: Mapping[str, Any]
    ):
        from train.translate import registry
        from train.translate.config import TranslateConfig

        return registry.build_model_config(
            model,
            preset,
            vocab_size=fields.get("vocab_size", TranslateConfig.vocab_size),
            overrides=overrides,
        )

    def tokenizer(self, directory: str, model_config, from_data: Callable[[], Any]):
        """The run's data source's SentencePiece model (`from_data`), trained the first time."""
        return from_data()

    def initial_params(self, model_config) -> None:
        return None  # the model's own initialiser

    def describe(self, model: str) -> str:
        return model


@dataclasses.dataclass(frozen=True)
class FromMarian:
    """A Transformer fine-tuned from an OPUS-MT / Marian folder (config.json,
    model.safetensors and the tokenizer's source.spm, target.spm and vocab.json)."""

    folder: str
    trains_tokenizer = False  # the folder's own vocabulary
    has_baseline = True  # the folder's model is scored before the first step

    def check(self, model: str, preset: str) -> None:
        if model != "transformer":
            raise ValueError(
                f"model: --pretrained fine-tunes a Transformer (a Marian folder), not {model}"
            )

    def model_config(
        self, model: str, preset: str, fields: dict[str, Any], overrides: Mapping[str, Any]
    ):
        """The folder's config.json as a TransformerConfig, with the fields of
        MARIAN_MAY_CHANGE overridden; any other model field is a ValueError naming it. The
        run's vocab_size becomes the model's (no SentencePiece model is trained)."""
        from transformer_jax.interchange.marian import CONFIG, marian_config
        from transformer_jax.interchange.marian_tokenizer import read_json

        self.check(model, preset)
        overrides = dict(overrides)
        fixed = sorted(set(overrides) - set(MARIAN_MAY_CHANGE))
        if fixed:
            raise ValueError(
                f"model.{fixed[0]}: a pretrained model's architecture is its config.json's; "
                f"fine-tuning may change only {', '.join(MARIAN_MAY_CHANGE)}"
            )
        if not os.path.isdir(self.folder):
            raise ValueError(f"pretrained: {self.folder} is not a folder")
        path = os.path.join(self.folder, CONFIG)
        config = marian_config(read_json(Path(path)), source=path).replace(**overrides)
        fields["vocab_size"] = config.tgt_vocab_size
        return config

    def tokenizer(self, directory: str, model_config, from_data: Callable[[], Any]):
        """The folder's tokenizer, copied to directory/marian the first time (so the run no
        longer needs the folder), and checked against the model's config (pad and EOS ids,
        vocabulary size)."""
        from train.data.text_files import DataError
        from transformer_jax.interchange.marian import check_tokenizer
        from transformer_jax.interchange.marian_tokenizer import (
            MarianTokenizer,
            has_tokenizer_files,
        )

        copy = os.path.join(directory, "marian")
        if not has_tokenizer_files(copy):
            if not has_tokenizer_files(self.folder):
                raise DataError(
                    f"pretrained: {self.folder} has no tokenizer (source.spm, target.spm, "
                    "vocab.json); fine-tuning encodes the data with the model's own"
                )
            MarianTokenizer.from_folder(self.folder).save(copy)
        tokenizer = MarianTokenizer.from_folder(copy)
        check_tokenizer(tokenizer, model_config, source=copy)
        return tokenizer

    def initial_params(self, model_config):
        """The folder's weights, checked against the model's config."""
        from transformer_jax.interchange.marian import marian_params, read_marian_weights

        return marian_params(read_marian_weights(self.folder), model_config)

    def describe(self, model: str) -> str:
        return f"{model} fine-tuned from {self.folder}"


ModelOrigin = FromScratch | FromMarian


def model_origin(pretrained: str | None) -> ModelOrigin:
    """The origin of a run whose `pretrained` field is `pretrained` (None: from scratch)."""
    return FromScratch() if pretrained is None else FromMarian(pretrained)
