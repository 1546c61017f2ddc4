"""Where a language-model run's tokens come from: one `LMSource` for each of Penn Treebank
(shipped with the package, word or char level), the user's text files and a prepared TFDS
text dataset. `lm_source(config)` picks the run's.

A source knows its own data and nothing of training: how to check that a resumed run reads
the same data (`check`), its vocabulary (`vocab`), and each split as one token stream
(`stream`; a text or TFDS run's encoded once into the token cache, memory-mapped after).

    source = lm_source(config)
    source.check(workdir, log)
    train = source.stream("train", cache_dir=..., log=log)
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

import numpy as np

from train.core.config import check_positive
from train.data.text_files import DataError, check_fingerprint, files_sha256
from train.data.tfds_source import is_tfds, open_dataset
from train.data.token_cache import ids_dtype, stream_cache
from train.data.tokenizers import CharVocab, WordVocab
from train.lm.config import (
    DATASETS,
    PAPER_LEVELS,
    VOCAB_SIZES,
    LMConfig,
    check_level,
    counts_its_vocabulary,
    data_kind,
    make_config,
    run_fields,
)
from train.lm.text import (
    byte_chunks,
    byte_length,
    encoded_chunks,
    encoded_lines,
    tfds_split,
    training_vocab,
)

Log = Callable[[str], None]
SPLITS = ("train", "valid", "test")


class LMSource(Protocol):
    """The data of one kind of language-model run (PTB, text, TFDS)."""

    # Whether its streams are encoded into the token cache (a corpus of any size), or read
    # into memory (the shipped PTB).
    cached: bool

    def check(self, workdir: str, log: Log) -> None:
        """That a resumed run in `workdir` reads the data it started on (W/data.json), before
        anything is encoded; notes about the data, in the log."""

    def vocab(self):
        """The run's vocabulary (`encode_lines`, `vocab_size`)."""

    def stream(self, split: str, cache_dir: str | None, log: Log | None) -> np.ndarray | None:
        """The ids of split `split` (one of SPLITS) in order, `<eos>` after every line (bytes
        as they are at the byte level): from the token cache under `cache_dir` when given,
        else int32 in memory; None when the run has no such split."""


def source_kind(dataset: str) -> str:
    """The kind of source of a dataset: 'ptb' (shipped), 'text' or 'tfds' (SOURCES' keys)."""
    if is_tfds(dataset):
        return "tfds"
    return "text" if dataset == "text" else "ptb"


def lm_source(config: LMConfig) -> LMSource:
    """The run's source: its TFDS dataset, its text files, or PTB."""
    return SOURCES[source_kind(config.dataset)](config)


def config_for_data(
    dataset: str = "ptb",
    preset: str = "cpu",
    *,
    model_overrides: Mapping[str, Any] = (),
    **run_overrides,
) -> LMConfig:
    """`make_config` for the data the fields name, its vocabulary counted by the data's
    source first where the data sets it (text and TFDS data at the word or char level: one
    streaming pass, kept for the process, so the data's preparation does not count again)."""
    dataset = data_kind(dataset, run_overrides)
    fields = run_fields(preset, run_overrides)
    vocab_size = None
    if counts_its_vocabulary(dataset, fields):
        vocab_size = SOURCES[source_kind(dataset)].count_vocab(dataset, fields).vocab_size
    return make_config(
        dataset, preset, vocab_size=vocab_size, model_overrides=model_overrides, **run_overrides
    )


def _no_text_options(config: LMConfig) -> None:
    if config.train_text or config.valid_text or config.test_text or config.split_bytes:
        raise ValueError(
            f"train_text: the text options need dataset 'text', not {config.dataset!r}"
        )


def _check_vocabulary_options(config: LMConfig) -> None:
    """The level a counted vocabulary reads its text at."""
    check_level(config.level)


def _check_counting(config: LMConfig) -> None:
    check_positive(config, ("min_count",))
    check_positive(config, ("max_vocab",), minimum=0)
    if config.max_vocab and config.max_vocab < 3:
        raise ValueError(f"max_vocab: <eos>, <unk> and at least one symbol, got {config.max_vocab}")


def _check_recipe_level(config: LMConfig) -> None:
    """A paper's recipe runs on the user's text of its level."""
    levels = PAPER_LEVELS.get(config.preset)
    if levels is not None and config.level not in levels:
        raise ValueError(
            f"level: the {config.preset} recipe is for {' or '.join(levels)}-level text, "
            f"got {config.level!r}"
        )


