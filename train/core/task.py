"""The `Task` protocol and the one run every task shares.

A task (translation, language modelling) says how to build its model, its data, its loss and
its evaluation; `train_and_evaluate(task, config, workdir)` does the rest once for all of them:
distributed start-up, the work-directory config check, placement, fresh state from the seed,
resume, the training loop, checkpoints and the final evaluation hand-off.

    train_and_evaluate(TRANSLATION, config, "runs/x")   # what train.translate.train_and_evaluate is
"""
from __future__ import annotations

import json
import os
import time
from typing import Any, Callable, Iterator, Mapping, Protocol, Sequence

import flax.linen as nn
import jax
import numpy as np
from jax.experimental import multihost_utils

from train.core.checkpoint import (Checkpoints, check_run_config, load_run_config,
                                   save_run_config)
from train.core.config import RunConfig, config_from_dict, config_to_dict
from train.core.loop import FitResult, LoopConfig, fit, printer, stop_on_signals
from train.core.parallel import (DataParallel, check_same_on_every_process,
                                 maybe_initialize_distributed)
from train.core.state import TrainState, count_params
from train.core.step import LossFn
from train.core.workdir import WorkdirLock, is_remote, local_dir, pull, push
from transformer_jax.optim import OptimizerConfig, find_params_ema, make_optimizer

PyTree = Any


class TaskData(Protocol):
    """What a task prepared for one run: the training stream and its evaluations."""

    def batches(self, start_step: int, rows: Callable[[int], slice] | None = None
                ) -> Iterator[Mapping[str, Any]]:
        """The global batch of step `start_step`, then the next, ... (host arrays): only the
        rows `rows(N)` of each N-row batch when given (this process's share), built from the
        same global plan on every process."""

    # Optional: example_batches(rows) -> one host batch of each shape `batches(..., rows)` can
    # yield, in its format; the train step is then compiled for all of them before step 1.
    # A task whose stream has one shape leaves it out (its step compiles at step 1 anyway).

    def evaluate(self, dp: DataParallel, eval_step: Callable, params: PyTree) -> dict[str, float]:
        """Validation figures ('loss' ranks the checkpoints) of `params` (global layout)."""

    def finish(self, *, workdir: str, dp: DataParallel, eval_step: Callable, model: nn.Module,
               state: TrainState, params: PyTree, validation: dict[str, float],
               start: float) -> dict[str, Any]:
        """The final evaluation after training (test figures, files, plots) -> the entries it
        adds to the run's final metrics."""


class Task(Protocol):
    """A kind of training run. `choice_flag` names what the run trains on or with (the
    translation model, the LM dataset); `config_cls` is the task's RunConfig subclass."""

    name: str
    choice_flag: str
    default_choice: str
    config_cls: type
    presets: Sequence[str]

    def choices(self) -> list[str]: ...

    def model_config_cls(self, choice: str) -> type: ...

    def make_config(self, choice: str, preset: str, *, model_overrides: Mapping[str, Any] = (),
                    **run_overrides) -> RunConfig: ...

    def build_model(self, config: RunConfig) -> nn.Module: ...

    def optimizer_config(self, config: RunConfig) -> OptimizerConfig: ...

    def init_params(self, config: RunConfig, model: nn.Module, rng: jax.Array
                    ) -> tuple[PyTree, PyTree]:
        """-> (params, the initial carried state `extra` or None), traceable under jit."""

    def loss_fn(self, config: RunConfig, model: nn.Module) -> LossFn: ...

    def prepare(self, config: RunConfig, workdir: str, dp: DataParallel,
                log: Callable[[str], None]) -> TaskData: ...

    def describe(self, config: RunConfig) -> str:
        """The model's name in log lines."""


def config_from_saved(task: Task, values: Mapping[str, Any]) -> RunConfig:
    """A task's config from its saved JSON form."""
    choice = values.get(task.choice_flag, task.default_choice)
    return config_from_dict(task.config_cls, task.model_config_cls(choice), values)


def normal_form(task: Task, values: Mapping[str, Any]) -> dict[str, Any]:
    """Saved JSON -> config -> JSON: fields added since it was saved get their defaults, so an
    older work directory compares equal to the same run described today."""
    return config_to_dict(config_from_saved(task, values))


def init_state(task: Task, config: RunConfig, model: nn.Module, tx,
               dp: DataParallel) -> TrainState:
    """Fresh float32 params, optimizer state and carried state from the seed, in the global
    layout."""

    def create(seed):
        init_rng, train_rng = jax.random.split(jax.random.PRNGKey(seed))
        params, extra = task.init_params(config, model, init_rng)
        return TrainState.create(params=params, tx=tx, rng=train_rng, extra=extra)

    return dp.init_state(create, config.seed)


def eval_params(state: TrainState) -> PyTree:
    """The parameters to evaluate and decode with: the moving average when the optimizer
    keeps one (ema_decay > 0), else the trained parameters themselves."""
    ema = find_params_ema(state.opt_state)
    return state.params if ema is None else ema


