"""The work directory: local or remote (gs://, s3://), and one run at a time in it.

Remote work directories (what a TPU VM or a cloud GPU node shares with its peers) go through
`etils.epath`. orbax writes checkpoints there itself; every other file of the run (config.json,
metrics.jsonl, TensorBoard events, checksums, the tokenizer, plots, translations) is written
in a local mirror, `local_dir(W)`, and copied up by process 0 with `push(W)` after each
checkpoint and at the end; `pull(W)` brings them down at the start (every process), so a run
on a fresh VM resumes from the bucket alone. Everything that reads or writes those files works
on plain local paths. For a local W, `local_dir(W)` is W itself and push/pull do nothing.
Metrics logged after the last checkpoint are pushed with the next one; a resumed run rewinds
to its checkpoint anyway (`MetricsWriter.rewind`), so nothing it keeps is lost.

One run per work directory: an advisory lock that a killed run cannot leave stuck.

`WorkdirLock(W)` takes an exclusive `flock` on W/.lock for the run's lifetime and writes who holds
it (pid, host, start time) into the file (emptied again at the end). The kernel drops a flock when
its process dies, however it dies, so a kill -9 never leaves the directory locked; a second run on W
is refused with a message naming the holder. A start that fails before its first checkpoint
removes the file if it made it (`train.core.task`); a run that opened it just before then locks
the file at the path instead. Process 0 locks for all processes of a multi-process
run; a remote work directory has no flock: its local mirror is locked instead.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import socket
import time

import jax
from etils import epath

from train.core.errors import WorkdirError

LOCK_FILE = ".lock"
# Written by orbax straight to the remote directory; never mirrored.
REMOTE_ONLY = ("checkpoints",)
# The token cache (train.data.token_cache), rebuilt from the data files when missing: too large
# to copy up with the run's files, so never pushed.
TOKEN_CACHE = "token_cache"
# Where remote work directories are mirrored; override with $ATTENTION_JAX_MIRROR.
MIRROR_ENV = "ATTENTION_JAX_MIRROR"


def is_remote(workdir: str) -> bool:
    """A URI (gs://bucket/run, s3://...) rather than a local path."""
    return "://" in str(workdir)


def local_dir(workdir: str) -> str:
    """The local directory holding `workdir`'s files other than checkpoints: W itself, or for a
    remote W its mirror (a fixed function of the URI, so every run on this machine finds it)."""
    if not is_remote(workdir):
        return workdir
    root = os.environ.get(MIRROR_ENV) or os.path.join(
        os.path.expanduser("~"), ".cache", "attention-jax", "workdirs"
    )
    uri = str(workdir).rstrip("/")
    tag = hashlib.sha256(uri.encode()).hexdigest()[:12]
    # One mirror per process: processes sharing a machine must not write each other's files.
    # (Asked before the distributed start-up too, which must come before any backend use.)
    process = f"-p{jax.process_index()}" if jax.distributed.is_initialized() else ""
    return os.path.join(root, f"{uri.rsplit('/', 1)[-1]}-{tag}{process}")


def entries_below(root) -> set[str]:
    """The name, relative to `root` (local or remote), of every file and directory below it
    (a link to a directory is listed, not followed); empty when `root` does not exist."""
    return {name for name, _, _ in _walk(root, follow_links=False)}


def remove_added(root, before: set[str]) -> list[str]:
    """Removes what is below `root` (local or remote) now and is not in `before` (its
    `entries_below` at an earlier time): a new file, a new directory with all it holds.
    Nothing named in `before` is touched. -> the names removed."""
    root = epath.Path(root)
    removed = []
    for name in sorted(entries_below(root) - before):  # a directory before what it holds
        if any(name.startswith(f"{gone}/") for gone in removed):
            continue
        path = root / name
        if path.is_dir() and not os.path.islink(path):
            path.rmtree()
        else:
            path.unlink()
        removed.append(name)
    return removed


def files_below(root, *, skip: tuple[str, ...] = ()):
    """(name relative to `root`, epath.Path) of every file below `root` (local or remote),
    leaving out the top-level entries named in `skip`."""
    for name, path, is_dir in _walk(root, skip=skip):
        if not is_dir:
            yield name, path


def _walk(root, *, skip: tuple[str, ...] = (), follow_links: bool = True):
    """(name relative to `root`, epath.Path, whether a directory) of every entry below `root`,
    each directory before what it holds, leaving out the top-level entries named in `skip`.
    Names are cut from `iterdir`'s paths (root / name), which keep the root's form; the paths
    `walk` yields need not (the tests' gs:// stand-in yields local ones)."""
    root = epath.Path(root)
    if not root.exists():
        return
    pending = [root]
    while pending:
        for child in sorted(pending.pop().iterdir()):
            name = str(child)[len(str(root)) :].lstrip("/")
            if name.split("/")[0] in skip:
                continue
            is_dir = child.is_dir() and (follow_links or not os.path.islink(child))
            if is_dir:
                pending.append(child)
            yield name, child, is_dir


def pull(workdir: str) -> int:
    """Copies a remote work directory's files (not its checkpoints) into `local_dir`, replacing
    what is there. Every process calls it; returns how many files came down."""
    if not is_remote(workdir):
        return 0
    local = local_dir(workdir)
    count = 0
    for name, remote in files_below(workdir, skip=REMOTE_ONLY):
        target = os.path.join(local, name)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        tmp = f"{target}.{os.getpid()}.pull"
        with open(tmp, "wb") as f:
            f.write(remote.read_bytes())
        os.replace(tmp, target)
        _pushed[target] = _signature(target)  # what is there is already up
        count += 1
    return count


# Local file -> (size, mtime_ns) when it was last pushed or pulled: push sends what changed.
_pushed: dict[str, tuple[int, int]] = {}


def push(workdir: str) -> int:
    """Copies the files of `local_dir(workdir)` that changed since the last push or pull up to
    the remote work directory (process 0 only; a no-op for a local W). Returns how many went."""
    if not is_remote(workdir) or jax.process_index() != 0:
        return 0
    local, root, count = local_dir(workdir), epath.Path(workdir), 0
    for parent, _, files in os.walk(local):
        for file in files:
            path = os.path.join(parent, file)
            if (
                file == LOCK_FILE
                or os.path.relpath(path, local).split(os.sep)[0] == TOKEN_CACHE
                or file.endswith((".tmp", ".pull"))
                or _pushed.get(path) == _signature(path)
            ):
                continue
            target = root / os.path.relpath(path, local)
            target.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "rb") as f:
                target.write_bytes(f.read())
            _pushed[path] = _signature(path)
            count += 1
    return count


