"""Schedules that end with the time budget (RunConfig.fit_to_budget).

A run fitted to its budget times its first steps, sets its length to the steps that fit the
time left, and its schedule decays over them. On a toy regression with a fake clock (each step
costs a fixed number of seconds, so nothing depends on real timing): the length follows the
budget and the rate reaches its floor at the last step; validations are counted; a resumed
run keeps the saved length and repeats the uninterrupted run exactly. A given step count
stays fixed and builds the optimizer it always did, and a fitted run without a budget is the
fixed run of its steps, number for number.
"""

from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import tiny_lm_config, toy_loss, train_losses, tree_of

from train import lm, translate
from train.core.budget import StepCosts, fitted_steps
from train.core.checkpoint import Checkpoints
from train.core.config import UsageError
from train.core.loop import LoopConfig, StopFlag, schedule_length, train_loop
from train.core.metrics import MetricsWriter, read_metrics
from train.core.parallel import DataParallel
from train.core.state import TrainState
from transformer_jax.optim import (
    OptimizerConfig,
    find_schedule_horizon,
    make_optimizer,
    make_schedule,
    set_schedule_horizon,
)

PEAK, FLOOR, WARMUP = 0.1, 0.01, 8
SKIP, MEASURE = 2, 4  # the fitted length is chosen after step SKIP + MEASURE = 6


def cosine(horizon_in_state: bool, decay_steps: int = 0) -> OptimizerConfig:
    return OptimizerConfig(
        schedule="cosine",
        learning_rate=PEAK,
        warmup_steps=WARMUP,
        decay_steps=decay_steps,
        min_learning_rate=FLOOR,
        clip_norm=1.0,
        horizon_in_state=horizon_in_state,
    )


def batches_from(step: int):
    """The batch of each step from `step` on: a function of the step alone, so a resumed run
    reads what an uninterrupted one did."""
    while True:
        rs = np.random.RandomState(step)
        x = rs.randn(8, 4).astype(np.float32)  # 8 rows: they split over the 8 test devices
        yield {"x": x, "y": (x @ np.arange(1.0, 5.0, dtype=np.float32) + 0.5).astype(np.float32)}
        step += 1


class FakeClock:
    """Seconds that move only when a step or a validation says so."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def run(
    workdir,
    clock: FakeClock,
    *,
    step_seconds: float,
    minutes: float,
    eval_every: int = 0,
    eval_seconds: float = 0.0,
    checkpoint_every: int = 0,
    stop_at: int | None = None,
    wrap_step=None,
    steps: int = 10_000,
    steps_given: bool = False,
):
    """A toy run fitted to `minutes` of `clock`, each step costing `step_seconds` (and each
    validation `eval_seconds`), from `workdir`'s checkpoint if any; with `stop_at`, stopped
    by hand (as by SIGTERM) after that step's line. -> (LoopResult, log lines)."""
    dp = DataParallel("jit")
    tx, schedule = make_optimizer(cosine(True))
    init = TrainState.create(
        params={"w": jnp.zeros(4), "b": jnp.zeros(())}, tx=tx, rng=jax.random.PRNGKey(0)
    )
    state = dp.put_state(init)
    checkpoints = Checkpoints(str(workdir))
    if checkpoints.latest_step() is not None:
        state, _ = checkpoints.restore(state)
    compiled = dp.compile_train_step(toy_loss, state, lr_schedule=schedule)

    def step(state, batch):
        clock.now += step_seconds
        return compiled(state, batch)

    if wrap_step is not None:
        step = wrap_step(step)

    def evaluate(state):
        clock.now += eval_seconds
        return {"loss": 0.0}

    stop, lines = StopFlag(), []

    def on_log(record):
        if record["split"] == "train" and record["step"] == stop_at:
            stop()

    try:
        result = train_loop(
            state,
            dp=dp,
            train_step=step,
            batches=batches_from(int(state.step)),
            config=LoopConfig(
                steps=steps,  # the length without a budget: never reached unless given
                steps_given=steps_given,
                deadline=clock() + 60.0 * minutes,
                log_every=1,
                eval_every=eval_every,
                checkpoint_every=checkpoint_every,
                progress=False,
                fit_to_budget=True,
                fit_skip=SKIP,
                fit_measure=MEASURE,
            ),
            writer=MetricsWriter(str(workdir)),
            checkpoints=checkpoints,
            evaluate=evaluate,
            stop=stop,
            on_log=on_log,
            log=lines.append,
            clock=clock,
        )
    finally:
        checkpoints.close()
    return result, lines


