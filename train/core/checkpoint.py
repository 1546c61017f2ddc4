"""What a work directory holds between runs: orbax checkpoints and the run config.

Its files::

  W/config.json        the run config, so `--workdir W` alone resumes the same run
  W/checkpoints/<step> orbax checkpoints: item 'state' (the TrainState pytree, global layout)
                       and item 'meta' (JSON: elapsed training seconds, ...), plus the
                       validation metrics orbax ranks by
  W/checksums/<step>.json  the sha256 of every file of that checkpoint, checked on restore

W may be remote (gs://bucket/run): see train.core.workdir for what lives where.

The last `keep` checkpoints are kept, and the best one by validation loss on top of those.
A checkpoint that cannot be read is an error naming its path; nothing is ever deleted or
overwritten to get past it.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath
from orbax.checkpoint.checkpoint_managers import preservation_policy as ocp_keep

from train.core.errors import CheckpointError
from train.core.state import TrainState
from train.core.workdir import files_below, is_remote, local_dir, push
from transformer_jax.files import file_sha256

CONFIG_FILE = "config.json"
CHECKPOINT_DIR = "checkpoints"
CHECKSUM_DIR = "checksums"
BEST_METRIC = "val_loss"


class _QuietUnrankedSaves(logging.Filter):
    """orbax warns on every save without metrics when a best_fn is set; ours are deliberate
    (SIGTERM and periodic saves between evaluations). Installed on the absl logger by the
    first `Checkpoints` (importing this module changes no logger)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "did not provide metrics" not in record.getMessage()


# One instance, so that every Checkpoints installs the same filter: addFilter keeps one copy.
_QUIET_UNRANKED_SAVES = _QuietUnrankedSaves()


def checkpoint_dir(workdir: str) -> str:
    """W/checkpoints: an absolute local path, or a URI under a remote W (orbax writes there
    itself; gs:// needs google-cloud-storage, the `gcs` extra)."""
    if is_remote(workdir):
        return str(workdir).rstrip("/") + "/" + CHECKPOINT_DIR
    return os.path.abspath(os.path.join(workdir, CHECKPOINT_DIR))


def has_checkpoint(workdir: str) -> bool:
    """Whether W/checkpoints holds a saved step (read without making the directory). orbax
    names a finished save by its step; one being written has a temporary name."""
    directory = epath.Path(checkpoint_dir(workdir))
    return directory.is_dir() and any(p.name.isdigit() for p in directory.iterdir())


