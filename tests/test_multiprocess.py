"""Two JAX processes on this machine (coordinator on 127.0.0.1, two CPU devices each, gloo
collectives) train with the project's own flags exactly as one process with four devices does,
evaluate alike, resume (also into sharded parameters split across both processes), decode
from parameters split across both, and stop together when only one of them gets SIGTERM."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from train.core.checkpoint import Checkpoints

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LM_FLAGS = ["--preset", "tiny", "--log_every", "1", "--checkpoint_every", "3",
            "--eval_tokens", "600", "--plots", "false", "--progress", "false"]


def _env(devices: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "TRAIN_"))}
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS="", PYTHONPATH=REPO,
               JAX_NUM_CPU_DEVICES=str(devices))
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(module: str, args: list[str], *, process_id: int, port: int) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", module, *args, "--distributed", "true",
         "--coordinator_address", f"127.0.0.1:{port}", "--num_processes", "2",
         "--process_id", str(process_id)],
        cwd=REPO, env=_env(2), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _pair(module: str, args: list[str], *, timeout: float = 240) -> list[tuple[int, str]]:
    """Runs two processes to the end -> [(exit code, output)] of process 0 and 1."""
    port = _free_port()
    procs = [_start(module, args, process_id=i, port=port) for i in range(2)]
    try:
        return [(p.wait(timeout=timeout), p.stdout.read()) for p in procs]
    finally:
        for p in procs:
            p.kill()


def _one(module: str, args: list[str], devices: int = 4) -> str:
    done = subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, env=_env(devices),
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def _records(workdir, split: str) -> list[dict]:
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if r["split"] == split]


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-5 * max(abs(a), abs(b), 1e-12)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("tfds")


def test_two_processes_train_evaluate_and_resume_as_one(tmp_path, data_dir):
    common = [*LM_FLAGS, "--data_dir", str(data_dir), "--decay_steps", "6"]
    # One process, four devices: the reference (it also prepares the data both will read).
    _one("train.lm", [*common, "--workdir", str(tmp_path / "one"), "--steps", "6"])
    two = str(tmp_path / "two")
    # Three steps, then six: a resumed two-process run, whose second half splits parameters
    # and optimizer state over the four devices of both processes (--sharding fsdp): the
    # replicated checkpoint is read into the split layout, and the last one is saved split.
    for steps, sharding in (("3", "replicated"), ("6", "fsdp")):
        for code, out in _pair("train.lm", [*common, "--workdir", two, "--steps", steps,
                                            "--sharding", sharding]):
            assert code == 0, out[-3000:]
    one_train, two_train = _records(tmp_path / "one", "train"), _records(two, "train")
    assert [r["step"] for r in two_train] == [1, 2, 3, 4, 5, 6]
    assert len(one_train) == len(two_train) == 6   # zip below compares every step
    assert all(_close(a["loss"], b["loss"]) for a, b in zip(one_train, two_train))
    for split in ("validation", "test"):
        a, b = _records(tmp_path / "one", split)[-1], _records(two, split)[-1]
        assert _close(a["loss"], b["loss"]), (split, a, b)
    assert Checkpoints(two).all_steps() == [3, 6]


def test_two_processes_translate_and_decode_as_one(tmp_path, data_dir):
    common = ["--preset", "tiny", "--steps", "3", "--log_every", "1", "--eval_sentences", "8",
              "--eval_batch_size", "8", "--beam_size", "2", "--plots", "false", "--progress",
              "false", "--data_dir", str(data_dir), "--model.d_model", "32", "--model.n_heads",
              "2", "--model.d_ff", "64", "--model.n_encoder_layers", "1",
              "--model.n_decoder_layers", "1"]
    one = tmp_path / "one"
    _one("train.translate", [*common, "--workdir", str(one)])
    # The tokenizer the reference trained, so the two processes only read it. Their parameters
    # are split over both processes (fsdp): decoding gathers them from the other host.
    two = str(tmp_path / "two")
    results = _pair("train.translate", [*common, "--workdir", two, "--tokenizer_dir",
                                        str(one / "tokenizer"), "--sharding", "fsdp"])
    for code, out in results:
        assert code == 0, out[-3000:]
    a, b = _records(one, "train"), _records(two, "train")
    assert len(a) == len(b) == 3 and all(_close(x["loss"], y["loss"]) for x, y in zip(a, b))
    test_a, test_b = _records(one, "test_2016_flickr")[-1], _records(two, "test_2016_flickr")[-1]
    assert _close(test_a["loss"], test_b["loss"]) and test_a["bleu"] == test_b["bleu"]
    hypotheses = [open(os.path.join(w, "translations", "test_2016_flickr.step3.en")).read()
                  for w in (one, two)]
    assert hypotheses[0] == hypotheses[1] and len(hypotheses[0].splitlines()) == 8
    # --translate_file with both processes (weights still split over them): one file, written
    # by process 0, equal to the one-process translation of the one-process run.
    source = tmp_path / "de.txt"
    source.write_text("Ein Mann fährt Fahrrad.\nZwei Hunde spielen im Schnee.\nEine Frau.\n",
                      encoding="utf-8")
    _one("train.translate", ["--workdir", str(one), "--translate_file", str(source),
                             "--output", str(tmp_path / "one.en")])
    for code, out in _pair("train.translate", ["--workdir", two, "--translate_file",
                                               str(source), "--output", str(tmp_path / "two.en")]):
        assert code == 0, out[-3000:]
    translated = [(tmp_path / f"{w}.en").read_text(encoding="utf-8") for w in ("one", "two")]
    assert translated[0] == translated[1] and len(translated[0].splitlines()) == 3


def test_sigterm_to_one_process_stops_both_with_a_checkpoint(tmp_path, data_dir):
    workdir = str(tmp_path / "run")
    port = _free_port()
    # --progress true: off a terminal, process 0 prints a 'step N/M' line per log interval.
    args = [*LM_FLAGS, "--data_dir", str(data_dir), "--workdir", workdir, "--steps", "100000",
            "--checkpoint_every", "100000", "--progress", "true"]
    procs = [_start("train.lm", args, process_id=i, port=port) for i in range(2)]
    try:
        lines, deadline = [], time.monotonic() + 180
        for line in procs[0].stdout:
            lines.append(line)
            if line.startswith("step 3/"):
                procs[1].send_signal(signal.SIGTERM)  # a preempted host: process 1 only
                break
            assert time.monotonic() < deadline, "".join(lines)[-3000:]
        codes = [p.wait(timeout=180) for p in procs]
        out = "".join(lines) + procs[0].stdout.read()
    finally:
        for p in procs:
            p.kill()
    assert codes == [75, 75], out[-3000:]
    assert "SIGTERM: checkpoint saved" in out
    saved = Checkpoints(workdir).latest_step()
    assert saved is not None and saved >= 3
    assert max(r["step"] for r in _records(workdir, "train")) <= saved


def test_a_coordinator_without_a_process_count_is_a_clear_error(tmp_path):
    env = _env(2)
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "train.lm", "--preset", "tiny", "--workdir", str(tmp_path),
         "--distributed", "true", "--coordinator_address", f"127.0.0.1:{_free_port()}"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "--num_processes" in done.stderr and "Traceback" not in done.stderr
    assert time.monotonic() - started < 120
