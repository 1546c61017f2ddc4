"""The training loop every entry point shares: steps, logging, evaluation, checkpoints, stops.

The loop dispatches compiled steps and keeps their metrics on device; it fetches them in one
transfer per logging interval (that is also where a NaN is noticed). It stops at `steps`, at a
wall-clock deadline, or on SIGTERM (after saving); a non-finite loss raises
`TrainingDiverged` and saves nothing, so the last checkpoint on disk is the last good one.

A resumed run reproduces an uninterrupted one exactly when the batches depend only on the step
(the batchers guarantee it) and the step rng is fold_in(rng, step) (TrainState guarantees it).
Logged training lines average over `log_every` steps counted from step 0, so they line up too
when the stop step is a multiple of log_every.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import signal
import sys
import threading
import time
from typing import Any, Callable, Iterator, Mapping

import jax
from tqdm.auto import tqdm

from train.core.checkpoint import BEST_METRIC, Checkpoints, save_run_config
from train.core.metrics import MetricsWriter, summarize_interval
from train.core.parallel import DataParallel
from train.core.state import TrainState


class TrainingDiverged(RuntimeError):
    """The training loss became NaN or infinite."""


@dataclasses.dataclass(frozen=True)
class LoopConfig:
    """steps: train until state.step == steps. deadline: time.monotonic() value after which no
    new step starts (None: no time limit). eval_every / checkpoint_every: 0 = only at the end.
    """

    steps: int
    deadline: float | None = None
    log_every: int = 50
    eval_every: int = 0
    checkpoint_every: int = 0
    progress: bool = True

    @classmethod
    def from_run(cls, run: Any, *, start: float) -> LoopConfig:
        """From a run config with steps, minutes (0 = no limit, counted from `start`, a
        time.monotonic() value), log_every, eval_every, checkpoint_every and progress."""
        return cls(steps=run.steps,
                   deadline=start + 60.0 * run.minutes if run.minutes else None,
                   log_every=run.log_every, eval_every=run.eval_every,
                   checkpoint_every=run.checkpoint_every, progress=run.progress)

    def __post_init__(self):
        if self.steps < 0:
            raise ValueError(f"steps: must be >= 0, got {self.steps}")
        if self.log_every < 1:
            raise ValueError(f"log_every: must be >= 1, got {self.log_every}")
        for name in ("eval_every", "checkpoint_every"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)}")


@dataclasses.dataclass
class LoopResult:
    state: TrainState  # in the train step's layout
    reason: str  # 'steps' | 'time' | 'sigterm'
    elapsed: float  # training seconds, summed over resumed runs
    last_eval: dict[str, float] | None


class StopFlag:
    """Set by SIGTERM (or by hand, e.g. from a test); the loop saves and returns when set."""

    def __init__(self):
        self.requested = False
        self.signum: int | None = None

    def __call__(self, signum=None, frame=None):
        self.requested = True
        self.signum = signum


@contextlib.contextmanager
def stop_on_sigterm():
    """Installs a SIGTERM handler for the duration that only sets a flag: the step in flight
    finishes, the loop saves a checkpoint and returns. Outside the main thread signal handlers
    cannot be installed; the flag then only works when set by hand."""
    flag = StopFlag()
    if threading.current_thread() is not threading.main_thread():
        yield flag
        return
    previous = signal.signal(signal.SIGTERM, flag)
    try:
        yield flag
    finally:
        signal.signal(signal.SIGTERM, previous)


def train_loop(
    state: TrainState,
    *,
    dp: DataParallel,
    train_step: Callable,
    batches: Iterator[Mapping[str, Any]],
    config: LoopConfig,
    writer: MetricsWriter,
    checkpoints: Checkpoints | None = None,
    evaluate: Callable[[TrainState], dict[str, float]] | None = None,
    elapsed: float = 0.0,
    stop: StopFlag | None = None,
    on_log: Callable[[dict[str, Any]], None] | None = None,
    log: Callable[[str], None] | None = None,
) -> LoopResult:
    """Runs `train_step` from state.step to config.steps.

    state: in `dp`'s step layout. batches: yields the global batch of step state.step, then
      the next, ... (host arrays). evaluate: global-layout state -> {'loss', 'ppl', ...} on the
      validation set, run every eval_every steps and at the end, logged as split 'validation';
      its 'loss' ranks the checkpoints for the best one. elapsed: training seconds of earlier runs (from the checkpoint meta).
    """
    stop = stop or StopFlag()
    step = int(jax.device_get(state.step).reshape(-1)[0])  # pmap: one copy per device
    start_step, pending, reason, last_eval = step, [], "steps", None
    # A bar on a terminal; elsewhere (CI, nohup, a log file) its carriage-return stream would
    # flood the log, so a plain line per logging interval instead.
    interactive = config.progress and sys.stderr.isatty()
    bar = tqdm(total=config.steps, initial=step, dynamic_ncols=True, desc="train",
               disable=not interactive or jax.process_index() != 0)
    log = log or printer()
    t_log = time.monotonic()
    t_run = t_log

    def flush():
        """Fetch the pending metrics (one transfer), check them, write one log line."""
        nonlocal pending, t_log
        if not pending:
            return
        host = dp.fetch(pending)
        now = time.monotonic()
        line = summarize_interval(host)
        if not math.isfinite(line["loss"]):
            last = checkpoints.latest_step() if checkpoints else None
            where = (f"the last good checkpoint is step {last} in {checkpoints.directory}"
                     if last is not None else "no checkpoint was saved")
            raise TrainingDiverged(
                f"training loss became {line['loss']} in steps {step - len(pending) + 1}.."
                f"{step}; stopped without saving ({where}). Lower the learning rate or check "
                f"the data.")
        line["tokens_per_sec"] = sum(m["n_tokens"] for m in host) / max(now - t_log, 1e-9)
        line["elapsed"] = elapsed + (now - t_run)
        record = writer.write(step, "train", line)
        bar.set_postfix(loss=f"{line['loss']:.3f}", lr=f"{line.get('lr', 0):.2e}",
                        tok_s=f"{line['tokens_per_sec']:.0f}", refresh=False)
        if config.progress and not interactive:
            log(f"step {step}/{config.steps}: loss {line['loss']:.4f}, lr "
                f"{line.get('lr', 0):.3g}, {line['tokens_per_sec']:.0f} tokens/s, "
                f"{line['elapsed']:.0f}s")
        if on_log:
            on_log(record)
        pending, t_log = [], now

    def save(val=None):
        if checkpoints is not None:
            meta = {"elapsed": elapsed + (time.monotonic() - t_run)}
            checkpoints.save(dp.get_state(state), meta=meta,
                             metrics=None if val is None else {BEST_METRIC: val["loss"]})

    def run_eval():
        nonlocal last_eval
        last_eval = evaluate(dp.get_state(state))
        writer.write(step, "validation", last_eval)
        if on_log:
            on_log({"step": step, "split": "validation", **last_eval})
        return last_eval

    try:
        while step < config.steps:
            if config.deadline is not None and time.monotonic() >= config.deadline:
                reason = "time"
                break
            state, metrics = train_step(state, dp.put_batch(next(batches)))
            step += 1
            pending.append(metrics)
            if len(pending) >= 2:
                # At most two steps in flight: enough to keep the device busy, few enough that
                # the deadline and SIGTERM checks act on the step actually running (async
                # dispatch would otherwise queue a whole logging interval). No transfer.
                jax.block_until_ready(pending[-2]["loss_sum"])
            bar.update(1)
            if stop.requested:
                reason = "sigterm"
                break
            if step % config.log_every == 0:
                flush()
            if config.eval_every and step % config.eval_every == 0 and evaluate:
                flush()
                save(run_eval())
            elif config.checkpoint_every and step % config.checkpoint_every == 0:
                flush()
                save()
        flush()
        if reason != "sigterm" and evaluate and step > start_step and (
                last_eval is None or not config.eval_every or step % config.eval_every):
            run_eval()
        if step > start_step or (checkpoints and checkpoints.latest_step() is None):
            # A final val eval at this step ranks it; a SIGTERM save carries no metrics.
            save(last_eval if reason != "sigterm" else None)
    finally:
        bar.close()
    return LoopResult(state=state, reason=reason,
                      elapsed=elapsed + (time.monotonic() - t_run), last_eval=last_eval)


def printer() -> Callable[[str], None]:
    """print on process 0 only (flushed: logs interleave with the progress bar)."""
    quiet = jax.process_index() != 0

    def log(message: str) -> None:
        if not quiet:
            print(message, flush=True)
    return log


@dataclasses.dataclass
class FitResult:
    state: TrainState  # global layout
    reason: str
    elapsed: float
    last_eval: dict[str, float] | None
    compiled_shapes: int | None  # how many batch shapes the train step compiled for

    @property
    def step(self) -> int:
        return int(jax.device_get(self.state.step))

    def summary(self) -> dict[str, Any]:
        """The start of an entry point's final metrics."""
        return {"step": self.step, "reason": self.reason}