class Checkpoints:
    """orbax CheckpointManager over W/checkpoints: keep the last `keep` and the best by
    `val_loss` (lowest). Saves are synchronous: the train step donates the state's buffers right
    after a save, and a SIGTERM save must be on disk before the process exits."""

    def __init__(self, workdir: str, *, keep: int = 3):
        if keep < 1:
            raise ValueError(f"keep_checkpoints: must be >= 1, got {keep}")
        logging.getLogger("absl").addFilter(_QUIET_UNRANKED_SAVES)
        # Remote (gs://...): orbax writes there itself; the checksums and the config live in
        # the local mirror and go up with `push` after each save.
        self.workdir = workdir
        self.directory = checkpoint_dir(workdir)
        policy = ocp_keep.AnyPreservationPolicy(
            [
                ocp_keep.LatestN(n=keep),
                ocp_keep.BestN(
                    get_metric_fn=_best_key,
                    reverse=True,
                    n=1,
                    keep_checkpoints_without_metrics=False,
                ),
            ]
        )
        options = ocp.CheckpointManagerOptions(
            best_fn=_best_key,
            best_mode="min",
            preservation_policy=policy,
            enable_async_checkpointing=False,
            create=True,
        )
        self.manager = ocp.CheckpointManager(
            self.directory, options=options, item_names=("state", "meta")
        )

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def best_step(self) -> int | None:
        return self.manager.best_step()

    def all_steps(self) -> list[int]:
        return list(self.manager.all_steps())

    def path(self, step: int) -> str:
        return f"{self.directory}/{step}"

    def save(
        self,
        state: TrainState,
        *,
        meta: Mapping[str, Any],
        metrics: Mapping[str, float] | None = None,
    ) -> bool:
        """Saves `state` (global layout) at its step; `metrics` must hold 'val_loss' to compete
        for best. Returns False (and writes nothing) if that step is already saved."""
        step = int(jax.device_get(state.step))
        if step in self.manager.all_steps():
            return False
        if metrics is not None and BEST_METRIC not in metrics:
            raise ValueError(f"checkpoint metrics need {BEST_METRIC!r}, got {sorted(metrics)}")
        self.manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(dict(meta))
            ),
            metrics=None if metrics is None else {k: float(v) for k, v in metrics.items()},
        )
        self.manager.wait_until_finished()
        if jax.process_index() == 0:
            self._write_checksums(step)
            push(self.workdir)  # a remote W: the files beside the checkpoint go up with it
        return True

    # ----------------------------------------------------------------- checksums
    # orbax checks a checkpoint's structure, not its bytes: a flipped bit in a data file
    # loads silently. So every file of a saved step gets a sha256, verified on restore.
    def checksum_path(self, step: int) -> str:
        return os.path.join(local_dir(self.workdir), CHECKSUM_DIR, f"{step}.json")

    def _file_hashes(self, step: int) -> dict[str, str]:
        return {name: file_sha256(path).hexdigest() for name, path in files_below(self.path(step))}

    def _write_checksums(self, step: int) -> None:
        path = self.checksum_path(step)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self._file_hashes(step), f, indent=0, sort_keys=True)
        os.replace(tmp, path)
        kept = {str(s) for s in self.all_steps()}
        for name in os.listdir(os.path.dirname(path)):  # steps the policy has deleted
            if name.endswith(".json") and name[: -len(".json")] not in kept:
                os.remove(os.path.join(os.path.dirname(path), name))

    def verify(self, step: int) -> str | None:
        """None if checkpoint `step`'s files match the checksums saved with it (or it predates
        checksums), else what differs."""
        path = self.checksum_path(step)
        if not os.path.exists(path):
            return None
        try:
            with open(path) as f:
                expected = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            return f"its checksum file {path} is unreadable ({e})"
        actual = self._file_hashes(step)
        for name, digest in sorted(expected.items()):
            if name not in actual:
                return f"{name} is missing"
            if actual[name] != digest:
                return f"{name} does not match the sha256 saved with it"
        return None

    def restore(
        self, template: TrainState, step: int | None = None
    ) -> tuple[TrainState, dict[str, Any]]:
        """Reads checkpoint `step` (default: the latest) into the structure, shapes and
        shardings of `template` (a global-layout state, arrays or ShapeDtypeStructs; leaves
        that are `ocp.PLACEHOLDER` are neither read nor built, and stay placeholders).
        Raises CheckpointError naming the path if it is missing or unreadable."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise CheckpointError(f"no checkpoint in {self.directory}")
        path = self.path(step)
        damage = self.verify(step)
        if damage is not None:
            others = [s for s in self.all_steps() if s < step and self.verify(s) is None]
            raise CheckpointError(
                f"checkpoint {path} is damaged: {damage}. Nothing was changed in "
                f"{self.directory}. "
                + (
                    f"The newest earlier checkpoint that verifies is step {others[-1]}: move "
                    f"{path} out of {self.directory} to resume from it."
                    if others
                    else "No earlier checkpoint verifies; start a new workdir."
                )
            )
        try:
            restored = self.manager.restore(
                step,
                args=ocp.args.Composite(state=_restore_args(template), meta=ocp.args.JsonRestore()),
            )
        except Exception as e:  # orbax raises many types; all mean "unusable" here
            others = [s for s in self.all_steps() if s != step]
            cause = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
            raise CheckpointError(
                f"checkpoint {path} could not be restored ({type(e).__name__}: {cause}). "
                f"Nothing was changed in {self.directory}; move that step directory away to "
                f"resume from an earlier one ({others or 'none left'}), or use a new workdir."
            ) from e
        state = restored["state"]
        if not isinstance(state, TrainState):  # keep the static tx of the template
            state = jax.tree.unflatten(jax.tree.structure(template), jax.tree.leaves(state))
        return state, dict(restored["meta"] or {})

    def close(self) -> None:
        self.manager.close()


def _restore_args(template: TrainState):
    """orbax's restore arguments for `template`: the standard restore of the whole state, or,
    when some leaves are placeholders, a partial PyTree restore of the others. (One manager
    must not mix the two: a manager registers one handler per item; see restore_for_inference,
    which uses a manager of its own.)"""
    leaves = jax.tree.leaves(template)
    if not any(x is ocp.PLACEHOLDER for x in leaves):
        return ocp.args.StandardRestore(jax.tree.map(ocp.utils.to_shape_dtype_struct, template))

    def restore_arg(x):
        if x is ocp.PLACEHOLDER:
            return x
        return ocp.ArrayRestoreArgs(sharding=x.sharding, global_shape=x.shape, dtype=x.dtype)

    abstract = jax.tree.map(
        lambda x: x if x is ocp.PLACEHOLDER else ocp.utils.to_shape_dtype_struct(x), template
    )
    return ocp.args.PyTreeRestore(abstract, restore_args=jax.tree.map(restore_arg, abstract))


def _best_key(metrics: Mapping[str, float]) -> float:
    return float(metrics[BEST_METRIC])


# ------------------------------------------------------------------------- run config
def save_run_config(workdir: str, config: Mapping[str, Any]) -> None:
    """Process 0 writes W/config.json (and a remote W gets it at once); the others read it."""
    if jax.process_index() != 0:
        return
    local = local_dir(workdir)
    os.makedirs(local, exist_ok=True)
    tmp = os.path.join(local, CONFIG_FILE + ".tmp")
    with open(tmp, "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    os.replace(tmp, os.path.join(local, CONFIG_FILE))
    push(workdir)


def load_run_config(workdir: str) -> dict[str, Any] | None:
    """The saved run config of `workdir` (read from the remote W itself when remote), or None
    if there is none."""
    path = epath.Path(workdir) / CONFIG_FILE
    try:
        if not path.exists():
            return None
        values = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(
            f"run config {path} is unreadable ({e}); restore it, or start a new --workdir"
        ) from e
    if not isinstance(values, dict):
        raise CheckpointError(
            f"run config {path} is not a JSON object (it holds a "
            f"{type(values).__name__}); restore it, or start a new --workdir"
        )
    return values


def config_mismatches(
    saved: Mapping[str, Any],
    given: Mapping[str, Any],
    *,
    may_change: tuple[str, ...] = (),
    prefix: str = "",
) -> list[str]:
    """Fields (dotted paths) whose values differ, as 'field: saved X, given Y' lines, ignoring
    the top-level fields in `may_change` (e.g. the step or time budget of a resumed run)."""
    out = []
    for key in sorted(set(saved) | set(given)):
        name = prefix + key
        if not prefix and key in may_change:
            continue
        a, b = saved.get(key, "<absent>"), given.get(key, "<absent>")
        if isinstance(a, Mapping) and isinstance(b, Mapping):
            out += config_mismatches(a, b, prefix=name + ".")
        elif a != b:
            out.append(f"{name}: saved {a!r}, given {b!r}")
    return out


def check_run_config(
    workdir: str,
    config: Mapping[str, Any],
    *,
    may_change: tuple[str, ...],
    normalize: Callable[[Mapping[str, Any]], Mapping[str, Any]] | None = None,
) -> list[str]:
    """An existing run config in `workdir` must match `config` except in `may_change` fields;
    else ValueError listing the differences. `normalize` maps the saved JSON to today's form
    of the same config (fields added since then at their defaults; a CheckpointError naming
    the file when it describes no such run). Writes nothing (see
    `save_run_config`). Returns the may-change fields that differ ('field: saved -> given')."""
    saved = load_run_config(workdir)
    if saved is None:
        return []
    if normalize is not None:  # raises CheckpointError when the file describes no such run
        saved = normalize(saved)
    diff = config_mismatches(saved, config, may_change=may_change)
    if diff:
        raise ValueError(
            f"{workdir} holds a run with a different config:\n  "
            + "\n  ".join(diff)
            + "\nResume it with --workdir alone (changing at most "
            f"{', '.join(may_change)}), or pick a new --workdir."
        )
    return [
        f"{k}: {saved.get(k)!r} -> {config.get(k)!r}"
        for k in may_change
        if saved.get(k) != config.get(k)
    ]
