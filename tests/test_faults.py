"""Faults injected the way they happen, through the command line (issue 13): a learning rate
that blows up, a flipped byte and a truncated file in a checkpoint, kill -9 during start-up and
mid-interval, a second process on a busy work directory, SIGINT and SIGTERM, a damaged
prepared dataset, bad flag values. Each run is a real `python -m train.lm` process on the
tiny Transformer-XL (the faults are task-independent; translation only for its own flags).

Every run is the same model, so the subprocesses share a persistent compilation cache: the
second and later runs load the train step instead of compiling it (a run is then ~10s, most of
it reading PTB). A learning rate is part of the compiled step, so each rate compiles once.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import warnings

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from helpers import (
    FRESH_LM,
    REPO,
    TIMEOUT,
    Running,
    file_hashes,
    subprocess_xla_flags,
    train_losses,
)

from train.core import cli
from train.core.checkpoint import Checkpoints
from train.core.metrics import read_metrics

# Every test here runs the command line in subprocesses.
pytestmark = pytest.mark.slow

FRESH = FRESH_LM  # a fresh tiny run (helpers.py)


@pytest.fixture(scope="module")
def env():
    # os.environ holds the session's compilation cache (conftest.py).
    return dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=subprocess_xla_flags(), PYTHONPATH=REPO)


def lm(workdir, *args):
    return [sys.executable, "-m", "train.lm", "--workdir", str(workdir), *args]


def run(args, env):
    """Runs to the end (killed at TIMEOUT) -> CompletedProcess with stdout and stderr apart."""
    return subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=TIMEOUT)


def wait_for_file(path, proc: Running, timeout: float = TIMEOUT):
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        assert proc.alive(), f"exited before {path} appeared:\n{proc.output}"
        assert time.monotonic() < deadline, f"no {path} within {timeout}s:\n{proc.output}"
        time.sleep(0.02)


def saved_arrays(workdir, step):
    """Every array of checkpoint `step`'s state, read by orbax without a template."""
    with ocp.PyTreeCheckpointer() as reader, warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "sharding info not provided"
        tree = reader.restore(os.path.join(Checkpoints(str(workdir)).path(step), "state"))
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def assert_one_clear_message(done, workdir):
    """An expected error: a short stderr without library tracebacks; the traceback is in
    W/error.log."""
    lines = done.stderr.strip().splitlines()
    assert 0 < len(lines) < 15, done.stderr
    assert "Traceback" not in done.stderr and "Event loop is closed" not in done.stderr
    with open(os.path.join(workdir, cli.ERROR_LOG)) as f:
        assert "Traceback" in f.read()


