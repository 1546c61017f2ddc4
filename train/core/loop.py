"""The training loop every entry point shares: steps, logging, evaluation, checkpoints, stops.

The loop dispatches compiled steps and keeps their metrics on device; it fetches them in one
transfer per logging interval. It stops at `steps`, at a wall-clock deadline, or on SIGTERM or
SIGINT (after saving). A step whose loss or gradient is not finite is never applied (the
compiled step keeps the old state and flags it in its metrics); when the flag reaches the host
the loop either raises `TrainingDiverged` naming the step, without saving (`nonfinite='stop'`,
so every checkpoint on disk is finite), or counts the skipped step and goes on ('skip').

Past one process every stop is decided by all processes together, at the same step: signals
through JAX's preemption sync point (a SIGTERM to any one process reaches every process), the
time budget and the stop flag by a tiny all-gather every `agree_every` steps, and NaN
decisions from the same replicated metrics everywhere. So no process waits alone in a
collective or a checkpoint save.

A resumed run reproduces an uninterrupted one exactly when the batches depend only on the step
(the batchers guarantee it) and the step rng is fold_in(rng, step) (TrainState guarantees it).
Logged training lines average over `log_every` steps counted from step 0; the metrics of an
interval cut short by a signal travel in the checkpoint, so the resumed run's line for that
interval is the one an uninterrupted run writes.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import signal
import sys
import threading
import time
from typing import Any, Callable, Iterator, Mapping, Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils
from tqdm.auto import tqdm

from train.core.checkpoint import BEST_METRIC, Checkpoints, save_run_config
from train.core.metrics import MetricsWriter, summarize_interval
from train.core.parallel import DataParallel
from train.core.state import TrainState

NONFINITE_POLICIES = ("stop", "skip")
SIGNAL_REASONS = {signal.SIGTERM: "sigterm", signal.SIGINT: "sigint"}


class TrainingDiverged(RuntimeError):
    """The training loss or gradient became NaN or infinite."""


@dataclasses.dataclass(frozen=True)
class LoopConfig:
    """steps: train until state.step == steps. deadline: time.monotonic() value after which no
    new step starts (None: no time limit). eval_every / checkpoint_every: 0 = only at the end.
    nonfinite: 'stop' (raise TrainingDiverged) or 'skip' (go on without that update).
    agree_every: past one process, how often (in steps) the processes agree on stopping.
    """

    steps: int
    deadline: float | None = None
    log_every: int = 50
    eval_every: int = 0
    checkpoint_every: int = 0
    progress: bool = True
    nonfinite: str = "stop"
    agree_every: int = 10

    @classmethod
    def from_run(cls, run: Any, *, start: float) -> LoopConfig:
        """From a run config with steps, minutes (0 = no limit, counted from `start`, a
        time.monotonic() value), log_every, eval_every, checkpoint_every, progress and
        on_nonfinite."""
        return cls(steps=run.steps,
                   deadline=start + 60.0 * run.minutes if run.minutes else None,
                   log_every=run.log_every, eval_every=run.eval_every,
                   checkpoint_every=run.checkpoint_every, progress=run.progress,
                   nonfinite=getattr(run, "on_nonfinite", "stop"))

    def __post_init__(self):
        if self.steps < 0:
            raise ValueError(f"steps: must be >= 0, got {self.steps}")
        if self.log_every < 1 or self.agree_every < 1:
            raise ValueError(f"log_every and agree_every: must be >= 1, got {self.log_every}, "
                             f"{self.agree_every}")
        for name in ("eval_every", "checkpoint_every"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)}")
        if self.nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f"on_nonfinite: expected one of {NONFINITE_POLICIES}, got "
                             f"{self.nonfinite!r}")


@dataclasses.dataclass
class LoopResult:
    state: TrainState  # in the train step's layout
    reason: str  # 'steps' | 'time' | 'sigterm' | 'sigint'
    elapsed: float  # training seconds, summed over resumed runs
    last_eval: dict[str, float] | None
    skipped: int = 0  # non-finite steps skipped (nonfinite='skip')


class StopFlag:
    """Set by SIGTERM or SIGINT (or by hand, e.g. from a test); the loop saves and returns when
    set. `reason` is the loop's stop reason for it."""

    def __init__(self):
        self.requested = False
        self.signum: int | None = None

    def __call__(self, signum=None, frame=None):
        self.requested = True
        self.signum = signum

    @property
    def reason(self) -> str:
        return SIGNAL_REASONS.get(self.signum, "sigterm")


