"""The `Task` protocol every kind of run follows, the state a run starts from, and what
a task's evaluation is handed (`EvalContext`).

A task (translation, language modelling) says how to build its model, its data, its loss and
its evaluation; `train.core.run.train_and_evaluate(task, config, workdir)` does the rest, and
`train.core.inference` reads back what a run saved.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from train.core.checkpoint import (
    CONFIG_FILE,
    CheckpointError,
)
from train.core.config import RunConfig, config_from_dict, config_to_dict
from train.core.metrics import MetricsWriter
from train.core.parallel import (
    DataParallel,
)
from train.core.state import TrainState
from train.core.step import LossFn
from transformer_jax.optim import OptimizerConfig, find_params_ema

PyTree = Any
Rows = Callable[[int], slice]  # a global batch's row count -> this process's rows of it


@dataclasses.dataclass(frozen=True)
class EvalContext:
    """What every evaluation of one run shares, built once by `train_and_evaluate` when the
    evaluation step is compiled and handed to the task's `start` and `finish`."""

    workdir: str  # the local work directory (a remote W's mirror), for translations and plots
    dp: DataParallel  # evaluation's layout: jit over every device
    eval_step: Callable  # (params, batch) -> summed metrics (DataParallel.compile_eval_step)
    model: nn.Module
    writer: MetricsWriter
    started: float  # time.monotonic() when the run started: total_seconds in test records


class TaskData(Protocol):
    """What a task prepared for one run: the training stream and its evaluations."""

    def batches(self, start_step: int, rows: Rows | None = None) -> Iterator[Mapping[str, Any]]:
        """The global batch of step `start_step`, then the next, ... (host arrays): only the
        rows `rows(N)` of each N-row batch when given (this process's share), built from the
        same global plan on every process."""

    def example_batches(self, rows: Rows | None = None) -> list[Mapping[str, Any]]:
        """One host batch of each shape `batches(..., rows)` can yield, in its format: the
        train step is compiled for all of them before step 1 (RunConfig.compile_ahead)."""

    def evaluate(self, dp: DataParallel, eval_step: Callable, params: PyTree) -> dict[str, float]:
        """Validation figures ('loss' ranks the checkpoints) of `params` (global layout)."""

    def start(self, ctx: EvalContext, params: PyTree) -> None:
        """Before the first step of a new run (not a resumed one): what the task measures of
        the model it starts from (a pretrained model's BLEU; nothing for a random one)."""

    def finish(
        self, ctx: EvalContext, step: int, params: PyTree, validation: dict[str, float]
    ) -> dict[str, Any]:
        """The final evaluation of `params` after training to `step` (test figures, files,
        plots; its metrics lines through `ctx.writer`), given the last validation figures ->
        the entries it adds to the run's final metrics."""


class Task(Protocol):
    """A kind of training run. `choice_flag` names what the run trains on or with (the
    translation model, the LM dataset); `config_cls` is the task's RunConfig subclass."""

    name: str
    choice_flag: str
    default_choice: str
    config_cls: type[RunConfig]
    presets: Sequence[str]

    def choices(self) -> list[str]: ...

    def model_config_cls(self, choice: str) -> type: ...

    def make_config(
        self, choice: str, preset: str, *, model_overrides: Mapping[str, Any] = (), **run_overrides
    ) -> RunConfig: ...

    def build_model(self, config: RunConfig) -> nn.Module: ...

    def optimizer_config(self, config: RunConfig) -> OptimizerConfig: ...

    def init_params(
        self, config: RunConfig, model: nn.Module, rng: jax.Array
    ) -> tuple[PyTree, PyTree]:
        """-> (params, the initial carried state `extra` or None), traceable under jit."""

    def initial_params(self, config: RunConfig) -> PyTree | None:
        """The weights a new run starts from instead of init_params' (a pretrained model's,
        host arrays of the same tree), or None: from the seed. Read only when the run has no
        checkpoint yet."""

    def loss_fn(self, config: RunConfig, model: nn.Module) -> LossFn: ...

    def prepare(
        self, config: RunConfig, workdir: str, dp: DataParallel, log: Callable[[str], None]
    ) -> TaskData: ...

    def describe(self, config: RunConfig) -> str:
        """The model's name in log lines."""