def lrs(workdir) -> dict[int, float]:
    return {r["step"]: r["lr"] for r in read_metrics(str(workdir)) if r["split"] == "train"}


def test_the_length_is_the_budget_over_the_step_time_and_the_decay_ends_at_the_last_step(
    tmp_path,
):
    result, lines = run(tmp_path, FakeClock(), step_seconds=0.5, minutes=1.01)
    # 6 steps timed (3 s), 57.6 s left at 0.5 s a step: 115 more, 121 in all, the whole
    # steps in 60.6 s at 0.5 s; they end before the deadline.
    assert result.reason == "steps" and int(result.state.step) == 121
    assert schedule_length(result.state) == 121
    assert any("0.5 s/step measured over 4 steps: schedule set to 121 steps" in x for x in lines)
    rate = lrs(tmp_path)
    # The last step (count 120) is the cosine's end: its floor, and not before.
    assert rate[121] == pytest.approx(FLOOR, rel=1e-6)
    assert rate[120] > FLOOR * 1.0001
    assert rate[4] == pytest.approx(PEAK * 4 / WARMUP, rel=1e-6)  # the warm-up, before the choice


def test_the_timed_steps_start_once_the_background_compilations_are_done(tmp_path):
    """A train step still compiling batch shapes in the background (CompiledStep) is waited
    for before the steps that set the length are timed: its stalls are not step time."""
    clock, calls, waited_at = FakeClock(), [], []

    class CompilingInTheBackground:
        def __init__(self, step):
            self.step, self.compiling = step, True

        def __call__(self, state, batch):
            calls.append(1)
            clock.now += 2.0 if self.compiling else 0.0  # a stall, or a core shared
            return self.step(state, batch)

        def wait_compiled(self):
            waited_at.append(len(calls))
            clock.now += 5.0
            self.compiling = False

    result, lines = run(
        tmp_path, clock, step_seconds=0.5, minutes=1.01, wrap_step=CompilingInTheBackground
    )
    assert waited_at == [SKIP]  # once, right before the first timed step
    # 2 steps at 2.5 s and the 5 s wait, then 4 timed at 0.5 s: 48.6 s left, 97 more.
    assert any("0.5 s/step measured over 4 steps: schedule set to 103 steps" in x for x in lines)
    assert int(result.state.step) == 103 and result.reason == "steps"


def test_the_length_counts_the_validations_made_within_the_budget(tmp_path):
    clock = FakeClock()
    result, lines = run(
        tmp_path, clock, step_seconds=0.5, minutes=1.0, eval_every=10, eval_seconds=1.0
    )
    # A validation is timed at step 6 (1 s): 56 s left at 0.5 + 1.0 / 10 s a step: 93 more.
    assert int(result.state.step) == 99 and result.reason == "steps"
    assert any("a validation 1.0 s every 10 steps: schedule set to 99 steps" in x for x in lines)
    # The 99 steps and 10 validations (6, 10, ..., 90) end within the minute; the final one,
    # at step 99, follows the budget.
    assert clock.now - 1000.0 - 1.0 <= 60.0
    assert lrs(tmp_path)[99] == pytest.approx(FLOOR, rel=1e-6)


def test_a_resumed_run_keeps_its_length_and_repeats_the_uninterrupted_run_exactly(tmp_path):
    straight, _ = run(tmp_path / "straight", FakeClock(), step_seconds=0.5, minutes=1.01)
    first, _ = run(tmp_path / "resumed", FakeClock(), step_seconds=0.5, minutes=1.01, stop_at=50)
    assert first.reason == "sigterm" and 50 <= int(first.state.step) < 121
    # Resumed on a machine twice as fast with a fresh minute: it would fit more steps, but the
    # length is the checkpoint's.
    second, lines = run(tmp_path / "resumed", FakeClock(), step_seconds=0.25, minutes=1.01)
    assert any("the schedule length this run chose: 121 steps" in x for x in lines)
    assert int(second.state.step) == 121 and second.reason == "steps"
    a, b = train_losses(tmp_path / "straight"), train_losses(tmp_path / "resumed")
    assert [s for s, _ in a] == list(range(1, 122))
    assert a == b  # exact, not approximately equal
    assert lrs(tmp_path / "straight") == lrs(tmp_path / "resumed")
    chex.assert_trees_all_equal(
        jax.device_get(straight.state.params), jax.device_get(second.state.params)
    )


