"""A multi-process run that loses a process ends in seconds, readably, on every survivor.

When one process dies (killed, its host lost), the others learn it from the next collective,
which fails at once (gloo: "Connection reset by peer"). A survivor then names the lost
process (the other one of two; past two, the one JAX's coordination service no longer counts
alive, if it knows within NAMING_S) and ends at once with EXIT_PEER_LOST. Left to itself it
would wait in JAX's shutdown barrier for the dead process, then abort with a C++ stack trace
when the service declares that process dead (its heartbeats stopped for HEARTBEAT_TIMEOUT_S,
set when the distributed runtime starts). Nothing saved is lost: the last checkpoint is whole
(a save is a barrier of every process), and starting every process again resumes from it.

A process can also die while the others wait on something that is not a collective: a
compilation, the data's preparation, a rendezvous of the coordination service. Nothing fails
there until the heartbeat timeout, and then JAX aborts the survivors with a C++ stack trace.
So every process of a run also holds a plain TCP connection to process 0 (`Liveness`), which
the kernel closes the moment its process dies, however it dies. A connection that closes
without the process's goodbye (`farewell`, sent when its command returns) means that process
was lost: process 0 tells the others which one, and every survivor stops at once with the
same one line and EXIT_PEER_LOST. A host that vanishes without closing its connections (power,
network) is still found by the heartbeats.
"""

from __future__ import annotations

import os
import socket
import struct
import sys
import threading
import time

import jax

from train.core.errors import EXIT_PEER_LOST, PeerLost

# Seconds without a heartbeat after which the coordination service declares a process dead
# and stops every other one (JAX's default is 100): a process that hangs without failing a
# collective is found in this time.
HEARTBEAT_TIMEOUT_S = 20
# How long a survivor asks the service which process is gone, well inside the timeout above
# (after it, the service would end this process first, unreadably).
NAMING_S = 3
# The messages of a collective whose peer has gone (gloo's, the CPU collectives'), or of the
# coordination service's verdict; a storage or network error elsewhere is not one of them.
_COLLECTIVE = ("Gloo",)
_GONE = ("Connection closed by peer", "Connection reset by peer", "Read error")
_DECLARED = ("heartbeat timeout", "stopped sending heartbeats")
# The coordination service's key under which process 0 publishes its liveness address.
_ADDRESS_KEY = "train/liveness_address"
# How long a process waits for process 0's address, then to connect to it.
CONNECT_S = 60
# One byte a process sends over its liveness connection: its command ended (the connection
# may close now), or (from process 0, followed by a 4-byte index) this process was lost.
_BYE, _LOST = b"B", b"L"
# Held by whichever thread stops the process for a lost peer, so that one line is printed.
_STOPPING = threading.Lock()


def lost_peer(error: BaseException) -> PeerLost | None:
    """`error` as a PeerLost when it is a failed collective or coordination call of a
    multi-process run whose cause is a process that stopped (naming it: `_lost_processes`),
    else None."""
    if not jax.distributed.is_initialized() or jax.process_count() < 2:
        return None
    text = str(error)
    collective = any(m in text for m in _COLLECTIVE) and any(m in text for m in _GONE)
    if not (collective or any(m in text for m in _DECLARED)):
        return None
    lost = _lost_processes(deadline=time.monotonic() + NAMING_S)
    first = text.strip().splitlines()[0] if text.strip() else type(error).__name__
    return _peer_lost(lost, first, jax.process_index(), jax.process_count())


def _peer_lost(lost: list[int], cause: str, me: int, count: int) -> PeerLost:
    """The error process `me` (of `count`) stops with when `lost` ([]: unknown) are gone."""
    who = (
        f"process {', '.join(map(str, lost))} (of {count})"
        if lost
        else f"another process (of {count})"
    )
    error = PeerLost(
        f"{who} was lost ({cause}); process {me} stops too. Start every process again with "
        "the same --workdir: the run resumes from its last checkpoint"
    )
    error.lost = lost
    return error


def _lost_processes(deadline: float) -> list[int]:
    """The lost processes: of two, the other; past two, those the coordination service no
    longer counts alive, asked until one is missing or `deadline` ([] if none yet); [0] when
    the service itself is gone (process 0 runs it)."""
    me, count = jax.process_index(), jax.process_count()
    if count == 2:
        return [1 - me]
    from jax._src import distributed  # the client of the running distributed runtime

    client = distributed.global_state.client
    everyone = list(range(count))
    while True:
        try:
            alive = set(client.get_live_nodes(everyone))
        except Exception:  # noqa: BLE001 - the service is unreachable: its process died
            return [0] if me != 0 else []
        lost = [i for i in everyone if i not in alive]
        if lost or time.monotonic() > deadline:
            return lost
        time.sleep(0.25)


def claim_stop() -> None:
    """Called by the thread that is about to stop this process for a lost peer; a second
    caller waits here until the first ends the process, so its line is printed once."""
    _STOPPING.acquire()


def exit_now(code: int, lost: list[int] | None = None) -> None:
    """Ends the process with `code` without the interpreter's exit, whose JAX shutdown
    barrier would wait for the lost process and then abort. On process 0, first tells the
    other processes which ones were `lost` (`Liveness`)."""
    if _liveness is not None and lost:
        _liveness.relay(lost)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# ----------------------------------------------------------------------------- liveness
