"""What a damaged work directory gets from a command: one line naming the problem and the path,
exit 1, found before data preparation, and nothing on disk changed.

The cases: a config.json cut short, one that holds a JSON list, a damaged TFDS
dataset_info.json, and a checkpoint directory that cannot be written. They run the command's
`main` in this process (the errors come before any training), through the same flow as
`python -m train.lm`. Then what a work directory without a checkpoint is: a start refused there
takes back what it wrote, and a config.json alone is no run to resume.
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys

import pytest
from helpers import FRESH_LM, REPO, TIMEOUT, made_up_corpus, tiny_lm_config, tree_of, write_lines

from train import lm
from train.core import cli, workdir_checks
from train.core.checkpoint import CONFIG_FILE, has_checkpoint, save_run_config
from train.core.config import config_to_dict
from train.core.metrics import read_metrics
from train.core.workdir import LOCK_FILE, WorkdirError, WorkdirLock
from train.data.datasets import DatasetError, Ptb, load_ptb
from train.lm import cli as lm_cli

FRESH = FRESH_LM


def assert_one_line_error(code, captured, *needles):
    assert code == cli.EXIT_ERROR, captured.out + captured.err
    err = captured.err.strip()
    assert "Traceback" not in err and len(err.splitlines()) <= 2, err  # the message + where
    for needle in needles:
        assert needle in err, err
    assert "data:" not in captured.out  # refused before the data was prepared


@pytest.mark.parametrize(
    "content, problem",
    [
        ('{"preset": "tiny", "steps": 20, "model_con', "is unreadable"),
        ('["preset", "tiny"]', "is not a JSON object (it holds a list)"),
    ],
)
def test_a_damaged_config_json_is_one_line_naming_it(tmp_path, capsys, content, problem):
    workdir = tmp_path / "run"
    workdir.mkdir()
    (workdir / CONFIG_FILE).write_text(content)
    before = tree_of(workdir)
    code = lm_cli.main(["--workdir", str(workdir)])
    assert_one_line_error(code, capsys.readouterr(), str(workdir / CONFIG_FILE), problem)
    after = tree_of(workdir)
    after.pop(cli.ERROR_LOG, None)  # the traceback of the error, for whoever debugs it
    assert after == before


def test_a_damaged_dataset_info_json_names_the_prepared_directory(tmp_path, capsys):
    data_dir = tmp_path / "tfds"
    Ptb(config="word", data_dir=data_dir).download_and_prepare()
    (info,) = (data_dir / "ptb" / "word").glob("*/dataset_info.json")
    info.write_text('{"name": "ptb", cut short')
    with pytest.raises(DatasetError, match="the prepared dataset .*ptb/word cannot be read"):
        load_ptb("word", "valid", data_dir=data_dir)
    capsys.readouterr()  # TFDS's progress lines while preparing
    workdir = tmp_path / "run"
    code = lm_cli.main([*FRESH, "--workdir", str(workdir), "--data_dir", str(data_dir)])
    assert_one_line_error(
        code,
        capsys.readouterr(),
        f"{data_dir}/ptb/word cannot be read",
        "delete that directory and run again",
    )


@pytest.fixture
def immutable(tmp_path):
    """Makes directories immutable (chattr +i: even root cannot add an entry; a mode bit
    would not stop root, who runs CI) and undoes it at the end."""
    made = []

    def make(path):
        done = subprocess.run(["chattr", "+i", str(path)], capture_output=True)
        if done.returncode != 0:
            pytest.skip(f"chattr +i is not available here: {done.stderr.decode().strip()}")
        made.append(path)

    yield make
    for path in made:
        subprocess.run(["chattr", "-i", str(path)], check=False)


def test_an_unwritable_checkpoint_directory_is_refused_before_the_run(tmp_path, capsys, immutable):
    workdir = tmp_path / "run"
    checkpoints = workdir / "checkpoints"
    checkpoints.mkdir(parents=True)
    immutable(checkpoints)
    code = lm_cli.main([*FRESH, "--workdir", str(workdir), "--data_dir", str(tmp_path / "tfds")])
    assert_one_line_error(
        code,
        capsys.readouterr(),
        f"checkpoint directory {os.path.abspath(checkpoints)} is not writable",
    )
    assert not (tmp_path / "tfds").exists()  # nothing prepared
    assert not (workdir / CONFIG_FILE).exists()


@pytest.mark.slow
def test_a_start_refused_before_its_first_checkpoint_leaves_the_workdir_as_it_found_it(
    tmp_path, capsys
):
    """An empty validation file is found while the data is prepared, after the start wrote
    config.json and the training text's sha256 (data.json): the refused start takes back all
    it wrote, and nothing of the user's; the corrected command then trains as a new run."""
    workdir = tmp_path / "run"
    (workdir / "checkpoints").mkdir(parents=True)  # the user's own, empty: it stays
    (workdir / "notes.txt").write_text("the user's own file")
    train = write_lines(tmp_path / "train.txt", made_up_corpus(300, 0)[0])
    valid = write_lines(tmp_path / "valid.txt", [])
    args = [
        *("--preset", "tiny", "--workdir", str(workdir), "--steps", "1"),
        *("--train_text", train, "--valid_text", valid, "--plots", "false"),
    ]
    before = tree_of(workdir)
    code = lm_cli.main(args)
    err = capsys.readouterr().err
    assert code == cli.EXIT_USAGE, err
    assert f"{valid}: the file is empty" in err
    assert tree_of(workdir) == before

    write_lines(valid, made_up_corpus(30, 1)[0])
    code = lm_cli.main(args)
    out = capsys.readouterr()
    assert code == cli.EXIT_OK, out.err
    assert "resuming" not in out.out and "training from step 0 to 1" in out.out
    assert has_checkpoint(str(workdir)) and (workdir / "notes.txt").exists()


