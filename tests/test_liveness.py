"""The liveness connections of a multi-process run (`train.core.peers.Liveness`), in one
process: three ends on the loopback, a dict for the coordination service's key-value store,
and the process's exit recorded instead of taken. (tests/test_multiprocess.py kills a real
process of a real two-process run.)"""

from __future__ import annotations

import socket
import threading
import time

import pytest

from train.core import peers
from train.core.errors import EXIT_PEER_LOST


class _Store:
    """The two calls of the coordination service's client that Liveness makes."""

    def __init__(self):
        self.values, self.set = {}, threading.Event()

    def key_value_set(self, key, value):
        self.values[key] = value
        self.set.set()

    def blocking_key_value_get(self, key, timeout_ms):
        assert self.set.wait(timeout_ms / 1000)
        return self.values[key]


@pytest.fixture
def three(monkeypatch):
    """Process 0, 1 and 2's Liveness, connected -> (ends, exits: [(process, code, lost)])."""
    exits, stopped = [], threading.local()

    def exit_now(code, lost=None):  # records, relays as the real one does, ends the thread
        me = stopped.me
        exits.append((me, code, lost))
        if me == 0:
            ends[0].relay(lost)

    def stop(self, lost, cause):
        stopped.me = self.me
        original_stop(self, lost, cause)

    original_stop = peers.Liveness._stop
    monkeypatch.setattr(peers, "exit_now", exit_now)
    monkeypatch.setattr(peers, "claim_stop", lambda: None)  # three "processes" in one
    monkeypatch.setattr(peers.Liveness, "_stop", stop)
    store = _Store()
    ends = [peers.Liveness(i, 3) for i in range(3)]
    ends[0].listen(store)
    for end in ends[1:]:
        end.connect(store, "127.0.0.1")
    _until(lambda: len(ends[0].peers) == 2)
    yield ends, exits
    for end in ends:  # the test's end: no watch may stop anything from here on
        end.done = True
    for end in ends:
        for conn in end.peers.values():
            conn.close()


def _until(condition, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "not within 10 s"
        time.sleep(0.01)


def _die(end: peers.Liveness) -> None:
    """The process of `end` dies: the kernel closes its connections, no goodbye said (and its
    own watches, which die with it, must not record an exit here)."""
    end.done = True
    for conn in end.peers.values():
        try:
            conn.shutdown(socket.SHUT_RDWR)
        except OSError:  # the other end closed first
            pass
        conn.close()


def test_a_lost_process_is_named_by_process_0_to_every_other_one(three, capfd):
    ends, exits = three
    _die(ends[2])
    _until(lambda: len(exits) == 2)
    assert sorted(exits) == [(0, EXIT_PEER_LOST, [2]), (1, EXIT_PEER_LOST, [2])]
    lines = sorted(capfd.readouterr().err.splitlines())
    assert lines == [
        "error: process 2 (of 3) was lost (its connection closed); process 0 stops too. Start "
        "every process again with the same --workdir: the run resumes from its last checkpoint",
        "error: process 2 (of 3) was lost (process 0 saw its connection close); process 1 "
        "stops too. Start every process again with the same --workdir: the run resumes from "
        "its last checkpoint",
    ]


def test_a_lost_process_0_is_named_by_the_others(three):
    ends, exits = three
    _die(ends[0])
    _until(lambda: len(exits) == 2)
    assert sorted(exits) == [(1, EXIT_PEER_LOST, [0]), (2, EXIT_PEER_LOST, [0])]


def test_a_process_whose_command_ended_stops_no_one(three):
    ends, exits = three
    ends[2].farewell()  # its command returned (any exit code), then the process exits
    _die(ends[2])
    ends[0].farewell()
    _die(ends[0])
    time.sleep(0.5)  # the watches have read the goodbyes and the closes
    assert exits == []
    # The goodbye ended each watch: process 1's end is still open, unwatched.
    assert ends[1].peers[0].fileno() != -1


def test_process_0_unable_to_listen_lets_the_others_go_on_at_once(monkeypatch):
    """No port for process 0 (a sandbox, a firewall): it says so in the store, so the others
    do not wait a minute for an address that will never come; each start says it goes without
    (JAX's heartbeats remain)."""

    def refused(*args, **kwargs):
        raise OSError("no sockets here")

    monkeypatch.setattr(socket, "create_server", refused)
    store = _Store()
    with pytest.raises(OSError, match="no sockets here"):
        peers.Liveness(0, 2).listen(store)
    # The address published is "": process 1 learns at once that there is none (else its
    # wait for one would end, a minute later, in the store's AssertionError).
    with pytest.raises(ConnectionError, match="process 0 could not listen"):
        peers.Liveness(1, 2).connect(store, "127.0.0.1")
    assert store.values[peers._ADDRESS_KEY] == ""
