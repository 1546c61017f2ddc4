"""Subprocesses for the end-to-end tests: every wait has a deadline that applies whether or
not the process prints, and a process is killed and reaped when its `with` block ends.

A thread reads the output line by line into a queue, so a wait for a line ends at its deadline
even while the process is silent (a `for line in proc.stdout` loop would check its deadline
only when a line arrives), and a process that prints a lot never blocks on a full pipe.
"""
from __future__ import annotations

import os
import queue
import signal
import subprocess
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT = 300  # seconds for any one wait: a guard against a hang, never a verdict


class Running:
    """A process in the background whose output (stdout and stderr together) is read line by
    line; waits on it are bounded, and leaving the `with` block kills it if still alive."""

    def __init__(self, args, env, cwd=REPO):
        self.proc = subprocess.Popen(args, cwd=cwd, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self._queue: queue.Queue = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line)
            self._queue.put(line)
        self._queue.put(None)

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait_for(self, text: str, timeout: float = TIMEOUT) -> str:
        """The first line from now on that contains `text`; an AssertionError if the process
        exits first or none comes within `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._queue.get(timeout=max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                raise AssertionError(f"no {text!r} within {timeout}s:\n{self.output}") from None
            if line is None:
                raise AssertionError(f"exited ({self.proc.wait()}) before {text!r}:\n"
                                     f"{self.output}")
            if text in line:
                return line

    def finish(self, timeout: float = TIMEOUT) -> int:
        """Waits for the exit (killing the process past `timeout`) -> its exit code, with all
        of its output read."""
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"still running after {timeout}s:\n{self.output}") from None
        self._reader.join(timeout=30)
        return rc

    def send_signal(self, signum: int):
        self.proc.send_signal(signum)

    def kill9(self) -> int:
        self.proc.send_signal(signal.SIGKILL)
        return self.finish()

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)
        self._reader.join(timeout=30)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.kill()


def finish_all(procs: list[Running], timeout: float = TIMEOUT, grace: float = 60) -> list[int]:
    """Waits until every process of `procs` has exited -> their exit codes. Once one has
    failed, the others get `grace` seconds (a peer of a failed process may wait for it in a
    collective until JAX's own timeouts), then are killed (a negative code). Past `timeout`
    all are killed and an AssertionError shows each one's output (a hang is a failure)."""
    deadline, give_up = time.monotonic() + timeout, None
    while any(p.alive() for p in procs):
        now = time.monotonic()
        if now > deadline:
            for p in procs:
                p.kill()
            raise AssertionError(f"not finished within {timeout}s:\n" + "\n".join(
                f"--- process {i}:\n{p.output[-3000:]}" for i, p in enumerate(procs)))
        if give_up is None and any(p.proc.poll() not in (None, 0) for p in procs):
            give_up = now + grace
        if give_up is not None and now > give_up:
            for p in procs:
                p.kill()
            break
        time.sleep(0.05)
    return [p.finish() for p in procs]
