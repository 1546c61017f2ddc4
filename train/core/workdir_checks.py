"""Whether a work directory can take a run (`check_workdir`), and taking back what a failed
start wrote in it (`taken_back_unless_saved`): a refused start leaves it as it found it.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterator, Mapping
from typing import Any

import jax

from train.core.checkpoint import (
    CONFIG_FILE,
    check_run_config,
    checkpoint_dir,
    has_checkpoint,
)
from train.core.processes import check_same_on_every_process
from train.core.task import Task, normal_form
from train.core.workdir import (
    LOCK_FILE,
    WorkdirError,
    entries_below,
    is_remote,
    local_dir,
    pull,
    remove_added,
)


@contextlib.contextmanager
def taken_back_unless_saved(workdir: str, *, made_lock: bool) -> Iterator[None]:
    """A start that fails (an error, a second Ctrl-C) while `workdir` holds no checkpoint
    leaves it as it found it: what the start added below it is removed (config.json,
    data.json, the tokenizer and token cache, metrics, an empty checkpoints/, W/.lock when
    `made_lock`), on a remote W in the bucket and the mirror, and nothing that was there
    before. W itself stays, for W/error.log.

    A work directory belongs to a run only once it holds a checkpoint: a start refused for
    bad data must not leave a config.json and the data's sha256 that refuse the corrected
    command. A run with a checkpoint (resumed, or saved during this start) loses nothing.
    Process 0 writes W's files, so it alone takes them back."""
    if jax.process_index() != 0 or has_checkpoint(workdir):
        yield
        return
    before = {root: entries_below(root) for root in {local_dir(workdir), workdir}}
    if made_lock:
        before[local_dir(workdir)].discard(LOCK_FILE)
    try:
        yield
    except BaseException:
        if not has_checkpoint(workdir):
            for root, entries in before.items():
                try:
                    remove_added(root, entries)
                except OSError as e:  # the error that stopped the run is the one to report
                    print(f"could not remove what this start wrote in {root}: {e}", file=sys.stderr)
        raise


def check_workdir(
    task: Task, workdir: str, run_config: Mapping[str, Any], may_change: tuple[str, ...]
) -> list[str]:
    """Whether `workdir` can take this run, before anything is written or prepared: the run
    it holds (if any) is this one, past one process every process was given the same run,
    and its checkpoint directory can be written. Pulls a remote W's files into the mirror.
    -> the may-change fields the run changes ('field: saved -> given'), when it resumes a
    checkpoint (a run that starts from step 0 changes nothing it has used)."""
    if jax.process_count() > 1:  # a flag missing on one host: an error on every host, not a hang
        check_same_on_every_process(
            json.dumps(run_config, sort_keys=True), "the run's settings (flags)"
        )
    path = os.path.join(workdir, CONFIG_FILE)
    changed = check_run_config(
        workdir,
        run_config,
        may_change=may_change,
        normalize=lambda saved: normal_form(task, saved, path=path),
    )
    if not is_remote(workdir) and jax.process_index() == 0:
        _check_writable(checkpoint_dir(workdir))
    pull(workdir)  # a remote W: its files (tokenizer, metrics, checksums) into the mirror
    return changed if has_checkpoint(workdir) else []


def _check_writable(directory: str) -> None:
    """A directory that exists but cannot take a new entry (read-only, or not a directory):
    found now, not at the first save after hours of training. Probed by making an entry,
    since a mode check says nothing to root."""
    if not os.path.lexists(directory):
        return
    probe = os.path.join(directory, f".write-test-{os.getpid()}")
    try:
        os.mkdir(probe)
        os.rmdir(probe)
    except OSError as e:
        raise WorkdirError(
            f"checkpoint directory {directory} is not writable ({e.strerror}); "
            "make it writable, or use another --workdir"
        ) from e
