"""Plain text files as training data: parallel sentence files for translation.

The format WMT, OPUS and Moses distribute: UTF-8, one sentence a line, the n-th line of the
source file translating the n-th line of the target file, optionally gzipped (`.gz`). Every
problem a user's files can have is a `DataError` naming the file (and the line), raised while
reading, before any training: a missing or empty file, bytes that are not UTF-8, parallel
files whose line counts differ, an empty line on either side (unless skipped).
"""

from __future__ import annotations

import gzip
import hashlib
import itertools
import json
import os
from collections.abc import Iterator, Mapping

import jax

from train.core.config import UsageError
from transformer_jax.files import file_sha256


class DataError(UsageError):
    """A data file the run was given cannot be used as it is (exit 2: fix the input)."""


def error_cause(e: BaseException) -> str:
    """The first line of an exception's message (at most 200 characters), or its type's name
    when it has none: what a DataError quotes of a library's error."""
    text = str(e).strip()
    return text.splitlines()[0][:200] if text else type(e).__name__


def _open_bytes(path: str):
    if not os.path.exists(path):
        raise DataError(f"{path}: no such file")
    if os.path.isdir(path):
        raise DataError(f"{path}: is a directory, not a text file")
    return gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")


def read_lines(path: str) -> Iterator[str]:
    """The lines of a UTF-8 text file (gzipped when its name ends in .gz), without their line
    ends. Bytes that are not UTF-8 are a DataError naming the file and the line."""
    with _open_bytes(path) as f:
        try:
            for number, raw in enumerate(f, 1):
                try:
                    yield raw.decode("utf-8").rstrip("\r\n")
                except UnicodeDecodeError as e:
                    raise DataError(
                        f"{path}, line {number}: not UTF-8 ({e.reason} at byte {e.start})"
                    ) from None
        except (OSError, EOFError) as e:  # a damaged gzip stream
            raise DataError(f"{path}: cannot be read ({e})") from e


def read_parallel(
    src_path: str, tgt_path: str, *, skip_empty: bool = False
) -> tuple[list[tuple[str, str]], int]:
    """-> ([(source, target), ...] in file order, how many pairs were skipped for an empty
    side). An empty line is an error naming it unless `skip_empty`."""
    src, tgt = list(read_lines(src_path)), list(read_lines(tgt_path))
    for path, lines in ((src_path, src), (tgt_path, tgt)):
        if not lines:
            raise DataError(f"{path}: the file is empty")
    if len(src) != len(tgt):
        raise DataError(
            f"parallel files differ in length: {src_path} has {len(src):,} lines, "
            f"{tgt_path} has {len(tgt):,}"
        )
    pairs, skipped = [], 0
    for number, (s, t) in enumerate(zip(src, tgt), 1):
        if s.strip() and t.strip():
            pairs.append((s, t))
        elif skip_empty:
            skipped += 1
        else:
            path = src_path if not s.strip() else tgt_path
            raise DataError(
                f"{path}, line {number}: empty (every line is a sentence; "
                "--skip_empty true leaves such pairs out)"
            )
    if not pairs:
        raise DataError(f"{src_path}, {tgt_path}: no pair with text on both sides")
    return pairs, skipped


def iter_parallel(
    src_path: str, tgt_path: str, *, skip_empty: bool = False, skipped: list[int] | None = None
) -> Iterator[tuple[str, str]]:
    """`read_parallel` as a stream: the (source, target) pairs in file order, one at a time, so
    a corpus of any size is never held whole. The same errors, each raised where it is found:
    an empty line (unless `skip_empty`) before a difference in length found at the end.

    skipped: a list whose one element counts the pairs left out for an empty side (read it
    once the stream is exhausted)."""
    skipped = [0] if skipped is None else skipped
    skipped[:] = [0]
    src, tgt = read_lines(src_path), read_lines(tgt_path)
    number = kept = 0
    for number, (s, t) in enumerate(itertools.zip_longest(src, tgt), 1):
        if s is None or t is None:  # one file ended: count the rest of the other
            longer = tgt if s is None else src
            total = number + sum(1 for _ in longer)  # the longer file's lines
            n_src, n_tgt = (number - 1, total) if s is None else (total, number - 1)
            if number == 1:
                raise DataError(f"{src_path if s is None else tgt_path}: the file is empty")
            raise DataError(
                f"parallel files differ in length: {src_path} has {n_src:,} lines, "
                f"{tgt_path} has {n_tgt:,}"
            )
        if s.strip() and t.strip():
            kept += 1
            yield s, t
        elif skip_empty:
            skipped[0] += 1
        else:
            path = src_path if not s.strip() else tgt_path
            raise DataError(
                f"{path}, line {number}: empty (every line is a sentence; "
                "--skip_empty true leaves such pairs out)"
            )
    if number == 0:
        raise DataError(f"{src_path}: the file is empty")
    if not kept:
        raise DataError(f"{src_path}, {tgt_path}: no pair with text on both sides")


def files_sha256(*paths: str) -> str:
    """One sha256 over the bytes of `paths` in order (their names left out, so a moved copy of
    the same files matches)."""
    digest = hashlib.sha256()
    for path in paths:
        if not os.path.isfile(path):
            raise DataError(f"{path}: no such file")
        file_sha256(path, digest)
        digest.update(b"\0")
    return digest.hexdigest()


def set_name(path: str) -> str:
    """A test set's name from its file: the base name without .gz and the language suffix
    (newstest2014.de.gz -> newstest2014)."""
    name = os.path.basename(path)
    for suffix in (".gz", ".txt"):
        name = name.removesuffix(suffix)
    stem, dot, _ = name.rpartition(".")
    return stem if dot and stem else name


FINGERPRINT_FILE = "data.json"


def check_fingerprint(workdir: str, files: Mapping[str, str], *, digest: str | None = None) -> str:
    """A resumed run must train on the bytes it started with: the sha256 of the training
    files ({field: path}) is kept in W/data.json (written by process 0 the first time);
    other bytes, under the same names or others, are a DataError naming the fields.
    digest: the files' sha256 when the caller has it (else they are read here).
    -> the sha256 (`files_sha256` of the files in order)."""
    if digest is None:
        digest = files_sha256(*files.values())
    path = os.path.join(workdir, FINGERPRINT_FILE)
    fields = ", ".join(files)
    if os.path.exists(path):
        with open(path) as f:
            saved = json.load(f).get("train_sha256")
        if saved != digest:
            raise DataError(
                f"{fields}: {', '.join(files.values())} are not the files this run "
                f"started with (sha256 {saved}, now {digest}); resume with the "
                "original files, or use a new --workdir"
            )
    elif jax.process_index() == 0:
        os.makedirs(workdir, exist_ok=True)
        with open(path + ".tmp", "w") as f:
            json.dump({"train_sha256": digest, **files}, f, indent=2)
        os.replace(path + ".tmp", path)
    return digest
