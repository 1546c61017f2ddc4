"""Agreement between the processes of one run: every process must have been given the same
settings, checked before any of them waits in a collective the others never reach."""

from __future__ import annotations

import json
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from train.core.errors import ProcessesDisagree


def check_same_on_every_process(value: str, what: str) -> None:
    """Past one process, every process must pass the same `value` (a work directory on a
    shared filesystem, the run's settings as JSON): else a `ProcessesDisagree` (exit 2) on
    every process, before any of them waits in a collective the others never reach, naming
    what differs with each process's value (the JSON objects' fields that differ)."""
    if jax.process_count() == 1:
        return
    values = gather_strings(value)
    if len(set(values)) == 1:
        return
    error = ProcessesDisagree(
        f"{what}: the processes were given different values: {_differences(values)}; give "
        "every process the same one"
    )
    for i, v in enumerate(values):
        error.add_note(f"process {i}: {v}")
    raise error


def gather_strings(value: str) -> list[str]:
    """Every process's `value`, in process order (two all-gathers: the lengths, then the
    bytes padded to the longest)."""
    data = np.frombuffer(value.encode(), np.uint8)
    lengths = np.asarray(
        multihost_utils.process_allgather(np.asarray([data.size], np.int32))
    ).reshape(-1)
    padded = np.zeros(int(lengths.max()), np.uint8)
    padded[: data.size] = data
    every = np.asarray(multihost_utils.process_allgather(padded)).reshape(len(lengths), -1)
    return [bytes(row[:n]).decode() for row, n in zip(every, lengths, strict=True)]


def _differences(values: list[str]) -> str:
    """What differs between the processes' values: the fields of JSON objects that differ
    (dotted paths, nested objects flattened), else the values themselves."""

    def fields(text: str) -> dict[str, Any] | None:
        try:
            loaded = json.loads(text)
        except ValueError:
            return None
        if not isinstance(loaded, dict):
            return None
        flat: dict[str, Any] = {}

        def walk(prefix: str, node: Any) -> None:
            if isinstance(node, dict):
                for k, v in node.items():
                    walk(f"{prefix}{k}.", v)
            else:
                flat[prefix.rstrip(".")] = node

        walk("", loaded)
        return flat

    parsed = [fields(v) for v in values]
    if any(p is None for p in parsed):
        return ", ".join(f"process {i}: {v}" for i, v in enumerate(values))
    names = sorted({k for p in parsed for k in p if len({repr(q.get(k)) for q in parsed}) > 1})
    return "; ".join(
        f"{name} (" + ", ".join(f"process {i}: {p.get(name)!r}" for i, p in enumerate(parsed)) + ")"
        for name in names
    )
