"""Translation on Multi30k German -> English: configs and presets, the task, evaluation and
inference, as a library (`python -m train.translate` is its command line).

    from train import translate
    config = translate.make_config("transformer", "tiny", steps=50)
    final = translate.train_and_evaluate(config, "runs/tiny")     # test BLEU, ppl, ...
    translate.translate_text("runs/tiny", ["Ein Mann fährt Fahrrad."])
"""

from __future__ import annotations

from typing import Any

from train.core.config import replace
from train.core.run import train_and_evaluate as _run
from train.core.task import eval_params
from train.translate import registry
from train.translate.cli import config_from_args
from train.translate.config import PRESETS, SPLITS, TranslateConfig, make_config
from train.translate.evaluate import (
    DecodeOptions,
    bleu,
    teacher_forced,
    translate_pairs,
    write_translations,
)
from train.translate.infer import translate_text
from train.translate.loss import make_loss_fn
from train.translate.sources import Split, encode_source, load_split, translation_source
from train.translate.task import TASK
from train.translate.tokenizer import load_tokenizer, trained_tokenizer


def train_and_evaluate(config: TranslateConfig, workdir: str) -> dict[str, Any]:
    """Trains (or resumes) in `workdir`, then evaluates; returns the final metrics: step,
    stop reason, params (count), train_seconds (summed over resumed runs), val/test loss and
    ppl, test BLEU, and the hypotheses path."""
    return _run(TASK, config, workdir)


def build_model(config: TranslateConfig):
    return TASK.build_model(config)


__all__ = [
    "DecodeOptions",
    "PRESETS",
    "SPLITS",
    "Split",
    "TASK",
    "TranslateConfig",
    "bleu",
    "build_model",
    "config_from_args",
    "encode_source",
    "eval_params",
    "load_split",
    "load_tokenizer",
    "trained_tokenizer",
    "make_config",
    "make_loss_fn",
    "registry",
    "replace",
    "teacher_forced",
    "train_and_evaluate",
    "translate_pairs",
    "translate_text",
    "translation_source",
    "write_translations",
]