def _signature(path: str) -> tuple[int, int]:
    info = os.stat(path)
    return info.st_size, info.st_mtime_ns


class WorkdirLock:
    """The lock of a local work directory, or of a remote one's local mirror (so two runs on
    this machine do not share a mirror; runs on other machines are not seen)."""

    def __init__(self, workdir: str):
        workdir = local_dir(workdir)
        self.workdir = workdir
        self.path = os.path.join(workdir, LOCK_FILE)
        self.made_file = False  # whether this lock made W/.lock (a start that fails removes it)
        self._fd: int | None = None

    def __enter__(self) -> WorkdirLock:
        if jax.process_index() != 0:
            return self
        fd = self._lock()
        while not _same_file(fd, self.path):
            # A start that failed removed the file after we opened it (and before we locked
            # it): that lock is one nobody else sees. Lock the file now at the path.
            os.close(fd)
            fd = self._lock()
        os.ftruncate(fd, 0)
        os.write(
            fd,
            json.dumps(
                {
                    "pid": os.getpid(),
                    "host": socket.gethostname(),
                    "since": time.strftime("%Y-%m-%d %H:%M:%S"),
                }
            ).encode(),
        )
        self._fd = fd
        return self

    def _lock(self) -> int:
        """Opens (or makes) W/.lock and takes its flock -> the descriptor; a WorkdirError when
        W cannot be written or another run holds it."""
        try:
            os.makedirs(self.workdir, exist_ok=True)
            self.made_file = not os.path.exists(self.path)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise WorkdirError(
                f"work directory {self.workdir} is not writable "
                f"({e.strerror}); choose another --workdir"
            ) from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise WorkdirError(
                f"work directory {self.workdir} is in use by another run ({holder}); wait for "
                "it to finish or stop it (SIGTERM saves a checkpoint), or use another "
                "--workdir"
            ) from None
        return fd

    def __exit__(self, *exc) -> None:
        if self._fd is not None:
            # Emptied, not deleted: it stays for the next run (only a failed start that made
            # it removes it, see __enter__). The flock goes with the close.
            os.ftruncate(self._fd, 0)
            os.close(self._fd)
            self._fd = None


def _same_file(fd: int, path: str) -> bool:
    """Whether the open file `fd` is the one at `path` (not one removed since it was opened)."""
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except FileNotFoundError:
        return False


def _read_holder(fd: int) -> str:
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        info = json.loads(os.read(fd, 4096).decode() or "{}")
        return f"pid {info['pid']} on {info['host']} since {info['since']}"
    except (OSError, ValueError, KeyError):
        return "holder unknown"
