"""The shared run layer: a work directory saved before fields were added still resumes (the
saved config is compared in today's form), and TensorBoard's curves show each step once after
a resume (the resumed writer purges what the lost steps logged)."""

from __future__ import annotations

import importlib.util
import json
import os
import struct
import subprocess
import sys

import pytest
from helpers import REPO

from train import lm
from train.core.checkpoint import CONFIG_FILE, check_run_config, save_run_config
from train.core.config import config_to_dict
from train.core.metrics import TENSORBOARD_DIR
from train.core.task import normal_form
from train.lm.task import TASK


def test_a_config_saved_before_newer_fields_existed_still_resumes(tmp_path):
    config = lm.make_config("ptb", "tiny", steps=6)
    old = config_to_dict(config)
    for newer in ("on_nonfinite", "reset_memory_each_epoch", "compile_ahead"):
        old.pop(newer)
    old["model_config"].pop("softmax_tails")
    save_run_config(str(tmp_path), old)
    assert (
        check_run_config(
            str(tmp_path),
            config_to_dict(config),
            may_change=config.MAY_CHANGE,
            normalize=lambda saved: normal_form(TASK, saved),
        )
        == []
    )
    # A real difference is still one.
    with pytest.raises(ValueError, match="seed: saved 0, given 1"):
        check_run_config(
            str(tmp_path),
            config_to_dict(lm.replace(config, seed=1)),
            may_change=config.MAY_CHANGE,
            normalize=lambda saved: normal_form(TASK, saved),
        )
    with open(os.path.join(tmp_path, CONFIG_FILE), "w") as f:
        json.dump({**old, "no_such_field": 1}, f)
    with pytest.raises(Exception, match="does not describe a run this version can resume"):
        check_run_config(
            str(tmp_path),
            config_to_dict(config),
            may_change=config.MAY_CHANGE,
            normalize=lambda saved: normal_form(TASK, saved),
        )


def _events(directory):
    """Every event of the TFRecord files in `directory`, file by file in name order."""
    from tensorboardX.proto import event_pb2

    out = []
    for name in sorted(os.listdir(directory)):
        with open(os.path.join(directory, name), "rb") as f:
            data = f.read()
        at = 0
        while at < len(data):
            (length,) = struct.unpack("<Q", data[at : at + 8])
            event = event_pb2.Event()
            event.ParseFromString(data[at + 12 : at + 12 + length])
            out.append(event)
            at += 12 + length + 4
    return out


def _curve(directory, tag):
    """What TensorBoard shows for `tag`: a SessionLog START at step s drops the earlier
    events at steps >= s (the purge a resumed writer asks for)."""
    points = {}
    for event in _events(directory):
        if event.HasField("session_log") and event.session_log.status == 1:  # START
            points = {s: v for s, v in points.items() if s < event.step}
        for value in event.summary.value:
            if value.tag == tag:
                points[event.step] = value.simple_value
    return points


@pytest.mark.slow
def test_tensorboard_shows_each_step_once_after_a_resume(tmp_path, lm_straight):
    straight, straight_dir, _ = lm_straight  # 6 steps, a checkpoint every 3
    resumed = tmp_path / "resumed"
    lm.train_and_evaluate(lm.replace(straight, steps=3), str(resumed))
    # Steps 4, 5 and 8 logged by a run (with a larger step budget) that died before saving
    # them, as a kill leaves them; the resumed run, given 6 steps, never logs step 8 again.
    with open(resumed / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 4, "split": "train", "loss": 99.0}) + "\n")
    from tensorboardX import SummaryWriter

    with SummaryWriter(str(resumed / TENSORBOARD_DIR)) as lost:
        lost.add_scalar("train/loss", 99.0, 4)
        lost.add_scalar("train/loss", 99.0, 5)
        lost.add_scalar("train/loss", 99.0, 8)
    lm.train_and_evaluate(straight, str(resumed))
    want = _curve(straight_dir / TENSORBOARD_DIR, "train/loss")
    got = _curve(resumed / TENSORBOARD_DIR, "train/loss")
    assert sorted(got) == [1, 2, 3, 4, 5, 6] and got == pytest.approx(want, rel=1e-6)
    hparams = [
        e
        for e in _events(resumed / TENSORBOARD_DIR)
        if any(v.tag == "_hparams_/session_start_info" for v in e.summary.value)
    ]
    assert hparams  # the run's config, for TensorBoard's hyperparameter view


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch installed")
def test_tensorboard_logging_leaves_torch_unimported_and_importable(tmp_path):
    # tensorboardX imports torch whenever it is installed: more than a second of every run's
    # start-up, for nothing a run logs. A fresh interpreter, as a run is.
    script = f"""
import sys
from train.core.metrics import MetricsWriter
with MetricsWriter({str(tmp_path)!r}) as writer:
    writer.hparams({{"lr": 0.1}})
    writer.write(1, "train", {{"loss": 2.0}})
assert "torch" not in sys.modules, "tensorboardX imported torch"
import torch  # still importable afterwards
print("ok", torch.tensor([1]).item())
"""
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=REPO,
        env=dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0 and done.stdout.split() == ["ok", "1"], done.stderr
    assert os.listdir(tmp_path / TENSORBOARD_DIR)  # the events were written