@contextlib.contextmanager
def stop_on_signals(signums=(signal.SIGTERM, signal.SIGINT)):
    """Installs handlers for the duration that only set a flag: the step in flight finishes,
    the loop saves a checkpoint and returns. A second SIGINT (Ctrl-C) raises
    KeyboardInterrupt as usual, for a user who will not wait for the save. Outside the main
    thread signal handlers cannot be installed; the flag then only works when set by hand."""
    flag = StopFlag()
    if threading.current_thread() is not threading.main_thread():
        yield flag
        return

    def handler(signum, frame):
        if signum == signal.SIGINT and flag.requested:
            raise KeyboardInterrupt
        flag(signum, frame)

    previous = {s: signal.signal(s, handler) for s in signums}
    try:
        yield flag
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def stop_on_sigterm():
    """`stop_on_signals` for SIGTERM alone."""
    return stop_on_signals((signal.SIGTERM,))


class Agreement:
    """Stop decisions every process takes at the same step. One process: the local view,
    every step. Several: a SIGTERM anywhere through JAX's preemption sync point, and the local
    time budget and flag all-gathered every `every` steps (each process reaches the same step
    numbers, so they meet in the same collective)."""

    def __init__(self, every: int):
        self.every = every
        self.multi = jax.process_count() > 1

    def should_stop(self, step: int, *, flag: StopFlag, deadline: float | None,
                    force: bool = False) -> str | None:
        """'sigterm' | 'sigint' | 'time' | None, the same on every process. force: gather now
        whatever the step (every process must pass it at the same step)."""
        late = deadline is not None and time.monotonic() >= deadline
        if not self.multi:
            return flag.reason if flag.requested else ("time" if late else None)
        if _preemption_sync_point(step):
            return "sigterm"
        if step % self.every and not force:
            return None
        votes = multihost_utils.process_allgather(
            np.array([flag.requested, late], np.int32))  # [processes, 2]
        if votes[:, 0].any():
            return "sigterm"
        return "time" if votes[:, 1].any() else None


