"""Where a translation run's sentences come from: one `TranslationSource` for each of Multi30k
(shipped with the package), a prepared TFDS translation dataset, and the user's parallel text
files. `translation_source(config)` picks the run's.

A source knows its own data and nothing of training: how to check that a resumed run reads
the same data (`check`), the joint SentencePiece model trained on it (`tokenizer`), its
training pairs encoded (`training_pairs`: the shipped corpus in memory, the others streamed
into the token cache), and its evaluation splits (`validation_split`, `test_splits`).

    source = translation_source(config)
    source.check(workdir, log)
    tokenizer = source.tokenizer(directory)
    pairs = source.training_pairs(tokenizer, cache_dir, log)
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

from train.data.text_files import (
    DataError,
    check_fingerprint,
    files_sha256,
    read_parallel,
    set_name,
)
from train.data.tfds_source import TfdsDataset, open_dataset
from train.data.token_cache import PairSource, cache_key, file_pairs, pairs_cache, sample_pairs
from train.data.tokenizers import (
    SentencePieceTokenizer,
    VocabularySizeError,
    model_file_name,
    multi30k_tokenizer,
    write_model,
)
from train.translate.config import MIN_VOCAB_SIZE, PAPER_PRESETS, TranslateConfig

Log = Callable[[str], None]
EncodedPair = tuple[list[int], list[int]]  # (source ids ending with eos, target ids)


@dataclasses.dataclass
class Split:
    """One evaluation split: raw sentences and their encoded pairs (src ids end with eos)."""

    name: str
    sources: list[str]
    references: list[str]
    pairs: list[EncodedPair]


class TranslationSource(Protocol):
    """The data of one kind of translation run (Multi30k, TFDS, files)."""

    # Names the joint SentencePiece model trained on this source ('<name>_spm...'), so a
    # trained run finds its tokenizer without reading the data.
    name: str

    def check(self, workdir: str, log: Log) -> None:
        """That a resumed run in `workdir` reads the data it started on (W/data.json), before
        anything is trained or encoded; notes about the data, in the log."""

    def tokenizer(self, directory: str) -> SentencePieceTokenizer:
        """The joint SentencePiece model of this source, found in or trained into
        `directory`."""

    def training_pairs(self, tokenizer, cache_dir: str, log: Log) -> Sequence[EncodedPair]:
        """The training pairs encoded by `tokenizer`; a streamed source's are memory-mapped
        from the token cache under `cache_dir`."""

    def validation_split(self, tokenizer, log: Log | None = None) -> Split:
        """The split that validation figures (and checkpoint ranking) are computed on."""

    def test_splits(self, tokenizer, log: Log | None = None) -> list[Split]:
        """The test sets, each scored and written under its own name; may be empty."""


def translation_source(config: TranslateConfig) -> TranslationSource:
    """The run's source: its files, its TFDS dataset, or Multi30k."""
    return config.source_class()(config)


class _Rules:
    """What a kind of data asks of a run's config: each source class's own defaults and
    checks, which TranslateConfig applies through SOURCES (a ValueError names the field)."""

    @staticmethod
    def defaults(config: TranslateConfig) -> dict[str, Any]:
        """Fields this kind of data fills when the run leaves them unset."""
        return {}

    @staticmethod
    def check_fields(config: TranslateConfig) -> None:
        """The fields' rules for this kind of data."""

    @staticmethod
    def check_vocabulary(config: TranslateConfig) -> None:
        """That the run's tokenizer can be made from this data (after the model origin's
        check: a Marian folder brings its own)."""


def _de_en(config: TranslateConfig) -> dict[str, Any]:
    # Multi30k, and a TFDS dataset, read de -> en unless told otherwise.
    return {"src_lang": config.src_lang or "de", "tgt_lang": config.tgt_lang or "en"}


def _no_evaluation_files(config: TranslateConfig) -> None:
    if config.valid_src is not None or config.test_src:
        raise ValueError(
            "valid_src, test_src: evaluation files need training files "
            "(train_src, train_tgt) of the same languages"
        )


# ----------------------------------------------------------------------------- encoding
def encode_source(tokenizer, sentences: Sequence[str]) -> list[list[int]]:
    # The source ends with eos, so the encoder sees where the sentence stops (as fairseq does).
    return [ids + [tokenizer.eos_id] for ids in tokenizer.encode_batch(list(sentences))]


