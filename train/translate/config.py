"""TranslateConfig: one translation run (Multi30k, a TFDS dataset or the user's files), its
presets and how it is made.

The model's own sizes per preset are in `train.translate.registry`; how each preset was chosen
is in benchmarks/README.md.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, ClassVar

from train.core.config import RunConfig, check_finite, check_positive, preset_run_fields
from train.data.tfds_source import is_tfds, tfds_name
from train.translate import registry
from train.translate.origin import ModelOrigin, model_origin
from transformer_jax.optim import OptimizerConfig

SPLITS = (
    "validation",
    "test_2016_flickr",
    "test_2017_flickr",
    "test_2017_mscoco",
    "test_2018_flickr",
)
OPTIMIZERS = ("noam", "adam", "adam_cosine")
TEACHER_FORCING_SCHEDULES = ("constant", "inverse_sigmoid")
# The fewest pieces SentencePiece can train the Multi30k tokenizer with: it keeps every
# character of the training text (character_coverage 1.0), so the 102 distinct characters of
# the de+en train split, the 256 byte pieces and the 4 special ids. Found by training it:
# 361 fails ("Vocabulary size is smaller than required_chars. 361 vs 362"), 362 trains.
MIN_VOCAB_SIZE = 362
# The papers' recipes: each needs its own data from files (see TranslateConfig._check_data).
PAPER_PRESETS = ("wmt14_base", "wmt14_big")
# Padded lengths for WMT sentences (about 30 pieces on average with a 32k vocabulary, a long
# tail): steps of at most 1.5x up to 128, so little of a batch is padding, then 256 for the
# tail, tensor2tensor's length limit for WMT. Longer pairs are left out (counted in the log).
WMT_BUCKETS = (16, 24, 32, 48, 64, 96, 128, 256)


@dataclasses.dataclass(frozen=True)
class TranslateConfig(RunConfig):
    """One translation run (the shared fields are `train.core.config.RunConfig`'s).

    Attributes:
      model: a name of `train.translate.registry` ('transformer', 'gru', 'bahdanau', ...);
        model_config is that model's own config, resolved from the preset.
      pretrained: an OPUS-MT / Marian folder (config.json, model.safetensors, source.spm,
        target.spm, vocab.json; `transformer_jax.load_marian`) to fine-tune: its config.json
        is the model's (model fields may change only dropout, attention_dropout, dtype and
        attention_impl), its weights start the run (no re-initialisation) and its own
        tokenizer encodes the data (no SentencePiece is trained; decoding starts from pad,
        Marian's convention). Its tokenizer is copied into the work directory at the first
        start, so a resumed run, --translate and the exports need the folder no more (a
        resume reads neither; it may not name another folder: that would be another run).
      preset: 'tiny' | 'cpu' | 'gpu' | 'base', or a paper's recipe: 'wmt14_base' |
        'wmt14_big' (see PRESETS; those need training files).
      vocab_size: joint German+English SentencePiece pieces (at least MIN_VOCAB_SIZE).
      tokens_per_batch: token budget N * L of each padded batch array (src or tgt): the
        GLOBAL batch, split over every device of every process (N is rounded down to a
        multiple of the device count), so the same run on more devices takes the same steps;
        scale it yourself to keep a per-device load.
      buckets: the allowed padded lengths L (one compiled shape per bucket in use).
      optimizer: 'noam' (Adam 0.9/0.98/1e-9 on lr_factor * D^-0.5 * min(s^-0.5,
        s * warmup^-1.5)), 'adam' (constant learning_rate, after a linear warm-up over
        adam_warmup_steps when set) or 'adam_cosine' (the same warm-up, then a cosine from
        learning_rate down to 0 at the run's last step: `steps`, or with fit_to_budget the
        steps that fit its minutes).
      lr_factor: the 'noam' schedule's multiplier.
      learning_rate: the 'adam' and 'adam_cosine' peak rate.
      warmup_steps: the 'noam' warm-up.
      adam_warmup_steps: the 'adam' and 'adam_cosine' warm-up (0: none).
      clip_norm: clip the gradient to this global norm (None: no clipping).
      label_smoothing: of the training loss (validation perplexity is unsmoothed).
      ema_decay: evaluate (validation, test, beam search, --translate) with an exponential
        moving average of the parameters at this decay (0 = off: the raw parameters). It is
        kept in the optimizer state, so it is checkpointed and resumes exactly.
      beam_size: the beam of the search on the test split.
      length_penalty: that search's length penalty.
      decode_margin: its outputs are at most (source bucket length + decode_margin) pieces.
      eval_sentences: evaluate on the first N sentences of each split (0 = all).
      eval_batch_size: sentences decoded (and scored) together in evaluation.
      test_split: the Multi30k test set of a Multi30k run (and of --eval).
      tokenizer_dir: where the trained SentencePiece model is cached (None: W/tokenizer); the
        file name encodes the options and a hash of the text, so runs can share a directory.
      teacher_forcing: the probability that a recurrent decoder is fed the reference token
        at a training step rather than its own previous prediction (1: always, the default).
      teacher_forcing_schedule: 'constant', or 'inverse_sigmoid' (scheduled sampling, Bengio
        et al. 2015): teacher_forcing * k / (k + exp(step / k)), k = teacher_forcing_k.
      teacher_forcing_k: the inverse sigmoid's k (in steps).
      dataset: 'multi30k' (shipped), or 'tfds:NAME[/CONFIG]', a prepared TFDS translation
        dataset in data_dir ('tfds:wmt14_translate/de-en'; train.data.tfds_source): its train
        split trains a joint SentencePiece model of vocab_size pieces and the model, its
        validation split validates, its test split is the test set ('<NAME>.test').
      src_lang: the source side of the direction. On Multi30k 'de' -> 'en' (the default) or
        'en' -> 'de'; on a TFDS dataset one of its language features (default 'de'); with
        files, the suffix of the run's source outputs in W/translations/ (none given: 'src',
        see `output_languages`).
      tgt_lang: the target side, as src_lang (default 'en'; with files, 'tgt').
      train_src: the source side of parallel text files to train on instead of Multi30k
        (UTF-8, one sentence a line, optionally gzipped: train.data.text_files); a joint
        SentencePiece model of vocab_size pieces is trained on both sides.
      train_tgt: the target side of those files, line for line.
      valid_src: the validation pair's source file (needed with training files).
      valid_tgt: the validation pair's target file.
      test_src: test sets' source files, each scored (BLEU and chrF) and written under its
        own name; without them a file run has no test evaluation and a Multi30k run uses
        test_split.
      test_tgt: the test sets' target files, as many as test_src, in the same order.
      skip_empty: leave out pairs with an empty side instead of refusing the file.
      spm_sample: with training files or a TFDS dataset, the SentencePiece model trains on
        at most this many of their training sentences: all when the data has no more, else
        both sides of a seeded uniform sample of spm_sample / 2 pairs (SentencePiece's own
        default sample size; a larger one changes the vocabulary little and costs memory and
        minutes).
    """

    model: str = "transformer"
    dataset: str = "multi30k"
    vocab_size: int = 8000
    tokens_per_batch: int = 4096
    buckets: tuple[int, ...] = (12, 16, 20, 24, 32, 48, 64, 96)
    optimizer: str = "noam"
    warmup_steps: int = 4000
    adam_warmup_steps: int = 0
    lr_factor: float = 1.0
    learning_rate: float = 1e-3
    clip_norm: float | None = None
    label_smoothing: float = 0.1
    ema_decay: float = 0.0
    beam_size: int = 4
    length_penalty: float = 0.6
    decode_margin: int = 16
    eval_batch_size: int = 128
    eval_sentences: int = 0
    test_split: str = "test_2016_flickr"
    tokenizer_dir: str | None = None
    teacher_forcing: float = 1.0
    teacher_forcing_schedule: str = "constant"
    teacher_forcing_k: float = 1000.0
    # None: the data source's default, set in __post_init__ (a run on files has none).
    src_lang: str | None = None
    tgt_lang: str | None = None
    train_src: str | None = None
    train_tgt: str | None = None
    valid_src: str | None = None
    valid_tgt: str | None = None
    test_src: tuple[str, ...] = ()
    test_tgt: tuple[str, ...] = ()
    skip_empty: bool = False
    spm_sample: int = 1_000_000
    pretrained: str | None = None

    MAY_CHANGE: ClassVar[tuple[str, ...]] = RunConfig.MAY_CHANGE + (
        "beam_size",
        "length_penalty",
        "decode_margin",
        "eval_batch_size",
        "eval_sentences",
        "test_split",
        "tokenizer_dir",
        "valid_src",
        "valid_tgt",
        "test_src",
        "test_tgt",
        # The rate may change (say, after a divergence); the optimizer state's tree does not.
        "learning_rate",
        "lr_factor",
    )

    def __post_init__(self):
        super().__post_init__()
        for name, value in self.source_class().defaults(self).items():  # its own defaults
            object.__setattr__(self, name, value)
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer: expected one of {OPTIMIZERS}, got {self.optimizer!r}")
        if self.optimizer == "adam_cosine" and not self.fit_to_budget and self.steps < 1:
            raise ValueError(
                f"steps: the cosine schedule decays over the run's steps; give steps >= 1, "
                f"got {self.steps}"
            )
        if self.optimizer == "noam" and not hasattr(self.model_config, "d_model"):
            raise ValueError(
                f"optimizer: 'noam' needs a model with d_model; {self.model} has none (use 'adam')"
            )
        if self.test_split not in SPLITS:
            raise ValueError(f"test_split: expected one of {SPLITS}, got {self.test_split!r}")
        check_positive(
            self, ("vocab_size", "tokens_per_batch", "warmup_steps", "beam_size", "eval_batch_size")
        )
        check_positive(self, ("eval_sentences", "decode_margin", "adam_warmup_steps"), minimum=0)
        check_positive(self, ("spm_sample",), minimum=2)
        self._check_data()
        self.origin.check(self.model, self.preset)
        self.source_class().check_vocabulary(self)
        check_finite(self, ("learning_rate", "lr_factor"), positive=True)
        check_finite(self, ("length_penalty",), positive=False)
        if not 0.0 <= self.label_smoothing < 1.0:
            raise ValueError(f"label_smoothing: must be in [0, 1), got {self.label_smoothing}")
        if not self.buckets or any(not isinstance(b, int) or b < 2 for b in self.buckets):
            raise ValueError(
                f"buckets: expected one or more lengths >= 2 (each a padded "
                f"length: BOS/EOS and at least one piece), got {self.buckets!r}"
            )
        if not 0.0 <= self.teacher_forcing <= 1.0:
            raise ValueError(f"teacher_forcing: must be in [0, 1], got {self.teacher_forcing}")
        if self.teacher_forcing_schedule not in TEACHER_FORCING_SCHEDULES:
            raise ValueError(
                f"teacher_forcing_schedule: expected one of "
                f"{TEACHER_FORCING_SCHEDULES}, got "
                f"{self.teacher_forcing_schedule!r}"
            )
        check_finite(self, ("teacher_forcing_k",), positive=True)
        if self.uses_teacher_forcing() and not registry.get(self.model).free_running:
            raise ValueError(
                f"teacher_forcing: {self.model} always decodes from the reference "
                "in training (only the recurrent models feed their own output)"
            )
        self.optimizer_config()  # clip_norm, ema_decay and the schedule, validated there

    def _check_data(self) -> None:
        """A known dataset or files, given in pairs; then the rules of the run's kind of
        data, which its source owns (`sources.SOURCES`)."""
        if self.dataset != "multi30k":
            if not is_tfds(self.dataset):
                raise ValueError(
                    f"dataset: expected 'multi30k' or tfds:NAME[/CONFIG] (a prepared TFDS "
                    f"dataset), got {self.dataset!r}"
                )
            tfds_name(self.dataset)  # something after the prefix
        for a, b in (("train_src", "train_tgt"), ("valid_src", "valid_tgt")):
            if (getattr(self, a) is None) != (getattr(self, b) is None):
                raise ValueError(f"{a}, {b}: give both files of the pair, or neither")
        if len(self.test_src) != len(self.test_tgt):
            raise ValueError(
                f"test_src, test_tgt: {len(self.test_src)} source and "
                f"{len(self.test_tgt)} target files; give them in pairs"
            )
        self.source_class().check_fields(self)

    def source_class(self) -> type:
        """The class of the run's data source (`sources.SOURCES`), which owns its rules."""
        from train.translate.sources import SOURCES  # sources imports this module

        return SOURCES[self.data_source()]

    @property
    def origin(self) -> ModelOrigin:
        """Where the model starts (`origin.py`): from scratch, or the --pretrained folder."""
        return model_origin(self.pretrained)

    def data_source(self) -> str:
        """'files' (the user's parallel files), 'tfds' (a prepared TFDS dataset) or
        'multi30k' (shipped)."""
        if self.train_src is not None:
            return "files"
        return "tfds" if is_tfds(self.dataset) else "multi30k"

    def output_languages(self) -> tuple[str, str]:
        """The suffixes of the source and target files of W/translations/
        (<split>.source.SRC, <split>.reference.TGT, <split>.step<N>.TGT): the run's languages,
        or 'src' and 'tgt' for files given none (nothing says what language they are)."""
        return self.src_lang or "src", self.tgt_lang or "tgt"

    def uses_files(self) -> bool:
        """Whether the run trains on the user's files."""
        return self.data_source() == "files"

    def uses_teacher_forcing(self) -> bool:
        """Whether training feeds the decoder its own predictions at some steps."""
        return self.teacher_forcing < 1.0 or self.teacher_forcing_schedule != "constant"

    def teacher_forcing_at(self, step: int) -> float:
        """The teacher-forcing ratio of training step `step` (0-based)."""
        if self.teacher_forcing_schedule == "constant":
            return self.teacher_forcing
        k = self.teacher_forcing_k
        return self.teacher_forcing * k / (k + math.exp(min(step / k, 700.0)))

    def optimizer_config(self) -> OptimizerConfig:
        if self.optimizer == "noam":
            return OptimizerConfig(
                schedule="noam",
                d_model=self.model_config.d_model,
                warmup_steps=self.warmup_steps,
                lr_factor=self.lr_factor,
                clip_norm=self.clip_norm,
                ema_decay=self.ema_decay,
                horizon_in_state=self.fit_to_budget,
            )
        return OptimizerConfig(
            schedule="constant" if self.optimizer == "adam" else "cosine",
            learning_rate=self.learning_rate,
            warmup_steps=self.adam_warmup_steps,
            decay_steps=0 if self.fit_to_budget else self.steps,
            clip_norm=self.clip_norm,
            ema_decay=self.ema_decay,
            horizon_in_state=self.fit_to_budget,
        )