@pytest.fixture(scope="module")
def base(tmp_path_factory, data_dir, env):
    """One uninterrupted run of 8 steps, a line every 4 and a checkpoint every 4: the
    reference for exact metrics and the starting point of the damage tests (copied)."""
    workdir = tmp_path_factory.mktemp("base") / "run"
    done = run(
        lm(
            workdir,
            *FRESH,
            "--data_dir",
            str(data_dir),
            "--steps",
            "8",
            "--log_every",
            "4",
            "--checkpoint_every",
            "4",
        ),
        env,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert Checkpoints(str(workdir)).all_steps() == [4, 8]
    assert [s for s, _ in train_losses(workdir)] == [4, 8]
    return workdir


def copy_of(base, tmp_path):
    workdir = tmp_path / "run"
    shutil.copytree(base, workdir)
    return workdir


# ------------------------------------------------------------------------- non-finite steps
def test_a_huge_learning_rate_stops_with_exit_3_saving_only_finite_states(base, tmp_path, env):
    workdir = copy_of(base, tmp_path)
    done = run(
        lm(
            workdir,
            "--steps",
            "14",
            "--learning_rate",
            "1e18",
            "--log_every",
            "1",
            "--checkpoint_every",
            "1",
        ),
        env,
    )
    assert done.returncode == cli.EXIT_DIVERGED, done.stdout + done.stderr
    assert done.stderr.startswith("training diverged: step "), done.stderr
    bad = int(re.match(r"training diverged: step (\d+)", done.stderr).group(1))
    assert bad > 9  # step 9 took the huge rate (finite loss); a later one blew up
    checkpoints = Checkpoints(str(workdir))
    # Nothing after the last finite step was saved; what was saved is finite and verifies.
    assert checkpoints.latest_step() == bad - 1
    for step in checkpoints.all_steps():
        assert checkpoints.verify(step) is None
        for array in saved_arrays(workdir, step):
            assert array.dtype.kind != "f" or np.isfinite(array).all(), step
    # That last checkpoint is the state the bad step started from: resuming it repeats the
    # step (its batch and rng are fixed), so the message points before it.
    earlier = [s for s in checkpoints.all_steps() if s < bad - 1][-1]
    assert f"{checkpoints.path(bad - 1)}, is the state step {bad} started from" in done.stderr
    assert f"to resume from step {earlier} with a lower --learning_rate" in done.stderr
    assert_one_clear_message(done, workdir)

    # As told: move it away, resume with a lower rate (the rate may change on resume).
    shutil.move(checkpoints.path(bad - 1), tmp_path / "moved")
    resumed = run(lm(workdir, "--learning_rate", "0.01", "--steps", str(earlier + 2)), env)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert f"resumed from {checkpoints.path(earlier)}" in resumed.stdout
    records = read_metrics(str(workdir))
    changes = [(r["step"], r["changed"]) for r in records if r["split"] == "resume"]
    assert changes[0][0] == 8 and "learning_rate: 0.01 -> 1e+18" in changes[0][1]
    assert changes[-1] == (
        earlier,
        [f"steps: 14 -> {earlier + 2}", "learning_rate: 1e+18 -> 0.01"],
    )
    steps = [s for s, _ in train_losses(workdir)]
    assert steps == sorted(set(steps)) and steps[-1] == earlier + 2  # none twice
    assert all(math.isfinite(loss) for _, loss in train_losses(workdir))


def test_skipped_nonfinite_steps_are_counted_and_an_infinite_test_ppl_exits_3(base, tmp_path, env):
    workdir = copy_of(base, tmp_path)
    done = run(
        lm(workdir, "--steps", "12", "--learning_rate", "1e18", "--on_nonfinite", "skip"), env
    )
    # Training went on past the non-finite steps; the parameters the one finite huge step
    # left give a non-finite test perplexity: that is a divergence too.
    assert done.returncode == cli.EXIT_DIVERGED, done.stdout + done.stderr
    assert re.search(r"training diverged: test ppl is (nan|inf)", done.stderr), done.stderr
    skipped = int(
        re.search(
            r"(\d+) step\(s\) with a non-finite loss or gradient were skipped", done.stdout
        ).group(1)
    )
    assert 1 <= skipped <= 3
    last = [r for r in read_metrics(str(workdir)) if r["split"] == "train"][-1]
    assert last["step"] == 12 and last["skipped_steps"] == skipped
    assert math.isfinite(last["loss"])  # the line averages the applied steps only
    assert Checkpoints(str(workdir)).latest_step() == 12
    for array in saved_arrays(workdir, 12):
        assert array.dtype.kind != "f" or np.isfinite(array).all()


def test_finished_maps_an_infinite_test_figure_and_a_signal_to_their_exit_codes(capsys):
    assert cli.finished({"reason": "steps", "test_ppl": 12.5}, "ppl") == cli.EXIT_OK
    assert cli.finished({"reason": "steps", "test_bpc": math.inf}, "bpc") == cli.EXIT_DIVERGED
    assert "training diverged: test bpc is inf" in capsys.readouterr().err
    assert cli.finished({"reason": "sigint"}, "ppl") == cli.EXIT_INTERRUPTED


# ------------------------------------------------------------------------- damaged checkpoints
def test_a_flipped_byte_in_the_latest_checkpoint_is_refused_naming_it(base, tmp_path, env):
    workdir = copy_of(base, tmp_path)
    latest = Checkpoints(str(workdir)).path(8)
    data = [
        os.path.join(root, name)
        for root, _, files in os.walk(os.path.join(latest, "state"))
        for name in files
        if os.path.basename(root) == "d"
    ]
    target = max(data, key=os.path.getsize)  # the array bytes
    with open(target, "r+b") as f:
        f.seek(os.path.getsize(target) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x01]))
    before = file_hashes(workdir)
    done = run(lm(workdir, "--steps", "10"), env)
    assert done.returncode == cli.EXIT_ERROR, done.stdout + done.stderr
    assert f"checkpoint {latest} is damaged" in done.stderr
    assert os.path.relpath(target, latest) in done.stderr  # which file
    assert "The newest earlier checkpoint that verifies is step 4" in done.stderr
    assert_one_clear_message(done, workdir)
    after = file_hashes(workdir)
    after.pop(cli.ERROR_LOG)
    assert after == before  # nothing deleted, rewritten or added (but the error log)