def test_a_lock_file_removed_before_it_was_locked_is_made_again(tmp_path, monkeypatch):
    """A start that fails removes the .lock it made. A run that opened that file just before
    must not lock it (a file nobody else sees, and two runs would share W): it locks a new
    one at the path."""
    real, calls = fcntl.flock, []

    def flock(fd, operation):
        if not calls:  # the failed start removes the file between this open and this flock
            os.remove(tmp_path / LOCK_FILE)
        calls.append(fd)
        return real(fd, operation)

    monkeypatch.setattr(fcntl, "flock", flock)
    with WorkdirLock(str(tmp_path)):
        assert len(calls) == 2 and os.path.exists(tmp_path / LOCK_FILE)
        with pytest.raises(WorkdirError, match="is in use by another run"):
            WorkdirLock(str(tmp_path)).__enter__()


@pytest.mark.slow
def test_changed_settings_are_reported_only_when_a_checkpoint_is_resumed(
    tmp_path, capsys, data_dir
):
    """A config.json without a checkpoint (a start killed before its first) is no run to
    resume: a start there with other steps trains from step 0 and says nothing changed."""
    workdir = str(tmp_path / "run")
    save_run_config(workdir, config_to_dict(tiny_lm_config(data_dir, steps=3)))
    lm.train_and_evaluate(tiny_lm_config(data_dir, steps=1), workdir)
    assert "resuming with changed settings" not in capsys.readouterr().out
    lm.train_and_evaluate(tiny_lm_config(data_dir, steps=2), workdir)
    assert "resuming with changed settings: steps: 1 -> 2" in capsys.readouterr().out
    resumes = [(r["step"], r["changed"]) for r in read_metrics(workdir) if r["split"] == "resume"]
    assert resumes == [(1, ["steps: 1 -> 2"])]


def test_a_config_json_that_is_not_a_run_config_is_one_line(tmp_path, capsys):
    workdir = tmp_path / "run"
    workdir.mkdir()
    (workdir / CONFIG_FILE).write_text(json.dumps({"preset": "tiny", "no_such_field": 1}))
    code = lm_cli.main(["--workdir", str(workdir)])
    assert_one_line_error(
        code, capsys.readouterr(), str(workdir / CONFIG_FILE), "does not describe a run"
    )


# A body that leaves what orbax's concurrent readers leave after one failed read: a sibling
# task whose exception nobody awaited, collected (and logged by asyncio) while the expected
# error propagates, then the expected error itself.
ORPHANED_TASK = """
import asyncio, gc, sys
from train.core import cli
from train.core.checkpoint import CheckpointError

def body():
    async def sibling_read():
        raise ValueError("OUT_OF_RANGE: sibling read of a truncated file")

    loop = asyncio.new_event_loop()
    task = loop.create_task(sibling_read())
    loop.run_until_complete(asyncio.sleep(0.01))  # the task fails; nobody asks for its result
    loop.close()
    del task
    gc.collect()  # asyncio logs 'Task exception was never retrieved' here
    raise CheckpointError("checkpoint W/checkpoints/8 could not be restored")

if sys.argv[1] == "bare":
    body()
else:
    sys.exit(cli.run_command(body, workdir=sys.argv[2]))
"""


