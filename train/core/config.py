"""The run config every task shares, and its round trip through W/config.json.

A task's config (`train.translate.TranslateConfig`, `train.lm.LMConfig`) is a frozen dataclass
that extends `RunConfig` with its own fields and holds the model's own frozen config in
`model_config`. Everything here is written once for every task: validation of the shared
fields, which fields a resumed run may change, the JSON form saved in the work directory and
the way back, and `replace` with model-field overrides.
"""

from __future__ import annotations

import dataclasses
import json
import math
import typing
from collections.abc import Mapping
from typing import Any, ClassVar

from train.core.errors import InputError, UsageError  # noqa: F401 - callers import them here

PARALLEL_MODES = ("jit", "pmap")
SHARDINGS = ("replicated", "fsdp")
# What a step with a NaN or infinite loss or gradient does: stop the run, or skip the update.
NONFINITE_POLICIES = ("stop", "skip")


def check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    """`value` must be one of `choices` (ValueError naming the field)."""
    if value not in choices:
        raise ValueError(f"{name}: expected one of {choices}, got {value!r}")


def check_parallel(mode: str, sharding: str) -> None:
    """The parallel mode and the sharding of the state, and whether they go together."""
    check_choice("parallel", mode, PARALLEL_MODES)
    check_choice("sharding", sharding, SHARDINGS)
    if sharding == "fsdp" and mode == "pmap":
        raise ValueError(
            "sharding: 'fsdp' needs parallel='jit' (pmap keeps a whole copy "
            "of the state on every device)"
        )


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """The fields of every training run.

    Attributes:
      preset: the named recipe this config started from (each task lists its own).
      model_config: the model's frozen config.
      steps: stop after this many optimizer steps (a resumed run may change it, not below
        its checkpoint's step). With fit_to_budget, the run's length when it has no time
        budget (minutes 0); given on a resume, where the run stops.
      minutes: also stop when this much wall time has passed since the start, data
        preparation included (0 = no limit); evaluation follows. Counted from each start: a
        resumed run gets the whole budget again.
      fit_to_budget: with a time budget (minutes), the run chooses its steps itself: it times
        its first steps after compiling (and a validation, when it validates within the
        budget), sets its length to the steps that fit the time left, and its learning-rate
        schedule decays over them (`train.core.budget`). The length is kept in the optimizer
        state, so a resumed run keeps it (a resumed run's steps does not move it; minutes
        still stops it). Without a budget the length is `steps`. A preset that sets it trains
        a given `steps` as a fixed count instead (`preset_run_fields`).
      seed: parameters, dropout and batch order all derive from it.
      parallel: 'jit' (Mesh + NamedSharding) or 'pmap'.
      distributed: initialise JAX's distributed runtime first (several processes).
      sharding: 'replicated' (every device holds all parameters and optimizer state) or
        'fsdp' (each leaf split over the devices along one axis, ZeRO-3 style; jit only). A
        resumed run may change it: the numbers are the same either way.
      log_every: log the training metrics every this many steps.
      eval_every: validate every this many steps (0: at the end only); a checkpoint is saved
        at each evaluation.
      checkpoint_every: save a checkpoint every this many steps too.
      keep_checkpoints: the last N are kept (and the best by validation loss).
      average_checkpoints: evaluate (the final validation, the test sets, decoding, and the
        task's inference commands) with the element-wise mean of the evaluation parameters
        of the last N checkpoints (0 = off: the final state's). Each checkpoint contributes
        what it would be evaluated with alone: its EMA when ema_decay keeps one. Needs
        keep_checkpoints >= N; a run that saved fewer averages those it has.
      data_dir: TFDS data directory (None: TFDS's default).
      cache_dir: where the token ids of the training data (the user's files, a TFDS dataset's
        splits) are cached, encoded once and read memory-mapped (train.data.token_cache;
        None: W/token_cache). Caches are named by a hash of the data and options, so runs may
        share one directory.
      progress: a progress bar on a terminal (a line per log interval otherwise).
      plots: write W/plots/ at the end.
      on_nonfinite: what a step with a NaN or infinite loss or gradient does (its update is
        never applied): 'stop' the run naming the step, or 'skip' it and go on.
      compile_ahead: lower the train step for every batch shape the task names before the
        first step and compile them in background threads while the first steps run (else
        each compiles when its first batch comes); the same executables either way, so the
        same losses.
    """

    preset: str = "cpu"
    model_config: Any = None
    steps: int = 100_000
    minutes: float = 0.0
    seed: int = 0
    parallel: str = "jit"
    sharding: str = "replicated"
    distributed: bool = False
    log_every: int = 100
    eval_every: int = 0
    checkpoint_every: int = 1000
    keep_checkpoints: int = 3
    average_checkpoints: int = 0
    data_dir: str | None = None
    cache_dir: str | None = None
    progress: bool = True
    plots: bool = True
    on_nonfinite: str = "stop"
    compile_ahead: bool = True
    # Not a may-change field: it adds the schedule's length to the optimizer state's tree.
    fit_to_budget: bool = False

    # Fields a resumed run may change: they do not alter the training trajectory. A task
    # adds its own (evaluation settings) with `RunConfig.MAY_CHANGE + (...)`.
    MAY_CHANGE: ClassVar[tuple[str, ...]] = (
        "steps",
        "minutes",
        "parallel",
        "sharding",
        "distributed",
        "log_every",
        "eval_every",
        "checkpoint_every",
        "keep_checkpoints",
        "average_checkpoints",
        "data_dir",
        "cache_dir",
        "progress",
        "plots",
        "on_nonfinite",
        "compile_ahead",
    )

    def __post_init__(self):
        if self.model_config is None:
            raise ValueError("model_config: build configs with the task's make_config(...)")
        check_parallel(self.parallel, self.sharding)
        for name in ("log_every", "keep_checkpoints"):
            _check(name, getattr(self, name), minimum=1)
        for name in ("steps", "eval_every", "checkpoint_every", "seed", "average_checkpoints"):
            _check(name, getattr(self, name), minimum=0)
        if self.average_checkpoints > self.keep_checkpoints:
            # The checkpoint manager deletes all but the last keep_checkpoints as it saves.
            raise ValueError(
                f"average_checkpoints: averaging the last {self.average_checkpoints} "
                f"checkpoints needs keep_checkpoints >= {self.average_checkpoints}, got "
                f"keep_checkpoints {self.keep_checkpoints}"
            )
        check_choice("on_nonfinite", self.on_nonfinite, NONFINITE_POLICIES)
        if not (math.isfinite(self.minutes) and self.minutes >= 0):
            raise ValueError(f"minutes: must be a finite number >= 0, got {self.minutes}")