def fit(
    state: TrainState,
    *,
    workdir: str,
    run_config: Mapping[str, Any],
    dp: DataParallel,
    loss_fn: Callable,
    lr_schedule: Callable | None,
    batches: Callable[[int], Iterator[Mapping[str, Any]]],
    config: LoopConfig,
    keep_checkpoints: int,
    evaluate: Callable[[TrainState], dict[str, float]] | None = None,
    log: Callable[[str], None] = print,
) -> FitResult:
    """Resume-or-start, train, save: what every entry point does between data and evaluation.

    state: a fresh global-layout state (the template a checkpoint is restored into).
    run_config: saved to W/config.json once the workdir's latest checkpoint (if any) has been
      restored, so a failed restore changes nothing on disk.
    batches: start step -> the batch stream from that step on.
    """
    checkpoints = Checkpoints(workdir, keep=keep_checkpoints)
    writer = MetricsWriter(workdir)
    try:
        elapsed = 0.0
        if checkpoints.latest_step() is not None:
            state, meta = checkpoints.restore(state)
            elapsed = float(meta.get("elapsed", 0.0))
            writer.rewind(int(jax.device_get(state.step)))
            log(f"resumed from {checkpoints.path(checkpoints.latest_step())}")
        save_run_config(workdir, run_config)
        writer.hparams(run_config)
        start = int(jax.device_get(state.step))
        dstate = dp.put_state(state)
        train_step = dp.compile_train_step(loss_fn, dstate, lr_schedule=lr_schedule)
        with stop_on_sigterm() as stop:
            log(f"training from step {start} to {config.steps}"
                + (f" or until {time.strftime('%H:%M:%S', _wall(config.deadline))}"
                   if config.deadline else "")
                + "; SIGTERM saves a checkpoint and stops")
            result = train_loop(dstate, dp=dp, train_step=train_step, batches=batches(start),
                                config=config, writer=writer, checkpoints=checkpoints,
                                evaluate=evaluate, elapsed=elapsed, stop=stop, log=log)
    finally:
        writer.close()
        checkpoints.close()
    compiled = getattr(train_step, "_cache_size", lambda: None)()
    state = dp.get_state(result.state)
    log(f"stopped at step {int(jax.device_get(state.step))} ({result.reason}) after "
        f"{result.elapsed:.0f}s of training"
        + (f"; the train step compiled {compiled} batch shape(s)" if compiled else ""))
    if result.reason == "sigterm":
        log(f"SIGTERM: checkpoint saved; resume with --workdir {workdir}")
    return FitResult(state=state, reason=result.reason, elapsed=result.elapsed,
                     last_eval=result.last_eval, compiled_shapes=compiled)


def _wall(deadline: float) -> time.struct_time:
    """A time.monotonic() deadline as local wall-clock time."""
    return time.localtime(time.time() + deadline - time.monotonic())
