"""The one run every task shares: `train_and_evaluate(task, config, workdir)`, in this order:
start, restore, loop, final save, evaluate, close.

    train_and_evaluate(TRANSLATION, config, "runs/x")   # what train.translate.train_and_evaluate is

It is the one owner of what a run holds: the distributed start, the work-directory lock, the
signal handlers, W/config.json, the checkpoints and the metrics writer each have one home here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
from jax.experimental import multihost_utils

from train.core.checkpoint import (
    Checkpoints,
    save_run_config,
)
from train.core.compile_cache import CacheTally
from train.core.config import RunConfig, UsageError, config_to_dict
from train.core.inference import average_last_checkpoints
from train.core.loop import LoopConfig, LoopResult, printer, stop_on_signals, train_loop
from train.core.metrics import MetricsWriter
from train.core.parallel import (
    CompiledStep,
    DataParallel,
    maybe_initialize_distributed,
)
from train.core.processes import check_same_on_every_process
from train.core.state import TrainState, count_params
from train.core.step import LossFn
from train.core.task import EvalContext, Task, TaskData, eval_params, init_state
from train.core.workdir import (
    WorkdirLock,
    is_remote,
    local_dir,
    pull,
    push,
)
from train.core.workdir_checks import check_workdir, taken_back_unless_saved
from transformer_jax.optim import make_optimizer


def _training_line(step: int, config: RunConfig, loop: LoopConfig) -> str:
    """The log line that says where the training goes: to its steps, or to those that fit
    the time budget, and until when."""
    end = (
        "the steps that fit the time budget"
        if config.fit_to_budget and loop.deadline
        else f"{config.steps}"
    )
    until = (
        f" or until {_wall_clock(loop.deadline)} (--minutes {config.minutes:g} from this start)"
        if loop.deadline
        else ""
    )
    return f"training from step {step} to {end}{until}; SIGTERM saves a checkpoint and stops"


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
            log(_training_line(step, config, loop))
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
    checkpoints = Checkpoints(workdir, keep=config.keep_checkpoints)
    latest = checkpoints.latest_step() if _steps_given(changed) else None
    if latest is not None and latest > config.steps:
        checkpoints.close()
        raise UsageError(
            f"--steps {config.steps}: the run in {workdir} is already at step {latest:,}; give "
            f"--steps {latest} or more, or leave it out to keep the run's own"
        )
    if changed:
        log("resuming with changed settings: " + "; ".join(changed))
    dp = DataParallel(config.parallel, sharding=config.sharding)
    tx, schedule = make_optimizer(task.optimizer_config(config))
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


def _wall_clock(deadline: float) -> str:
    """A time.monotonic() deadline as local wall-clock time."""
    return time.strftime("%H:%M:%S", time.localtime(time.time() + deadline - time.monotonic()))


def _log_average(steps: Sequence[int], wanted: int, log: Callable[[str], None]) -> None:
    """Which checkpoints an evaluation averaged, in the log."""
    log(
        f"evaluating with the mean of the last {len(steps)} checkpoints (steps "
        + ", ".join(str(s) for s in steps)
        + ")"
        + (f"; {wanted} asked for, only {len(steps)} saved" if len(steps) < wanted else "")
    )
