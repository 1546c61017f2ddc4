"""The training loop every task shares: steps, logging, evaluation, checkpoints, stops.

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

A run fitted to its time budget (`fit_to_budget`) chooses its length once: it times
`fit_measure` steps after the first `fit_skip` (whose first executions load programs and fill
the data pipeline), and a validation when it makes them within its budget, then sets its
schedule's length to the steps that fit the time left (`train.core.budget`). The length is
written into the optimizer state, so every later checkpoint holds it and a resumed run keeps
it; a run stopped before it chose measures again when resumed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from tqdm.auto import tqdm

from train.core.checkpoint import BEST_METRIC, Checkpoints
from train.core.config import NONFINITE_POLICIES, check_choice
from train.core.errors import TrainingDiverged
from train.core.metrics import MetricsWriter, summarize_interval
from train.core.parallel import DataParallel
from train.core.state import TrainState

if TYPE_CHECKING:  # only for the annotation: the run config imports nothing from here
    from train.core.config import RunConfig

SIGNAL_REASONS = {signal.SIGTERM: "sigterm", signal.SIGINT: "sigint"}


@dataclasses.dataclass(frozen=True)
class LoopConfig:
    """The settings of one training loop.

    - steps: train until state.step == steps.
    - deadline: time.monotonic() value after which no new step starts (None: no time limit).
    - eval_every / checkpoint_every: 0 = only at the end.
    - nonfinite: 'stop' (raise TrainingDiverged) or 'skip' (go on without that update).
    - agree_every: past one process, how often (in steps) the processes agree on stopping.
    - fit_to_budget: the state's optimizer keeps its schedule's length (horizon_in_state), and
      the loop chooses it: from the deadline, after timing fit_measure steps that follow the
      first fit_skip of this run; `steps` without a deadline. A length already chosen (a
      resumed run's) is kept, and is where the loop stops.
    - steps_given: a fitted run resumed with an explicit --steps: the loop stops there. A run
      that has not chosen its length yet takes it as its length (no fitting, as a new run
      given --steps); one that has keeps the length its schedule decays over.
    """

    steps: int
    deadline: float | None = None
    log_every: int = 50
    eval_every: int = 0
    checkpoint_every: int = 0
    progress: bool = True
    nonfinite: str = "stop"
    agree_every: int = 10
    fit_to_budget: bool = False
    steps_given: bool = False
    # Long enough to pass the first executions of a translation run's several batch shapes,
    # which fall over its first tens of steps (benchmarks/translate_cpu_recipe_2026-11-29/).
    fit_skip: int = 20
    fit_measure: int = 200

    @classmethod
    def from_run(cls, run: RunConfig, *, start: float, steps_given: bool = False) -> LoopConfig:
        """The loop settings of a run config; its `minutes` (0 = no limit) count from `start`,
        a time.monotonic() value (a resumed run's budget starts afresh). steps_given: see the
        class."""
        return cls(
            steps_given=steps_given and run.fit_to_budget,
            steps=run.steps,
            deadline=start + 60.0 * run.minutes if run.minutes else None,
            log_every=run.log_every,
            eval_every=run.eval_every,
            checkpoint_every=run.checkpoint_every,
            progress=run.progress,
            nonfinite=run.on_nonfinite,
            fit_to_budget=run.fit_to_budget,
        )

    def __post_init__(self):
        if self.steps < 0:
            raise ValueError(f"steps: must be >= 0, got {self.steps}")
        if self.log_every < 1 or self.agree_every < 1:
            raise ValueError(
                f"log_every and agree_every: must be >= 1, got {self.log_every}, {self.agree_every}"
            )
        for name in ("eval_every", "checkpoint_every"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)}")
        check_choice("on_nonfinite", self.nonfinite, NONFINITE_POLICIES)
        if self.fit_skip < 0 or self.fit_measure < 1:
            raise ValueError(
                f"fit_skip, fit_measure: must be >= 0 and >= 1, got {self.fit_skip}, "
                f"{self.fit_measure}"
            )


@dataclasses.dataclass
class LoopResult:
    state: TrainState  # in the train step's layout
    reason: str  # 'steps' | 'time' | 'sigterm' | 'sigint'
    elapsed: float  # training seconds, summed over resumed runs
    last_eval: dict[str, float] | None
    skipped: int = 0  # non-finite steps skipped (nonfinite='skip')

    @property
    def interrupted(self) -> bool:
        """Stopped by SIGTERM or SIGINT (after saving a checkpoint)."""
        return self.reason in SIGNAL_REASONS.values()


# ----------------------------------------------------------------------------- stops
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


class Agreement:
    """Stop decisions every process takes at the same step. One process: the local view,
    every step. Several: a SIGTERM anywhere through JAX's preemption sync point, and the local
    time budget and flag all-gathered every `every` steps (each process reaches the same step
    numbers, so they meet in the same collective)."""

    def __init__(self, every: int):
        self.every = every
        self.multi = jax.process_count() > 1

    def should_stop(
        self,
        step: int,
        *,
        flag: StopFlag,
        deadline: float | None,
        now: float,
        force: bool = False,
    ) -> str | None:
        """'sigterm' | 'sigint' | 'time' | None, the same on every process. now: the clock's
        time, deadline's units. force: gather now whatever the step (every process must pass it
        at the same step)."""
        late = deadline is not None and now >= deadline
        if not self.multi:
            return flag.reason if flag.requested else ("time" if late else None)
        if _preemption_sync_point(step):
            return "sigterm"
        if step % self.every and not force:
            return None
        votes = multihost_utils.process_allgather(
            np.array([flag.requested, late], np.int32)
        )  # [processes, 2]
        if votes[:, 0].any():
            return "sigterm"
        return "time" if votes[:, 1].any() else None

    def same_everywhere(self, value: int) -> int:
        """Process 0's `value` on every process (each measures its own clock, and a run's
        length must be one)."""
        if not self.multi:
            return value
        return int(multihost_utils.broadcast_one_to_all(np.int64(value)))


def _preemption_sync_point(step: int) -> bool:
    try:
        return bool(multihost_utils.reached_preemption_sync_point(step))
    except RuntimeError:  # no preemption service (a runtime started without it)
        return False


# ----------------------------------------------------------------------------- intervals
def divergence_message(
    step: int, metrics: Mapping[str, float], checkpoints: Checkpoints | None
) -> str:
    """What to tell the user when step `step` (its host `metrics`) was not finite: what was
    not applied, what is on disk, and how to go on from there."""
    last = checkpoints.latest_step() if checkpoints else None
    advice = (
        "Resume with a lower --learning_rate (it may change on resume), or "
        "--on_nonfinite skip to go on without such steps."
    )
    if last is None:
        # The start then takes back what it wrote in W (train.core.task): there is no run
        # to resume, only the command to give again.
        where = "no checkpoint was saved, so the work directory is left as it was"
        advice = (
            "Start again with a lower --learning_rate, or --on_nonfinite skip to go on "
            "without such steps."
        )
    elif last == step - 1:
        # The state this step started from: a step's batch and rng depend only on its number,
        # so a resume from it computes the same non-finite step whatever the rate. The advice
        # to lower the rate must point before it.
        earlier = [s for s in checkpoints.all_steps() if s < last]
        where = (
            f"the last checkpoint, {checkpoints.path(last)}, is the state step {step} "
            "started from, so a resume from it repeats this step"
        )
        advice = (
            f"Move it out of {checkpoints.directory} to resume from "
            + (f"step {earlier[-1]}" if earlier else "step 0")
            + " with a lower --learning_rate (it may change on resume), or resume it with "
            "--on_nonfinite skip to go on without such steps."
        )
    else:
        where = f"the last good checkpoint is step {last} in {checkpoints.directory}"
    loss = metrics["loss_sum"] / max(metrics["n_tokens"], 1)
    return (
        f"step {step}: the loss ({loss:.4g} a token) or the gradient (norm "
        f"{metrics['grad_norm']:.4g}) is not finite; that update was not applied and nothing "
        f"after step {step - 1} was saved ({where}). {advice}"
    )


class Interval:
    """The steps of the current logging interval: device metrics not fetched yet, after the
    host metrics an interrupted run carried over in its checkpoint."""

    def __init__(self, dp: DataParallel, carried: list[dict[str, float]] | None = None):
        self.dp = dp
        self.carried = list(carried or [])
        self.pending: list[Mapping[str, Any]] = []
        self.skipped = 0  # non-finite steps left out so far

    def __bool__(self) -> bool:
        return bool(self.pending or self.carried)

    def add(self, metrics: Mapping[str, Any]) -> None:
        self.pending.append(metrics)
        if len(self.pending) >= 2:
            # At most two steps in flight: enough to keep the device busy, few enough that the
            # deadline and signal checks act on the step actually running (async dispatch would
            # otherwise queue a whole interval). No transfer.
            jax.block_until_ready(self.pending[-2]["loss_sum"])

    def take(
        self, step: int, *, nonfinite: str, checkpoints: Checkpoints | None
    ) -> list[dict[str, float]]:
        """The interval's host metrics up to `step` (one transfer) without its non-finite
        steps, and a fresh interval. nonfinite 'stop': such a step raises TrainingDiverged."""
        host = self.carried + self.dp.fetch(self.pending)
        self.pending, self.carried = [], []
        first = step - len(host) + 1
        bad = [i for i, m in enumerate(host) if m.get("nonfinite")]
        if bad and nonfinite == "stop":
            raise TrainingDiverged(divergence_message(first + bad[0], host[bad[0]], checkpoints))
        self.skipped += len(bad)
        return [m for i, m in enumerate(host) if i not in bad]


class Reporter:
    """Where the loop's figures go: metrics.jsonl and TensorBoard (`writer`), a progress bar on
    a terminal, else a line per interval, and an optional `on_log(record)` hook."""

    def __init__(
        self,
        config: LoopConfig,
        writer: MetricsWriter,
        *,
        step: int,
        steps: int | None,
        elapsed: float,
        log: Callable[[str], None],
        on_log=None,
        clock: Callable[[], float] = time.monotonic,
    ):
        # A bar on a terminal; elsewhere (CI, nohup, a log file) its carriage-return stream
        # would flood the log, so a plain line per logging interval instead.
        self.interactive = config.progress and sys.stderr.isatty()
        self.lines = config.progress and not self.interactive
        self.steps = steps  # None: not chosen yet (fit_to_budget)
        self.bar = tqdm(
            total=steps,
            initial=step,
            dynamic_ncols=True,
            desc="train",
            disable=not self.interactive or jax.process_index() != 0,
        )
        self.writer, self.log, self.on_log, self.clock = writer, log, on_log, clock
        self.earlier = elapsed  # training seconds of the runs before this one
        self.started = self.last = clock()

    def elapsed(self) -> float:
        """Training seconds, summed over resumed runs."""
        return self.earlier + (self.clock() - self.started)

    def set_steps(self, steps: int) -> None:
        """The run's length, once chosen."""
        self.steps = self.bar.total = steps
        self.bar.refresh()

    def train(self, step: int, host: list[dict[str, float]], skipped: int) -> None:
        """One 'train' line for an interval's (finite) steps."""
        now = self.clock()
        if not host:  # every step of the interval was skipped
            return
        line = summarize_interval(host)
        line["tokens_per_sec"] = sum(m["n_tokens"] for m in host) / max(now - self.last, 1e-9)
        line["elapsed"] = self.elapsed()
        if skipped:
            line["skipped_steps"] = skipped
        record = self.writer.write(step, "train", line)
        self.bar.set_postfix(
            loss=f"{line['loss']:.3f}",
            lr=f"{line.get('lr', 0):.2e}",
            tok_s=f"{line['tokens_per_sec']:.0f}",
            refresh=False,
        )
        if self.lines:
            self.log(
                f"step {step}/{self.steps or '?'}: loss {line['loss']:.4f}, lr "
                f"{line.get('lr', 0):.3g}, {line['tokens_per_sec']:.0f} tokens/s, "
                f"{line['elapsed']:.0f}s"
            )
        if self.on_log:
            self.on_log(record)
        self.last = now

    def validation(self, step: int, figures: Mapping[str, float]) -> None:
        record = self.writer.write(step, "validation", figures)
        if self.on_log:
            self.on_log(record)

    def close(self) -> None:
        self.bar.close()


# ----------------------------------------------------------------------------- the loop
class Loop:
    """What a training loop holds while it runs, and what its hooks act through
    (`train.core.hooks`): the state in `dp`'s step layout, the step, the steps to run to (None:
    not chosen yet), why it stops (None while it goes on), the last validation, and the
    seconds its saves and validations took (`outside_s`, which timed steps leave out; the
    budget fit resets it) and its last validation's (`validation_s`)."""

    def __init__(self, state, *, dp, config, train_step, checkpoints, evaluate, clock, log):
        self.state, self.dp, self.config, self.train_step = state, dp, config, train_step
        self.checkpoints, self.evaluate, self.clock, self.log = checkpoints, evaluate, clock, log
        self.agreement = Agreement(config.agree_every)
        self.step = self.start_step = int(jax.device_get(state.step).reshape(-1)[0])  # pmap
        self.steps: int | None = config.steps
        self.reason: str | None = None
        self.last_eval: dict[str, float] | None = None
        self.evaluated_at: int | None = None
        self.outside_s, self.validation_s = 0.0, None
        self.interval: Interval | None = None
        self.report: Reporter | None = None

    def more_to_do(self) -> bool:
        return self.steps is None or self.step < self.steps

    def log_interval(self) -> None:
        if self.interval:
            host = self.interval.take(
                self.step, nonfinite=self.config.nonfinite, checkpoints=self.checkpoints
            )
            self.report.train(self.step, host, self.interval.skipped)

    def save(self, validation=None, unfinished=None) -> None:
        if self.checkpoints is None:
            return
        meta = {"elapsed": self.report.elapsed()}
        if unfinished:
            meta["interval_metrics"] = unfinished
        t0 = self.clock()
        self.checkpoints.save(
            self.dp.get_state(self.state),
            meta=meta,
            metrics=None if validation is None else {BEST_METRIC: validation["loss"]},
        )
        self.outside_s += self.clock() - t0

    def validate(self) -> dict[str, float]:
        t0 = self.clock()
        figures = self.evaluate(self.dp.get_state(self.state))
        self.report.validation(self.step, figures)
        self.evaluated_at = self.step
        self.validation_s = self.clock() - t0
        self.outside_s += self.validation_s
        return figures


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
    clock: Callable[[], float] = time.monotonic,
    hooks: Sequence = (),
) -> LoopResult:
    """Runs `train_step` from state.step to config.steps (with fit_to_budget, to the length
    the state's schedule holds or the loop chooses), the periodic work done by the hooks of
    `train.core.hooks.loop_hooks`, then by `hooks` (the caller's `train.core.hooks.Hook` objects).

    state: in `dp`'s step layout. batches: yields the batch of step state.step, then the
      next, ... (host arrays; past one process, this process's `dp.local_rows` of each global
      batch). evaluate: global-layout state -> {'loss', 'ppl', ...} on the validation set, run
      every eval_every steps and at the end, logged as split 'validation'; its 'loss' ranks
      the checkpoints for the best one. elapsed: training seconds of earlier runs (from the
      checkpoint meta). carried: host metrics of the steps of the current logging interval
      that an interrupted run had done (from the checkpoint meta). clock: seconds, in the
      units of config.deadline (time.monotonic; a test's fake clock).
    """
    from train.core.hooks import loop_hooks  # the hooks import this module's Loop

    hooks = [*loop_hooks(config, stop or StopFlag()), *hooks]
    loop = Loop(
        state,
        dp=dp,
        config=config,
        train_step=train_step,
        checkpoints=checkpoints,
        evaluate=evaluate,
        clock=clock,
        log=log or printer(),
    )
    for hook in hooks:
        hook.start(loop)
    loop.interval = Interval(dp, carried)
    loop.report = Reporter(
        config,
        writer,
        step=loop.step,
        steps=loop.steps,
        elapsed=elapsed,
        log=loop.log,
        on_log=on_log,
        clock=clock,
    )
    try:
        # The time budget may be spent before the first step (data preparation counts).
        if loop.more_to_do():
            loop.reason = loop.agreement.should_stop(
                loop.step, flag=StopFlag(), deadline=config.deadline, now=clock(), force=True
            )
        while loop.reason is None and loop.more_to_do():
            for hook in hooks:
                hook.before_step(loop)
            loop.state, metrics = train_step(loop.state, dp.put_batch(next(batches)))
            loop.step += 1
            loop.interval.add(metrics)
            loop.report.bar.update(1)
            # A signal ends the loop at once; 'time' after this step is logged, evaluated and
            # saved as usual.
            for hook in hooks:
                hook.after_step(loop)
                if loop.reason in SIGNAL_REASONS.values():
                    break
        loop.reason = loop.reason or "steps"
        for hook in hooks:
            hook.end(loop)
        _finish(loop)
    finally:
        loop.report.close()
    return LoopResult(
        loop.state, loop.reason, loop.report.elapsed(), loop.last_eval, loop.interval.skipped
    )


def _finish(loop: Loop) -> None:
    """The loop's last save: after a signal, with the steps of an interval cut short in the
    checkpoint (the resumed run completes it, so its log lines are an uninterrupted run's);
    otherwise after the last interval's line and a final validation at this step (which
    ranks the checkpoint)."""
    config, step = loop.config, loop.step
    progressed = step > loop.start_step or (
        loop.checkpoints and loop.checkpoints.latest_step() is None
    )
    if loop.reason in SIGNAL_REASONS.values():
        if step % config.log_every == 0:
            loop.log_interval()
        unfinished = loop.interval.take(
            step, nonfinite=config.nonfinite, checkpoints=loop.checkpoints
        )
        if progressed:
            loop.save(unfinished=unfinished)
        return
    loop.log_interval()
    if loop.evaluate and step > loop.start_step and loop.evaluated_at != step:
        loop.last_eval = loop.validate()
    if progressed:
        loop.save(loop.last_eval)


def printer() -> Callable[[str], None]:
    """print on process 0 only (flushed: logs interleave with the progress bar)."""
    quiet = jax.process_index() != 0

    def log(message: str) -> None:
        if not quiet:
            print(message, flush=True)

    return log


# The budget fit's pieces moved to train.core.hooks; still importable from here.
_MOVED = ("BudgetMeasure", "SHORT_BUDGET_S", "schedule_length", "with_schedule_length")


def __getattr__(name: str):
    if name in _MOVED:
        from train.core import hooks

        return getattr(hooks, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
