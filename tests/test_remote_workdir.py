"""A work directory on a bucket (gs://): the run's files reach the bucket with each checkpoint,
and a run on a machine that has nothing but the bucket resumes it exactly.

No network: etils.epath's gs:// backend is replaced by one that maps gs://B/... to a local
folder (epath.testing.mock_epath), and orbax's own gs:// support (tensorstore and
google-cloud-storage, not installed here) by the same mapping of the checkpoint directory.
Everything of ours that touches the work directory goes through epath or the local mirror,
so this exercises our code paths for a remote W.
"""

from __future__ import annotations

import json
import os

import pytest
from etils import epath
from etils.epath import testing as epath_testing
from helpers import made_up_corpus, tiny_lm_config, train_losses, tree_of, write_lines

from train import lm
from train.core import checkpoint as checkpoint_module
from train.core import cli
from train.core import workdir as workdir_module
from train.lm import cli as lm_cli

BACKEND_CALLS = (
    "open",
    "exists",
    "isdir",
    "listdir",
    "glob",
    "walk",
    "makedirs",
    "mkdir",
    "rmtree",
    "remove",
    "rename",
    "replace",
    "stat",
    "copy",
)


@pytest.fixture
def bucket(tmp_path, monkeypatch):
    """-> the local folder that stands in for gs://"""
    root = tmp_path / "gcs"
    root.mkdir()

    def local(path: str) -> str:
        path = os.fspath(path)
        return str(root / path[len("gs://") :]) if path.startswith("gs://") else path

    def redirect(original, path, *args, **kwargs):
        if (
            args
            and isinstance(args[0], (str, os.PathLike))
            and os.fspath(args[0]).startswith("gs://")
        ):
            args = (local(args[0]),) + args[1:]  # rename / replace / copy targets
        return original(local(path), *args, **kwargs)

    real_dir = checkpoint_module.checkpoint_dir
    monkeypatch.setattr(checkpoint_module, "checkpoint_dir", lambda w: local(real_dir(w)))
    monkeypatch.setenv(workdir_module.MIRROR_ENV, str(tmp_path / "machine-1"))
    monkeypatch.setattr(workdir_module, "_pushed", {})
    with epath_testing.mock_epath(**{name: redirect for name in BACKEND_CALLS}):
        yield root


def _config(data_dir, steps):
    return tiny_lm_config(data_dir, steps=steps)


@pytest.mark.slow
def test_a_bucket_workdir_holds_the_run_and_resumes_on_a_fresh_machine(
    bucket, tmp_path, monkeypatch, data_dir, lm_straight
):
    uri = "gs://runs-bucket/lm"
    lm.train_and_evaluate(_config(data_dir, 3), uri)
    run = bucket / "runs-bucket" / "lm"
    assert (run / "config.json").exists() and (run / "checkpoints" / "3").is_dir()
    assert json.loads((run / "checksums" / "3.json").read_text())  # the checksums went up
    assert [s for s, _ in train_losses(run)] == [1, 2, 3]
    assert list((run / "tensorboard").iterdir())
    assert not (run / ".lock").exists()  # the lock is the local mirror's, not the bucket's

    # Another machine: an empty mirror, only the bucket. `--workdir gs://...` alone resumes.
    monkeypatch.setenv(workdir_module.MIRROR_ENV, str(tmp_path / "machine-2"))
    monkeypatch.setattr(workdir_module, "_pushed", {})
    assert lm.train_and_evaluate(_config(data_dir, 6), uri)["step"] == 6
    resumed = train_losses(run)

    config, straight, _ = lm_straight  # the same run, uninterrupted and local
    assert config == _config(data_dir, 6)
    expected = train_losses(straight)
    assert [s for s, _ in resumed] == [s for s, _ in expected] == list(range(1, 7))
    for (_, a), (_, b) in zip(resumed, expected):
        assert a == pytest.approx(b, rel=1e-6)
    assert sorted(p.name for p in (run / "checksums").iterdir()) == sorted(
        p.name for p in (straight / "checksums").iterdir()
    )


def test_a_refused_start_on_a_bucket_takes_back_what_it_pushed(bucket, tmp_path, capsys):
    """config.json goes up as the run starts: a start refused later (an empty validation
    file, found while the data is prepared) removes it from the bucket as from the mirror,
    or the next start would resume the refused one."""
    uri = "gs://runs-bucket/refused"
    epath.Path(uri).mkdir(parents=True)
    epath.Path(f"{uri}/notes.txt").write_text("the user's own file")
    train = write_lines(tmp_path / "train.txt", made_up_corpus(300, 0)[0])
    valid = write_lines(tmp_path / "valid.txt", [])
    code = lm_cli.main(
        [
            *("--preset", "tiny", "--workdir", uri, "--steps", "1"),
            *("--train_text", train, "--valid_text", valid, "--plots", "false"),
        ]
    )
    assert code == cli.EXIT_USAGE, capsys.readouterr().err
    assert tree_of(bucket / "runs-bucket" / "refused") == {"notes.txt": b"the user's own file"}
    assert tree_of(workdir_module.local_dir(uri)) == {}


def test_the_mirror_sends_only_what_changed(bucket, tmp_path):
    uri = "gs://b/w"
    local = workdir_module.local_dir(uri)
    assert local.startswith(str(tmp_path / "machine-1")) and local != uri
    assert workdir_module.local_dir(str(tmp_path)) == str(tmp_path)  # a local W is itself
    os.makedirs(os.path.join(local, "sub"))
    for name in ("a.txt", os.path.join("sub", "b.txt")):
        with open(os.path.join(local, name), "w") as f:
            f.write(name)
    assert workdir_module.push(uri) == 2
    assert workdir_module.push(uri) == 0
    with open(os.path.join(local, "a.txt"), "a") as f:
        f.write("more")
    assert workdir_module.push(uri) == 1
    assert epath.Path("gs://b/w/a.txt").read_text() == "a.txtmore"
    # Checkpoints are orbax's, written straight to the bucket: never pulled into a mirror.
    epath.Path("gs://b/w/checkpoints/1").mkdir(parents=True)
    epath.Path("gs://b/w/checkpoints/1/x").write_text("orbax")
    os.remove(os.path.join(local, "a.txt"))
    assert workdir_module.pull(uri) == 2
    assert open(os.path.join(local, "a.txt")).read() == "a.txtmore"
    assert not os.path.exists(os.path.join(local, "checkpoints"))
