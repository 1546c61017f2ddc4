"""Language-model data from the user's text files, at three levels.

  word: whitespace-separated tokens, `<eos>` after every line (as WikiText-103 and PTB are
        distributed). The vocabulary is built from the training counts: `<eos>`, `<unk>`, then
        the tokens seen at least `min_count` times, most frequent first (ties in code point
        order), at most `max_vocab` symbols in all (0: no limit); others read as `<unk>`.
  char: every character of a line (spaces included), `<eos>` after every line; the same
        vocabulary rules.
  byte: the raw bytes of the file (newlines included, no `<eos>`): 256 ids, reported in bits
        per character as enwik8 and text8 are. One file may be split into train, valid and
        test by byte counts (`split_bytes`, e.g. 90M, 5M, 5M for enwik8).

Files are UTF-8 (`train.data.text_files.read_lines`: a bad byte is an error naming file and
line), optionally gzipped; at the byte level any bytes are data.

A prepared TFDS dataset (`tfds_lines`) is read the same way, as a stream, each example's text
feature a line: word and char levels as above, the byte level the UTF-8 bytes of each line and
a newline.
"""

from __future__ import annotations

import functools
import gzip
import itertools
import os
from collections.abc import Iterable, Iterator, Sequence

import numpy as np

from train.data.text_files import DataError, read_lines
from train.data.tfds_source import TfdsDataset, is_tfds, open_dataset
from train.data.vocab import EOS, UNK, ClosedVocab, line_symbols  # noqa: F401 (UNK: public here)

LEVELS = ("word", "char", "byte")
BYTE_VOCAB = 256


_SPLIT = {"word": "words", "char": "chars"}  # how a line is cut, at each closed level


def tokens(line: str, level: str) -> list[str]:
    """The symbols of one line at a word or char level."""
    return line_symbols(line, _SPLIT[level])