def test_an_orphaned_asyncio_task_error_goes_to_error_log_not_stderr(tmp_path):
    """A CI run under load printed orbax's unretrieved sibling read error, with its asyncio
    traceback, after the one restore message (issue 28's stop 45). run_command writes it to
    W/error.log instead."""

    def python(*args):
        return subprocess.run(
            [sys.executable, "-c", ORPHANED_TASK, *args],
            cwd=REPO,
            env=dict(os.environ, PYTHONPATH=REPO),
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
        )

    bare = python("bare")  # the control: without run_command, asyncio prints it to stderr
    assert "Task exception was never retrieved" in bare.stderr, bare.stderr
    assert "sibling read of a truncated file" in bare.stderr

    done = python("run", str(tmp_path))
    assert done.returncode == cli.EXIT_ERROR, done.stderr
    assert "checkpoint W/checkpoints/8 could not be restored" in done.stderr
    assert "Traceback" not in done.stderr and "never retrieved" not in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 2, done.stderr  # the message + where
    with open(tmp_path / cli.ERROR_LOG) as f:
        log = f.read()
    assert "Task exception was never retrieved" in log
    assert "ValueError: OUT_OF_RANGE: sibling read of a truncated file" in log
    assert "CheckpointError" in log  # the error itself, as before


# --------------------------- train.core.workdir_checks alone (what its mutation run found)


def _as_process(monkeypatch, index: int, count: int = 2) -> list[tuple[str, str]]:
    """This process plays process `index` of `count`; -> the (value, what) pairs that
    check_workdir hands to check_same_on_every_process (which here compares nothing)."""
    monkeypatch.setattr(workdir_checks.jax, "process_index", lambda: index)
    monkeypatch.setattr(workdir_checks.jax, "process_count", lambda: count)
    compared = []
    monkeypatch.setattr(
        workdir_checks, "check_same_on_every_process", lambda v, what: compared.append((v, what))
    )
    return compared


@pytest.mark.parametrize("count, compares", [(1, False), (2, True), (3, True)])
def test_the_run_s_settings_are_compared_across_processes_only_past_one(
    tmp_path, monkeypatch, count, compares
):
    compared = _as_process(monkeypatch, 0, count)
    # The same settings given in another order are the same run on every process.
    for config in ({"steps": 3, "preset": "tiny"}, {"preset": "tiny", "steps": 3}):
        assert workdir_checks.check_workdir(None, str(tmp_path / "run"), config, ()) == []
    if compares:
        assert compared == [('{"preset": "tiny", "steps": 3}', "the run's settings (flags)")] * 2
    else:
        assert compared == []


def test_only_process_0_probes_the_checkpoint_directory(tmp_path, monkeypatch, immutable):
    checkpoints = tmp_path / "run" / "checkpoints"
    checkpoints.mkdir(parents=True)
    immutable(checkpoints)
    _as_process(monkeypatch, 1)  # another host's W may not be this one's: it writes nothing there
    assert workdir_checks.check_workdir(None, str(tmp_path / "run"), {}, ()) == []
    _as_process(monkeypatch, 0)
    with pytest.raises(WorkdirError, match="is not writable"):
        workdir_checks.check_workdir(None, str(tmp_path / "run"), {}, ())


def _failed_start(workdir, *, made_lock: bool = False):
    with pytest.raises(RuntimeError, match="the start failed"):
        with workdir_checks.taken_back_unless_saved(str(workdir), made_lock=made_lock):
            (workdir / CONFIG_FILE).write_text("{}")
            raise RuntimeError("the start failed")


def test_only_process_0_takes_back_what_a_failed_start_wrote(tmp_path, monkeypatch):
    workdir = tmp_path / "run"
    workdir.mkdir()
    _as_process(monkeypatch, 1)
    _failed_start(workdir)
    assert (workdir / CONFIG_FILE).exists()  # process 0 writes W's files and takes them back
    _as_process(monkeypatch, 0)
    (workdir / CONFIG_FILE).unlink()
    _failed_start(workdir)
    assert not (workdir / CONFIG_FILE).exists()
    with pytest.raises(TypeError):
        workdir_checks.taken_back_unless_saved(str(workdir), False)  # made_lock by name only


def test_a_take_back_that_fails_reports_it_and_keeps_the_start_s_error(
    tmp_path, monkeypatch, capsys
):
    workdir = tmp_path / "run"
    workdir.mkdir()
    _as_process(monkeypatch, 0)

    def cannot_remove(root, entries):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(workdir_checks, "remove_added", cannot_remove)
    _failed_start(workdir)  # the RuntimeError, not the PermissionError
    assert "could not remove what this start wrote in" in capsys.readouterr().err
    assert (workdir / CONFIG_FILE).exists()
