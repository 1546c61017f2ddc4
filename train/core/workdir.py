"""One run per work directory: an advisory lock that a killed run cannot leave stuck.

`WorkdirLock(W)` takes an exclusive `flock` on W/.lock for the run's lifetime and writes who
holds it (pid, host, start time) into the file (emptied again at the end). The kernel drops a flock when its process dies,
however it dies, so a kill -9 never leaves the directory locked; a second run on W is refused
with a message naming the holder. Process 0 locks for all processes of a multi-process run;
paths on remote filesystems (gs://, ...) have no flock and are not locked.
"""
from __future__ import annotations

import fcntl
import json
import os
import socket
import time

import jax

LOCK_FILE = ".lock"


class WorkdirError(RuntimeError):
    """The work directory cannot be used: in use by another run, or not writable."""


class WorkdirLock:
    def __init__(self, workdir: str):
        self.workdir = workdir
        self.path = os.path.join(workdir, LOCK_FILE)
        self._fd: int | None = None

    def __enter__(self) -> WorkdirLock:
        if jax.process_index() != 0 or "://" in self.workdir:
            return self
        try:
            os.makedirs(self.workdir, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise WorkdirError(f"work directory {self.workdir} is not writable "
                               f"({e.strerror}); choose another --workdir") from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise WorkdirError(
                f"work directory {self.workdir} is in use by another run ({holder}); wait for "
                "it to finish or stop it (SIGTERM saves a checkpoint), or use another "
                "--workdir") from None
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                 "since": time.strftime("%Y-%m-%d %H:%M:%S")}).encode())
        self._fd = fd
        return self

    def __exit__(self, *exc) -> None:
        if self._fd is not None:
            # Emptied, not deleted: deleting would let a run that opened it before the unlink
            # lock a file nobody else sees. The flock goes with the close.
            os.ftruncate(self._fd, 0)
            os.close(self._fd)
            self._fd = None


def _read_holder(fd: int) -> str:
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        info = json.loads(os.read(fd, 4096).decode() or "{}")
        return f"pid {info['pid']} on {info['host']} since {info['since']}"
    except (OSError, ValueError, KeyError):
        return "holder unknown"
