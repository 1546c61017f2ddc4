"""The training loop's pieces one at a time, with host stand-ins for the device, the step,
the checkpoints and the metrics file: the settings and their checks, the stop flag and
signals, the stop decisions of one process and of several (JAX's multi-process calls
replaced), the message of a diverged step, the logging interval, the reporter, and the loop's
order of work and its last save. No program is compiled, so each test runs in milliseconds;
test_train_loop.py runs the same loop on a compiled toy step with real checkpoints.
"""

from __future__ import annotations

import dataclasses
import signal
import sys
import threading
import types

import numpy as np
import pytest

from train import lm
from train.core import hooks as hooks_module
from train.core import loop as loop_module
from train.core.errors import TrainingDiverged
from train.core.loop import (
    Agreement,
    Interval,
    LoopConfig,
    LoopResult,
    Reporter,
    StopFlag,
    divergence_message,
    printer,
    stop_on_signals,
    train_loop,
)


# ----------------------------------------------------------------------------- stand-ins
@dataclasses.dataclass(frozen=True)
class State:
    step: np.ndarray


class HostDP:
    """The DataParallel calls the loop makes, on the host: batches and states as they are,
    metrics fetched as floats."""

    def __init__(self):
        self.fetched = []  # the lengths of each fetch: one transfer an interval

    def put_batch(self, batch):
        return batch

    def get_state(self, state):
        return state

    def fetch(self, pending):
        self.fetched.append(len(pending))
        return [{k: float(v) for k, v in m.items()} for m in pending]


class Saves:
    """The Checkpoints calls the loop makes: each save recorded as (step, meta, metrics)."""

    directory = "W/checkpoints"

    def __init__(self, steps=()):
        self.steps = list(steps)
        self.saved = []

    def latest_step(self):
        # A fresh int, as orbax's listing of the directory gives: never the object
        # all_steps() holds.
        return int(str(self.steps[-1])) if self.steps else None

    def all_steps(self):
        return list(self.steps)

    def path(self, step):
        return f"{self.directory}/{step}"

    def save(self, state, *, meta, metrics):
        step = int(state.step)
        self.steps.append(step)
        self.saved.append((step, meta, metrics))


class Records:
    """A MetricsWriter that keeps its records."""

    def __init__(self):
        self.records = []

    def write(self, step, split, values):
        record = {"step": step, "split": split, **values}
        self.records.append(record)
        return record

    def lines(self, split):
        return [r for r in self.records if r["split"] == split]


class Clock:
    """Seconds that move only when told (`host_step` moves them by `per_step` a step)."""

    def __init__(self, now=0.0):
        self.now = now

    def __call__(self):
        return self.now


def metrics_of(step, *, tokens=10.0, nonfinite=False):
    """A step's device metrics: a loss of `step` a token, so each line's figure says which
    steps it averaged."""
    return {
        "loss_sum": np.float32(step * tokens),
        "nll_sum": np.float32(step * tokens),
        "n_tokens": np.float32(tokens),
        "grad_norm": np.float32(step + 0.5),
        "lr": np.float32(0.001 * step),
        "nonfinite": np.float32(nonfinite),
    }


def host_step(clock=None, per_step=0.0, nonfinite_at=(), tokens=10.0):
    """A train step on the host: the state's step plus one, its metrics, the clock moved on."""
    calls = []

    def step(state, batch):
        new = int(state.step) + 1
        calls.append((int(state.step), batch))
        if clock is not None:
            clock.now += per_step
        return State(np.int32(new)), metrics_of(new, tokens=tokens, nonfinite=new in nonfinite_at)

    step.calls = calls
    return step


def numbered_batches(start, stop):
    """The batches of steps start ... stop - 1, then none: a loop that draws past its last
    step fails at once rather than running on."""
    while start < stop:
        yield {"batch": start}
        start += 1


FRESH = object()  # run()'s checkpoints when none are given: a Saves of no step yet


def run(
    *,
    steps=6,
    start=0,
    clock=None,
    per_step=0.0,
    nonfinite_at=(),
    evaluate=None,
    checkpoints=FRESH,
    stop=None,
    on_log=None,
    carried=None,
    elapsed=None,
    hooks=(),
    **config,
):
    """The loop over the stand-ins -> (LoopResult, step fn, writer, checkpoints, log lines).
    checkpoints: a Saves, or None for a loop that saves nothing."""
    clock = clock or Clock()
    lines = []
    step = host_step(clock, per_step, nonfinite_at)
    writer = Records()
    checkpoints = Saves() if checkpoints is FRESH else checkpoints
    config = {"log_every": 1, "progress": False, **config}
    result = train_loop(
        State(np.int32(start)),
        dp=HostDP(),
        train_step=step,
        batches=numbered_batches(start, steps),
        config=LoopConfig(steps=steps, **config),
        writer=writer,
        checkpoints=checkpoints,
        evaluate=evaluate,
        **({} if elapsed is None else {"elapsed": elapsed}),
        stop=stop,
        on_log=on_log,
        log=lines.append,
        carried=carried,
        clock=clock,
        hooks=hooks,
    )
    return result, step, writer, checkpoints, lines