@dataclasses.dataclass(frozen=True)
class PtbSource:
    """Penn Treebank (Mikolov's preprocessing) at the word or char level, shipped with the
    package: closed vocabularies, 0.9M / 5M training tokens, in memory."""

    config: LMConfig
    cached = False

    @staticmethod
    def check_fields(config: LMConfig) -> None:
        """No text options; no paper's recipe (sized for 103M words or 100M bytes; PTB has
        1M words, below every one of WikiText-103's cut-offs: a forgotten --train_text, not
        the recipe; the 'base' and 'gpu' presets are PTB's); PTB's own vocabulary size."""
        _no_text_options(config)
        levels = PAPER_LEVELS.get(config.preset)
        if levels is not None:
            raise ValueError(
                f"preset: {config.preset} is a recipe of Dai et al. (2019) for "
                f"{' or '.join(levels)}-level text; give its text with --train_text (and "
                "--valid_text, --test_text, or --split_bytes at the byte level) or --dataset "
                "tfds:NAME: see the "
                f"README's 'The papers' recipes'. For {config.dataset} use --preset base or gpu"
            )
        if config.model_config.vocab_size != VOCAB_SIZES[config.dataset]:
            raise ValueError(
                f"model_config.vocab_size: {config.dataset} has "
                f"{VOCAB_SIZES[config.dataset]} symbols, got "
                f"{config.model_config.vocab_size}"
            )

    def check(self, workdir: str, log: Log) -> None:
        """Nothing to fingerprint: the corpus is the package's own."""

    def vocab(self):
        level = DATASETS[self.config.dataset]
        return (WordVocab if level == "word" else CharVocab).from_ptb(data_dir=self.config.data_dir)

    def stream(self, split: str, cache_dir: str | None, log: Log | None) -> np.ndarray:
        from train.data.datasets import load_ptb  # lazy: importing TFDS is not free

        c = self.config
        return self.vocab().encode_lines(load_ptb(DATASETS[c.dataset], split, data_dir=c.data_dir))


class _Counted:
    """A source whose vocabulary is counted on its training split (`training_vocab`), and
    must give the run's model its vocabulary size."""

    config: LMConfig

    @staticmethod
    def count_vocab(dataset: str, fields: Mapping[str, Any]):
        """The vocabulary of the training data LMConfig `fields` name (a bad file or dataset
        is an error naming it); counted once per process."""
        if dataset == "text" and fields.get("train_text") is None:
            raise ValueError("train_text: dataset 'text' needs the training file")
        return training_vocab(
            dataset,
            fields.get("level", LMConfig.level),
            train_text=None if is_tfds(dataset) else fields.get("train_text"),
            text_feature=fields.get("text_feature", LMConfig.text_feature),
            min_count=fields.get("min_count", LMConfig.min_count),
            max_vocab=fields.get("max_vocab", LMConfig.max_vocab),
            data_dir=fields.get("data_dir"),
        )

    def vocab(self):
        c = self.config
        vocab = self.count_vocab(c.dataset, vars(c))
        if vocab.vocab_size != c.model_config.vocab_size:
            raise DataError(
                f"{self._named()} gives {vocab.vocab_size:,} symbols, the run's model "
                f"{c.model_config.vocab_size:,}: not the {self._what} this run was made from"
            )
        return vocab

    _what = "data"

    def _named(self) -> str:
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class TextSource(_Counted):
    """The user's text: train_text, valid_text and test_text, or one file cut into three by
    byte counts (split_bytes), at the word, char or byte level (`train.lm.text`)."""

    config: LMConfig
    cached = True
    _what = "text"

    @staticmethod
    def check_fields(config: LMConfig) -> None:
        """A level; the training file, and a validation file or split_bytes (three positive
        byte counts of one file, at the byte level); the vocabulary's counting; a recipe's
        level."""
        _check_vocabulary_options(config)
        if config.train_text is None:
            raise ValueError("train_text: dataset 'text' needs the training file")
        if config.split_bytes:
            if config.level != "byte" or len(config.split_bytes) != 3:
                raise ValueError(
                    f"split_bytes: three byte counts (train, valid, test) of one "
                    f"file at the byte level, got {config.split_bytes} at level "
                    f"{config.level!r}"
                )
            if config.valid_text or config.test_text or min(config.split_bytes) < 1:
                raise ValueError(
                    "split_bytes: positive counts, and no valid_text / test_text "
                    "(the parts come from train_text)"
                )
        elif config.valid_text is None:
            raise ValueError(
                "valid_text: training on text needs a validation file (or "
                "split_bytes at the byte level)"
            )
        _check_counting(config)
        _check_recipe_level(config)

    def _named(self) -> str:
        return f"train_text: {self.config.train_text}"

    def check(self, workdir: str, log: Log) -> None:
        check_fingerprint(workdir, {"train_text": self.config.train_text})

    def stream(self, split: str, cache_dir: str | None, log: Log | None) -> np.ndarray | None:
        """A text run's split: its ids as `chunks` yields them, cached when `cache_dir` is
        set."""
        config = self.config
        if config.split_bytes:
            path = config.train_text
            a, b, c = config.split_bytes
            total = byte_length(path)
            if a + b >= total:
                raise DataError(
                    f"split_bytes {tuple(config.split_bytes)}: {path} has only {total:,} "
                    "bytes, too few for a train and a validation part and a test part"
                )
            start, stop = {"train": (0, a), "valid": (a, a + b), "test": (a + b, a + b + c)}[split]
        else:
            path = {
                "train": config.train_text,
                "valid": config.valid_text,
                "test": config.test_text,
            }[split]
            if path is None:
                return None
            start, stop = 0, None
        vocab = self.vocab()
        if config.level == "byte":
            dtype = np.uint8

            def chunks():
                empty = True
                for chunk in byte_chunks(path, start, stop):
                    empty = False
                    yield np.frombuffer(chunk, np.uint8)
                if empty and not config.split_bytes:
                    raise DataError(f"{path}: the file is empty")
        else:
            dtype = ids_dtype(vocab.vocab_size)

            def chunks():
                yield from encoded_lines(vocab, path)

        return _stream(
            chunks,
            dtype=dtype,
            cache_dir=cache_dir,
            log=log,
            what=f"{split} text",
            text_sha256=_sha256(path),
            byte_range=[start, stop],
            train_sha256=_sha256(config.train_text),  # the vocabulary's source
            level=config.level,
            min_count=config.min_count,
            max_vocab=config.max_vocab,
        )