def encode_pairs(tokenizer, pairs: Sequence[tuple[str, str]]) -> list[EncodedPair]:
    return list(
        zip(
            encode_source(tokenizer, [p[0] for p in pairs]),
            tokenizer.encode_targets([p[1] for p in pairs]),
        )
    )


def make_split(
    config: TranslateConfig, tokenizer, name: str, pairs: Sequence[tuple[str, str]]
) -> Split:
    """An evaluation split of (source, target) sentences under `name`: its first
    eval_sentences pairs when set."""
    pairs = list(pairs)
    if config.eval_sentences:
        pairs = pairs[: config.eval_sentences]
    return Split(name, [p[0] for p in pairs], [p[1] for p in pairs], encode_pairs(tokenizer, pairs))


def load_split(
    config: TranslateConfig,
    tokenizer,
    name: str,
    files: tuple[str, str] | None = None,
    log: Log | None = None,
) -> Split:
    """An evaluation split: Multi30k's split `name`, or the parallel `files` (source, target)
    under that name; its first eval_sentences pairs when set."""
    if files is None:
        return make_split(config, tokenizer, name, multi30k_pairs(config, name))
    pairs, skipped = read_parallel(*files, skip_empty=config.skip_empty)
    if skipped and log:
        log(f"data: {name}: {skipped:,} pair(s) with an empty side left out (skip_empty)")
    return make_split(config, tokenizer, name, pairs)


def sampled_tokenizer(
    config: TranslateConfig, directory: str, source: PairSource, *, name: str
) -> SentencePieceTokenizer:
    """The joint model of `source`'s pairs, trained on at most spm_sample of their sentences
    (`token_cache.sample_pairs`, one pass over the stream) the first time, and named by a hash
    of the source's fingerprint and the options, so finding it reads no sentence."""
    key = cache_key(
        **source.fingerprint, vocab_size=config.vocab_size, spm_sample=config.spm_sample
    )
    path = os.path.join(directory, model_file_name(f"{name}_spm", config.vocab_size, key[:12]))
    if not os.path.exists(path):
        sentences, _ = sample_pairs(source.read([0]), sample=config.spm_sample)
        try:
            write_model(path, sentences, vocab_size=config.vocab_size)
        except VocabularySizeError as e:  # the sizes this text can give, named
            raise DataError(f"--vocab_size {config.vocab_size}: {e.reason}") from e
        except ValueError as e:  # SentencePiece failed another way on this text
            raise DataError(f"vocab_size: {e}") from e
    return SentencePieceTokenizer(path)


def unique_names(names: Sequence[str]) -> list[str]:
    """Test set names made unique (a second 'test' becomes 'test.2')."""
    out, seen = [], {}
    for name in names:
        seen[name] = seen.get(name, 0) + 1
        out.append(name if seen[name] == 1 else f"{name}.{seen[name]}")
    return out


# ----------------------------------------------------------------------------- Multi30k
def multi30k_pairs(config: TranslateConfig, split: str) -> list[tuple[str, str]]:
    """A Multi30k split as (source, target) in the configured direction (de-en or en-de)."""
    from train.data.datasets import load_multi30k  # lazy: importing TFDS is not free

    pairs = load_multi30k(split, data_dir=config.data_dir)
    return pairs if config.src_lang == "de" else [(en, de) for de, en in pairs]


@dataclasses.dataclass(frozen=True)
class _ByModel:
    """A tokenizer as a cache key: equal to another of its type with the same model bytes."""

    tokenizer: SentencePieceTokenizer = dataclasses.field(compare=False)
    kind: type
    sha256: str


@functools.lru_cache(maxsize=2)
def _encoded_corpus(
    by_model: _ByModel, pairs: tuple[tuple[str, str], ...]
) -> tuple[EncodedPair, ...]:
    # Kept for the process: a notebook or a test session trains run after run on the same
    # corpus and vocabulary, and encoding Multi30k's 29k pairs takes a second or two each time.
    # Keyed by the sentences themselves, so a changed corpus is encoded again.
    return tuple(encode_pairs(by_model.tokenizer, pairs))