def restore_for_inference(task: Task, workdir: str, *, step: int | None = None,
                          dp: DataParallel | None = None):
    """-> (config, model, state, dp) of a trained work directory's checkpoint `step`
    (default: the best by validation loss, else the latest)."""
    saved = load_run_config(workdir)
    if saved is None:
        raise FileNotFoundError(f"{workdir} has no config.json: not a train.{task.name} work "
                                "directory")
    pull(workdir)  # a remote W: the checksums (and the tokenizer) beside the checkpoints
    config = config_from_saved(task, saved)
    checkpoints = Checkpoints(workdir, keep=config.keep_checkpoints)
    try:
        if checkpoints.latest_step() is None:
            raise FileNotFoundError(f"no checkpoint in {checkpoints.directory}: train first")
        step = checkpoints.best_step() if step is None else step
        dp = dp or DataParallel("jit", sharding=config.sharding)
        model = task.build_model(config)
        tx, _ = make_optimizer(task.optimizer_config(config))
        template = init_state(task, config, model, tx, dp)  # what to restore into
        state, _ = checkpoints.restore(template, step)
    finally:
        checkpoints.close()
    return config, model, state, dp


def train_and_evaluate(task: Task, config: RunConfig, workdir: str) -> dict[str, Any]:
    """Trains (or resumes) `config` in `workdir`, then evaluates; returns the final metrics:
    step, stop reason, params (count), train_seconds (summed over resumed runs), and what the
    task's evaluation adds (val_/test_ figures, ...)."""
    t0 = time.monotonic()
    maybe_initialize_distributed(config.distributed)
    check_same_on_every_process(workdir if is_remote(workdir) else os.path.abspath(workdir),
                                "--workdir")
    # From here on SIGTERM / SIGINT only set a flag (after JAX's own start-up, whose
    # preemption notifier would otherwise take SIGTERM): a signal during data preparation or
    # compilation stops the run cleanly after its first step, with a checkpoint.
    with stop_on_signals() as stop, WorkdirLock(workdir):
        return _train_and_evaluate(task, config, workdir, start=t0, stop=stop)


def _train_and_evaluate(task: Task, config: RunConfig, workdir: str, *, start: float,
                        stop) -> dict[str, Any]:
    run_config = config_to_dict(config)
    several = jax.process_count() > 1
    if several:  # a flag missing on one host: an error on every host, not a hang
        check_same_on_every_process(json.dumps(run_config, sort_keys=True),
                                    "the run's settings (flags)")
    changed = check_run_config(workdir, run_config, may_change=config.MAY_CHANGE,
                               normalize=lambda saved: normal_form(task, saved))
    if load_run_config(workdir) is None:
        # First thing on disk: a run killed during data preparation or before its first
        # checkpoint resumes as itself with --workdir alone. Process 0 writes it.
        save_run_config(workdir, run_config)
    pull(workdir)  # a remote W: its files (tokenizer, metrics, checksums) into the mirror
    files = local_dir(workdir)
    log = printer()
    if changed:
        log("resuming with changed settings: " + "; ".join(changed))
    dp = DataParallel(config.parallel, sharding=config.sharding)
    eval_dp = dp if dp.mode == "jit" else DataParallel("jit")
    # Past one process, process 0 prepares first (TFDS builds the datasets, the tokenizer is
    # trained and written, and pushed when W is remote) and the others then read what it
    # wrote: two writers of the same files would race.
    if several and jax.process_index() != 0:
        multihost_utils.sync_global_devices("train: process 0 prepared the data")
        pull(workdir)
    data = task.prepare(config, files, dp, log)
    if several and jax.process_index() == 0:
        push(workdir)
        multihost_utils.sync_global_devices("train: process 0 prepared the data")
    log(f"prepared in {time.monotonic() - start:.1f}s")

    model = task.build_model(config)
    tx, schedule = make_optimizer(task.optimizer_config(config))
    state = init_state(task, config, model, tx, eval_dp)
    log(f"model: {task.describe(config)} ({config.preset}), {count_params(state.params):,} "
        "parameters")
    loss_fn = task.loss_fn(config, model)
    eval_step = eval_dp.compile_eval_step(loss_fn, state)

    def evaluate(global_state: TrainState) -> dict[str, float]:
        return data.evaluate(eval_dp, eval_step, eval_params(global_state))

    examples = getattr(data, "example_batches", None) if config.compile_ahead else None

    fitted: FitResult = fit(
        state, workdir=workdir, run_config=run_config, dp=dp, loss_fn=loss_fn,
        lr_schedule=schedule,
        # Each process builds only its own rows of every global batch.
        batches=lambda step: data.batches(step, dp.local_rows),
        keep_checkpoints=config.keep_checkpoints,
        config=LoopConfig.from_run(config, start=start), evaluate=evaluate, log=log,
        stop=stop, changes=changed,
        example_batches=examples(dp.local_rows) if examples else None)
    state, final = fitted.state, fitted.summary()
    final.update(params=count_params(state.params), train_seconds=fitted.elapsed)
    if fitted.interrupted:
        return final
    validation = fitted.last_eval or evaluate(state)
    final.update(data.finish(workdir=files, dp=eval_dp, eval_step=eval_step, model=model,
                             state=state, params=eval_params(state), validation=validation,
                             start=start))
    push(workdir)  # the test figures, translations and plots
    return final


def default_workdir(task: Task, config: RunConfig) -> str:
    """runs/<task>-<choice>-<preset>-<time>: a new directory for a run given no --workdir.
    Past one process, process 0's time names it for all (each clock would name its own)."""
    stamp = int(time.time())
    if jax.process_count() > 1:
        stamp = int(multihost_utils.broadcast_one_to_all(np.int64(stamp)))
    return os.path.join("runs", f"{task.name}-{getattr(config, task.choice_flag)}-"
                                f"{config.preset}-"
                                f"{time.strftime('%Y%m%d-%H%M%S', time.localtime(stamp))}")