def preset_run_fields(preset: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """A preset's run fields with the caller's `overrides` on top. A `steps` given without
    `fit_to_budget` is a fixed count: it turns off a preset's fitting to its time budget, so
    `--steps N` trains N steps on the schedule they name, as before presets fitted."""
    fields = {**preset, **overrides}
    if "steps" in overrides and "fit_to_budget" not in overrides:
        fields["fit_to_budget"] = False
    return fields


def _check(name: str, value: Any, *, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name}: must be an integer >= {minimum}, got {value!r}")


def check_positive(config: Any, names: tuple[str, ...], *, minimum: int = 1) -> None:
    """Each integer field in `names` must be >= `minimum` (ValueError naming the field)."""
    for name in names:
        _check(name, getattr(config, name), minimum=minimum)


def check_finite(config: Any, names: tuple[str, ...], *, positive: bool) -> None:
    """Each float field in `names` must be finite and > 0 (positive) or >= 0."""
    for name in names:
        value = getattr(config, name)
        ok = (
            isinstance(value, (int, float))
            and math.isfinite(value)
            and (value > 0 if positive else value >= 0)
        )
        if not ok:
            raise ValueError(
                f"{name}: must be a finite number {'>' if positive else '>='} 0, got {value!r}"
            )


# ------------------------------------------------------------------------- round trip
def field_hints(cls: type) -> dict[str, Any]:
    """{field name: resolved type hint} of a dataclass (Any where a hint cannot be resolved)."""
    try:
        hints = typing.get_type_hints(cls)
    except Exception:  # a hint naming something not importable here: treat loosely
        hints = {}
    return {f.name: hints.get(f.name, Any) for f in dataclasses.fields(cls)}


def from_dict(cls: type, values: Mapping[str, Any]) -> Any:
    """A dataclass from a JSON dict: lists become tuples where the field is a tuple; unknown
    keys are an error naming them."""
    hints = field_hints(cls)
    unknown = set(values) - set(hints)
    if unknown:
        raise ValueError(f"{cls.__name__} has no field(s) {sorted(unknown)}")
    fixed = {}
    for k, v in values.items():
        if isinstance(v, list) and typing.get_origin(hints[k]) is tuple:
            v = tuple(v)
        fixed[k] = v
    return cls(**fixed)


def config_to_dict(config: Any) -> dict[str, Any]:
    """A (nested) config dataclass -> JSON-able dict (dtypes and tuples made plain)."""
    return json.loads(json.dumps(dataclasses.asdict(config), default=_json_default))


def _json_default(x: Any):
    if hasattr(x, "dtype") and hasattr(x, "name"):  # a numpy/jax dtype or scalar type
        return str(x.name)
    if isinstance(x, type):
        return x.__name__
    return str(x)


def config_from_dict(run_cls: type, model_cls: type, values: Mapping[str, Any]) -> Any:
    """`run_cls` from its JSON form (model_config: a dict of `model_cls` fields). Fields the
    JSON lacks (a config saved before they existed) take their defaults."""
    values = dict(values)
    values["model_config"] = from_dict(model_cls, values["model_config"])
    return from_dict(run_cls, values)


def replace(config: Any, *, model_overrides: Mapping[str, Any] = (), **run_overrides) -> Any:
    """`config` with some run and model fields changed (validated again)."""
    model_config = config.model_config
    if model_overrides:
        model_config = dataclasses.replace(model_config, **dict(model_overrides))
    return dataclasses.replace(config, model_config=model_config, **run_overrides)