def test_a_chosen_horizon_gives_the_updates_of_the_fixed_schedule_of_that_length():
    params = {"w": jnp.arange(4.0), "b": jnp.zeros(())}
    fixed, _ = make_optimizer(cosine(False, decay_steps=12))
    fitted, schedule = make_optimizer(cosine(True))
    a, b = fixed.init(params), set_schedule_horizon(fitted.init(params), 12)
    assert int(find_schedule_horizon(b)) == 12 and find_schedule_horizon(a) is None
    pa = pb = params
    for i in range(16):  # through the warm-up, the decay and past its end
        grads = jax.tree.map(lambda x, i=i: jnp.sin(x + i), params)
        ua, a = fixed.update(grads, a, pa)
        ub, b = fitted.update(grads, b, pb)
        pa, pb = optax.apply_updates(pa, ua), optax.apply_updates(pb, ub)
        # The same arithmetic, but XLA may fold a division by the fixed length into a product.
        chex.assert_trees_all_close(pa, pb, rtol=1e-6, atol=1e-8)
    # Not chosen yet (0): no decay, the peak after the warm-up.
    assert float(schedule(100, jnp.int32(0))) == pytest.approx(PEAK)
    assert float(schedule(11, jnp.int32(12))) == pytest.approx(FLOOR)


def test_fitted_steps_is_the_time_left_over_the_cost_of_a_step():
    costs = StepCosts(step=0.2, measured=20, validation=3.0)
    assert fitted_steps(step=30, seconds_left=100.0, costs=costs, eval_every=0) == 530
    # Each step also pays a tenth of a 3 s validation every 10 steps: 0.5 s.
    assert fitted_steps(step=30, seconds_left=100.0, costs=costs, eval_every=10) == 230
    assert fitted_steps(step=30, seconds_left=-5.0, costs=costs, eval_every=0) == 30


def test_a_given_step_count_is_fixed_and_builds_the_optimizer_it_always_did():
    for task, argv in ((translate, ["--steps", "40"]), (lm, ["--steps", "40"])):
        config, _, _ = task.config_from_args(argv)
        assert config.preset == "cpu" and config.minutes > 0
        assert not config.fit_to_budget and config.steps == 40
        assert not config.optimizer_config().horizon_in_state
        # Both CPU defaults fit unless a step count is given, or when asked to anyway.
        assert task.config_from_args([])[0].fit_to_budget
        assert task.config_from_args(argv + ["--fit_to_budget", "true"])[0].fit_to_budget
    assert lm.config_from_args(["--steps", "40"])[0].decay_steps == 40
    # The optimizer state of a fixed schedule is optax's Adam's (checkpoints unchanged).
    params = {"w": jnp.zeros(3)}
    tx, _ = make_optimizer(translate.config_from_args(["--steps", "40"])[0].optimizer_config())
    adam = tx.init(params)[1]  # after the clipping's, before the parameter average's
    expected = optax.adam(optax.constant_schedule(1e-3)).init(params)
    assert jax.tree.structure(adam) == jax.tree.structure(expected)


def test_translation_adam_cosine_decays_to_zero_at_the_runs_last_step():
    fixed = translate.make_config(
        "transformer", "tiny", optimizer="adam_cosine", steps=40, adam_warmup_steps=4
    )
    schedule = make_schedule(fixed.optimizer_config())
    lr = fixed.learning_rate
    assert float(schedule(0)) == pytest.approx(lr / 4)  # the warm-up's first step
    assert float(schedule(19)) == pytest.approx(lr / 2, rel=1e-5)  # half-way down the cosine
    assert float(schedule(39)) == pytest.approx(0.0, abs=1e-9)  # step 40, the last
    # Fitted to a budget, the length is the state's: no decay until the run chooses it.
    fitted = translate.make_config(
        "transformer", "tiny", optimizer="adam_cosine", minutes=1.0, fit_to_budget=True
    )
    oc = fitted.optimizer_config()
    assert oc.horizon_in_state and oc.schedule == "cosine"
    schedule = make_schedule(oc)
    assert float(schedule(100, jnp.int32(0))) == pytest.approx(lr)
    assert float(schedule(499, jnp.int32(500))) == pytest.approx(0.0, abs=1e-9)