def config_from_saved(
    task: Task, values: Mapping[str, Any], *, path: str = CONFIG_FILE
) -> RunConfig:
    """A task's config from its saved JSON form (read from `path`): one that does not
    describe a run of this task is a CheckpointError naming the file."""
    try:
        choice = values.get(task.choice_flag, task.default_choice)
        return config_from_dict(task.config_cls, task.model_config_cls(choice), values)
    except (ValueError, TypeError, KeyError) as e:
        raise CheckpointError(
            f"run config {path} does not describe a run this version can resume (of "
            f"train.{task.name}; {type(e).__name__}: {e}). Start a new --workdir, or edit "
            "that file to today's fields (see the README's 'Reliability' section)."
        ) from e


def normal_form(
    task: Task, values: Mapping[str, Any], *, path: str = CONFIG_FILE
) -> dict[str, Any]:
    """Saved JSON -> config -> JSON: fields added since it was saved get their defaults, so an
    older work directory compares equal to the same run described today."""
    return config_to_dict(config_from_saved(task, values, path=path))


def init_state(
    task: Task,
    config: RunConfig,
    model: nn.Module,
    tx,
    dp: DataParallel,
    *,
    params: PyTree | None = None,
) -> TrainState:
    """Fresh float32 params, optimizer state and carried state from the seed, in the global
    layout; with `params` (`Task.initial_params`), those weights instead of init_params',
    and the optimizer state (its parameter average too) made from them."""
    create = state_maker(task, config, model, tx)
    if params is None:
        return dp.init_state(create, config.seed)
    return dp.init_state(create, config.seed, params)


def state_maker(task: Task, config: RunConfig, model: nn.Module, tx):
    def create(seed, start_params=None):
        init_rng, train_rng = jax.random.split(jax.random.PRNGKey(seed))
        params, extra = task.init_params(config, model, init_rng)
        if start_params is not None:  # the random ones are then dead code, left out by XLA
            params = jax.tree.map(lambda x: x.astype(jnp.float32), start_params)
        return TrainState.create(params=params, tx=tx, rng=train_rng, extra=extra)

    return create


def eval_params(state: TrainState) -> PyTree:
    """The parameters to evaluate and decode with: the moving average when the optimizer
    keeps one (ema_decay > 0), else the trained parameters themselves."""
    ema = find_params_ema(state.opt_state)
    return state.params if ema is None else ema


def default_workdir(task: Task, config: RunConfig) -> str:
    """runs/<task>-<choice>-<preset>-<time>: a new directory for a run given no --workdir.
    Past one process, process 0's time names it for all (each clock would name its own)."""
    stamp = int(time.time())
    if jax.process_count() > 1:
        stamp = int(multihost_utils.broadcast_one_to_all(np.int64(stamp)))
    return os.path.join(
        "runs",
        f"{task.name}-{getattr(config, task.choice_flag)}-"
        f"{config.preset}-"
        f"{time.strftime('%Y%m%d-%H%M%S', time.localtime(stamp))}",
    )


# What this module held before the run, inference and work-directory checks moved to their
# own modules: still importable from here (an import of them from train.core.task works).
_MOVED = {
    "train_and_evaluate": "train.core.run",
    "prepare_data": "train.core.run",
    "log_stop": "train.core.run",
    "restore_for_inference": "train.core.inference",
    "params_for_inference": "train.core.inference",
    "saved_config": "train.core.inference",
    "inference_template": "train.core.inference",
    "average_last_checkpoints": "train.core.inference",
    "average_checkpoints": "train.core.inference",
    "check_workdir": "train.core.workdir_checks",
    "taken_back_unless_saved": "train.core.workdir_checks",
}


def __getattr__(name: str):
    if name in _MOVED:
        return getattr(importlib.import_module(_MOVED[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
