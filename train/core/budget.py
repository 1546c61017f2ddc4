"""How many steps fit a run's time budget: the arithmetic of `RunConfig.fit_to_budget`.

A run fitted to its budget cannot know its length before it runs: the step time depends on
the machine, its load and the compiled program. So the loop times its first steps after
compiling (`StepCosts`), then fixes its length once, here: the steps done plus those that fit
the seconds left. The learning-rate schedule decays over that length (it lives in the
optimizer state, `transformer_jax.optim.set_schedule_horizon`), so the run ends its decay as
its budget ends, on any machine, and a resumed run keeps the same length.

Validations inside the budget (every `eval_every` steps) are counted at the time one took.
Checkpoint saves are not: they are short beside the steps between them, and a run that
overshoots by a few steps is stopped by its deadline where the cosine is at its floor.
"""

from __future__ import annotations

import dataclasses
import math

# The train step's counter is an int32.
MAX_STEPS = 2**31 - 1


@dataclasses.dataclass(frozen=True)
class StepCosts:
    """What the loop measured, in seconds. step: one training step, the mean over `measured`
    steps; validation: one validation (0 when the run makes none within its budget)."""

    step: float
    measured: int
    validation: float = 0.0

    def __post_init__(self):
        if self.measured < 1:
            raise ValueError(f"measured: at least one timed step, got {self.measured}")
        if not (self.step >= 0 and self.validation >= 0):
            raise ValueError(f"step and validation seconds must be >= 0, got {self}")


def fitted_steps(*, step: int, seconds_left: float, costs: StepCosts, eval_every: int) -> int:
    """The run's length: `step` (the steps done) plus the steps that fit `seconds_left`, each
    costing a step and its share of the validations made every `eval_every` steps (0: none
    within the budget). Never below `step`, never above MAX_STEPS."""
    per_step = costs.step + (costs.validation / eval_every if eval_every else 0.0)
    if per_step <= 0:  # a clock that did not move (a test's): no bound but the counter's
        return MAX_STEPS
    more = math.floor(max(seconds_left, 0.0) / per_step)
    return min(step + more, MAX_STEPS)


def describe(*, seconds_left: float, costs: StepCosts, eval_every: int, total: int) -> str:
    """The log line of the choice: the budget left, what was measured, the length chosen."""
    validation = (
        f", a validation {costs.validation:.1f} s every {eval_every:,} steps"
        if eval_every and costs.validation
        else ""
    )
    return (
        f"{max(seconds_left, 0.0) / 60:.1f} min of the time budget left, {costs.step:.3g} "
        f"s/step measured over {costs.measured} steps{validation}: schedule set to "
        f"{total:,} steps"
    )