@pytest.mark.slow
def test_a_fitted_run_without_a_budget_is_the_fixed_run_of_its_steps(lm_straight, tmp_path):
    config, workdir, _ = lm_straight  # 6 steps, the cosine over 6
    fitted = tiny_lm_config(config.data_dir, decay_steps=0, fit_to_budget=True)
    assert fitted.minutes == 0 and fitted.steps == 6
    final = lm.train_and_evaluate(fitted, str(tmp_path))
    assert final["step"] == 6
    # To float rounding: XLA folds the fixed run's division by its constant 6 into a product
    # by 1/6, an ulp away from the fitted run's division by the 6 in its state.
    a, b = train_losses(workdir), train_losses(tmp_path)
    assert [s for s, _ in a] == [s for s, _ in b] == [1, 2, 3, 4, 5, 6]
    assert [x for _, x in b] == pytest.approx([x for _, x in a], rel=1e-6)
    assert lrs(tmp_path) == pytest.approx(lrs(workdir), rel=1e-6)
    assert lrs(tmp_path)[6] == pytest.approx(0.0, abs=1e-9)  # the cosine's end at step 6
    with pytest.raises(ValueError, match="decay_steps"):
        tiny_lm_config(config.data_dir, fit_to_budget=True)  # its decay_steps=6 is fixed


def test_a_steps_given_on_resume_is_where_the_run_stops(tmp_path):
    # Chosen before the stop: the run stops at the given step, its schedule keeps the length
    # it chose (the rates are the uninterrupted run's up to there).
    straight, _ = run(tmp_path / "straight", FakeClock(), step_seconds=0.5, minutes=1.01)
    run(tmp_path / "chosen", FakeClock(), step_seconds=0.5, minutes=1.01, stop_at=50)
    resumed, lines = run(
        tmp_path / "chosen", FakeClock(), step_seconds=0.5, minutes=1.01, steps=70, steps_given=True
    )
    assert int(resumed.state.step) == 70 and resumed.reason == "steps"
    assert schedule_length(resumed.state) == 121
    assert any("stopping at step 70 (--steps); the schedule keeps" in x for x in lines)
    assert lrs(tmp_path / "chosen") == {
        s: r for s, r in lrs(tmp_path / "straight").items() if s <= 70
    }
    # Stopped before it chose: the given steps are its length, not fitted to the budget.
    run(tmp_path / "early", FakeClock(), step_seconds=0.5, minutes=1.01, stop_at=3)
    resumed, lines = run(
        tmp_path / "early", FakeClock(), step_seconds=0.5, minutes=1.01, steps=9, steps_given=True
    )
    assert int(resumed.state.step) == 9 and schedule_length(resumed.state) == 9
    assert any("--steps 9: schedule set to 9 steps, not fitted" in x for x in lines)
    assert lrs(tmp_path / "early")[9] == pytest.approx(FLOOR, rel=1e-6)


def test_a_budget_too_short_to_fit_is_warned_of_and_said_to_have_ended_unfitted(tmp_path):
    # Each step 10 s and a minute: the budget ends at step 6, as the timing window does.
    result, lines = run(tmp_path, FakeClock(), step_seconds=10.0, minutes=0.9)
    assert result.reason == "time" and schedule_length(result.state) == 0
    assert any(x.startswith("warning: 54 s of the time budget are left") for x in lines)
    assert any("before the run had timed its steps (steps 2-6)" in x for x in lines)
    # A budget that fits the window says neither.
    _, lines = run(tmp_path / "long", FakeClock(), step_seconds=0.5, minutes=2)
    assert not any("warning" in x or "never fitted" in x for x in lines)


@pytest.mark.slow
def test_a_resume_with_steps_below_its_checkpoint_is_refused_and_changes_nothing(lm_straight):
    config, workdir, _ = lm_straight  # a checkpoint at step 6
    before = tree_of(workdir)
    with pytest.raises(UsageError, match=r"--steps 4: the run in .* is already at step 6"):
        lm.train_and_evaluate(dataclasses.replace(config, steps=4), str(workdir))
    assert tree_of(workdir) == before