# ----------------------------------------------------------------------------- settings
@pytest.mark.parametrize(
    ("field", "value", "named"),
    [
        ("steps", -1, "steps"),
        ("log_every", 0, "log_every"),
        ("agree_every", 0, "agree_every"),
        ("eval_every", -1, "eval_every"),
        ("checkpoint_every", -1, "checkpoint_every"),
        ("nonfinite", "ignore", "on_nonfinite"),
        ("fit_skip", -1, "fit_skip"),
        ("fit_measure", 0, "fit_measure"),
    ],
)
def test_loop_config_refuses_each_bad_setting_by_name(field, value, named):
    with pytest.raises(ValueError, match=named):
        LoopConfig(**{"steps": 5, field: value})


def test_loop_config_is_frozen():
    config = LoopConfig(steps=3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.steps = 4


def test_loop_config_takes_each_setting_at_its_bound():
    config = LoopConfig(
        steps=0,
        log_every=1,
        agree_every=1,
        eval_every=0,
        checkpoint_every=0,
        nonfinite="skip",
        fit_skip=0,
        fit_measure=1,
    )
    assert (config.steps, config.fit_skip, config.fit_measure) == (0, 0, 1)
    defaults = LoopConfig(steps=3)
    assert (defaults.log_every, defaults.agree_every, defaults.nonfinite) == (50, 10, "stop")
    assert (defaults.fit_skip, defaults.fit_measure, defaults.deadline) == (20, 200, None)
    assert not defaults.fit_to_budget and not defaults.steps_given and defaults.progress


def test_loop_config_from_a_run_config_carries_every_setting():
    run_config = lm.make_config(
        "ptb",
        "tiny",
        minutes=2.0,
        steps=77,
        log_every=3,
        eval_every=5,
        checkpoint_every=7,
        progress=False,
        on_nonfinite="skip",
        fit_to_budget=True,
    )
    config = LoopConfig.from_run(run_config, start=100.0, steps_given=True)
    assert config == LoopConfig(
        steps=77,
        deadline=220.0,
        log_every=3,
        eval_every=5,
        checkpoint_every=7,
        progress=False,
        nonfinite="skip",
        fit_to_budget=True,
        steps_given=True,
    )
    # No budget: no deadline. --steps counts as given only for a fitted run.
    plain = lm.make_config("ptb", "tiny", steps=77)
    config = LoopConfig.from_run(plain, start=100.0, steps_given=True)
    assert config.deadline is None and not config.steps_given
    assert not LoopConfig.from_run(run_config, start=0.0).steps_given
    with pytest.raises(TypeError):  # the start and steps_given by keyword
        LoopConfig.from_run(run_config, 0.0)


@pytest.mark.parametrize(
    ("reason", "interrupted"),
    [("steps", False), ("time", False), ("sigterm", True), ("sigint", True)],
)
def test_a_result_is_interrupted_only_by_a_signal(reason, interrupted):
    result = LoopResult(None, reason, 0.0, None)
    assert result.interrupted is interrupted and result.skipped == 0


# ----------------------------------------------------------------------------- stops
def test_the_stop_flag_names_its_signal():
    flag = StopFlag()
    assert not flag.requested and flag.signum is None
    flag()  # by hand: counts as a SIGTERM
    assert flag.requested and flag.reason == "sigterm"
    flag(signal.SIGINT, None)
    assert flag.signum == signal.SIGINT and flag.reason == "sigint"
    flag(signal.SIGTERM, None)
    assert flag.reason == "sigterm"


def test_signals_set_the_flag_a_second_ctrl_c_raises_and_the_handlers_come_back():
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    # Real signals, raised in this process: the handler is given the signal's number as an
    # int, not the enum member.
    with stop_on_signals() as flag:
        handler = signal.getsignal(signal.SIGINT)
        assert handler is signal.getsignal(signal.SIGTERM)
        assert handler not in before
        signal.raise_signal(signal.SIGTERM)
        assert flag.requested and flag.reason == "sigterm"
        # A SIGTERM after a SIGTERM is only a flag again; a SIGINT after one raises.
        signal.raise_signal(signal.SIGTERM)
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before
    with stop_on_signals((signal.SIGINT,)) as flag:
        signal.raise_signal(signal.SIGINT)  # the first Ctrl-C: a flag
        assert flag.requested and flag.reason == "sigint"
        assert signal.getsignal(signal.SIGTERM) == before[1]  # not asked for: untouched
    assert signal.getsignal(signal.SIGINT) == before[0]
    # Only a second Ctrl-C raises, not a second of another signal asked for (SIGHUP's number
    # is below SIGINT's).
    with stop_on_signals((signal.SIGHUP,)) as flag:
        signal.raise_signal(signal.SIGHUP)
        signal.raise_signal(signal.SIGHUP)
        assert flag.requested and flag.signum == signal.SIGHUP


def test_outside_the_main_thread_no_handler_is_installed():
    before = signal.getsignal(signal.SIGTERM)
    seen = {}

    def body():
        with stop_on_signals() as flag:
            seen["handler"] = signal.getsignal(signal.SIGTERM)
            flag()
            seen["flag"] = flag

    thread = threading.Thread(target=body)
    thread.start()
    thread.join()
    assert seen["handler"] == before and seen["flag"].requested


def test_one_process_stops_on_its_flag_then_on_its_deadline():
    one = Agreement(every=10)
    assert not one.multi and one.every == 10
    flag = StopFlag()
    ask = one.should_stop
    assert ask(3, flag=flag, deadline=None, now=1e9) is None
    assert ask(3, flag=flag, deadline=5.0, now=4.99) is None
    assert ask(3, flag=flag, deadline=5.0, now=5.0) == "time"  # the deadline itself is late
    flag(signal.SIGINT, None)
    assert ask(3, flag=flag, deadline=5.0, now=5.0) == "sigint"  # the flag first
    assert one.same_everywhere(7) == 7
    with pytest.raises(TypeError):  # all but the step by keyword
        ask(3, flag, None, 0.0)


class Peers:
    """JAX's multi-process calls as the loop makes them, answered by hand."""

    def __init__(self, others=(), preempted=False, broadcast=None):
        self.others = [np.array(o, np.int32) for o in others]  # the other processes' votes
        self.preempted = preempted  # True, False, or an exception to raise
        self.broadcast = broadcast
        self.gathered = []

    def reached_preemption_sync_point(self, step):
        if isinstance(self.preempted, Exception):
            raise self.preempted
        return self.preempted

    def process_allgather(self, mine):
        self.gathered.append(mine.copy())
        return np.stack([mine, *self.others])

    def broadcast_one_to_all(self, value):
        return np.int64(self.broadcast)


def several(monkeypatch, peers, every=10):
    monkeypatch.setattr(loop_module.jax, "process_count", lambda: 2)
    monkeypatch.setattr(loop_module, "multihost_utils", peers)
    agreement = Agreement(every)
    assert agreement.multi
    return agreement


def test_several_processes_meet_only_every_few_steps_or_when_forced(monkeypatch):
    peers = Peers(others=[[0, 0]])
    agreement = several(monkeypatch, peers, every=4)
    flag = StopFlag()
    flag()
    # Between meetings nothing is gathered, even with this process's flag set and late.
    assert agreement.should_stop(3, flag=flag, deadline=1.0, now=2.0) is None
    assert peers.gathered == []
    assert agreement.should_stop(4, flag=flag, deadline=1.0, now=2.0) == "sigterm"
    assert agreement.should_stop(5, flag=StopFlag(), deadline=1.0, now=2.0, force=True) == "time"
    assert [g.tolist() for g in peers.gathered] == [[1, 1], [0, 1]]
    assert all(g.dtype == np.int32 for g in peers.gathered)
    assert agreement.should_stop(8, flag=StopFlag(), deadline=3.0, now=2.0) is None
    assert peers.gathered[-1].tolist() == [0, 0]


@pytest.mark.parametrize(
    ("other", "expected"), [([1, 0], "sigterm"), ([0, 1], "time"), ([1, 1], "sigterm")]
)
def test_several_processes_stop_together_on_any_one_s_vote(monkeypatch, other, expected):
    agreement = several(monkeypatch, Peers(others=[[0, 0], other]))
    assert agreement.should_stop(10, flag=StopFlag(), deadline=None, now=0.0) == expected


def test_a_preemption_notice_stops_every_process_and_its_absence_is_no_stop(monkeypatch):
    peers = Peers(others=[[0, 0]], preempted=True)
    agreement = several(monkeypatch, peers)
    assert agreement.should_stop(3, flag=StopFlag(), deadline=None, now=0.0) == "sigterm"
    assert peers.gathered == []
    peers.preempted = RuntimeError("no preemption service")
    assert agreement.should_stop(3, flag=StopFlag(), deadline=None, now=0.0) is None
    assert agreement.should_stop(10, flag=StopFlag(), deadline=None, now=0.0) is None
    assert len(peers.gathered) == 1


def test_several_processes_agree_before_the_first_step_whatever_the_step(monkeypatch):
    """The budget may be spent on another process before this one's first step: all meet
    once before it, at a step that is no meeting step, and run none."""
    peers = Peers(others=[[0, 1]])
    monkeypatch.setattr(loop_module.jax, "process_count", lambda: 2)
    monkeypatch.setattr(loop_module, "multihost_utils", peers)
    result, step, _, saves, _ = run(steps=10, start=3, checkpoints=Saves([3]), deadline=1e9)
    assert result.reason == "time" and step.calls == [] and saves.saved == []
    assert [g.tolist() for g in peers.gathered] == [[0, 0]]


def test_several_processes_take_process_0_s_value(monkeypatch):
    agreement = several(monkeypatch, Peers(broadcast=41))
    value = agreement.same_everywhere(7)
    assert value == 41 and type(value) is int


# ----------------------------------------------------------------------------- divergence
def test_a_diverged_step_without_any_checkpoint_says_start_again():
    message = divergence_message(
        7, {"loss_sum": 30.0, "n_tokens": 4.0, "grad_norm": float("inf")}, Saves()
    )
    assert message.startswith("step 7: the loss (7.5 a token) or the gradient (norm inf)")
    assert "nothing after step 6 was saved" in message
    assert "no checkpoint was saved, so the work directory is left as it was" in message
    assert message.endswith(
        "Start again with a lower --learning_rate, or --on_nonfinite skip to go on without "
        "such steps."
    )
    assert divergence_message(7, {"loss_sum": 1.0, "n_tokens": 1.0, "grad_norm": 0.0}, None)
    # No tokens: the loss is the sum, not a division by zero.
    assert "(3 a token)" in divergence_message(
        2, {"loss_sum": 3.0, "n_tokens": 0.0, "grad_norm": 1.0}, None
    )


def test_a_diverged_step_right_after_a_checkpoint_points_before_it():
    metrics = {"loss_sum": float("nan"), "n_tokens": 2.0, "grad_norm": 1.25}
    message = divergence_message(5, metrics, Saves([2, 3, 4]))
    assert "(nan a token) or the gradient (norm 1.25)" in message
    assert (
        "the last checkpoint, W/checkpoints/4, is the state step 5 started from, so a resume "
        "from it repeats this step" in message
    )
    assert message.endswith(
        "Move it out of W/checkpoints to resume from step 3 with a lower --learning_rate (it "
        "may change on resume), or resume it with --on_nonfinite skip to go on without such "
        "steps."
    )
    assert "to resume from step 0 with" in divergence_message(5, metrics, Saves([4]))


def test_a_diverged_step_past_small_ints_and_at_an_even_step_is_named_right():
    """Steps past the ints Python keeps one object of (a step number is computed, never the
    checkpoint list's own object), and an even step (step ^ 1 is step - 1 at odd ones)."""
    metrics = {"loss_sum": 1.0, "n_tokens": 1.0, "grad_norm": float("nan")}
    message = divergence_message(1000, metrics, Saves([996, 998, int("999")]))
    assert "nothing after step 999 was saved" in message
    assert "checkpoints/999, is the state step 1000 started from" in message
    assert "to resume from step 998 with" in message
    assert "nothing after step 7 was saved" in divergence_message(8, metrics, None)


def test_a_diverged_step_later_than_the_last_checkpoint_names_it():
    metrics = {"loss_sum": 1.0, "n_tokens": 1.0, "grad_norm": float("nan")}
    message = divergence_message(9, metrics, Saves([2, 4]))
    assert "(the last good checkpoint is step 4 in W/checkpoints)" in message
    assert message.endswith(
        "Resume with a lower --learning_rate (it may change on resume), or --on_nonfinite "
        "skip to go on without such steps."
    )


# ----------------------------------------------------------------------------- intervals
def test_an_interval_waits_on_the_step_before_the_last(monkeypatch):
    waited = []
    monkeypatch.setattr(loop_module.jax, "block_until_ready", waited.append)
    interval = Interval(HostDP())
    assert not interval
    interval.add(metrics_of(1))
    assert waited == [] and interval
    interval.add(metrics_of(2))
    interval.add(metrics_of(3))
    assert [float(w) for w in waited] == [10.0, 20.0]  # steps 1 and 2's loss_sum
    assert Interval(HostDP(), carried=[{"loss_sum": 1.0}])  # carried steps count


def test_an_interval_hands_over_its_steps_once_after_the_carried_ones():
    dp = HostDP()
    carried = [{"loss_sum": 99.0, "n_tokens": 1.0}]
    interval = Interval(dp, carried)
    carried.append({"loss_sum": -1.0})  # the caller's list is not the interval's
    for step in (2, 3):
        interval.add(metrics_of(step))
    host = interval.take(3, nonfinite="stop", checkpoints=None)
    assert [m["loss_sum"] for m in host] == [99.0, 20.0, 30.0]
    assert dp.fetched == [2] and not interval
    assert interval.take(3, nonfinite="stop", checkpoints=None) == []
    with pytest.raises(TypeError):  # the policy and the checkpoints by keyword
        interval.take(3, "stop", None)


def test_an_interval_names_its_first_nonfinite_step_or_leaves_such_steps_out():
    def interval_of(steps, bad):
        interval = Interval(HostDP(), carried=[dict(metrics_of(1), nonfinite=0.0)])
        for step in steps:
            interval.add(metrics_of(step, nonfinite=step in bad))
        return interval

    # Steps 1 (carried) to 5; 3 and 5 not finite: the message names step 3.
    with pytest.raises(TrainingDiverged, match=r"^step 3: the loss \(3 a token\)"):
        interval_of([2, 3, 4, 5], bad={3, 5}).take(5, nonfinite="stop", checkpoints=None)
    interval = interval_of([2, 3, 4, 5], bad={3, 5})
    host = interval.take(5, nonfinite="skip", checkpoints=None)
    assert [m["loss_sum"] for m in host] == [10.0, 20.0, 40.0] and interval.skipped == 2
    interval.add(metrics_of(6, nonfinite=True))
    assert interval.take(6, nonfinite="skip", checkpoints=None) == []
    assert interval.skipped == 3  # counted over the run
    # An interval that starts at an even step: steps 2 (carried) to 6, step 4 not finite.
    interval = Interval(HostDP(), carried=[dict(metrics_of(2), nonfinite=0.0)])
    for step in (3, 4, 5, 6):
        interval.add(metrics_of(step, nonfinite=step == 4))
    with pytest.raises(TrainingDiverged, match=r"^step 4: the loss \(4 a token\)"):
        interval.take(6, nonfinite="".join(["st", "op"]), checkpoints=None)  # a flag's value


# ----------------------------------------------------------------------------- reporter
def reporter(clock, *, progress=True, elapsed=0.0, steps=10, on_log=None):
    writer, lines = Records(), []
    report = Reporter(
        LoopConfig(steps=steps or 1, progress=progress),
        writer,
        step=0,
        steps=steps,
        elapsed=elapsed,
        log=lines.append,
        on_log=on_log,
        clock=clock,
    )
    return report, writer, lines


def test_the_reporter_writes_one_line_an_interval_with_its_rate_and_clock():
    clock = Clock(100.0)
    seen = []
    report, writer, lines = reporter(clock, elapsed=50.0, on_log=seen.append)
    assert not report.interactive and report.lines  # the tests' stderr is no terminal
    clock.now = 104.0
    host = [{k: float(v) for k, v in metrics_of(s).items()} for s in (1, 2)]
    report.train(2, host, skipped=0)
    (record,) = writer.records
    assert record["step"] == 2 and record["split"] == "train"
    assert record["loss"] == pytest.approx(1.5)
    assert record["tokens_per_sec"] == 5.0  # 20 tokens in 4 s
    assert record["elapsed"] == 54.0 and report.elapsed() == 54.0
    assert record["lr"] == pytest.approx(0.002) and "skipped_steps" not in record
    assert lines == ["step 2/10: loss 1.5000, lr 0.002, 5 tokens/s, 54s"]
    assert seen == [record]
    # The next interval's rate counts from this line; skipped steps are said.
    clock.now = 120.0
    report.train(4, [{"loss_sum": 30.0, "n_tokens": 10.0}], skipped=2)
    record = writer.records[-1]
    assert record["tokens_per_sec"] == 10 / 16 and record["skipped_steps"] == 2
    assert lines[-1] == "step 4/10: loss 3.0000, lr 0, 1 tokens/s, 70s"
    report.set_steps(30)
    assert report.steps == 30 == report.bar.total
    report.train(6, [{"loss_sum": 30.0, "n_tokens": 10.0}], skipped=0)
    assert lines[-1].startswith("step 6/30: ")
    report.close()


def test_the_reporter_says_nothing_for_an_interval_all_skipped_nor_without_progress():
    clock = Clock()
    seen = []
    report, writer, lines = reporter(clock, on_log=seen.append)
    report.train(3, [], skipped=3)
    assert writer.records == [] and lines == [] and seen == []
    report, writer, lines = reporter(clock, progress=False, steps=None)
    assert not report.lines
    clock.now = 1.0
    report.train(3, [{"loss_sum": 3.0, "n_tokens": 1.0}], skipped=0)
    assert len(writer.records) == 1 and lines == []
    report.validation(3, {"loss": 2.0})
    assert writer.records[-1] == {"step": 3, "split": "validation", "loss": 2.0}
    report, writer, lines = reporter(clock, steps=None)
    report.train(3, [{"loss_sum": 3.0, "n_tokens": 1.0}], skipped=0)
    assert lines[-1].startswith("step 3/?: ")


def test_the_bar_shows_on_a_terminal_on_process_0_only(monkeypatch):
    terminal = types.SimpleNamespace(stderr=types.SimpleNamespace(isatty=lambda: True))
    monkeypatch.setattr(loop_module, "sys", terminal)
    report, _, _ = reporter(Clock())
    assert report.interactive and not report.lines and not report.bar.disable
    assert report.bar.dynamic_ncols  # follows the terminal's width
    report.train(1, [{"loss_sum": 3.0, "n_tokens": 2.0}], skipped=0)
    assert report.bar.postfix.startswith("loss=1.500, lr=0.00e+00, tok_s=")  # no lr given
    report.close()
    counted = []

    class Count(hooks_module.Hook):
        def end(self, loop):
            counted.append(loop.report.bar.n)

    run(steps=3, progress=True, hooks=[Count()])
    assert counted == [3]  # one tick a step
    report, _, _ = reporter(Clock(), progress=False)
    assert not report.interactive and report.bar.disable
    monkeypatch.setattr(loop_module.jax, "process_index", lambda: 1)
    report, _, _ = reporter(Clock())
    assert report.interactive and report.bar.disable
    with pytest.raises(TypeError):  # all but the config and the writer by keyword
        Reporter(LoopConfig(steps=1), Records(), 0, 1, 0.0, print)


def test_a_zero_second_interval_has_a_finite_rate():
    report, writer, _ = reporter(Clock())
    report.train(1, [{"loss_sum": 1.0, "n_tokens": 2.0}], skipped=0)
    assert writer.records[0]["tokens_per_sec"] == pytest.approx(2e9)


# ----------------------------------------------------------------------------- the loop
def test_the_loop_runs_its_steps_in_order_and_logs_every_few():
    evaluations = []

    def evaluate(state):
        evaluations.append(int(state.step))
        return {"loss": float(state.step)}

    result, step, writer, saves, _ = run(steps=6, log_every=4, evaluate=evaluate)
    assert step.calls == [(s, {"batch": s}) for s in range(6)]
    assert result.reason == "steps" and int(result.state.step) == 6 and result.skipped == 0
    # Steps 1-4 in one line, 5-6 in the last; one validation at the end ranks the last save.
    assert [(r["step"], r["loss"]) for r in writer.lines("train")] == [(4, 2.5), (6, 5.5)]
    assert evaluations == [6] and result.last_eval == {"loss": 6.0}
    assert saves.saved == [(6, {"elapsed": 0.0}, {"val_loss": 6.0})]


def test_the_loop_validates_and_saves_every_few_steps_and_not_twice_at_the_end():
    evaluations = []

    def evaluate(state):
        evaluations.append(int(state.step))
        return {"loss": 10.0 - int(state.step)}

    result, _, writer, saves, _ = run(steps=6, eval_every=3, checkpoint_every=2, evaluate=evaluate)
    assert evaluations == [3, 6]
    assert [r["step"] for r in writer.lines("validation")] == [3, 6]
    assert [(s, m) for s, _, m in saves.saved] == [
        (2, None),
        (3, {"val_loss": 7.0}),
        (4, None),
        (6, {"val_loss": 4.0}),
        (6, {"val_loss": 4.0}),  # the last save, at the step validated last
    ]
    assert result.last_eval == {"loss": 4.0}


def test_a_resumed_loop_starts_at_its_step_and_carries_the_time_and_the_interval():
    clock = Clock()
    carried = [{k: float(v) for k, v in metrics_of(3).items()}]
    result, step, writer, saves, _ = run(
        steps=6,
        start=3,
        log_every=2,
        clock=clock,
        per_step=2.0,
        elapsed=100.0,
        carried=carried,
        checkpoints=Saves([3]),
    )
    assert [c for c, _ in step.calls] == [3, 4, 5]
    # Steps 3 (carried) and 4 in the line of step 4.
    assert [(r["step"], r["loss"]) for r in writer.lines("train")] == [(4, 3.5), (6, 5.5)]
    assert result.elapsed == 106.0 and saves.saved == [(6, {"elapsed": 106.0}, None)]


def test_a_loop_with_nothing_to_do_saves_nothing_unless_nothing_was_saved():
    result, step, writer, saves, _ = run(steps=3, start=3, checkpoints=Saves([3]))
    assert result.reason == "steps" and step.calls == [] and saves.saved == []
    assert writer.records == []
    # A new run of zero steps leaves its step-0 checkpoint to resume from.
    result, _, _, saves, _ = run(steps=0, evaluate=lambda state: {"loss": 1.0})
    assert saves.saved == [(0, {"elapsed": 0.0}, None)] and result.last_eval is None
    # No checkpoints at all: nothing to save, and nothing asks for one.
    result, step, _, checkpoints, _ = run(steps=0, checkpoints=None)
    assert checkpoints is None and result.reason == "steps" and step.calls == []


def test_the_loop_counts_the_seconds_its_saves_and_validations_take():
    clock = Clock()
    seen = []

    class CostlySaves(Saves):
        def save(self, state, *, meta, metrics):
            super().save(state, meta=meta, metrics=metrics)
            clock.now += 2.0

    def evaluate(state):
        clock.now += 3.0
        return {"loss": 1.0}

    class Watch(hooks_module.Hook):
        def after_step(self, loop):
            seen.append((loop.step, loop.outside_s, loop.validation_s))

    run(
        steps=4,
        eval_every=2,
        checkpoint_every=3,
        evaluate=evaluate,
        checkpoints=CostlySaves(),
        clock=clock,
        per_step=1.0,
        hooks=[Watch()],
    )
    # Step 2: a validation (3 s) and its save (2 s); step 3: a save; step 4: both again.
    assert seen == [(1, 0.0, None), (2, 5.0, 3.0), (3, 7.0, 3.0), (4, 12.0, 3.0)]


def test_the_loop_logs_its_lines_through_the_given_log_else_prints_them(capsys):
    _, _, _, _, lines = run(steps=4, log_every=2, progress=True)
    assert [line.split(":")[0] for line in lines] == ["step 2/4", "step 4/4"]
    assert capsys.readouterr().out == ""
    clock = Clock()
    train_loop(
        State(np.int32(0)),
        dp=HostDP(),
        train_step=host_step(clock),
        batches=numbered_batches(0, 2),
        config=LoopConfig(steps=2, log_every=2),
        writer=Records(),
        clock=clock,
    )
    assert capsys.readouterr().out.startswith("step 2/2: loss 1.5000")


def test_a_run_past_python_s_small_ints_stops_at_its_steps():
    """The step counted by the loop is never the config's own int object."""
    result, step, _, saves, _ = run(steps=300, start=297, checkpoints=Saves([297]))
    assert [c for c, _ in step.calls] == [297, 298, 299] and result.reason == "steps"
    assert [s for s, _, _ in saves.saved] == [300]


def test_a_run_already_past_its_steps_runs_none():
    result, step, _, saves, _ = run(steps=3, start=5, checkpoints=Saves([5]))
    assert result.reason == "steps" and step.calls == [] and saves.saved == []


def test_a_budget_spent_before_the_first_step_runs_none():
    result, step, _, saves, _ = run(steps=5, deadline=0.0, checkpoints=Saves([2]), start=2)
    assert result.reason == "time" and step.calls == [] and saves.saved == []


def test_a_budget_spent_during_a_step_stops_after_it_and_saves_it():
    clock = Clock()
    result, step, writer, saves, _ = run(
        steps=10, deadline=3.5, clock=clock, per_step=1.0, log_every=3
    )
    assert result.reason == "time" and len(step.calls) == 4
    assert [r["step"] for r in writer.lines("train")] == [3, 4]
    assert saves.saved == [(4, {"elapsed": 4.0}, None)]


def test_a_signal_saves_the_unfinished_interval_and_stops_at_once():
    flag = StopFlag()
    after = []

    class Later(hooks_module.Hook):
        def after_step(self, loop):
            after.append(loop.step)

    def on_log(record):
        if record["step"] == 2:
            flag(signal.SIGINT, None)

    result, step, writer, saves, _ = run(
        steps=10, log_every=2, stop=flag, on_log=on_log, hooks=[Later()]
    )
    # Step 2's line set the flag; the step after it ran, and stopped before a caller's hook.
    assert result.reason == "sigint" and result.interrupted and len(step.calls) == 3
    assert after == [1, 2]
    assert [r["step"] for r in writer.lines("train")] == [2]
    ((saved_step, meta, metrics),) = saves.saved
    assert saved_step == 3 and metrics is None
    assert [m["loss_sum"] for m in meta["interval_metrics"]] == [30.0]


def test_a_signal_on_a_logging_step_logs_it_and_saves_no_interval():
    flag = StopFlag()
    evaluations = []

    class SetFlag(hooks_module.Hook):
        def before_step(self, loop):
            if loop.step == 3:
                flag()

    result, step, writer, saves, _ = run(
        steps=10,
        log_every=2,
        stop=flag,
        hooks=[SetFlag()],
        evaluate=lambda s: evaluations.append(1) or {"loss": 0.0},
    )
    assert result.reason == "sigterm" and len(step.calls) == 4
    assert [r["step"] for r in writer.lines("train")] == [2, 4]
    assert saves.saved == [(4, {"elapsed": 0.0}, None)]  # no interval left to carry
    assert evaluations == []  # a signal's save does not validate


def test_a_signal_before_any_step_of_a_resumed_run_saves_nothing():
    flag = StopFlag()
    flag()
    result, step, _, saves, _ = run(steps=10, start=4, stop=flag, checkpoints=Saves([4]))
    # The first step runs (the flag is read after a step), then the run stops.
    assert result.reason == "sigterm" and len(step.calls) == 1
    assert [s for s, _, _ in saves.saved] == [5]


def test_nonfinite_steps_stop_the_loop_or_are_counted_and_skipped():
    with pytest.raises(TrainingDiverged, match=r"^step 3: .*no checkpoint was saved"):
        run(steps=6, nonfinite_at={3}, log_every=2)
    result, _, writer, saves, _ = run(steps=6, nonfinite_at={3, 4}, log_every=2, nonfinite="skip")
    assert result.skipped == 2 and result.reason == "steps"
    lines = writer.lines("train")
    assert [r["step"] for r in lines] == [2, 6]  # steps 3-4's line was all skipped
    assert lines[1]["skipped_steps"] == 2 and "skipped_steps" not in lines[0]


def test_a_loop_is_made_from_its_parts_by_keyword():
    parts = dict(
        dp=HostDP(),
        config=LoopConfig(steps=2),
        train_step=host_step(),
        checkpoints=None,
        evaluate=None,
        clock=Clock(),
        log=print,
    )
    loop = loop_module.Loop(State(np.int32(5)), **parts)
    assert (loop.step, loop.start_step, loop.steps, loop.reason) == (5, 5, 2, None)
    pmap = loop_module.Loop(State(np.full((8,), 5, np.int32)), **parts)  # one per device
    assert (pmap.step, pmap.start_step) == (5, 5)
    assert (loop.outside_s, loop.validation_s, loop.evaluated_at) == (0.0, None, None)
    with pytest.raises(TypeError, match="positional argument"):
        loop_module.Loop(State(np.int32(5)), *parts.values())
    with pytest.raises(TypeError, match="positional argument"):  # train_loop's too
        train_loop(State(np.int32(5)), *parts.values())


def test_the_printer_speaks_on_process_0_only(monkeypatch, capsys):
    printer()("hello")
    assert capsys.readouterr().out == "hello\n"
    # Each line flushed at once: logs interleave with the progress bar's stderr.
    out = types.SimpleNamespace(text=[], flushes=0)
    out.write = out.text.append
    out.flush = lambda: setattr(out, "flushes", out.flushes + 1)
    monkeypatch.setattr(sys, "stdout", out)
    printer()("again")
    assert "".join(out.text) == "again\n" and out.flushes == 1
    monkeypatch.undo()
    monkeypatch.setattr(loop_module.jax, "process_index", lambda: 1)
    printer()("hello")
    assert capsys.readouterr().out == ""


def test_the_budget_fit_s_pieces_are_still_importable_from_the_loop():
    for name in ("BudgetMeasure", "SHORT_BUDGET_S", "schedule_length", "with_schedule_length"):
        assert getattr(loop_module, name) is getattr(hooks_module, name)
    with pytest.raises(AttributeError, match="'train.core.loop' has no attribute 'nothing'"):
        loop_module.nothing  # noqa: B018
