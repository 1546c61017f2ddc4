"""Locating, verifying and reading the raw text files the TFDS builders are made from.

Both builders (`multi30k`, `ptb`) read small gzipped text files. By default these are the copies
shipped inside the package (`train/data/datasets/data/<dataset>/`), so a fresh clone prepares its
datasets offline. The upstream URLs are kept next to each file and are used only when the user
asks for them (`source='download'`). A third option is a directory of the user's own copies,
named like the shipped files.

Every file is checked against a hard-coded SHA-256 before it is read, so a truncated, altered
or missing file stops preparation with an error that names the file, instead of producing a
silently different dataset.
"""

from __future__ import annotations

import dataclasses
import gzip
import os
import zlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import tensorflow_datasets as tfds
from etils import epath

from train.core.config import InputError
from transformer_jax.files import file_sha256

# Where a builder reads its files from; any other value is a directory (see `read_sources`).
SHIPPED = "shipped"
DOWNLOAD = "download"


class DatasetSourceError(InputError, ValueError):
    """A source file of a dataset is missing, corrupt, altered, or inconsistent with another."""


@dataclasses.dataclass(frozen=True)
class SourceFile:
    """One raw source file of a dataset.

    Attributes:
      name: the shipped file name, e.g. 'train.de.gz' (always gzipped).
      sha256: SHA-256 of the shipped (gzipped) file.
      url: where upstream serves the same content.
      url_sha256: SHA-256 of the bytes `url` serves.
      url_gzipped: whether `url` serves gzip (Multi30k) or plain text (PTB).
    """

    name: str
    sha256: str
    url: str
    url_sha256: str
    url_gzipped: bool = True

    def __post_init__(self):
        for field in ("sha256", "url_sha256"):
            value = getattr(self, field)
            if len(value) != 64 or any(c not in "0123456789abcdef" for c in value):
                raise ValueError(
                    f"SourceFile.{field} of {self.name} must be 64 lowercase hex digits"
                )


def shipped_dir(dataset: str) -> Path:
    """The directory holding the package's copies of `dataset`'s files (package data)."""
    return Path(__file__).resolve().parent / "data" / dataset


def _read_verified(path: Path, *, name: str, expected_sha256: str | None, gzipped: bool) -> str:
    """Returns the decoded text of `path` after checking it exists and has the expected hash."""
    if not path.is_file():
        raise DatasetSourceError(
            f"missing source file {name!r}: {path} does not exist (restore the file, e.g. from "
            f"a fresh checkout, or prepare with source='download')"
        )
    if expected_sha256 is not None:
        actual = file_sha256(path).hexdigest()
        if actual != expected_sha256:
            raise DatasetSourceError(
                f"checksum mismatch for source file {name!r} ({path}): expected sha256 "
                f"{expected_sha256}, got {actual}. The file is truncated, corrupt or not the "
                "upstream version; restore it (the dataset README lists the sums)."
            )
    try:
        raw = path.read_bytes()
        if gzipped:
            raw = gzip.decompress(raw)
        return raw.decode("utf-8")
    except (OSError, EOFError, zlib.error, UnicodeDecodeError) as e:
        # Reached only with verify_checksums=False: a corrupt file with an unknown hash.
        raise DatasetSourceError(f"cannot read source file {name!r} ({path}): {e}") from e


def split_lines(text: str) -> list[str]:
    """Splits file text into lines; a line is text ended by '\\n'.

    The text after the last '\\n' is a line only if it holds more than whitespace: the PTB char
    files end with '\\n ' (a lone space), which is not a sentence, and the line counts the
    READMEs give are '\\n' counts.
    """
    lines = text.split("\n")
    if not lines[-1].strip():
        lines.pop()
    return lines


def read_sources(
    files: Sequence[SourceFile],
    *,
    source: str | os.PathLike,
    dataset: str,
    dl_manager: Any = None,
    verify_checksums: bool = True,
) -> dict[str, list[str]]:
    """Reads and verifies `files`, returning {file name: lines}.

    Args:
      files: the source files to read.
      source: 'shipped' (the package's copies), 'download' (the upstream URLs, through
        `dl_manager`), or a directory holding files with the shipped names (gzipped).
      dataset: the dataset's directory name under `data/` (for 'shipped').
      dl_manager: a `tfds.download.DownloadManager`, needed only for 'download'.
      verify_checksums: check each file's SHA-256 before reading it. Turn off only to read
        deliberately modified copies.

    Raises:
      DatasetSourceError: a file is missing, fails its checksum, or cannot be decompressed or
        decoded; the message names the file.
    """
    if os.fspath(source) == DOWNLOAD:
        if dl_manager is None:
            raise ValueError("source='download' needs a TFDS download manager")
        paths: Mapping[str, Any] = dl_manager.download({f.name: f.url for f in files})
        located = {
            f.name: (Path(os.fspath(paths[f.name])), f.url_sha256, f.url_gzipped) for f in files
        }
    else:
        directory = shipped_dir(dataset) if os.fspath(source) == SHIPPED else Path(source)
        located = {f.name: (directory / f.name, f.sha256, True) for f in files}
    lines = {}
    for name, (path, sha, gzipped) in located.items():
        text = _read_verified(
            path, name=name, expected_sha256=sha if verify_checksums else None, gzipped=gzipped
        )
        lines[name] = split_lines(text)
    return lines


def check_source(source: str | os.PathLike) -> str | os.PathLike:
    """Validates a builder's `source` argument early, with a sentence rather than a KeyError."""
    if os.fspath(source) in (SHIPPED, DOWNLOAD):
        return source
    if not Path(source).is_dir():
        raise ValueError(
            f"source must be 'shipped', 'download' or an existing directory, got {source!r}"
        )
    return source


class LocalDatasetInfo(tfds.core.DatasetInfo):
    """The package's builders' DatasetInfo (their `_info` returns one): TFDS's, less its look
    for pre-computed metadata on TFDS's bucket, which these datasets do not have. TFDS does that
    look whenever a builder is made over a directory holding no prepared copy (every run that
    reads the shipped files), and it leaves an empty temporary folder behind each time."""

    def initialize_from_bucket(self) -> None:
        return None


class SourceBuilder(tfds.core.GeneratorBasedBuilder):
    """Base of the package's builders: the `source` and `verify_checksums` options.

    Abstract (no `_info`), so TFDS does not register it as a dataset.
    """

    # TFDS derives `code_path` (where it looks for a checksums file) through a check that
    # imports the `importlib_resources` backport, which Python >= 3.9 installs often lack and
    # then fail in `download_and_prepare`. Subclasses set it to their module file instead.
    code_path: epath.Path | None = None

    def __init__(
        self,
        *,
        source: str | os.PathLike = SHIPPED,
        verify_checksums: bool = True,
        file_format: str | None = "array_record",
        **kwargs: Any,
    ):
        """Args:
        source: where the raw files come from: 'shipped' (default, offline), 'download'
          (the upstream URLs) or a directory with files named like the shipped ones (gzipped).
        verify_checksums: check every file's SHA-256 before reading it.
        file_format: TFDS file format; array_record needs no TensorFlow.
        **kwargs: `data_dir`, `config`, `version`, ... as for any TFDS builder.
        """
        self._source = check_source(source)
        self._verify_checksums = verify_checksums
        super().__init__(file_format=file_format, **kwargs)

    def _read_sources(
        self, files: Sequence[SourceFile], *, dataset: str, dl_manager: Any
    ) -> dict[str, list[str]]:
        return read_sources(
            files,
            source=self._source,
            dataset=dataset,
            dl_manager=dl_manager,
            verify_checksums=self._verify_checksums,
        )