class Liveness:
    """The liveness connections of one multi-process run (`start_liveness`): process 0
    listens and holds one connection to each other process; each other process holds one to
    process 0. A thread per connection reads it: a goodbye (`_BYE`) ends the watch, process
    0's word that a process was lost (`_LOST`), or a close without goodbye (the process at the
    other end died), stops this process (`_stop`)."""

    def __init__(self, me: int, count: int):
        self.me, self.count = me, count
        self.peers: dict[int, socket.socket] = {}  # process index -> its connection
        self.lock = threading.Lock()
        self.done = False  # this process's command ended: no more watching

    # -- process 0
    def listen(self, client) -> None:
        try:
            if socket.has_dualstack_ipv6():
                server = socket.create_server(("", 0), family=socket.AF_INET6, dualstack_ipv6=True)
            else:
                server = socket.create_server(("", 0))
        except OSError:
            client.key_value_set(_ADDRESS_KEY, "")  # none: the others need not wait for it
            raise
        client.key_value_set(_ADDRESS_KEY, str(server.getsockname()[1]))
        threading.Thread(target=self._accept, args=(server,), daemon=True).start()

    def _accept(self, server: socket.socket) -> None:
        server.settimeout(CONNECT_S)
        with server:
            while len(self.peers) < self.count - 1:
                try:
                    conn, _ = server.accept()
                    conn.settimeout(CONNECT_S)
                    (index,) = struct.unpack("!i", _read(conn, 4))
                    conn.settimeout(None)
                except (OSError, struct.error):
                    return  # not every process connected: those are left to the heartbeats
                with self.lock:
                    self.peers[index] = conn
                threading.Thread(target=self._watch, args=(index, conn), daemon=True).start()

    def relay(self, lost: list[int]) -> None:
        """Process 0: tells every other process still connected that `lost` were lost."""
        with self.lock:
            peers = [(i, c) for i, c in self.peers.items() if i not in lost]
        for _, conn in peers:
            try:
                conn.sendall(_LOST + struct.pack("!i", lost[0]))
            except OSError:
                pass  # that one is gone too, or going

    # -- the others
    def connect(self, client, host: str) -> None:
        port = client.blocking_key_value_get(_ADDRESS_KEY, CONNECT_S * 1000)
        if not port:
            raise ConnectionError("process 0 could not listen for them")
        conn = socket.create_connection((host, int(port)), timeout=CONNECT_S)
        conn.sendall(struct.pack("!i", self.me))
        conn.settimeout(None)
        with self.lock:
            self.peers[0] = conn
        threading.Thread(target=self._watch, args=(0, conn), daemon=True).start()

    # -- both
    def _watch(self, index: int, conn: socket.socket) -> None:
        try:
            kind = _read(conn, 1)
            if kind == _BYE:
                return
            if kind == _LOST:
                (lost,) = struct.unpack("!i", _read(conn, 4))
                self._stop(lost, "process 0 saw its connection close")
                return
            raise ConnectionError  # an unknown byte: treat the connection as broken
        except (OSError, struct.error):
            self._stop(index, "its connection closed")

    def _stop(self, lost: int, cause: str) -> None:
        if self.done:
            return
        claim_stop()
        if self.done:  # the command ended meanwhile (its goodbye was on the way)
            _STOPPING.release()
            return
        print(f"error: {_peer_lost([lost], cause, self.me, self.count)}", file=sys.stderr)
        exit_now(EXIT_PEER_LOST, [lost])

    def farewell(self) -> None:
        """This process's command ended: tell the other ends, which stop watching it."""
        self.done = True
        with self.lock:
            peers = list(self.peers.values())
        for conn in peers:
            try:
                conn.sendall(_BYE)
            except OSError:
                pass


def _read(conn: socket.socket, n: int) -> bytes:
    """`n` bytes from `conn`; ConnectionError if it closes first."""
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise ConnectionError("closed")
        data += chunk
    return data


_liveness: Liveness | None = None


def start_liveness() -> None:
    """Opens this process's liveness connections (`Liveness`) once JAX's distributed runtime
    runs with more than one process. Only a command may (`train.core.cli`): the command's end
    says goodbye (`farewell`), and a process that ended without it would stop the others. A
    connection that cannot be made leaves that process to JAX's heartbeats (a warning says
    so)."""
    global _liveness
    if _liveness is not None or not jax.distributed.is_initialized():
        return
    me, count = jax.process_index(), jax.process_count()
    if count < 2:
        return
    from jax._src import distributed  # the client of the running distributed runtime

    state = distributed.global_state
    liveness = Liveness(me, count)
    try:
        if me == 0:
            liveness.listen(state.client)
        else:
            # The coordinator runs in process 0: "host:port", "[v6 address]:port".
            host = state.coordinator_address.rsplit(":", 1)[0].strip("[]")
            liveness.connect(state.client, host)
    except Exception as e:  # noqa: BLE001 - a firewall, a slow process 0: not fatal
        print(
            f"warning: no liveness connection to process 0 ({e}); a lost process is found "
            "by JAX's heartbeats instead",
            file=sys.stderr,
        )
        return
    _liveness = liveness


def farewell() -> None:
    """This process's command ended (any exit code): its liveness connections close without
    stopping the other processes."""
    if _liveness is not None:
        _liveness.farewell()