def _preemption_sync_point(step: int) -> bool:
    try:
        return bool(multihost_utils.reached_preemption_sync_point(step))
    except RuntimeError:  # no preemption service (a runtime started without it)
        return False


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
    carried: list[dict[str, float]] | None = None,
) -> LoopResult:
    """Runs `train_step` from state.step to config.steps.

    state: in `dp`'s step layout. batches: yields the batch of step state.step, then the
      next, ... (host arrays; past one process, this process's `dp.local_rows` of each global
      batch). evaluate: global-layout state -> {'loss', 'ppl', ...} on the
      validation set, run every eval_every steps and at the end, logged as split 'validation';
      its 'loss' ranks the checkpoints for the best one. elapsed: training seconds of earlier
      runs (from the checkpoint meta). carried: host metrics of the steps of the current
      logging interval that an interrupted run had done (from the checkpoint meta).
    """
    stop = stop or StopFlag()
    agreement = Agreement(config.agree_every)
    step = int(jax.device_get(state.step).reshape(-1)[0])  # pmap: one copy per device
    start_step, pending, reason, last_eval = step, [], "steps", None
    carried, skipped = list(carried or []), 0
    # A bar on a terminal; elsewhere (CI, nohup, a log file) its carriage-return stream would
    # flood the log, so a plain line per logging interval instead.
    interactive = config.progress and sys.stderr.isatty()
    bar = tqdm(total=config.steps, initial=step, dynamic_ncols=True, desc="train",
               disable=not interactive or jax.process_index() != 0)
    log = log or printer()
    t_log = time.monotonic()
    t_run = t_log

    def fetch_pending() -> list[dict[str, float]]:
        """The interval's host metrics so far (one transfer); non-finite steps handled."""
        nonlocal pending, carried, skipped
        host = carried + dp.fetch(pending)
        first = step - len(host) + 1
        bad = [first + i for i, m in enumerate(host) if m.get("nonfinite")]
        if bad and config.nonfinite == "stop":
            last = checkpoints.latest_step() if checkpoints else None
            advice = ("Resume with a lower --learning_rate (it may change on resume), or "
                      "--on_nonfinite skip to go on without such steps.")
            if last is None:
                where = "no checkpoint was saved"
            elif last == bad[0] - 1:
                # The state this step started from: a step's batch and rng depend only on its
                # number, so a resume from it computes the same non-finite step whatever the
                # rate. The advice to lower the rate must point before it.
                earlier = [s for s in checkpoints.all_steps() if s < last]
                where = (f"the last checkpoint, {checkpoints.path(last)}, is the state step "
                         f"{bad[0]} started from, so a resume from it repeats this step")
                advice = (f"Move it out of {checkpoints.directory} to resume from "
                          + (f"step {earlier[-1]}" if earlier else "step 0") + " with a lower "
                          "--learning_rate (it may change on resume), or resume it with "
                          "--on_nonfinite skip to go on without such steps.")
            else:
                where = f"the last good checkpoint is step {last} in {checkpoints.directory}"
            m = host[bad[0] - first]
            raise TrainingDiverged(
                f"step {bad[0]}: the loss ({m['loss_sum'] / max(m['n_tokens'], 1):.4g} a "
                f"token) or the gradient (norm {m['grad_norm']:.4g}) is not finite; that "
                f"update was not applied and nothing after step {bad[0] - 1} was saved "
                f"({where}). {advice}")
        skipped += len(bad)
        pending, carried = [], []
        return [m for m in host if not m.get("nonfinite")]

    def flush():
        """Fetch the pending metrics (one transfer), check them, write one log line."""
        nonlocal t_log
        if not pending and not carried:
            return
        host = fetch_pending()
        now = time.monotonic()
        if not host:  # every step of the interval was skipped
            return
        line = summarize_interval(host)
        line["tokens_per_sec"] = sum(m["n_tokens"] for m in host) / max(now - t_log, 1e-9)
        line["elapsed"] = elapsed + (now - t_run)
        if skipped:
            line["skipped_steps"] = skipped
        record = writer.write(step, "train", line)
        bar.set_postfix(loss=f"{line['loss']:.3f}", lr=f"{line.get('lr', 0):.2e}",
                        tok_s=f"{line['tokens_per_sec']:.0f}", refresh=False)
        if config.progress and not interactive:
            log(f"step {step}/{config.steps}: loss {line['loss']:.4f}, lr "
                f"{line.get('lr', 0):.3g}, {line['tokens_per_sec']:.0f} tokens/s, "
                f"{line['elapsed']:.0f}s")
        if on_log:
            on_log(record)
        t_log = now

    def save(val=None, interval=None):
        if checkpoints is not None:
            meta = {"elapsed": elapsed + (time.monotonic() - t_run)}
            if interval:
                meta["interval_metrics"] = interval
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
        # The time budget may be spent before the first step (data preparation counts).
        if step < config.steps and agreement.should_stop(
                step, flag=StopFlag(), deadline=config.deadline, force=True) == "time":
            reason = "time"
        while step < config.steps and reason == "steps":
            state, metrics = train_step(state, dp.put_batch(next(batches)))
            step += 1
            pending.append(metrics)
            if len(pending) >= 2:
                # At most two steps in flight: enough to keep the device busy, few enough that
                # the deadline and signal checks act on the step actually running (async
                # dispatch would otherwise queue a whole logging interval). No transfer.
                jax.block_until_ready(pending[-2]["loss_sum"])
            bar.update(1)
            decided = agreement.should_stop(step, flag=stop, deadline=config.deadline)
            if decided in ("sigterm", "sigint"):
                reason = decided
                break
            if decided == "time":
                reason = "time"  # this step is logged, evaluated and saved as usual below
            if step % config.log_every == 0:
                flush()
            if config.eval_every and step % config.eval_every == 0 and evaluate:
                flush()
                save(run_eval())
            elif config.checkpoint_every and step % config.checkpoint_every == 0:
                flush()
                save()
        if reason in ("sigterm", "sigint"):
            # A complete interval is logged; the steps of one cut short go into the
            # checkpoint, not into a short log line, and the resumed run completes it.
            if step % config.log_every == 0:
                flush()
            interval = fetch_pending()
            if step > start_step or (checkpoints and checkpoints.latest_step() is None):
                save(None, interval)
        else:
            flush()
            if evaluate and step > start_step and (
                    last_eval is None or not config.eval_every or step % config.eval_every):
                run_eval()
            if step > start_step or (checkpoints and checkpoints.latest_step() is None):
                save(last_eval)  # a final val eval at this step ranks it
    finally:
        bar.close()
    return LoopResult(state=state, reason=reason, elapsed=elapsed + (time.monotonic() - t_run),
                      last_eval=last_eval, skipped=skipped)


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
    skipped: int = 0  # non-finite steps skipped

    @property
    def interrupted(self) -> bool:
        """Stopped by SIGTERM or SIGINT (after saving a checkpoint)."""
        return self.reason in SIGNAL_REASONS.values()

    @property
    def step(self) -> int:
        return int(jax.device_get(self.state.step))

    def summary(self) -> dict[str, Any]:
        """The start of an entry point's final metrics."""
        out = {"step": self.step, "reason": self.reason}
        if self.skipped:
            out["skipped_steps"] = self.skipped
        return out


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
    stop: StopFlag | None = None,
    changes: list[str] | None = None,
    example_batches: Sequence[Mapping[str, Any]] | None = None,
) -> FitResult:
    """Resume-or-start, train, save: what every entry point does between data and evaluation.

    state: a fresh global-layout state (the template a checkpoint is restored into).
    run_config: saved to W/config.json once the workdir's latest checkpoint (if any) has been
      restored, so a failed restore changes nothing on disk.
    batches: start step -> the batch stream from that step on.
    changes: settings a resumed run changed ('field: old -> new'), recorded in the metrics.
    example_batches: one host batch of each shape the stream can yield (as `batches` yields
      them): the train step is compiled for all of them, in threads, before the first step
      (`DataParallel.compile_ahead`), instead of one after another as each shape first
      comes. None: lazily only.
    stop: a flag the caller installed earlier (signals during set-up then count too); by
      default SIGTERM and SIGINT handlers are installed for the training loop.
    """
    checkpoints = Checkpoints(workdir, keep=keep_checkpoints)
    writer = MetricsWriter(workdir)
    try:
        elapsed, carried = 0.0, []
        if checkpoints.latest_step() is not None:
            state, meta = checkpoints.restore(state)
            elapsed = float(meta.get("elapsed", 0.0))
            carried = list(meta.get("interval_metrics", []))
            log(f"resumed from {checkpoints.path(checkpoints.latest_step())}")
        # Lines past the restored step (0 without a checkpoint) were logged by a run that
        # died before saving them; this run logs them again.
        writer.rewind(int(jax.device_get(state.step)))
        if changes:
            writer.write(int(jax.device_get(state.step)), "resume", {"changed": changes})
        save_run_config(workdir, run_config)
        writer.hparams(run_config)
        start = int(jax.device_get(state.step))
        dstate = dp.put_state(state)
        train_step = dp.compile_train_step(loss_fn, dstate, lr_schedule=lr_schedule)
        if example_batches and start < config.steps:
            t0 = time.monotonic()
            train_step = dp.compile_ahead(train_step, dstate, example_batches)
            ahead = getattr(train_step, "compiled_ahead", 0)
            if ahead:
                log(f"compiled the train step for {ahead} batch shape(s) ahead in "
                    f"{time.monotonic() - t0:.1f}s")
        with contextlib.ExitStack() as stack:
            if stop is None:
                stop = stack.enter_context(stop_on_signals())
            log(f"training from step {start} to {config.steps}"
                + (f" or until {time.strftime('%H:%M:%S', _wall(config.deadline))}"
                   if config.deadline else "")
                + "; SIGTERM saves a checkpoint and stops")
            result = train_loop(dstate, dp=dp, train_step=train_step, batches=batches(start),
                                config=config, writer=writer, checkpoints=checkpoints,
                                evaluate=evaluate, elapsed=elapsed, stop=stop, log=log,
                                carried=carried)
    finally:
        writer.close()
        checkpoints.close()
    compiled = getattr(train_step, "_cache_size", lambda: None)()
    state = dp.get_state(result.state)
    log(f"stopped at step {int(jax.device_get(state.step))} ({result.reason}) after "
        f"{result.elapsed:.0f}s of training"
        + (f"; the train step compiled {compiled} batch shape(s)" if compiled else ""))
    if result.reason in SIGNAL_REASONS.values():
        log(f"{result.reason.upper()}: checkpoint saved; resume with --workdir {workdir}")
    if result.skipped:
        log(f"{result.skipped} step(s) with a non-finite loss or gradient were skipped")
    return FitResult(state=state, reason=result.reason, elapsed=result.elapsed,
                     last_eval=result.last_eval, compiled_shapes=compiled,
                     skipped=result.skipped)


def _wall(deadline: float) -> time.struct_time:
    """A time.monotonic() deadline as local wall-clock time."""
    return time.localtime(time.time() + deadline - time.monotonic())