class TextVocab(ClosedVocab):
    """A text run's closed vocabulary at the word or char level (`train.data.vocab.ClosedVocab`):
    `<eos>` is 0, `<unk>` 1 (what unknown symbols read as), then the symbols in decreasing
    training count (ties in code point order)."""

    def __init__(self, symbols: Sequence[str], level: str):
        super().__init__(symbols, split=_SPLIT[level], unknown=True)
        self.level = level

    @classmethod
    def build(
        cls, lines: Iterable[str], level: str, *, min_count: int = 1, max_vocab: int = 0
    ) -> TextVocab:
        symbols = cls.counted_symbols(
            lines, split=_SPLIT[level], unknown=True, min_count=min_count, max_vocab=max_vocab
        )
        return cls(symbols, level)

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids`: words joined by spaces, characters joined; `<eos>` a line break."""
        symbols = [self.symbols[i] for i in np.asarray(ids).reshape(-1).tolist()]
        sep = " " if self.level == "word" else ""
        return sep.join("\n" if s == EOS else s for s in symbols).replace(" \n ", "\n")


class ByteVocab:
    """The byte level: id = byte value."""

    level = "byte"
    vocab_size = BYTE_VOCAB
    eos_id = ord("\n")

    def encode_bytes(self, data: bytes) -> np.ndarray:
        return np.frombuffer(data, np.uint8).astype(np.int32)

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(np.asarray(ids, np.uint8).reshape(-1).tolist()).decode("utf-8", "replace")


def iter_text(path: str) -> Iterator[str]:
    """The lines of a text file as a stream (`read_lines`); a file with no text on any line
    is a DataError, raised when the stream ends."""
    blank = True
    for line in read_lines(path):
        blank = blank and not line.strip()
        yield line
    if blank:
        raise DataError(f"{path}: the file is empty")


def tfds_split(
    dataset: str, split: str, *, feature: str, data_dir: str | os.PathLike | None
) -> tuple[TfdsDataset, str | None]:
    """A prepared TFDS dataset, checked to have the text `feature`, and the TFDS split a run's
    'train', 'valid' or 'test' reads (train.data.tfds_source.Splits; None for a test split it
    lacks)."""
    data = open_dataset(dataset, data_dir)
    data.check_text_features((feature,), field="text_feature", what="text feature")
    splits = data.splits()
    return data, {"train": splits.train, "valid": splits.validation, "test": splits.test}[split]


def tfds_lines(
    dataset: str, split: str, *, feature: str, data_dir: str | os.PathLike | None
) -> Iterator[str] | None:
    """The `feature` text of every example of a prepared TFDS dataset's split 'train',
    'valid' or 'test' (`tfds_split`), as a stream; None for a test split it lacks."""
    data, name = tfds_split(dataset, split, feature=feature, data_dir=data_dir)
    return None if name is None else (line for (line,) in data.iter_read(name, (feature,)))


@functools.lru_cache(maxsize=4)
def tfds_vocab(
    dataset: str,
    level: str,
    *,
    feature: str,
    min_count: int,
    max_vocab: int,
    data_dir: str | None,
) -> TextVocab | ByteVocab:
    """The vocabulary of a TFDS dataset's train split at `level`, counted in one streaming
    pass (cached: the config and the run's data both ask for it, and a large split takes a
    while to count)."""
    if level == "byte":
        return ByteVocab()
    lines = tfds_lines(dataset, "train", feature=feature, data_dir=data_dir)
    return TextVocab.build(lines, level, min_count=min_count, max_vocab=max_vocab)


def encode_text(vocab: TextVocab | ByteVocab, lines: Sequence[str]) -> np.ndarray:
    """[N]: `lines` at the vocabulary's level, each ended by `<eos>` (int32), or at the byte
    level their UTF-8 bytes, each line ended by a newline (uint8)."""
    if isinstance(vocab, ByteVocab):
        return np.frombuffer("".join(line + "\n" for line in lines).encode("utf-8"), np.uint8)
    return vocab.encode_lines(lines)


def encoded_chunks(
    vocab: TextVocab | ByteVocab, lines: Iterable[str], *, size: int = 100_000
) -> Iterator[np.ndarray]:
    """`encode_text` of a stream of lines, `size` lines at a time: their concatenation is
    `encode_text` of all of them."""
    stream = iter(lines)
    while chunk := list(itertools.islice(stream, size)):
        yield encode_text(vocab, chunk)


@functools.lru_cache(maxsize=4)
def _text_vocab(path: str, stamp: tuple[int, int], level: str, min_count: int, max_vocab: int):
    return TextVocab.build(iter_text(path), level, min_count=min_count, max_vocab=max_vocab)


def text_vocab(path: str, level: str, *, min_count: int = 1, max_vocab: int = 0):
    """The vocabulary of a training text at `level` (`ByteVocab` at the byte level), counted in
    one streaming pass and kept for the process: the config and the data both ask for it.
    A file changed since (size or time) is counted again."""
    if level == "byte":
        return ByteVocab()
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise DataError(f"{path}: no such file") from None
    stamp = (info.st_size, info.st_mtime_ns)
    return _text_vocab(path, stamp, level, min_count, max_vocab)


def training_vocab(
    dataset: str,
    level: str,
    *,
    train_text: str | None,
    text_feature: str,
    min_count: int,
    max_vocab: int,
    data_dir: str | None,
) -> TextVocab | ByteVocab:
    """The vocabulary of a run's own training data at `level`: its training file (dataset
    'text', `text_vocab`) or its TFDS dataset's train split (`tfds_vocab`). The config (for
    the model's size) and the data both ask for it; each is counted once per process."""
    if is_tfds(dataset):
        return tfds_vocab(
            dataset,
            level,
            feature=text_feature,
            min_count=min_count,
            max_vocab=max_vocab,
            data_dir=data_dir,
        )
    return text_vocab(train_text, level, min_count=min_count, max_vocab=max_vocab)


def encoded_lines(vocab: TextVocab, path: str, *, lines: int = 100_000) -> Iterator[np.ndarray]:
    """`vocab.encode_lines` of a text file, `lines` lines at a time (int32 arrays)."""
    return encoded_chunks(vocab, iter_text(path), size=lines)


def byte_length(path: str) -> int:
    """The bytes of a file (uncompressed: a gzipped one is read through)."""
    if not path.endswith(".gz"):
        try:
            return os.path.getsize(path)
        except FileNotFoundError:
            raise DataError(f"{path}: no such file") from None
    return sum(len(chunk) for chunk in byte_chunks(path))


def byte_chunks(
    path: str, start: int = 0, stop: int | None = None, *, size: int = 1 << 24
) -> Iterator[bytes]:
    """Bytes [start, stop) of a file (uncompressed), `size` at a time."""
    try:
        with gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb") as f:
            position = 0
            while stop is None or position < stop:
                chunk = f.read(size if stop is None else min(size, stop - position))
                if not chunk:
                    break
                lo, position = max(start - position, 0), position + len(chunk)
                if lo < len(chunk):
                    yield chunk[lo:]
    except FileNotFoundError:
        raise DataError(f"{path}: no such file") from None
    except (OSError, EOFError) as e:
        raise DataError(f"{path}: cannot be read ({e})") from e
