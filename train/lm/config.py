"""LMConfig: one Transformer-XL language-model run on Penn Treebank, a TFDS text dataset or
the user's text, its presets and how it is made. How each preset was chosen is in
benchmarks/README.md."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

from train.core.config import RunConfig, check_finite, check_positive, preset_run_fields
from train.data.tfds_source import is_tfds, tfds_name
from train.lm.text import BYTE_VOCAB
from transformer_jax.optim import OptimizerConfig
from xl_jax.config import TransformerXLConfig

# dataset -> its level; 'text' is the user's files, at the config's own `level`, as is any
# prepared TFDS dataset, 'tfds:NAME[/CONFIG]' (train.data.tfds_source).
DATASETS = {"ptb": "word", "ptb_char": "char", "text": None}
VOCAB_SIZES = {"ptb": 10_000, "ptb_char": 50}
LEVELS = ("word", "char", "byte")
# Adaptive input/softmax clusters for a large word vocabulary with none named (WikiText-103's
# cut-offs, those below the vocabulary size).
LARGE_VOCAB, LARGE_VOCAB_CUTOFFS = 50_000, (20_000, 40_000, 200_000)
# The papers' recipes (Dai et al. 2019): the paper's model (a TransformerXLConfig preset and
# overrides) whatever the data, and the levels of text it is for. They train on the user's
# text only (see train.lm.sources: the recipes' rules).
PAPER_MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "wt103_base": ("wt103_base", {}),
    # Unrolled layers: faster a step on a GPU, and the memory fits
    # (benchmarks/h100_2026-11-22_session3/).
    "enwik8_base": ("enwik8_base", dict(remat="none")),
}
# enwik8's recipe is a character-level one: bytes as the paper, or characters (text8).
PAPER_LEVELS = {"wt103_base": ("word",), "enwik8_base": ("byte", "char")}


@dataclasses.dataclass(frozen=True)
class LMConfig(RunConfig):
    """One language-model run (the shared fields are `train.core.config.RunConfig`'s).

    Attributes:
      dataset: 'ptb' (word level, perplexity) or 'ptb_char' (character level, bpc); 'text'
        (the user's files, below); or 'tfds:NAME[/CONFIG]', a prepared TFDS dataset in
        data_dir ('tfds:lm1b') whose examples' `text_feature` are the lines, at `level` as
        text is (vocabulary from its train split; validation and test splits as
        train.data.tfds_source finds them).
      preset: 'tiny' | 'cpu' | 'gpu' | 'base', or a paper's recipe: 'wt103_base' (word-level
        text) | 'enwik8_base' (byte- or char-level text) (see PRESETS).
      model_config: the TransformerXLConfig; its tgt_len and mem_len are the training segment
        and memory lengths.
      batch_size: rows of the training stream: the GLOBAL batch, split over every device of
        every process (divisible by the device count).
      decay_steps: the length of the cosine decay (the reference's max_step); part of the
        training recipe, so fixed for a run (0: equal to steps when the config is made; with
        fit_to_budget it stays 0: the decay is over the steps the run chooses).
      learning_rate: Adam's peak rate, after a linear warm-up over warmup_steps, then a
        cosine down to min_learning_rate at decay_steps.
      warmup_steps: the linear warm-up's steps.
      min_learning_rate: the cosine's floor.
      clip_norm: global gradient-norm clipping (the reference: 0.25).
      eval_batch_size: evaluation rows.
      eval_tgt_len: evaluation segment length.
      eval_mem_len: evaluation memory length.
      eval_tokens: evaluate on the first N tokens of each stream (0 = all).
      reset_memory_each_epoch: start each pass over the training stream with an empty memory,
        as the reference does (its memory ends where the last epoch's stream did); False
        carries it over.
      train_text: with dataset 'text', the user's training file (train.lm.text); the model's
        vocab_size is its vocabulary, counted by its source when the data is prepared
        (`train.lm.sources.config_for_data`).
      valid_text: with dataset 'text', the validation file.
      test_text: with dataset 'text', the test file.
      level: how text is read: 'word' | 'char' | 'byte'.
      min_count: a word or char enters the vocabulary when seen at least this many times in
        training.
      max_vocab: at most this many symbols with <eos> and <unk> (0: no limit).
      split_bytes: byte level, one file: (train, valid, test) byte counts of train_text.
      text_feature: with a TFDS dataset, the text feature read from each example.
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
    text_feature: str = "text"

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
        check_dataset(self.dataset)
        super().__post_init__()
        self.source_class().check_fields(self)  # the rules of the run's kind of data
        check_positive(self, ("batch_size", "eval_batch_size", "eval_tgt_len"))
        check_positive(
            self, ("decay_steps", "warmup_steps", "eval_mem_len", "eval_tokens"), minimum=0
        )
        check_finite(self, ("learning_rate", "clip_norm"), positive=True)
        check_finite(self, ("min_learning_rate",), positive=False)
        if self.fit_to_budget and self.decay_steps:
            raise ValueError(
                f"decay_steps: a run that fits its steps to its budget decays over the steps it "
                f"chooses; leave decay_steps 0 (got {self.decay_steps}), or give fixed steps "
                "with --fit_to_budget false"
            )
        if self.decay_steps == 0 and not self.fit_to_budget:
            object.__setattr__(self, "decay_steps", max(self.steps, 1))
        if self.model_config.same_length and self.eval_mem_len == 0:
            raise ValueError("eval_mem_len: same_length needs a memory")
        self.optimizer_config()  # validated there too

    def source_class(self) -> type:
        """The class of the run's data source (`sources.SOURCES`), which owns its rules."""
        from train.lm.sources import SOURCES, source_kind  # sources imports this module

        return SOURCES[source_kind(self.dataset)]

    def data_level(self) -> str:
        """'word', 'char' or 'byte'."""
        return DATASETS.get(self.dataset) or self.level

    def optimizer_config(self) -> OptimizerConfig:
        return OptimizerConfig(
            schedule="cosine",
            learning_rate=self.learning_rate,
            warmup_steps=self.warmup_steps,
            decay_steps=self.decay_steps,
            min_learning_rate=self.min_learning_rate,
            clip_norm=self.clip_norm,
            horizon_in_state=self.fit_to_budget,
        )


# Model sizes per (dataset, preset): TransformerXLConfig preset and overrides. The run fields
# per preset are in PRESETS.
MODEL_PRESETS: dict[str, dict[str, tuple[str, dict[str, Any]]]] = {
    "ptb": {
        "tiny": ("tiny", dict(tgt_len=16, mem_len=16)),
        # A small model a 2-core CPU trains for two to four epochs in minutes. Its activations
        # are small, so recomputing nothing (remat 'none') is faster (benchmarks/README.md).
        # Pre-LN, and no dropout: in so few epochs dropout slows learning more than it
        # regularises, and its random numbers cost a fifth of the CPU step
        # (benchmarks/lm_cpu_recipe_2026-11-29/).
        "cpu": (
            "ptb",
            dict(
                n_layers=3,
                n_heads=4,
                d_model=256,
                d_head=64,
                d_inner=768,
                dropout=0.0,
                dropatt=0.0,
                tgt_len=35,
                mem_len=35,
                norm_first=True,
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
    # The CPU default: the batch and rate that won their sweep in 8 minutes, the cosine over
    # the steps that fit them (why each: benchmarks/lm_cpu_recipe_2026-11-29/README.md).
    "cpu": dict(
        batch_size=24,
        steps=2400,
        minutes=8.0,
        fit_to_budget=True,
        learning_rate=2e-3,
        warmup_steps=200,
        log_every=50,
        checkpoint_every=500,
        eval_batch_size=16,
        eval_tgt_len=70,
        eval_mem_len=140,
    ),
    # One GPU, one ten-minute command: 7.5 minutes of training, Adam 5e-4 after a 1,000-step
    # warm-up, cosine over the steps that fit on the GPU it runs on (fit_to_budget; 12,000
    # without a budget), then evaluation.
    "gpu": dict(
        batch_size=32,
        steps=12_000,
        minutes=7.5,
        fit_to_budget=True,
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
    # The papers' base models (Dai et al. 2019) with the official scripts' recipes
    # (run_wt103_base.sh, run_enwik8_base.sh): Adam 2.5e-4 without warm-up, cosine to 0 over
    # max_step (fixed here, so a run cut short with --steps keeps the paper's rate; pass
    # --decay_steps too to shrink it), clip 0.25, the paper's batch and segment = memory
    # lengths (in PAPER_MODELS' configs); evaluated as their eval.py does, shorter segments
    # against a longer memory (its same_length and clamp_len are not applied: they are model
    # fields here, and would change training too). The models: PAPER_MODELS.
    "wt103_base": dict(
        level="word",
        batch_size=60,
        steps=200_000,
        decay_steps=200_000,
        learning_rate=2.5e-4,
        warmup_steps=0,
        clip_norm=0.25,
        log_every=200,
        eval_every=4000,
        checkpoint_every=4000,
        eval_batch_size=10,
        eval_tgt_len=64,
        eval_mem_len=640,
    ),
    "enwik8_base": dict(
        level="byte",
        batch_size=22,
        steps=400_000,
        decay_steps=400_000,
        learning_rate=2.5e-4,
        warmup_steps=0,
        clip_norm=0.25,
        log_every=200,
        eval_every=4000,
        checkpoint_every=4000,
        eval_batch_size=10,
        eval_tgt_len=80,
        eval_mem_len=2100,
    ),
}


def check_dataset(dataset: str) -> None:
    """One of DATASETS or a well-formed 'tfds:NAME' (ValueError naming the field)."""
    if is_tfds(dataset):
        tfds_name(dataset)
    elif dataset not in DATASETS:
        raise ValueError(
            f"dataset: expected one of {sorted(DATASETS)} or tfds:NAME[/CONFIG], got {dataset!r}"
        )


def data_kind(dataset: str, run_overrides: Mapping[str, Any]) -> str:
    """The run's dataset: a `train_text` makes the default 'ptb' the user's 'text'. Checked
    (`check_dataset`)."""
    if run_overrides.get("train_text") is not None and dataset == "ptb":
        dataset = "text"
    check_dataset(dataset)
    return dataset


def run_fields(preset: str, run_overrides: Mapping[str, Any]) -> dict[str, Any]:
    """The LMConfig fields of `preset` with the overrides on top (a bad preset names it)."""
    if preset not in PRESETS:
        raise ValueError(f"preset: expected one of {sorted(PRESETS)}, got {preset!r}")
    return preset_run_fields(PRESETS[preset], run_overrides)


def counts_its_vocabulary(dataset: str, fields: Mapping[str, Any]) -> bool:
    """Whether the run's vocabulary is counted from its training data (text and TFDS data at
    the word or char level), rather than fixed (PTB's, or the byte level's 256)."""
    if dataset != "text" and not is_tfds(dataset):
        return False
    level = check_level(fields.get("level", LMConfig.level))
    return level != "byte"


def check_level(level: str) -> str:
    """`level` if it is one a vocabulary can be read at (`LEVELS`); a named error if not."""
    if level not in LEVELS:
        raise ValueError(f"level: expected one of {LEVELS}, got {level!r}")
    return level


def make_config(
    dataset: str = "ptb",
    preset: str = "cpu",
    *,
    vocab_size: int | None = None,
    model_overrides: Mapping[str, Any] = (),
    **run_overrides,
) -> LMConfig:
    """The config of `preset` for `dataset` with field overrides (validated). A `train_text`
    makes the dataset 'text' (the default 'ptb' otherwise).

    Pure: nothing is read. The vocabulary size is PTB's, the byte level's 256, or, for text
    and TFDS data at the word or char level, `vocab_size`: the count of the training data's
    vocabulary, which its source makes when the data is prepared
    (`train.lm.sources.config_for_data` counts it and calls this)."""
    dataset = data_kind(dataset, run_overrides)
    run = run_fields(preset, run_overrides)
    if counts_its_vocabulary(dataset, run):
        if vocab_size is None:
            raise ValueError(
                f"vocab_size: a {dataset} run's vocabulary is counted from its training data; "
                "make its config with train.lm.config_for_data (which counts it), or give "
                "the count"
            )
        level = run.get("level", LMConfig.level)
    else:
        if dataset in VOCAB_SIZES:
            level, fixed = DATASETS[dataset], VOCAB_SIZES[dataset]
        else:
            level, fixed = "byte", BYTE_VOCAB
        if vocab_size not in (None, fixed):
            raise ValueError(f"vocab_size: fixed by the dataset ({fixed}), got {vocab_size}")
        vocab_size = fixed
    if preset in PAPER_MODELS:  # the paper's model; LMConfig refuses data it is not for
        base, sizes = PAPER_MODELS[preset]
        sizes = {**sizes, **paper_clusters(base, vocab_size)}
    else:
        base, sizes = MODEL_PRESETS[dataset if dataset in MODEL_PRESETS else _TEXT_ROWS[level]][
            preset
        ]
    sizes = dict(sizes)
    if "cutoffs" in model_overrides:
        sizes["tie_projs"] = ()  # the user's clusters: the paper's per-cluster ties fit its own
    elif level == "word" and vocab_size >= LARGE_VOCAB and "cutoffs" not in sizes:
        sizes["cutoffs"] = tuple(c for c in LARGE_VOCAB_CUTOFFS if c < vocab_size)
    fields = {**sizes, **dict(model_overrides), "vocab_size": vocab_size}
    if dict(model_overrides).get("vocab_size", fields["vocab_size"]) != fields["vocab_size"]:
        raise ValueError(f"model.vocab_size: fixed by the dataset ({fields['vocab_size']})")
    model_config = getattr(TransformerXLConfig, base)(**fields)
    return LMConfig(dataset=dataset, preset=preset, model_config=model_config, **run)


# A text run's model sizes: the PTB presets' at the word level, the PTB characters' otherwise.
_TEXT_ROWS = {"word": "ptb", "char": "ptb_char", "byte": "ptb_char"}


def paper_clusters(base: str, vocab_size: int) -> dict[str, Any]:
    """The adaptive input/softmax clusters of TransformerXLConfig preset `base` that fit a
    vocabulary of `vocab_size`: its cut-offs below the size (WikiText-103's 20k, 40k and 200k
    all fit its 267,735 words; a smaller vocabulary keeps fewer clusters), with the per-cluster
    projection ties of the clusters kept. None for a preset without clusters."""
    paper = getattr(TransformerXLConfig, base)()
    cutoffs = tuple(c for c in paper.cutoffs if c < vocab_size)
    out: dict[str, Any] = {"cutoffs": cutoffs}
    if paper.tie_projs:
        out["tie_projs"] = paper.tie_projs[: len(cutoffs) + 1]
    return out