@dataclasses.dataclass(frozen=True)
class Multi30kSource(_Rules):
    """Multi30k, shipped with the package (or a prepared TFDS copy under data_dir): held in
    memory, 29k training pairs."""

    config: TranslateConfig
    name = "multi30k"
    defaults = staticmethod(_de_en)

    @staticmethod
    def check_fields(config: TranslateConfig) -> None:
        if config.preset in PAPER_PRESETS:
            # Without files the run would be on Multi30k: a forgotten flag, not the recipe
            # (a 32k vocabulary and 25k-token batches are sized for WMT14's 4.5M pairs, not
            # Multi30k's 29k; the 'base' preset is the paper's base model for Multi30k).
            raise ValueError(
                f"preset: {config.preset} is the WMT14 recipe of Vaswani et al. (2017); give "
                "its data with --train_src, --train_tgt, --valid_src, --valid_tgt (and "
                "--test_src, --test_tgt), or --dataset tfds:wmt14_translate/de-en: see the "
                "README's 'The papers' recipes'. For "
                "Multi30k use --preset base (the paper's base model, an 8k vocabulary)"
            )
        _no_evaluation_files(config)
        if {config.src_lang, config.tgt_lang} != {"de", "en"}:
            raise ValueError(
                f"src_lang, tgt_lang: Multi30k is de-en, in either direction; "
                f"got {config.src_lang!r} -> {config.tgt_lang!r} (train on a TFDS dataset or "
                "on files for other languages)"
            )

    @staticmethod
    def check_vocabulary(config: TranslateConfig) -> None:
        if config.origin.trains_tokenizer and config.vocab_size < MIN_VOCAB_SIZE:
            raise ValueError(
                f"vocab_size: the Multi30k tokenizer needs at least "
                f"{MIN_VOCAB_SIZE} pieces (4 special, 256 byte pieces and the 102 "
                f"characters of its training text), got {config.vocab_size}"
            )

    def check(self, workdir: str, log: Log) -> None:
        """Nothing to fingerprint: the corpus is the package's own."""

    def tokenizer(self, directory: str) -> SentencePieceTokenizer:
        c = self.config
        return multi30k_tokenizer(directory, vocab_size=c.vocab_size, data_dir=c.data_dir)

    def training_pairs(self, tokenizer, cache_dir: str, log: Log) -> list[EncodedPair]:
        """The train split encoded (a new list; its id lists are shared, read-only)."""
        pairs = tuple(multi30k_pairs(self.config, "train"))
        return list(
            _encoded_corpus(_ByModel(tokenizer, type(tokenizer), tokenizer.sha256()), pairs)
        )

    def validation_split(self, tokenizer, log: Log | None = None) -> Split:
        return load_split(self.config, tokenizer, "validation")

    def test_splits(self, tokenizer, log: Log | None = None) -> list[Split]:
        return [load_split(self.config, tokenizer, self.config.test_split)]


# ----------------------------------------------------------------------------- streamed
class _Streamed(_Rules):
    """A source whose training pairs are streamed into the token cache, never held as
    strings: its `stream()` (a PairSource with a fingerprint) feeds the tokenizer's sample
    and the cache. `skipped_note` follows the count of pairs left out in the log."""

    config: TranslateConfig
    name: str
    skipped_note: str

    def stream(self) -> PairSource:
        raise NotImplementedError

    def tokenizer(self, directory: str) -> SentencePieceTokenizer:
        return sampled_tokenizer(self.config, directory, self.stream(), name=self.name)

    def training_pairs(self, tokenizer, cache_dir: str, log: Log) -> Sequence[EncodedPair]:
        pairs, meta = pairs_cache(self.stream(), tokenizer, cache_dir, log=log)
        if meta["skipped"]:
            log(
                f"data: {meta['skipped']:,} training pair(s) with an empty side left "
                f"out{self.skipped_note}"
            )
        return pairs


