"""Language modelling with Transformer-XL on Penn Treebank: configs and presets, the task and
its evaluation, as a library (`python -m train.lm` is its command line).

    from train import lm
    config = lm.make_config("ptb", "tiny", steps=50)
    final = lm.train_and_evaluate(config, "runs/ptb-tiny")        # test ppl (bpc for ptb_char)
"""

from __future__ import annotations

from typing import Any

from train.core.config import replace
from train.core.run import train_and_evaluate as _run
from train.lm.cli import config_from_args
from train.lm.config import DATASETS, MODEL_PRESETS, PRESETS, VOCAB_SIZES, LMConfig, make_config
from train.lm.sources import config_for_data
from train.lm.task import (
    TASK,
    as_batch,
    evaluate_stream,
    load_stream,
    make_loss_fn,
    train_batches,
    with_bpc,
)


def train_and_evaluate(config: LMConfig, workdir: str) -> dict[str, Any]:
    """Trains (or resumes) in `workdir`, then evaluates on valid and test; returns the final
    metrics (step, reason, the validation and test loss, ppl and, at the char level, bpc:
    `val_loss`, `test_ppl`, ...)."""
    return _run(TASK, config, workdir)


__all__ = [
    "DATASETS",
    "LMConfig",
    "MODEL_PRESETS",
    "PRESETS",
    "TASK",
    "VOCAB_SIZES",
    "as_batch",
    "config_for_data",
    "config_from_args",
    "evaluate_stream",
    "load_stream",
    "make_config",
    "make_loss_fn",
    "replace",
    "train_and_evaluate",
    "train_batches",
    "with_bpc",
]
