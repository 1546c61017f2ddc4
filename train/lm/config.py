"""LMConfig: one Transformer-XL language-model run on Penn Treebank or the user's text, its
presets and how it is made. How each preset was chosen is in benchmarks/README.md."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

from train.core.config import RunConfig, check_finite, check_positive
from train.lm.text import BYTE_VOCAB, text_vocab
from transformer_jax.optim import OptimizerConfig
from xl_jax.config import TransformerXLConfig

# dataset -> its level; 'text' is the user's files, at the config's own `level`.
DATASETS = {"ptb": "word", "ptb_char": "char", "text": None}
VOCAB_SIZES = {"ptb": 10_000, "ptb_char": 50}
LEVELS = ("word", "char", "byte")
# Adaptive input/softmax clusters for a large word vocabulary with none named (WikiText-103's
# cut-offs, those below the vocabulary size).
LARGE_VOCAB, LARGE_VOCAB_CUTOFFS = 50_000, (20_000, 40_000, 200_000)


@dataclasses.dataclass(frozen=True)
class LMConfig(RunConfig):
    """One language-model run (the shared fields are `train.core.config.RunConfig`'s).

    Attributes:
      dataset: 'ptb' (word level, perplexity) or 'ptb_char' (character level, bpc).
      preset: 'tiny' | 'cpu' | 'gpu' | 'base' (see PRESETS).
      model_config: the TransformerXLConfig; its tgt_len and mem_len are the training segment
        and memory lengths.
      batch_size: rows of the training stream: the GLOBAL batch, split over every device of
        every process (divisible by the device count).
      decay_steps: the length of the cosine decay (the reference's max_step); part of the
        training recipe, so fixed for a run (0: equal to steps when the config is made).
      learning_rate, warmup_steps, min_learning_rate: Adam with linear warm-up over
        warmup_steps, then cosine from learning_rate to min_learning_rate at decay_steps.
      clip_norm: global gradient-norm clipping (the reference: 0.25).
      eval_batch_size, eval_tgt_len, eval_mem_len: evaluation rows, segment and memory length.
      eval_tokens: evaluate on the first N tokens of each stream (0 = all).
      reset_memory_each_epoch: start each pass over the training stream with an empty memory,
        as the reference does (its memory ends where the last epoch's stream did); False
        carries it over.
      train_text, valid_text, test_text: with dataset 'text', the user's files (train.lm.text);
        the model's vocab_size is the training text's vocabulary, found when the config is
        made. level: 'word' | 'char' | 'byte'. min_count, max_vocab: a word or char enters
        the vocabulary when seen at least min_count times in training, at most max_vocab
        symbols with <eos> and <unk> (0: no limit). split_bytes: byte level, one file:
        (train, valid, test) byte counts of train_text.
    """

    dataset: str = "ptb"
    steps: int = 4000
    batch_size: int = 32
    decay_steps: int = 0
    learning_rate: float = 2.5e-4
    warmup_steps: int = 0
    min_learning_rate: float = 0.0
    clip_norm: float = 0.25
    eval_batch_size: int = 16
    eval_tgt_len: int = 70
    eval_mem_len: int = 140
    eval_tokens: int = 0
    reset_memory_each_epoch: bool = True
    train_text: str | None = None
    valid_text: str | None = None
    test_text: str | None = None
    level: str = "word"
    min_count: int = 1
    max_vocab: int = 0
    split_bytes: tuple[int, ...] = ()

    MAY_CHANGE: ClassVar[tuple[str, ...]] = RunConfig.MAY_CHANGE + (
        "eval_batch_size",
        "eval_tgt_len",
        "eval_mem_len",
        "eval_tokens",
        "valid_text",
        "test_text",
        # The rate may change (say, after a divergence); the optimizer state's tree does not.
        "learning_rate",
        "min_learning_rate",
    )

    def __post_init__(self):
        if self.dataset not in DATASETS:
            raise ValueError(f"dataset: expected one of {sorted(DATASETS)}, got {self.dataset!r}")
        super().__post_init__()
        self._check_text()
        if (
            self.dataset in VOCAB_SIZES
            and self.model_config.vocab_size != VOCAB_SIZES[self.dataset]
        ):
            raise ValueError(
                f"model_config.vocab_size: {self.dataset} has "
                f"{VOCAB_SIZES[self.dataset]} symbols, got "
                f"{self.model_config.vocab_size}"
            )
        check_positive(self, ("batch_size", "eval_batch_size", "eval_tgt_len"))
        check_positive(
            self, ("decay_steps", "warmup_steps", "eval_mem_len", "eval_tokens"), minimum=0
        )
        check_finite(self, ("learning_rate", "clip_norm"), positive=True)
        check_finite(self, ("min_learning_rate",), positive=False)
        if self.decay_steps == 0:
            object.__setattr__(self, "decay_steps", max(self.steps, 1))
        if self.model_config.same_length and self.eval_mem_len == 0:
            raise ValueError("eval_mem_len: same_length needs a memory")
        self.optimizer_config()  # validated there too

    def _check_text(self) -> None:
        if self.dataset != "text":
            if self.train_text or self.valid_text or self.test_text or self.split_bytes:
                raise ValueError(
                    f"train_text: the text options need dataset 'text', not {self.dataset!r}"
                )
            return
        if self.level not in LEVELS:
            raise ValueError(f"level: expected one of {LEVELS}, got {self.level!r}")
        if self.train_text is None:
            raise ValueError("train_text: dataset 'text' needs the training file")
        if self.split_bytes:
            if self.level != "byte" or len(self.split_bytes) != 3:
                raise ValueError(
                    f"split_bytes: three byte counts (train, valid, test) of one "
                    f"file at the byte level, got {self.split_bytes} at level "
                    f"{self.level!r}"
                )
            if self.valid_text or self.test_text or min(self.split_bytes) < 1:
                raise ValueError(
                    "split_bytes: positive counts, and no valid_text / test_text "
                    "(the parts come from train_text)"
                )
        elif self.valid_text is None:
            raise ValueError(
                "valid_text: training on text needs a validation file (or "
                "split_bytes at the byte level)"
            )
        check_positive(self, ("min_count",))
        check_positive(self, ("max_vocab",), minimum=0)
        if self.max_vocab and self.max_vocab < 3:
            raise ValueError(
                f"max_vocab: <eos>, <unk> and at least one symbol, got {self.max_vocab}"
            )

    def data_level(self) -> str:
        """'word', 'char' or 'byte'."""
        return DATASETS[self.dataset] or self.level

    def optimizer_config(self) -> OptimizerConfig:
        return OptimizerConfig(
            schedule="cosine",
            learning_rate=self.learning_rate,
            warmup_steps=self.warmup_steps,
            decay_steps=self.decay_steps,
            min_learning_rate=self.min_learning_rate,
            clip_norm=self.clip_norm,
        )


# Model sizes per (dataset, preset): TransformerXLConfig preset and overrides. The run fields
# per preset are in PRESETS.
MODEL_PRESETS: dict[str, dict[str, tuple[str, dict[str, Any]]]] = {
    "ptb": {
        "tiny": ("tiny", dict(tgt_len=16, mem_len=16)),
        # A small model a 2-core CPU trains for about an epoch in minutes. Its activations
        # are small, so recomputing nothing (remat 'none') is faster (benchmarks/README.md).
        "cpu": (
            "ptb",
            dict(
                n_layers=3,
                n_heads=4,
                d_model=256,
                d_head=64,
                d_inner=768,
                dropout=0.1,
                dropatt=0.0,
                tgt_len=35,
                mem_len=35,
                remat="none",
            ),
        ),
        # One GPU, ten minutes: 8 x 512 (32.4M parameters with the 10k embedding), heavily
        # regularised, as the paper's PTB model (24M) needs.
        "gpu": (
            "ptb",
            dict(
                n_layers=8,
                n_heads=8,
                d_model=512,
                d_head=64,
                d_inner=2048,
                dropout=0.45,
                dropatt=0.2,
                tgt_len=70,
                mem_len=70,
                remat="none",
                dtype="bfloat16",
            ),
        ),
        "base": ("ptb", {}),
    },
    "ptb_char": {
        "tiny": ("tiny", dict(tgt_len=32, mem_len=32)),
        "cpu": (
            "ptb",
            dict(
                n_layers=3,
                n_heads=4,
                d_model=256,
                d_head=64,
                d_inner=768,
                dropout=0.1,
                dropatt=0.0,
                tgt_len=100,
                mem_len=100,
            ),
        ),
        # One GPU, ten minutes: the paper's 12 x 512 enwik8 shape on ~5M characters.
        "gpu": (
            "ptb",
            dict(
                n_layers=12,
                n_heads=8,
                d_model=512,
                d_head=64,
                d_inner=2048,
                dropout=0.2,
                dropatt=0.1,
                tgt_len=150,
                mem_len=150,
                remat="none",
                dtype="bfloat16",
            ),
        ),
        "base": ("ptb", dict(dropout=0.2, tgt_len=150, mem_len=150)),
    },
}

PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        batch_size=8,
        steps=20,
        learning_rate=1e-2,
        log_every=5,
        checkpoint_every=10,
        eval_batch_size=8,
        eval_tgt_len=16,
        eval_mem_len=32,
        eval_tokens=2000,
    ),
    # The CPU default: stops at `minutes`. Batch 16 (more updates), lr 1e-3 (2e-3 diverged),
    # a cosine horizon about twice the steps that fit (the rate is ~half its peak at the stop).
    "cpu": dict(
        batch_size=16,
        steps=3500,
        minutes=8.0,
        learning_rate=1e-3,
        warmup_steps=100,
        log_every=50,
        checkpoint_every=500,
        eval_batch_size=16,
        eval_tgt_len=70,
        eval_mem_len=140,
    ),
    # One GPU, one ten-minute command: 7.5 minutes of training, Adam 5e-4 after a 1,000-step
    # warm-up, cosine over about the steps that fit, then evaluation.
    "gpu": dict(
        batch_size=32,
        steps=12_000,
        minutes=7.5,
        learning_rate=5e-4,
        warmup_steps=1000,
        log_every=200,
        checkpoint_every=4000,
        eval_batch_size=16,
        eval_tgt_len=70,
        eval_mem_len=280,
    ),
    # The reference's recipe (Adam 2.5e-4, no warm-up, cosine to 0, clip 0.25).
    "base": dict(
        batch_size=32,
        steps=40_000,
        learning_rate=2.5e-4,
        log_every=200,
        eval_every=2000,
        checkpoint_every=2000,
        eval_batch_size=16,
        eval_tgt_len=70,
        eval_mem_len=280,
    ),
}


def make_config(
    dataset: str = "ptb",
    preset: str = "cpu",
    *,
    model_overrides: Mapping[str, Any] = (),
    **run_overrides,
) -> LMConfig:
    """The config of `preset` for `dataset` with field overrides (validated). A `train_text`
    makes the dataset 'text' (the default 'ptb' otherwise), whose vocabulary size is read from
    the training text here."""
    if run_overrides.get("train_text") is not None and dataset == "ptb":
        dataset = "text"
    if dataset not in DATASETS:
        raise ValueError(f"dataset: expected one of {sorted(DATASETS)}, got {dataset!r}")
    if preset not in PRESETS:
        raise ValueError(f"preset: expected one of {sorted(PRESETS)}, got {preset!r}")
    if dataset == "text":
        level = run_overrides.get("level", LMConfig.level)
        base, sizes = MODEL_PRESETS["ptb" if level == "word" else "ptb_char"][preset]
        vocab_size = text_vocab_size(run_overrides)
        sizes = dict(sizes)
        if level == "word" and vocab_size >= LARGE_VOCAB and "cutoffs" not in model_overrides:
            sizes["cutoffs"] = tuple(c for c in LARGE_VOCAB_CUTOFFS if c < vocab_size)
    else:
        base, sizes = MODEL_PRESETS[dataset][preset]
        vocab_size = VOCAB_SIZES[dataset]
    fields = {**sizes, **dict(model_overrides), "vocab_size": vocab_size}
    if dict(model_overrides).get("vocab_size", fields["vocab_size"]) != fields["vocab_size"]:
        raise ValueError(f"model.vocab_size: fixed by the dataset ({fields['vocab_size']})")
    model_config = getattr(TransformerXLConfig, base)(**fields)
    return LMConfig(
        dataset=dataset,
        preset=preset,
        model_config=model_config,
        **{**PRESETS[preset], **run_overrides},
    )


def text_vocab_size(fields: Mapping[str, Any]) -> int:
    """The vocabulary size of a text run's training data (LMConfig field values; a bad level
    or file is an error naming it)."""
    level = fields.get("level", LMConfig.level)
    if level not in LEVELS:
        raise ValueError(f"level: expected one of {LEVELS}, got {level!r}")
    if level == "byte":
        return BYTE_VOCAB
    vocab = text_vocab(
        fields["train_text"],
        level,
        min_count=fields.get("min_count", LMConfig.min_count),
        max_vocab=fields.get("max_vocab", LMConfig.max_vocab),
    )
    return vocab.vocab_size