class FilesSource(_Streamed):
    """The user's parallel text files: train_src/train_tgt, valid_src/valid_tgt and any
    number of test_src/test_tgt pairs, one sentence a line."""

    name = "files"
    skipped_note = " (skip_empty)"

    def __init__(self, config: TranslateConfig):
        self.config = config

    @staticmethod
    def check_fields(config: TranslateConfig) -> None:
        if config.dataset != "multi30k":
            raise ValueError(f"dataset, train_src: train on {config.dataset} or on files, not both")
        if config.valid_src is None:
            raise ValueError(
                "valid_src, valid_tgt: training on files needs a validation pair "
                "of files (it ranks the checkpoints)"
            )

    @functools.cached_property
    def train_sha256(self) -> str:
        """The training files' sha256 (`files_sha256`), read once for this source: `check`
        holds the run to it and `stream` keys the token cache with it."""
        return files_sha256(self.config.train_src, self.config.train_tgt)

    def check(self, workdir: str, log: Log) -> None:
        c = self.config
        check_fingerprint(
            workdir, {"train_src": c.train_src, "train_tgt": c.train_tgt}, digest=self.train_sha256
        )

    def stream(self) -> PairSource:
        c = self.config
        return file_pairs(
            c.train_src, c.train_tgt, train_sha256=self.train_sha256, skip_empty=c.skip_empty
        )

    def validation_split(self, tokenizer, log: Log | None = None) -> Split:
        c = self.config
        return load_split(c, tokenizer, "validation", (c.valid_src, c.valid_tgt), log)

    def test_splits(self, tokenizer, log: Log | None = None) -> list[Split]:
        c = self.config
        names = unique_names([set_name(src) for src in c.test_src])
        return [
            load_split(c, tokenizer, name, files, log)
            for name, files in zip(names, zip(c.test_src, c.test_tgt))
        ]


class TfdsSource(_Streamed):
    """A prepared TFDS translation dataset (`--dataset tfds:NAME`): its train split streamed,
    its validation split and test set read in memory (only their first eval_sentences pairs
    when that is set)."""

    name = "tfds"
    skipped_note = ""
    defaults = staticmethod(_de_en)

    def __init__(self, config: TranslateConfig):
        self.config = config

    @staticmethod
    def check_fields(config: TranslateConfig) -> None:
        _no_evaluation_files(config)

    @functools.cached_property
    def dataset(self) -> TfdsDataset:
        """The run's prepared TFDS dataset, checked to hold both languages."""
        c = self.config
        data = open_dataset(c.dataset, c.data_dir)
        data.check_text_features(
            (c.src_lang, c.tgt_lang), field="src_lang, tgt_lang", what="language"
        )
        return data

    def check(self, workdir: str, log: Log) -> None:
        data = self.dataset
        check_fingerprint(workdir, {"dataset": data.info_path})
        if data.splits().note:
            log(f"data: {self.config.dataset}: {data.splits().note}")

    def stream(self) -> PairSource:
        """The training split as a stream of pairs; those with an empty side are left out and
        counted (a published corpus has a few, and there is no file to fix), and a split with
        none left is a DataError at the end of the stream.

        Its fingerprint: the sha256 of the prepared copy's dataset_info.json (its version,
        splits and sizes: what `check_fingerprint` keeps), the dataset's full name, the split
        and the direction."""
        c, data = self.config, self.dataset
        split, languages = data.splits().train, (c.src_lang, c.tgt_lang)

        def read(skipped: list[int]) -> Iterator[tuple[str, str]]:
            skipped[:] = [0]
            kept = 0
            for s, t in data.iter_read(split, languages):
                if s.strip() and t.strip():
                    kept += 1
                    yield s, t
                else:
                    skipped[0] += 1
            if not kept:
                raise DataError(f"{c.dataset}: no training pair with text on both sides")

        return PairSource(
            read=read,
            fingerprint={
                "dataset_sha256": files_sha256(data.info_path),
                "dataset": data.builder.info.full_name,  # name/config/version
                "split": split,
                "languages": list(languages),
            },
            origin={"dataset": c.dataset, "split": split},
        )

    def _head(self, split: str) -> list[tuple[str, str]]:
        c = self.config
        pairs = self.dataset.iter_read(split, (c.src_lang, c.tgt_lang))
        return list(itertools.islice(pairs, c.eval_sentences or None))

    def validation_split(self, tokenizer, log: Log | None = None) -> Split:
        splits = self.dataset.splits()
        return make_split(self.config, tokenizer, "validation", self._head(splits.validation))

    def test_splits(self, tokenizer, log: Log | None = None) -> list[Split]:
        """Its test set, named '<NAME>.<split>'; none when the dataset has no test split."""
        data = self.dataset
        test = data.splits().test
        if test is None:
            return []
        return [make_split(self.config, tokenizer, f"{data.name}.{test}", self._head(test))]


# The one table from a kind of data (`TranslateConfig.data_source`) to the source that owns
# its rules and reads it.
SOURCES: dict[str, type] = {"multi30k": Multi30kSource, "tfds": TfdsSource, "files": FilesSource}
