"""Writing files and folders so that a reader never sees half of one and a failed write leaves
what was there: the exports (`save_marian`, `save_ct2`) and the tokenizer files use these. And
`file_sha256`, the one reader of a file's bytes for a checksum."""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def write_bytes(path: Path, data: bytes) -> None:
    """`data` into `path`, through a temporary file renamed over it. (Opened with `open`, so
    the file gets the umask's permissions, not a temporary file's owner-only ones.)"""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)


def _sibling(folder: Path, kind: str) -> Path:
    """A new hidden name beside `folder` (not mkdtemp's: its folders are private, 0700)."""
    return folder.with_name(f".{folder.name}.{kind}-{secrets.token_hex(6)}")


@contextlib.contextmanager
def staged_folder(folder: str | os.PathLike) -> Iterator[Path]:
    """Yields a new, empty hidden sibling of `folder` to write into. When the block ends
    without an error the sibling becomes `folder`: an existing `folder` is moved aside first
    and deleted only once the new one is in place (put back if the rename fails). On an error
    the sibling is deleted and `folder` is as it was. The caller decides beforehand whether an
    existing `folder` may be replaced."""
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = _sibling(folder, "partial")
    staging.mkdir()
    try:
        yield staging
        if not folder.exists():
            staging.rename(folder)
            return
        old = _sibling(folder, "old")
        folder.rename(old)
        try:
            staging.rename(folder)
        except BaseException:
            old.rename(folder)
            raise
        shutil.rmtree(old)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def file_sha256(path: Any, digest: Any = None) -> Any:
    """`digest` (a new sha256 when None) updated with the bytes of the file at `path`, read 1 MiB
    at a time so that a large file is never held whole -> the digest (`.hexdigest()`).

    path: a local path (str, os.PathLike), or a path object with `open` (pathlib, or
    `etils.epath` for a remote file such as a checkpoint's in a bucket)."""
    digest = hashlib.sha256() if digest is None else digest
    with path.open("rb") if hasattr(path, "open") else open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest
