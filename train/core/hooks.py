"""The periodic work of a training loop, one unit each: stopping, logging, evaluation and
checkpoints, and the schedule fitted to the time budget.

`train.core.loop.train_loop` runs the steps and calls, in order, each hook's `start` (before
the first step), `before_step`, `after_step` (after each step) and `end`; the hooks act through
the `train.core.loop.Loop` they are handed (its state, step, reason and its `log_interval`,
`validate` and `save`). Flax's examples and clu's periodic actions are the model.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import jax
import numpy as np

from train.core.budget import StepCosts, describe, fitted_steps
from train.core.parallel import DataParallel
from train.core.state import TrainState
from transformer_jax.optim import find_schedule_horizon, set_schedule_horizon

if TYPE_CHECKING:  # the loop imports this module to build its hooks
    from train.core.loop import Agreement, Loop, LoopConfig, StopFlag

# A fitted run with less time than this left when its loop starts is warned that it may not
# get to choose its length: it times 200 steps after 20 (about 30 s of the CPU main job).
SHORT_BUDGET_S = 90.0


class Hook:
    """A unit of a loop's periodic work; every method does nothing unless overridden."""

    def start(self, loop: Loop) -> None:
        """Before the first step (may set the loop's state and its `steps`)."""

    def before_step(self, loop: Loop) -> None:
        """Before the step from `loop.step` to `loop.step + 1`."""

    def after_step(self, loop: Loop) -> None:
        """After a step (`loop.step` is the new step; `loop.reason` says whether it stops)."""

    def end(self, loop: Loop) -> None:
        """After the last step, once `loop.reason` is final, before the final save."""


class StopCheck(Hook):
    """The stop flag (a signal), the deadline, and past one process the agreement of every
    process on both (`Agreement`), decided after each step."""

    def __init__(self, stop: StopFlag):
        self.stop = stop

    def after_step(self, loop: Loop) -> None:
        loop.reason = loop.agreement.should_stop(
            loop.step, flag=self.stop, deadline=loop.config.deadline, now=loop.clock()
        )


class LogEvery(Hook):
    """The training line of every `log_every` steps."""

    def after_step(self, loop: Loop) -> None:
        if loop.step % loop.config.log_every == 0:
            loop.log_interval()


class EvaluateAndSave(Hook):
    """A validation and a checkpoint it ranks every `eval_every` steps; else a checkpoint
    every `checkpoint_every` steps."""

    def after_step(self, loop: Loop) -> None:
        config = loop.config
        if loop.evaluate and config.eval_every and loop.step % config.eval_every == 0:
            loop.log_interval()
            loop.last_eval = loop.validate()
            loop.save(loop.last_eval)
        elif config.checkpoint_every and loop.step % config.checkpoint_every == 0:
            loop.log_interval()
            loop.save()


class BudgetFit(Hook):
    """The schedule's length, for a run fitted to its time budget: kept when the run chose it
    already (resumed) or was given it (--steps on a resume), the run's steps without a budget,
    else chosen after timing the steps from `start` to `end` of this run (`BudgetMeasure`),
    and written into the optimizer state."""

    def __init__(self):
        self.measure: BudgetMeasure | None = None

    def start(self, loop: Loop) -> None:
        config, log = loop.config, loop.log
        chosen = schedule_length(loop.state)
        if config.steps_given and chosen:
            log(
                f"stopping at step {config.steps:,} (--steps); the schedule keeps the length "
                f"this run chose, {chosen:,} steps"
            )
        elif config.steps_given:
            loop.state = with_schedule_length(loop.dp, loop.state, config.steps)
            log(f"--steps {config.steps:,}: schedule set to {config.steps:,} steps, not fitted")
        elif chosen:
            loop.steps = chosen
            log(f"resumed with the schedule length this run chose: {chosen:,} steps")
        elif config.deadline is None:
            loop.state = with_schedule_length(loop.dp, loop.state, config.steps)
            log(f"no time budget: schedule set to the run's {config.steps:,} steps")
        else:
            loop.steps, self.measure = None, BudgetMeasure(loop.step, config, loop.clock)
            left = config.deadline - loop.clock()
            if left < SHORT_BUDGET_S:
                log(
                    f"warning: {left:.0f} s of the time budget are left, and the run first "
                    f"times steps {self.measure.start}-{self.measure.end} to fit its schedule "
                    "to the budget; if the budget ends before, the run stops with its schedule "
                    "not fitted (still warming up). Give more --minutes, or --steps N"
                )

    def before_step(self, loop: Loop) -> None:
        if self.measure and loop.step == self.measure.start:
            # Batch shapes still compiling in the background would stall timed steps.
            wait_compiled = getattr(loop.train_step, "wait_compiled", None)
            if wait_compiled is not None:
                wait_compiled()
            self.measure.begin(loop.state)
            loop.outside_s = 0.0

    def after_step(self, loop: Loop) -> None:
        measure = self.measure
        if not (measure and loop.step == measure.end and loop.reason is None):
            return
        # A validation within the budget costs steps: time one now if none was.
        if loop.evaluate and loop.config.eval_every and loop.validation_s is None:
            loop.last_eval = loop.validate()
        measure.outside, measure.validation = loop.outside_s, loop.validation_s
        loop.steps = measure.choose(loop.state, loop.config, loop.agreement)
        loop.state = with_schedule_length(loop.dp, loop.state, loop.steps)
        loop.report.set_steps(loop.steps)
        loop.log(measure.message)
        self.measure = None

    def end(self, loop: Loop) -> None:
        if self.measure is not None and loop.reason == "time":
            loop.log(
                f"the time budget ended at step {loop.step:,}, before the run had timed its "
                f"steps (steps {self.measure.start}-{self.measure.end}): its schedule was never "
                "fitted"
            )


def loop_hooks(config: LoopConfig, stop: StopFlag) -> list[Hook]:
    """A run's hooks, in the order they act after each step."""
    hooks: list[Hook] = [StopCheck(stop), LogEvery(), EvaluateAndSave()]
    return hooks + [BudgetFit()] if config.fit_to_budget else hooks


class BudgetMeasure:
    """What a run fitted to its budget times before it chooses its length: the steps from
    `start` to `end`, less the time validations and saves took among them (`outside`), and
    the last validation's seconds (`validation`, None until one ran)."""

    def __init__(self, first_step: int, config: LoopConfig, clock: Callable[[], float]):
        self.start = first_step + config.fit_skip
        self.end = self.start + config.fit_measure
        self.clock = clock
        self.began = 0.0
        self.outside = 0.0
        self.validation: float | None = None
        self.message = ""

    def begin(self, state: TrainState) -> None:
        # The steps dispatched so far must have run: the clock starts on an idle device.
        jax.block_until_ready(state)
        self.began = self.clock()
        self.outside = 0.0

    def choose(self, state: TrainState, config: LoopConfig, agreement: Agreement) -> int:
        """The run's length, the same on every process (process 0's measurement)."""
        jax.block_until_ready(state)
        now = self.clock()
        costs = StepCosts(
            step=max(now - self.began - self.outside, 0.0) / (self.end - self.start),
            measured=self.end - self.start,
            validation=self.validation or 0.0,
        )
        total = agreement.same_everywhere(
            fitted_steps(
                step=self.end,
                seconds_left=config.deadline - now,
                costs=costs,
                eval_every=config.eval_every,
            )
        )
        self.message = describe(
            seconds_left=config.deadline - now,
            costs=costs,
            eval_every=config.eval_every,
            total=total,
        )
        return total


def schedule_length(state: TrainState) -> int | None:
    """The schedule length the state's optimizer keeps (0: not chosen yet), or None when it
    keeps none (a fixed schedule)."""
    horizon = find_schedule_horizon(state.opt_state)
    if horizon is None:
        return None
    return int(np.ravel(jax.device_get(horizon))[0])  # pmap: one per device


def with_schedule_length(dp: DataParallel, state: TrainState, steps: int) -> TrainState:
    """`state` (in `dp`'s step layout) with its schedule's length set to `steps`."""
    state = dp.get_state(state)
    return dp.put_state(state.replace(opt_state=set_schedule_horizon(state.opt_state, steps)))
