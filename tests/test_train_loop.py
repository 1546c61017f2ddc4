"""The shared training loop and checkpoints, on a toy regression whose loss uses the step rng.

Resume must be exact, SIGTERM must save, a NaN must stop without saving, a corrupt checkpoint
must be an error that changes nothing on disk, and the kept checkpoints must be the last N plus
the best by validation loss.
"""

from __future__ import annotations

import os
import signal
import time

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import file_hashes, toy_loss, train_losses

from train import lm
from train.core.checkpoint import CheckpointError, Checkpoints
from train.core.loop import LoopConfig, StopFlag, TrainingDiverged, stop_on_signals, train_loop
from train.core.metrics import MetricsWriter, read_metrics
from train.core.parallel import DataParallel
from train.core.state import TrainState

D = 4
ROWS = 8  # divisible by the 8 test devices


def toy_batch(step: int, nan_at: int | None = None) -> dict[str, np.ndarray]:
    rs = np.random.RandomState(step)
    x = rs.randn(ROWS, D).astype(np.float32)
    y = (x @ np.arange(1, D + 1, dtype=np.float32) + 0.5).astype(np.float32)
    if step == nan_at:
        y[0] = np.nan
    return {"x": x, "y": y}


def batches_from(start: int, nan_at: int | None = None):
    step = start
    while True:
        yield toy_batch(step, nan_at)
        step += 1


def toy_eval(state: TrainState) -> dict[str, float]:
    batch = toy_batch(10_000)
    loss_sum, sums, _ = toy_loss(
        jax.device_get(state.params), batch, rng=None, extra=None, deterministic=True
    )
    return {"loss": float(loss_sum / sums["n_tokens"])}


def run(
    workdir,
    *,
    steps,
    nan_at=None,
    eval_every=0,
    checkpoint_every=0,
    keep=3,
    stop=None,
    on_log=None,
    deadline=None,
    batches=batches_from,
    clock=time.monotonic,
    hooks=(),
):
    """Init or resume from `workdir`, train to `steps` (or the `deadline`, on `clock`);
    returns (LoopResult, Checkpoints). batches: (start step, nan_at) -> the batch stream."""
    dp = DataParallel("jit")
    tx = optax.sgd(0.1)
    init = TrainState.create(
        params={"w": jnp.zeros(D), "b": jnp.zeros(())}, tx=tx, rng=jax.random.PRNGKey(0)
    )
    init = dp.put_state(init)
    ckpt = Checkpoints(str(workdir), keep=keep)
    state, elapsed = init, 0.0
    if ckpt.latest_step() is not None:
        state, meta = ckpt.restore(init)
        elapsed = meta["elapsed"]
    step_fn = dp.compile_train_step(toy_loss, state, lr_schedule=lambda s: 0.1)
    start = int(state.step)
    result = train_loop(
        state,
        dp=dp,
        train_step=step_fn,
        batches=batches(start, nan_at),
        config=LoopConfig(
            steps=steps,
            deadline=deadline,
            log_every=1,
            eval_every=eval_every,
            checkpoint_every=checkpoint_every,
            progress=False,
        ),
        writer=MetricsWriter(str(workdir)),
        checkpoints=ckpt,
        evaluate=toy_eval,
        elapsed=elapsed,
        stop=stop,
        on_log=on_log,
        clock=clock,
        hooks=hooks,
    )
    return result, ckpt


def test_a_few_steps_lower_the_loss(tmp_path):
    result, _ = run(tmp_path, steps=8)
    losses = [loss for _, loss in train_losses(tmp_path)]
    assert len(losses) == 8 and result.reason == "steps"
    assert losses[-1] < 0.5 * losses[0]


def test_resume_reproduces_an_uninterrupted_run_exactly(tmp_path):
    straight, _ = run(tmp_path / "straight", steps=6)
    first, ckpt = run(tmp_path / "resumed", steps=3)
    assert ckpt.latest_step() == 3
    second, _ = run(tmp_path / "resumed", steps=6)
    a, b = train_losses(tmp_path / "straight"), train_losses(tmp_path / "resumed")
    assert [s for s, _ in a] == [1, 2, 3, 4, 5, 6]
    assert a == b  # exact, not approximately equal
    chex.assert_trees_all_equal(
        jax.device_get(straight.state.params), jax.device_get(second.state.params)
    )
    # Training time carries over a resume: the resumed run's clock starts from the one its
    # checkpoint saved (after step 3's line was written), not from zero. (Not against
    # first.elapsed: that also counts the first run's final save, which its checkpoint cannot;
    # a fast resumed run could then end below it.)
    clock = {
        r["step"]: r["elapsed"]
        for r in read_metrics(str(tmp_path / "resumed"))
        if r["split"] == "train"
    }
    assert clock[3] <= first.elapsed
    assert clock[3] <= clock[4] <= second.elapsed


def test_sigterm_saves_and_returns(tmp_path):
    def send_sigterm(record):
        if record["split"] == "train" and record["step"] == 2:
            os.kill(os.getpid(), signal.SIGTERM)

    with stop_on_signals((signal.SIGTERM,)) as flag:
        result, ckpt = run(tmp_path, steps=10, stop=flag, on_log=send_sigterm)
    assert flag.signum == signal.SIGTERM
    assert result.reason == "sigterm"
    # The signal arrived after step 2's log line; step 3 was in flight and finished.
    assert ckpt.latest_step() == int(result.state.step) == 3
    assert signal.getsignal(signal.SIGTERM) is not flag  # handler restored
    resumed, _ = run(tmp_path, steps=5)
    assert [s for s, _ in train_losses(tmp_path)] == [1, 2, 3, 4, 5]