@dataclasses.dataclass(frozen=True)
class TfdsSource(_Counted):
    """A prepared TFDS text dataset (`--dataset tfds:NAME`), each example's text feature a
    line; its splits read and encoded in chunks."""

    config: LMConfig
    cached = True

    @staticmethod
    def check_fields(config: LMConfig) -> None:
        """No text files; a level and the text feature; the vocabulary's counting; a recipe's
        level."""
        _no_text_options(config)
        _check_vocabulary_options(config)
        if not config.text_feature:
            raise ValueError("text_feature: the name of a text feature of the dataset")
        _check_counting(config)
        _check_recipe_level(config)

    def _named(self) -> str:
        return f"dataset: {self.config.dataset}"

    def check(self, workdir: str, log: Log) -> None:
        """Its version and splits: the prepared copy's dataset_info.json."""
        data = open_dataset(self.config.dataset, self.config.data_dir)
        check_fingerprint(workdir, {"dataset": data.info_path})
        if data.splits().note:
            log(f"data: {self.config.dataset}: {data.splits().note}")

    def stream(self, split: str, cache_dir: str | None, log: Log | None) -> np.ndarray | None:
        """Keyed by the prepared copy's dataset_info.json (which fixes every split, the train
        split the vocabulary is counted on included)."""
        config = self.config
        feature = config.text_feature
        data, name = tfds_split(config.dataset, split, feature=feature, data_dir=config.data_dir)
        if name is None:
            return None
        vocab = self.vocab()

        def chunks():
            lines = (line for (line,) in data.iter_read(name, (feature,)))
            yield from encoded_chunks(vocab, lines)

        return _stream(
            chunks,
            dtype=np.uint8 if config.level == "byte" else ids_dtype(vocab.vocab_size),
            cache_dir=cache_dir,
            log=log,
            what=f"{config.dataset} {name}",
            dataset_sha256=_sha256(data.info_path),
            dataset=data.builder.info.full_name,  # name/config/version
            split=name,
            feature=feature,
            level=config.level,
            min_count=config.min_count,
            max_vocab=config.max_vocab,
        )


def _stream(
    chunks: Callable[[], Iterable[np.ndarray]],
    *,
    dtype: np.dtype,
    cache_dir: str | None,
    log,
    what: str,
    **key_parts: Any,
) -> np.ndarray:
    """The ids `chunks()` yields, concatenated: from the token cache of `key_parts` in
    `cache_dir` (memory-mapped), or with no cache_dir in memory (int32)."""
    if cache_dir is None:
        parts = list(chunks())
        return np.concatenate(parts).astype(np.int32) if parts else np.zeros(0, np.int32)
    return stream_cache(cache_dir, chunks, dtype=dtype, log=log, what=what, **key_parts)


def _sha256(path: str) -> str:
    """`files_sha256(path)`, computed once per process for each file version (size, time):
    the three splits' caches all name the training file."""
    info = os.stat(path)
    return _sha256_of(path, (info.st_size, info.st_mtime_ns))


@functools.lru_cache(maxsize=8)
def _sha256_of(path: str, stamp: tuple[int, int]) -> str:
    return files_sha256(path)


# The one table from a kind of data to the source that owns its rules (`source_kind`).
SOURCES: dict[str, type] = {"ptb": PtbSource, "text": TextSource, "tfds": TfdsSource}
