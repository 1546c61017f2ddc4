"""A multi-process run that loses a process ends in seconds, readably, on every survivor.

When one process dies (killed, its host lost), the others learn it from the next collective,
which fails at once (gloo: "Connection reset by peer"). A survivor then names the lost
process (the other one of two; past two, the one JAX's coordination service no longer counts
alive, if it knows within NAMING_S) and ends at once with EXIT_PEER_LOST. Left to itself it
would wait in JAX's shutdown barrier for the dead process, then abort with a C++ stack trace
when the service declares that process dead (its heartbeats stopped for HEARTBEAT_TIMEOUT_S,
set when the distributed runtime starts). Nothing saved is lost: the last checkpoint is whole
(a save is a barrier of every process), and starting every process again resumes from it.
"""

from __future__ import annotations

import os
import sys
import time

import jax

from train.core.errors import PeerLost

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
    who = (
        f"process {', '.join(map(str, lost))} (of {jax.process_count()})"
        if lost
        else f"another process (of {jax.process_count()})"
    )
    first = text.strip().splitlines()[0] if text.strip() else type(error).__name__
    return PeerLost(
        f"{who} was lost ({first}); process {jax.process_index()} stops too. Start every "
        "process again with the same --workdir: the run resumes from its last checkpoint"
    )


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


def exit_now(code: int) -> None:
    """Ends the process with `code` without the interpreter's exit, whose JAX shutdown
    barrier would wait for the lost process and then abort."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