def test_a_truncated_checkpoint_without_checksums_is_one_message(base, tmp_path, env):
    """A checkpoint from before checksums (its W/checksums file gone): orbax's own read fails,
    and that is still one message, not a page of asyncio tracebacks."""
    workdir = copy_of(base, tmp_path)
    checkpoints = Checkpoints(str(workdir))
    os.remove(checkpoints.checksum_path(8))
    for root, _, files in os.walk(os.path.join(checkpoints.path(8), "state")):
        if os.path.basename(root) == "d":
            for name in files:
                with open(os.path.join(root, name), "r+b") as f:
                    f.truncate(5)
    before = file_hashes(workdir)
    done = run(lm(workdir, "--steps", "10"), env)
    assert done.returncode == cli.EXIT_ERROR, done.stdout + done.stderr
    assert f"checkpoint {checkpoints.path(8)} could not be restored" in done.stderr
    assert_one_clear_message(done, workdir)
    after = file_hashes(workdir)
    after.pop(cli.ERROR_LOG)
    assert after == before


# ------------------------------------------------------------------------- kill -9, the lock
def test_kill_9_at_start_up_and_mid_run_resumes_as_the_same_run_logging_each_step_once(
    base, tmp_path, data_dir, env
):
    workdir = tmp_path / "run"
    # Killed during data preparation: the config is already on disk. So many steps that no
    # run can finish, or checkpoint, before the kill.
    with Running(
        lm(
            workdir,
            *FRESH,
            "--data_dir",
            str(data_dir),
            "--steps",
            "100000",
            "--log_every",
            "4",
            "--checkpoint_every",
            "1000",
        ),
        env,
    ) as first:
        wait_for_file(workdir / "config.json", first)
        first.kill9()
    assert "training from" not in first.output
    assert not Checkpoints(str(workdir)).all_steps()
    # --workdir alone is the same run (tiny, 100000 steps; not the CPU default), and the lock
    # of the killed process died with it. Killed again after its first log line, before any
    # checkpoint, and as if mid-write of a line.
    with Running(lm(workdir), env) as second:
        second.wait_for("training from step 0 to 100000")
        second.wait_for("step 4/100000")
        second.kill9()
    assert "model: Transformer-XL (tiny)" in second.output
    assert not Checkpoints(str(workdir)).all_steps()
    assert 4 in [s for s, _ in train_losses(workdir)]
    with open(workdir / "metrics.jsonl", "a") as f:
        f.write('{"step": 12, "split": "train", "loss": 6.')
    done = run(lm(workdir, "--steps", "8"), env)
    assert done.returncode == 0, done.stdout + done.stderr
    # Each step logged once, the partial line gone, and the lines are those of a run that
    # was never killed.
    assert train_losses(workdir) == train_losses(base)
    with open(workdir / "metrics.jsonl") as f:
        text = f.read()
    assert text.endswith("\n") and all(json.loads(line) for line in text.splitlines())