def test_nan_stops_with_a_message_and_keeps_the_last_good_checkpoint(tmp_path):
    # Step 5 started from checkpoint 4 and its batch is fixed: a resume from 4 would repeat it,
    # so the message says so and points at the step before.
    with pytest.raises(
        TrainingDiverged,
        match=r"checkpoints/4, is the state step 5 started "
        r"from, .*to resume from step 2",
    ):
        run(tmp_path, steps=10, nan_at=4, checkpoint_every=2)  # batch 4 is used by step 5
    ckpt = Checkpoints(str(tmp_path))
    assert ckpt.latest_step() == 4
    # --minutes sets that deadline, counted from the run's start.
    minutes = lm.make_config("ptb", "tiny", minutes=2.0)
    assert LoopConfig.from_run(minutes, start=100.0).deadline == 220.0
    restored, _ = ckpt.restore(
        DataParallel("jit").put_state(
            TrainState.create(
                params={"w": jnp.zeros(D), "b": jnp.zeros(())},
                tx=optax.sgd(0.1),
                rng=jax.random.PRNGKey(0),
            )
        )
    )
    chex.assert_tree_all_finite(jax.device_get(restored.params))


def test_keeps_the_last_n_and_the_best_by_validation_loss(tmp_path):
    dp = DataParallel("jit")
    state = dp.put_state(
        TrainState.create(params={"w": jnp.zeros(D)}, tx=optax.sgd(1.0), rng=jax.random.PRNGKey(0))
    )
    ckpt = Checkpoints(str(tmp_path), keep=2)
    val = {1: 5.0, 2: 1.0, 3: 4.0, 4: None, 5: 3.0, 6: 2.5}
    for step, loss in val.items():
        ckpt.save(
            state.replace(step=jnp.int32(step)),
            meta={"elapsed": 0.0},
            metrics=None if loss is None else {"val_loss": loss},
        )
    assert ckpt.all_steps() == [2, 5, 6]
    assert ckpt.best_step() == 2


def test_corrupt_checkpoint_is_a_clear_error_and_changes_nothing(tmp_path):
    run(tmp_path, steps=4, checkpoint_every=2)
    ckpt = Checkpoints(str(tmp_path))
    assert ckpt.all_steps() == [2, 4]
    # Truncate every array data file of the latest checkpoint.
    data_files = [
        os.path.join(root, name)
        for root, _, files in os.walk(os.path.join(ckpt.path(4), "state"))
        for name in files
        if os.path.basename(root) == "d"
    ]
    assert data_files
    for path in data_files:
        with open(path, "r+b") as f:
            f.truncate(3)
    before = file_hashes(tmp_path)
    with pytest.raises(CheckpointError, match=str(ckpt.path(4))):
        run(tmp_path, steps=6)
    assert file_hashes(tmp_path) == before


def test_stop_flag_by_hand_before_any_step_still_runs_one_step(tmp_path):
    flag = StopFlag()
    flag()
    result, ckpt = run(tmp_path, steps=5, stop=flag)
    assert result.reason == "sigterm" and ckpt.latest_step() == 1


def test_a_time_budget_spent_after_some_steps_stops_the_run_after_that_step(tmp_path):
    # The loop's clock, moved on one second by each batch drawn (one a step): steps that take
    # time, deterministically. A budget of 3.5 s runs out during step 4, long before step 10.
    clock = [0.0]

    def timed_batches(start, nan_at):
        for batch in batches_from(start, nan_at):
            clock[0] += 1.0
            yield batch

    result, ckpt = run(
        tmp_path, steps=10, deadline=3.5, batches=timed_batches, clock=lambda: clock[0]
    )
    assert result.reason == "time" and int(result.state.step) == 4
    # Step 4 is logged, validated and saved as any last step.
    assert [s for s, _ in train_losses(tmp_path)] == [1, 2, 3, 4]
    assert [r["step"] for r in read_metrics(str(tmp_path)) if r["split"] == "validation"] == [4]
    assert ckpt.latest_step() == 4
    # --minutes sets that deadline, counted from the run's start.
    minutes = lm.make_config("ptb", "tiny", minutes=2.0)
    assert LoopConfig.from_run(minutes, start=100.0).deadline == 220.0


def test_a_hook_of_the_caller_s_runs_after_the_run_s_own_at_every_step(tmp_path):
    """The loop's one protocol (`train.core.hooks.Hook`): start, before and after each step,
    end; a caller's hook sees each step after the run's own have logged, evaluated and saved."""
    from train.core.hooks import Hook

    class Recorder(Hook):
        def __init__(self):
            self.calls = []

        def start(self, loop):
            self.calls.append(("start", loop.step))

        def before_step(self, loop):
            self.calls.append(("before", loop.step))

        def after_step(self, loop):
            saved = loop.checkpoints.latest_step()
            self.calls.append(("after", loop.step, loop.evaluated_at, saved))

        def end(self, loop):
            self.calls.append(("end", loop.step, loop.reason))

    recorder = Recorder()
    result, _ = run(tmp_path, steps=4, eval_every=2, hooks=[recorder])
    assert result.reason == "steps"
    assert recorder.calls == [
        ("start", 0),
        ("before", 0),
        ("after", 1, None, None),
        ("before", 1),
        ("after", 2, 2, 2),  # the validation and the checkpoint of step 2 came first
        ("before", 2),
        ("after", 3, 2, 2),
        ("before", 3),
        ("after", 4, 4, 4),
        ("end", 4, "steps"),
    ]
