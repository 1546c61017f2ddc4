"""TFDS builders for the datasets shipped with the package (offline first), and loaders.

Importing this package registers the builders `multi30k` and `ptb` (configs `ptb/word`,
`ptb/char`) with TFDS, so `tfds.data_source('multi30k', split='train', data_dir=...)` works
once a dataset is prepared. The loaders below return plain Python lists: from the prepared
copy where `data_dir` holds one, else straight from the shipped files (checksums verified, no
TFDS generation step: a fresh machine's first run starts sooner). A process decodes each split
of a local prepared copy once, while the copy's files stay as they are; each call returns a
list of its own.

`data_dir=None` means what it means to TFDS: $TFDS_DATA_DIR, else ~/tensorflow_datasets.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable

import tensorflow_datasets as tfds
from etils import epath

from train.core.config import InputError
from train.data.datasets import multi30k, ptb
from train.data.datasets.multi30k import Multi30k
from train.data.datasets.ptb import Ptb
from train.data.datasets.sources import DatasetSourceError
from train.data.text_files import error_cause


class DatasetError(InputError, RuntimeError):
    """A prepared dataset on disk is damaged (it can be deleted and rebuilt)."""


__all__ = ["DatasetError", "DatasetSourceError", "Multi30k", "Ptb", "load_multi30k", "load_ptb"]

# Accepted spellings of the PTB validation split: the upstream files say 'valid'.
_PTB_SPLIT_ALIASES = {"valid": "validation"}


def _builder(
    cls: type, data_dir: str | os.PathLike | None, *, prepare: bool = True, **kwargs
) -> tfds.core.DatasetBuilder | None:
    """`cls(data_dir=..., **kwargs)`, prepared; with `prepare=False`, None where no prepared
    copy exists. A prepared copy whose metadata (dataset_info.json, features.json) cannot be
    read is a DatasetError naming its directory, like a damaged data file: TFDS itself raises
    a protobuf or JSON parse error."""
    root = os.fspath(data_dir) if data_dir is not None else tfds.core.constants.DATA_DIR
    version = epath.Path(root) / cls.name / kwargs.get("config", "") / str(cls.VERSION)
    if not prepare and not version.exists():
        return None  # (looked up first: the builder warns of a missing copy)
    try:
        builder = cls(data_dir=data_dir, **kwargs)
        builder.download_and_prepare()  # a no-op once the dataset is on disk
    except DatasetSourceError:
        raise
    except Exception as e:  # TFDS raises protobuf, JSON and OS errors for damaged metadata
        where = os.path.join(root, cls.name, kwargs.get("config", "") or "")
        cause = error_cause(e)
        raise DatasetError(
            f"the prepared dataset {os.path.normpath(where)} cannot be read ({cause}). It is "
            f"built from the files shipped with the package: delete that directory and run "
            f"again to rebuild it."
        ) from e
    return builder


def _check_split(name: str, split: str, splits) -> None:
    if split not in splits:
        raise ValueError(f"{name} has no split {split!r}; splits: {sorted(splits)}")


def _read_split(builder: tfds.core.DatasetBuilder, split: str) -> list[dict]:
    """Every example of a prepared `builder`'s `split`, in key order."""
    _check_split(builder.name, split, builder.info.splits)
    try:
        source = builder.as_data_source(split=split)
        return source.__getitems__(list(range(len(source))))
    except Exception as e:  # array_record / TFDS raise many types for a damaged file
        cause = error_cause(e)
        raise DatasetError(
            f"the prepared dataset {builder.data_dir} cannot be read ({cause}). It is built "
            f"from the files shipped with the package: delete that directory and run again to "
            f"rebuild it."
        ) from e


def _files_stamp(directory: str) -> tuple | None:
    """(name, size, mtime_ns) of each file of a local prepared copy; None for a remote one
    (not kept: its files' times are not cheap to ask for), or one whose files cannot be
    listed (the read that follows names the problem)."""
    if not os.path.isdir(directory):
        return None
    try:
        entries = sorted(os.scandir(directory), key=lambda e: e.name)
        stats = [(e.name, e.stat()) for e in entries]
    except OSError:
        return None
    return tuple((name, st.st_size, st.st_mtime_ns) for name, st in stats)


@dataclasses.dataclass(frozen=True)
class _Split:
    """A prepared copy's split as a cache key: its directory, the split and the copy's files
    as they are on disk (the builder and the decoding function ride along, not compared)."""

    builder: tfds.core.DatasetBuilder = dataclasses.field(compare=False)
    decode: Callable = dataclasses.field(compare=False)
    directory: str
    split: str
    stamp: tuple


@functools.lru_cache(maxsize=8)
def _decoded_kept(split: _Split) -> tuple:
    # TFDS decodes example by example (about half a second for PTB's or Multi30k's train
    # split), and a process often reads one split several times: a run's vocabulary and its
    # stream, the tokenizer and the batches, or a notebook's or test's many runs. A file
    # changed since (size or time) is another key, so it is read again.
    return tuple(split.decode(ex) for ex in _read_split(split.builder, split.split))


def _decoded(builder: tfds.core.DatasetBuilder, split: str, decode: Callable) -> list:
    """`decode(example)` of every example of a prepared `builder`'s `split`, read and decoded
    once per process while the copy's files stay as they are (each call gets its own list)."""
    directory = os.fspath(builder.data_dir)
    stamp = _files_stamp(directory)
    if stamp is None:
        return [decode(ex) for ex in _read_split(builder, split)]
    return list(_decoded_kept(_Split(builder, decode, directory, split, stamp)))


def load_multi30k(
    split: str, *, data_dir: str | os.PathLike | None = None
) -> list[tuple[str, str]]:
    """Multi30k de-en pairs of `split` in file order, as [(de, en), ...].

    Splits: train, validation, test_2016_flickr, test_2017_flickr, test_2017_mscoco,
    test_2018_flickr.
    """
    builder = _builder(Multi30k, data_dir, prepare=False)
    if builder is None:
        _check_split("multi30k", split, multi30k.SPLITS)
        return multi30k.shipped_pairs(split)
    return _decoded(builder, split, lambda ex: (ex["de"].decode("utf-8"), ex["en"].decode("utf-8")))


def load_ptb(level: str, split: str, *, data_dir: str | os.PathLike | None = None) -> list[str]:
    """PTB lines of `level` ('word'|'char') and `split` ('train'|'valid'|'test'), in file order.

    Each line's tokens are its whitespace-separated symbols; append `<eos>` after each line to
    get the standard LM stream (`train.data.tokenizers.WordVocab.encode_lines` does).
    """
    if level not in ("word", "char"):
        raise ValueError(f"level must be 'word' or 'char', got {level!r}")
    split = _PTB_SPLIT_ALIASES.get(split, split)
    builder = _builder(Ptb, data_dir, prepare=False, config=level)
    if builder is None:
        _check_split("ptb", split, ptb.SPLITS)
        return ptb.shipped_lines(level, split)
    return _decoded(builder, split, lambda ex: ex["text"].decode("utf-8"))