# The recipe both WMT14 presets share (Vaswani et al. 2017; the data from files: README, "The
# papers' recipes"): ~25k source and ~25k target tokens a batch, a joint 32k SentencePiece
# vocabulary with one shared embedding table (the model's default), Adam 0.9/0.98/1e-9 on the
# Noam schedule with 4000 warm-up steps, label smoothing 0.1, beam 4, length penalty 0.6 and
# outputs up to the source's length + 50 (section 6.1). The paper saved a checkpoint every 10
# minutes (1,500 of base's 0.4 s steps, 600 of big's 1.0 s) and evaluated the mean of the
# last 5 (base) or 20 (big); validation comes every 5 checkpoints, on their steps, so it adds
# none between them.
WMT14: dict[str, Any] = dict(
    vocab_size=32_000,
    tokens_per_batch=25_000,
    buckets=WMT_BUCKETS,
    warmup_steps=4000,
    lr_factor=1.0,
    label_smoothing=0.1,
    beam_size=4,
    length_penalty=0.6,
    decode_margin=50,
    log_every=100,
)

# Run presets: TranslateConfig fields per preset (the model's own sizes are in registry.py).
# Why each is what it is: benchmarks/README.md ("How the presets were chosen").
PRESETS: dict[str, dict[str, Any]] = {
    # Tests and smoke runs: seconds. One bucket: one compiled shape each for training,
    # evaluation and decoding.
    "tiny": dict(
        vocab_size=1000,
        tokens_per_batch=1024,
        buckets=(64,),
        steps=20,
        warmup_steps=10,
        lr_factor=2.0,
        log_every=5,
        checkpoint_every=10,
        eval_sentences=64,
        eval_batch_size=32,
        decode_margin=8,
    ),
    # The CPU default, under ten minutes on 2 cores: each setting won its sweep at this budget
    # (why each: benchmarks/translate_cpu_batch_2026-11-29/README.md, its last section).
    "cpu": dict(
        vocab_size=4000,
        tokens_per_batch=1024,
        buckets=(12, 16, 20, 24, 32, 48, 64),
        steps=2500,
        minutes=8.0,
        fit_to_budget=True,
        optimizer="adam_cosine",
        learning_rate=1.5e-3,
        adam_warmup_steps=200,
        clip_norm=1.0,
        ema_decay=0.99,
        log_every=100,
        checkpoint_every=1000,
        length_penalty=1.3,
        eval_batch_size=256,
    ),
    # One GPU, one ten-minute command: 7 minutes of training in bf16, then evaluation. Few
    # buckets (each shape compiles in tens of seconds), 8k-token batches, Noam (whose decay
    # has no end to fit: it trains until its minutes are spent, as on the CPU).
    "gpu": dict(
        vocab_size=8000,
        tokens_per_batch=8192,
        buckets=(16, 32, 64),
        steps=100_000,
        minutes=7.0,
        warmup_steps=2000,
        lr_factor=1.0,
        clip_norm=1.0,
        log_every=200,
        checkpoint_every=5000,
    ),
    # The paper's base recipe (~25k target tokens a batch, Noam factor 1, warm-up 4000).
    "base": dict(
        vocab_size=8000,
        tokens_per_batch=25_000,
        steps=100_000,
        warmup_steps=4000,
        lr_factor=1.0,
        log_every=100,
        eval_every=1000,
        checkpoint_every=1000,
    ),
    # Fine-tuning a pretrained model (--pretrained; the default preset with it): the usual
    # recipe for adapting a trained model, not the from-scratch ones: a small constant rate
    # (5e-5, transformers' Trainer default) after a short linear warm-up, so Adam's first,
    # poorly estimated steps do not undo the pretrained weights; clipping; the checkpoint's
    # own dropout; label smoothing 0.1 as OPUS-MT was trained with. The validation every 500
    # steps is teacher-forced (it ranks the checkpoints); BLEU and chrF come before the first
    # step and at the end, decoding being dearer than 500 steps on a CPU.
    "finetune": dict(
        optimizer="adam",
        learning_rate=5e-5,
        adam_warmup_steps=200,
        clip_norm=1.0,
        label_smoothing=0.1,
        tokens_per_batch=2048,
        steps=5000,
        log_every=50,
        eval_every=500,
        checkpoint_every=500,
    ),
    # Vaswani et al. (2017), WMT14 English-German: the recipe WMT14 above, at two sizes.
    "wmt14_base": dict(
        WMT14,
        steps=100_000,
        checkpoint_every=1500,
        eval_every=7500,
        keep_checkpoints=5,
        average_checkpoints=5,
    ),
    "wmt14_big": dict(
        WMT14,
        steps=300_000,
        checkpoint_every=600,
        eval_every=3000,
        keep_checkpoints=20,
        average_checkpoints=20,
    ),
}


def make_config(
    model: str = "transformer",
    preset: str = "cpu",
    *,
    model_overrides: Mapping[str, Any] = (),
    **run_overrides,
) -> TranslateConfig:
    """The config of `preset` for `model`, with field overrides (validated)."""
    if preset not in PRESETS:  # the one list of run presets; the registry sizes each model
        raise ValueError(f"preset: expected one of {sorted(PRESETS)}, got {preset!r}")
    spec = registry.get(model)
    fields = preset_run_fields({**spec.run_defaults, **PRESETS[preset]}, run_overrides)
    bad = {"model", "preset", "model_config"} & set(run_overrides)
    if bad:
        raise ValueError(
            f"{sorted(bad)}: pass model/preset as arguments and model fields as model_overrides"
        )
    origin = model_origin(fields.get("pretrained"))
    origin.check(model, preset)
    # The preset's sizes, or a Marian folder's (which then sets vocab_size in `fields`).
    model_config = origin.model_config(model, preset, fields, model_overrides)
    return TranslateConfig(model=model, preset=preset, model_config=model_config, **fields)