def test_a_second_run_on_a_busy_workdir_is_refused_naming_the_first(tmp_path, data_dir, env):
    workdir = tmp_path / "run"
    # So many steps that the first run is still training when the second is refused; it is
    # stopped by SIGTERM afterwards.
    with Running(
        lm(
            workdir,
            *FRESH,
            "--data_dir",
            str(data_dir),
            "--steps",
            "100000",
            "--log_every",
            "4",
            "--checkpoint_every",
            "20",
        ),
        env,
    ) as first:
        first.wait_for("step 4/100000")  # training, under the lock
        second = run(lm(workdir, "--steps", "40"), env)
        assert first.alive(), first.output  # the first still ran meanwhile
        assert second.returncode == cli.EXIT_ERROR, second.stdout + second.stderr
        assert f"is in use by another run (pid {first.pid} on " in second.stderr
        assert "data:" not in second.stdout  # refused before touching anything
        first.wait_for("step 24/100000")  # and it went on training past a checkpoint
        first.send_signal(signal.SIGTERM)
        assert first.finish() == cli.EXIT_INTERRUPTED, first.output
    assert "SIGTERM: checkpoint saved" in first.output
    checkpoints = Checkpoints(str(workdir))
    last = checkpoints.latest_step()
    # Checkpoints every 20 steps, and the one SIGTERM saved.
    assert last >= 24 and all(s % 20 == 0 for s in checkpoints.all_steps()[:-1])
    assert all(checkpoints.verify(s) is None for s in checkpoints.all_steps())
    # Every interval it completed is logged once, in order: the refused run wrote nothing.
    assert [s for s, _ in train_losses(workdir)] == list(range(4, last // 4 * 4 + 1, 4))


# ------------------------------------------------------------------------- signals, metrics
def test_sigint_and_sigterm_mid_interval_save_exit_75_and_resume_logs_the_same_lines(
    base, tmp_path, data_dir, env
):
    workdir = tmp_path / "run"
    saved = []
    for signum, args in (
        (
            signal.SIGINT,
            [
                *FRESH,
                "--data_dir",
                str(data_dir),
                "--steps",
                "200",
                "--log_every",
                "4",
                "--checkpoint_every",
                "1000",
            ],
        ),
        (signal.SIGTERM, []),
    ):
        start = saved[-1] if saved else 0
        with Running(lm(workdir, *args), env) as proc:
            # Ctrl-C / a scheduler's stop during set-up (the model line comes before the
            # compilation and the first step): the signal is in before any step has run, so
            # the run stops after exactly one step, whatever the speed of the machine.
            proc.wait_for("model: Transformer-XL")
            proc.send_signal(signum)
            assert proc.finish() == cli.EXIT_INTERRUPTED, proc.output
        assert f"training from step {start} to 200" in proc.output
        assert f"{signal.Signals(signum).name}: checkpoint saved" in proc.output
        saved.append(Checkpoints(str(workdir)).latest_step())
        assert saved[-1] == start + 1
    # Both stops cut the first logging interval short: its steps' metrics travelled in the
    # checkpoints, no short line was written.
    assert saved == [1, 2] and not train_losses(workdir), saved
    done = run(lm(workdir, "--steps", "8"), env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert train_losses(workdir) == train_losses(base)  # exactly, loss for loss
    # A finished directory run again evaluates again, and still has one test line.
    again = run(lm(workdir, "--steps", "8"), env)
    assert again.returncode == 0, again.stdout + again.stderr
    records = read_metrics(str(workdir))
    assert [(r["step"], r["split"]) for r in records if r["split"] != "train"] == [
        (saved[-1], "resume"),
        (8, "validation"),
        (8, "test"),
    ]  # resume: steps 200 -> 8
    assert train_losses(workdir) == train_losses(base)


# ------------------------------------------------------------------------- data and flags
def test_a_damaged_prepared_dataset_names_its_directory(tmp_path, data_dir, base, env):
    private = tmp_path / "tfds"
    shutil.copytree(data_dir / "ptb", private / "ptb")  # the session's, left intact
    prepared = private / "ptb" / "word" / "1.0.0"
    (train_file,) = prepared.glob("ptb-train.array_record-*")
    with open(train_file, "r+b") as f:
        f.seek(os.path.getsize(train_file) // 2)
        f.write(b"\xff" * 64)
    workdir = tmp_path / "run"
    done = run(lm(workdir, *FRESH, "--data_dir", str(private), "--steps", "2"), env)
    assert done.returncode == cli.EXIT_ERROR, done.stdout + done.stderr
    assert f"the prepared dataset {prepared} cannot be read" in done.stderr
    assert "delete that directory and run again to rebuild it" in done.stderr
    assert_one_clear_message(done, workdir)


@pytest.mark.parametrize(
    "task, argv, field",
    [
        ("lm", ["--set", "model.d_model=abc"], "model.d_model"),
        ("lm", ["--learning_rate", "nan"], "learning_rate"),
        ("lm", ["--learning_rate", "-1"], "learning_rate"),
        ("translate", ["--buckets", ""], "buckets"),
        ("translate", ["--buckets", ","], "buckets"),
        ("translate", ["--vocab_size", "100"], "vocab_size"),
        ("translate", ["--vocab_size", "361"], "vocab_size"),
    ],
)
def test_bad_values_are_usage_errors_naming_the_field(task, argv, field, tmp_path, capsys):
    from train.lm import cli as lm_cli
    from train.translate import cli as translate_cli

    main = {"lm": lm_cli.main, "translate": translate_cli.main}[task]
    with pytest.raises(SystemExit) as e:
        main(["--preset", "tiny", "--workdir", str(tmp_path / "run"), *argv])
    assert e.value.code == cli.EXIT_USAGE
    assert f"{field}" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "run")  # rejected before anything is written


def test_the_smallest_vocabulary_sentencepiece_trains_is_accepted():
    from train import translate
    from train.translate.config import MIN_VOCAB_SIZE

    config = translate.make_config("transformer", "tiny", vocab_size=MIN_VOCAB_SIZE)
    assert config.model_config.src_vocab_size == MIN_VOCAB_SIZE


def test_an_unwritable_workdir_fails_before_data_preparation(tmp_path, capsys):
    from train.lm import cli as lm_cli

    (tmp_path / "a_file").write_text("not a directory")  # root ignores modes; this it cannot
    workdir = tmp_path / "a_file" / "run"
    fresh_data = tmp_path / "tfds"  # nothing prepared: a run that got that far would build it
    code = lm_cli.main([*FRESH, "--workdir", str(workdir), "--data_dir", str(fresh_data)])
    out = capsys.readouterr()
    assert code == cli.EXIT_ERROR, out.out + out.err
    assert f"work directory {workdir} is not writable" in out.err
    assert "data:" not in out.out and not fresh_data.exists()
