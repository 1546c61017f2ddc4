"""The `Task` protocol and the one run every task shares.

A task (translation, language modelling) says how to build its model, its data, its loss and
its evaluation; `train_and_evaluate(task, config, workdir)` does the rest, once for all of
them and in this order: start, restore, loop, final save, evaluate, close.

    train_and_evaluate(TRANSLATION, config, "runs/x")   # what train.translate.train_and_evaluate is

It is the one owner of what a run holds: the distributed start, the work-directory lock, the
signal handlers, W/config.json, the checkpoints and the metrics writer each have one home here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from train.core.checkpoint import (
    CONFIG_FILE,
    CheckpointError,
    Checkpoints,
    check_run_config,
    checkpoint_dir,
    has_checkpoint,
    load_run_config,
    save_run_config,
)
from train.core.compile_cache import CacheTally
from train.core.config import RunConfig, UsageError, config_from_dict, config_to_dict
from train.core.loop import LoopConfig, LoopResult, printer, stop_on_signals, train_loop
from train.core.metrics import MetricsWriter
from train.core.parallel import (
    CompiledStep,
    DataParallel,
    check_same_on_every_process,
    maybe_initialize_distributed,
)
from train.core.state import TrainState, count_params
from train.core.step import LossFn
from train.core.workdir import (
    LOCK_FILE,
    WorkdirError,
    WorkdirLock,
    entries_below,
    is_remote,
    local_dir,
    pull,
    push,
    remove_added,
)
from transformer_jax.optim import OptimizerConfig, find_params_ema, make_optimizer

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
    create = _state_maker(task, config, model, tx)
    if params is None:
        return dp.init_state(create, config.seed)
    return dp.init_state(create, config.seed, params)


def _state_maker(task: Task, config: RunConfig, model: nn.Module, tx):
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


def restore_for_inference(
    task: Task, workdir: str, *, step: int | None = None, dp: DataParallel | None = None
):
    """-> (config, model, state, dp) of a trained work directory's checkpoint `step`
    (default: the best by validation loss, else the latest).

    Only what decoding reads comes back: the params and the optimizer's parameter average.
    Adam's moments and the carried state are neither built nor read (their leaves in the
    returned state are `ocp.PLACEHOLDER`), which halves the memory of a large model's
    inference."""
    config = saved_config(task, workdir)
    checkpoints = Checkpoints(workdir, keep=config.keep_checkpoints)
    try:
        if checkpoints.latest_step() is None:
            raise FileNotFoundError(f"no checkpoint in {checkpoints.directory}: train first")
        step = checkpoints.best_step() if step is None else step
        dp = dp or DataParallel("jit", sharding=config.sharding)
        model = task.build_model(config)
        state, _ = checkpoints.restore(inference_template(task, config, model, dp), step)
    finally:
        checkpoints.close()
    return config, model, state, dp


def params_for_inference(
    task: Task, workdir: str, *, step: int | None = None, dp: DataParallel | None = None
):
    """-> (config, model, params, dp) to decode with: the evaluation parameters of checkpoint
    `step` (default: the best, as `restore_for_inference`), or, when the run averages
    checkpoints (`average_checkpoints`) and no step is asked for, the mean of its last N, as
    its own evaluation used."""
    config = saved_config(task, workdir)
    if step is not None or not config.average_checkpoints:
        config, model, state, dp = restore_for_inference(task, workdir, step=step, dp=dp)
        return config, model, eval_params(state), dp
    dp = dp or DataParallel("jit", sharding=config.sharding)
    model = task.build_model(config)
    params, _ = average_last_checkpoints(task, config, workdir, model, dp)
    return config, model, params, dp


def saved_config(task: Task, workdir: str) -> RunConfig:
    """The run config of a trained work directory (pulling a remote W's local files)."""
    saved = load_run_config(workdir)
    if saved is None:
        raise FileNotFoundError(
            f"{workdir} has no config.json: not a train.{task.name} work directory"
        )
    pull(workdir)  # a remote W: the checksums (and the tokenizer) beside the checkpoints
    return config_from_saved(task, saved, path=os.path.join(workdir, CONFIG_FILE))


def inference_template(
    task: Task, config: RunConfig, model: nn.Module, dp: DataParallel
) -> TrainState:
    """The global-layout state of `config` as a restore template: shapes and shardings, nothing
    computed, with only the leaves decoding reads (the params and the optimizer's parameter
    average); the others are `ocp.PLACEHOLDER`, which orbax neither builds nor reads."""
    tx, _ = make_optimizer(task.optimizer_config(config))
    create = _state_maker(task, config, model, tx)
    abstract = jax.eval_shape(
        jax.jit(create, out_shardings=dp.state_shardings(jax.eval_shape(create, 0))), 0
    )
    keep = {id(x) for x in jax.tree.leaves(find_params_ema(abstract.opt_state))}
    return abstract.replace(
        opt_state=jax.tree.map(
            lambda x: x if id(x) in keep else ocp.PLACEHOLDER, abstract.opt_state
        ),
        extra=jax.tree.map(lambda _: ocp.PLACEHOLDER, abstract.extra),
    )


def average_last_checkpoints(
    task: Task, config: RunConfig, workdir: str, model: nn.Module, dp: DataParallel
) -> tuple[PyTree, list[int]]:
    """-> (the mean evaluation parameters of the last `config.average_checkpoints` checkpoints
    of `workdir`, their steps). Fewer are averaged when fewer were saved.

    A manager of its own: one orbax manager registers one handler per item, and the run's
    restores whole states (see checkpoint._restore_args)."""
    checkpoints = Checkpoints(workdir, keep=config.keep_checkpoints)
    try:
        steps = sorted(checkpoints.all_steps())[-config.average_checkpoints :]
        if not steps:
            raise FileNotFoundError(f"no checkpoint in {checkpoints.directory}: train first")
        template = inference_template(task, config, model, dp)
        return average_checkpoints(checkpoints, template, steps), steps
    finally:
        checkpoints.close()


def average_checkpoints(
    checkpoints: Checkpoints, template: TrainState, steps: Sequence[int]
) -> PyTree:
    """The element-wise mean of the evaluation parameters (`eval_params`: the EMA where the run
    keeps one) of checkpoints `steps`, restored into `template` (`inference_template`).

    One pass: each checkpoint is read once, only its evaluation parameters (the raw ones are
    not read when an EMA stands in for them), and added to a running sum in float32 (float64
    for float64 parameters), so memory holds two copies of the parameters whatever N. The mean
    has the parameters' own dtypes."""
    if not steps:
        raise ValueError("average_checkpoints: no checkpoint steps to average")
    if find_params_ema(template.opt_state) is not None:
        template = template.replace(params=jax.tree.map(lambda _: ocp.PLACEHOLDER, template.params))
    total = None
    for step in steps:
        state, _ = checkpoints.restore(template, step)
        params = eval_params(state)
        total = _sum_in_float32(params) if total is None else _accumulate(total, params)
        del state, params
    dtypes = [x.dtype for x in jax.tree.leaves(eval_params(template))]
    leaves = [(x / len(steps)).astype(d) for x, d in zip(jax.tree.leaves(total), dtypes)]
    return jax.tree.unflatten(jax.tree.structure(total), leaves)


@jax.jit
def _sum_in_float32(params: PyTree) -> PyTree:
    return jax.tree.map(lambda x: x.astype(jnp.promote_types(x.dtype, jnp.float32)), params)


@functools.partial(jax.jit, donate_argnums=0)
def _accumulate(total: PyTree, params: PyTree) -> PyTree:
    return jax.tree.map(lambda t, x: t + x.astype(t.dtype), total, params)


# ----------------------------------------------------------------------------- the run
def train_and_evaluate(task: Task, config: RunConfig, workdir: str) -> dict[str, Any]:
    """Trains (or resumes) `config` in `workdir`, then evaluates; returns the final metrics:
    step, stop reason, params (count), train_seconds (summed over resumed runs), and what the
    task's evaluation adds (`val_*` / `test_*` figures, ...).

    In order: open the run, restore its state, prepare the data, compile, train (the loop
    saves last), evaluate, close."""
    start = time.monotonic()
    # The distributed runtime (a no-op when the command started it) and one work directory
    # for every process; from here on SIGTERM / SIGINT only set a flag (after JAX's own
    # start-up, whose preemption notifier would otherwise take SIGTERM): a signal during data
    # preparation or compilation stops the run after its first step, saved.
    maybe_initialize_distributed(config.distributed)
    check_same_on_every_process(
        workdir if is_remote(workdir) else os.path.abspath(workdir), "--workdir"
    )
    # A start that fails before the run's first checkpoint takes back what it wrote in W.
    with (
        stop_on_signals() as stop,
        WorkdirLock(workdir) as lock,
        taken_back_unless_saved(workdir, made_lock=lock.made_file),
    ):
        log = printer()
        with _opened(task, config, workdir, log) as run:
            state, elapsed, carried = _restore(task, run, log)
            step = int(jax.device_get(state.step))
            data = prepare_data(task, config, workdir, run.dp, log)
            log(f"prepared in {time.monotonic() - start:.1f}s")
            log(
                f"model: {task.describe(config)} ({config.preset}), "
                f"{count_params(state.params):,} parameters"
            )
            loss_fn = task.loss_fn(config, run.model)
            ctx = EvalContext(
                workdir=local_dir(workdir),
                dp=run.eval_dp,
                eval_step=run.eval_dp.compile_eval_step(loss_fn, state),
                model=run.model,
                writer=run.writer,
                started=start,
            )

            def evaluate(global_state: TrainState) -> dict[str, float]:
                return data.evaluate(ctx.dp, ctx.eval_step, eval_params(global_state))

            if step == 0:
                data.start(ctx, eval_params(state))
            dstate = run.dp.put_state(state)
            train_step = _compiled_train_step(run, loss_fn, dstate, data, step, log)
            loop = LoopConfig.from_run(config, start=start, steps_given=_steps_given(run.changed))
            log(
                f"training from step {step} to "
                + (
                    "the steps that fit the time budget"
                    if config.fit_to_budget and loop.deadline
                    else f"{config.steps}"
                )
                + (
                    f" or until {_wall_clock(loop.deadline)} (--minutes {config.minutes:g} "
                    "from this start)"
                    if loop.deadline
                    else ""
                )
                + "; SIGTERM saves a checkpoint and stops"
            )
            try:
                result = train_loop(
                    dstate,
                    dp=run.dp,
                    train_step=train_step,
                    batches=data.batches(step, run.dp.local_rows),
                    config=loop,
                    writer=run.writer,
                    checkpoints=run.checkpoints,
                    evaluate=evaluate,
                    elapsed=elapsed,
                    stop=stop,
                    log=log,
                    carried=carried,
                )
            except BaseException:
                _end_compiles(train_step, wait=False)  # exit without compiling what is left
                raise
            # A short run may end before the background compilations: their log line comes
            # first. A signal's stop does not wait for those not started.
            _end_compiles(train_step, wait=not result.interrupted)
            state = run.dp.get_state(result.state)
            log_stop(result, state, train_step, workdir, log)
            final = {
                "step": int(jax.device_get(state.step)),
                "reason": result.reason,
                "params": count_params(state.params),
                "train_seconds": result.elapsed,
            }
            if result.skipped:
                final["skipped_steps"] = result.skipped
            if result.interrupted:
                return final
            final.update(_final_evaluation(task, run, data, ctx, state, result, final, log))
        push(workdir)  # the test figures, translations and plots
        return final


@dataclasses.dataclass(frozen=True)
class _Run:
    """What an opened run holds until it closes: its layouts, model, optimizer, checkpoints
    and metrics writer (one owner each: `_opened`)."""

    config: RunConfig
    workdir: str
    run_config: dict[str, Any]  # the config's JSON form, as W/config.json holds it
    changed: list[str]  # the may-change settings a resumed run changes ('f: saved -> given')
    dp: DataParallel  # training's layout (config.parallel)
    eval_dp: DataParallel  # evaluation's: jit (pmap runs evaluate under jit too)
    model: nn.Module
    tx: Any  # the optax transformation
    schedule: Callable  # its learning-rate schedule, for the logged rate
    checkpoints: Checkpoints
    writer: MetricsWriter


def _steps_given(changed: Sequence[str]) -> bool:
    """Whether a resume was given a --steps other than the run's ('steps: saved -> given' in
    its changed settings)."""
    return any(c.startswith("steps:") for c in changed)


@contextlib.contextmanager
def _opened(
    task: Task, config: RunConfig, workdir: str, log: Callable[[str], None]
) -> Iterator[_Run]:
    """Open a run in `workdir`: check that W can take it (and say what a resume changes),
    then build its layouts, model and optimizer and open its checkpoints and metrics, closed
    again on the way out whatever happens."""
    run_config = config_to_dict(config)
    changed = check_workdir(task, workdir, run_config, config.MAY_CHANGE)
    if changed:
        log("resuming with changed settings: " + "; ".join(changed))
    dp = DataParallel(config.parallel, sharding=config.sharding)
    tx, schedule = make_optimizer(task.optimizer_config(config))
    checkpoints = Checkpoints(workdir, keep=config.keep_checkpoints)
    latest = checkpoints.latest_step() if _steps_given(changed) else None
    if latest is not None and latest > config.steps:
        checkpoints.close()
        raise UsageError(
            f"--steps {config.steps}: the run in {workdir} is already at step {latest:,}; give "
            f"--steps {latest} or more, or leave it out to keep the run's own"
        )
    writer = MetricsWriter(workdir)
    try:
        yield _Run(
            config=config,
            workdir=workdir,
            run_config=run_config,
            changed=changed,
            dp=dp,
            eval_dp=dp if dp.mode == "jit" else DataParallel("jit"),
            model=task.build_model(config),
            tx=tx,
            schedule=schedule,
            checkpoints=checkpoints,
            writer=writer,
        )
    finally:
        writer.close()
        checkpoints.close()


def _restore(
    task: Task, run: _Run, log: Callable[[str], None]
) -> tuple[TrainState, float, list[dict]]:
    """The run's state (global layout): a fresh one from the seed (or the task's pretrained
    weights), or the latest checkpoint restored into it -> (state, the training seconds
    before this start, the interval metrics the checkpoint carried). Then W/config.json and
    the metrics are brought to that step."""
    config, checkpoints, writer = run.config, run.checkpoints, run.writer
    fresh = checkpoints.latest_step() is None
    start_params = task.initial_params(config) if fresh else None
    state = init_state(task, config, run.model, run.tx, run.eval_dp, params=start_params)
    del start_params
    elapsed, carried = 0.0, []
    if not fresh:
        state, meta = checkpoints.restore(state)
        elapsed = float(meta.get("elapsed", 0.0))
        carried = list(meta.get("interval_metrics", []))
        log(f"resumed from {checkpoints.path(checkpoints.latest_step())}")
    step = int(jax.device_get(state.step))
    # config.json once, after a restore that worked (a failed one changes nothing on disk)
    # and before anything slow, so a run killed from here on resumes as itself with
    # --workdir alone.
    save_run_config(run.workdir, run.run_config)
    # Lines past the restored step were logged by a run that died before saving them.
    writer.rewind(step)
    if run.changed:
        writer.write(step, "resume", {"changed": run.changed})
    writer.hparams(run.run_config)
    return state, elapsed, carried


def _compiled_train_step(
    run: _Run, loss_fn: LossFn, dstate: TrainState, data: TaskData, step: int, log
) -> Callable:
    """The run's train step, compiled ahead for every batch shape the data can yield
    (RunConfig.compile_ahead) when there are steps left to train: lowered here, compiled in
    background threads while the first steps run (a step whose shape is not ready waits for
    it or compiles it), and logged once all are compiled. The cache tally listens from here
    until the set is over, however it ends (compiled, failed, dropped by a stopping run)."""
    config, dp = run.config, run.dp
    train_step = dp.compile_train_step(loss_fn, dstate, lr_schedule=run.schedule)
    # A run fitted to its budget may train past `steps` (its length without one).
    if config.compile_ahead and (step < config.steps or config.fit_to_budget):
        t0 = time.monotonic()
        cache = CacheTally().__enter__()

        def compiled(ahead: int) -> None:
            cache.__exit__(None, None, None)
            if ahead:
                log(
                    f"compiled the train step for {ahead} batch shape(s) ahead in "
                    f"{time.monotonic() - t0:.1f}s{cache.describe()}"
                )

        try:
            batches = data.example_batches(dp.local_rows)
            dp.compile_ahead(train_step, dstate, batches, background=True, on_done=compiled)
        except BaseException:  # no set was started: nothing else will close the tally
            cache.__exit__(None, None, None)
            raise
    return train_step


def _end_compiles(train_step, *, wait: bool) -> None:
    """Waits for the train step's background compilations, or drops those not started."""
    if not isinstance(train_step, CompiledStep):
        return
    if wait:
        train_step.wait_compiled()
    else:
        train_step.cancel_compiles()


def _final_evaluation(
    task: Task,
    run: _Run,
    data: TaskData,
    ctx: EvalContext,
    state: TrainState,
    result: LoopResult,
    final: Mapping[str, Any],
    log: Callable[[str], None],
) -> dict[str, Any]:
    """The last validation (or a new one), then the task's test figures; with
    average_checkpoints, both of the mean of the last N checkpoints -> the entries they add
    to the final metrics."""
    config, added = run.config, {}
    if config.average_checkpoints:
        params, averaged = average_last_checkpoints(
            task, config, run.workdir, run.model, run.eval_dp
        )
        validation = data.evaluate(ctx.dp, ctx.eval_step, params)
        _log_average(averaged, config.average_checkpoints, log)
        run.writer.write_final(final["step"], "averaged", {"steps": averaged, **validation})
        added["averaged_steps"] = averaged
    else:
        params = eval_params(state)
        validation = result.last_eval or data.evaluate(ctx.dp, ctx.eval_step, params)
    added.update(data.finish(ctx, final["step"], params, validation))
    return added


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


def prepare_data(
    task: Task, config: RunConfig, workdir: str, dp: DataParallel, log: Callable[[str], None]
) -> TaskData:
    """The task's data. Past one process, process 0 prepares first (TFDS builds the datasets,
    the tokenizer is trained and written, and pushed when W is remote) and the others then
    read what it wrote: two writers of the same files would race."""
    several = jax.process_count() > 1
    if several and jax.process_index() != 0:
        multihost_utils.sync_global_devices("train: process 0 prepared the data")
        pull(workdir)
    data = task.prepare(config, local_dir(workdir), dp, log)
    if several and jax.process_index() == 0:
        push(workdir)
        multihost_utils.sync_global_devices("train: process 0 prepared the data")
    return data


def log_stop(
    result: LoopResult, state: TrainState, train_step, workdir: str, log: Callable[[str], None]
) -> None:
    """How the loop ended, in the log."""
    compiled = getattr(train_step, "compiled_shapes", None)  # None: the pmap path
    log(
        f"stopped at step {int(jax.device_get(state.step))} ({result.reason}) after "
        f"{result.elapsed:.0f}s of training"
        + (f"; the train step compiled {compiled} batch shape(s)" if compiled else "")
    )
    if result.interrupted:
        log(f"{result.reason.upper()}: checkpoint saved; resume with --workdir {workdir}")
    if result.skipped:
        log(f"{result.skipped} step(s) with a non-finite loss or gradient were skipped")


def _log_average(steps: Sequence[int], wanted: int, log: Callable[[str], None]) -> None:
    """Which checkpoints an evaluation averaged, in the log."""
    log(
        f"evaluating with the mean of the last {len(steps)} checkpoints (steps "
        + ", ".join(str(s) for s in steps)
        + ")"
        + (f"; {wanted} asked for, only {len(steps)} saved" if len(steps) < wanted else "")
    )


def _wall_clock(deadline: float) -> str:
    """A time.monotonic() deadline as local wall-clock time."""
    return time.strftime("%H:%M:%S", time.localtime(time.time() + deadline - time.monotonic()))


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


__all__ = [
    "CheckpointError",
    "EvalContext",
    "Task",
    "TaskData",
    "config_from_saved",
    "default_workdir",
    "average_checkpoints",
    "average_last_checkpoints",
    "eval_params",
    "inference_template",
    "init_state",
    "normal_form",
    "params_for_inference",
    "restore_for_inference",
    "saved_config",
    "train_and_evaluate",
]
