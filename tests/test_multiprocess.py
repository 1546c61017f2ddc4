"""Two JAX processes on this machine (coordinator on 127.0.0.1, two CPU devices each, gloo
collectives) train with the project's own flags exactly as one process with four devices does,
evaluate alike, resume (also into sharded parameters split across both processes), decode
from parameters split across both, and stop together when only one of them gets SIGTERM or
when the time budget is spent. The distributed set-up also comes from the environment alone,
and processes given different work directories all fail instead of hanging."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
from helpers import REPO, Running, finish_all, made_up_corpus, subprocess_xla_flags, write_lines

from train.core import cli
from train.core.checkpoint import Checkpoints, load_run_config
from train.core.errors import EXIT_PEER_LOST

# Every test here trains runs (several processes, or every model).
pytestmark = pytest.mark.slow

LM_FLAGS = [
    "--preset",
    "tiny",
    "--log_every",
    "1",
    "--checkpoint_every",
    "3",
    "--eval_tokens",
    "600",
    "--plots",
    "false",
    "--progress",
    "false",
]
# What the coordinator prints when its port was taken after `_free_port` released it.
BIND_FAILED = ("Failed to start RPC server", "ddress already in use")
ATTEMPTS = 3  # ports to try


def _env(devices: int) -> dict[str, str]:
    # No JAX_/TRAIN_ settings of the test process (the route under test is the flags or the
    # variables a test sets), except the session's compilation cache (conftest.py).
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("JAX_", "TRAIN_"))
        or k.startswith(("JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE"))
    }
    env.update(
        JAX_PLATFORMS="cpu",
        XLA_FLAGS=subprocess_xla_flags(),
        PYTHONPATH=REPO,
        JAX_NUM_CPU_DEVICES=str(devices),
    )
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(
    module: str, args: list[str], *, process_id: int, port: int, via_env: bool = False
) -> Running:
    """Process `process_id` of two of `module` (or of a script, a path ending in .py), told
    where the coordinator is by flags, or (via_env) by $TRAIN_DISTRIBUTED,
    $JAX_COORDINATOR_ADDRESS, $JAX_NUM_PROCESSES and $JAX_PROCESS_ID."""
    env, address = _env(2), f"127.0.0.1:{port}"
    if via_env:
        env.update(
            TRAIN_DISTRIBUTED="1",
            JAX_COORDINATOR_ADDRESS=address,
            JAX_NUM_PROCESSES="2",
            JAX_PROCESS_ID=str(process_id),
        )
        flags = []
    else:
        flags = [
            "--distributed",
            "true",
            "--coordinator_address",
            address,
            "--num_processes",
            "2",
            "--process_id",
            str(process_id),
        ]
    run = [module] if module.endswith(".py") else ["-m", module]  # a script, or a module
    return Running([sys.executable, *run, *args, *flags], env)


def _bind_failed(proc: Running) -> bool:
    return any(text in proc.output for text in BIND_FAILED)


def _pair(
    module: str,
    args: list[str] | tuple[list[str], list[str]],
    *,
    timeout: float = 240,
    via_env: bool = False,
) -> list[tuple[int, str]]:
    """Runs two processes to the end -> [(exit code, output)] of process 0 and 1. `args`: the
    same for both, or one list each. A port taken by someone else between `_free_port` and the
    coordinator's bind is a retry on another port, not a failure."""
    each = args if isinstance(args, tuple) else (args, args)
    for _ in range(ATTEMPTS):
        port = _free_port()
        with (
            _start(module, each[0], process_id=0, port=port, via_env=via_env) as p0,
            _start(module, each[1], process_id=1, port=port, via_env=via_env) as p1,
        ):
            codes = finish_all([p0, p1], timeout)
        if not (codes[0] != 0 and _bind_failed(p0)):
            return [(codes[0], p0.output), (codes[1], p1.output)]
    raise AssertionError(
        f"the coordinator could not bind in {ATTEMPTS} attempts:\n{p0.output[-3000:]}"
    )


def _one(module: str, args: list[str], devices: int = 4) -> str:
    done = subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=REPO,
        env=_env(devices),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def _records(workdir, split: str) -> list[dict]:
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if r["split"] == split]


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-5 * max(abs(a), abs(b), 1e-12)


def test_two_processes_train_evaluate_and_resume_as_one(tmp_path, data_dir, lm_straight):
    # The reference: the session's uninterrupted 6-step run, one process on eight devices.
    reference, one, _ = lm_straight
    common = [
        *LM_FLAGS,
        *("--data_dir", str(data_dir), "--decay_steps", "6"),
        *("--learning_rate", str(reference.learning_rate)),
    ]
    two = str(tmp_path / "two")
    # Three steps, then six: a resumed two-process run, whose second half splits parameters
    # and optimizer state over the four devices of both processes (--sharding fsdp): the
    # replicated checkpoint is read into the split layout, and the last one is saved split.
    # The first half is told of the other process by the environment alone (no flag), the
    # second by the flags.
    for steps, sharding, via_env in (("3", "replicated", True), ("6", "fsdp", False)):
        for code, out in _pair(
            "train.lm",
            [*common, "--workdir", two, "--steps", steps, "--sharding", sharding],
            via_env=via_env,
        ):
            assert code == 0, out[-3000:]
    # The same run as the reference: only where it ran (and how its state was laid out) differ.
    saved, wanted = load_run_config(two), load_run_config(str(one))
    fields = ("steps", "decay_steps", "learning_rate", "batch_size", "seed", "eval_tokens")
    assert {k: saved[k] for k in fields + ("model_config",)} == {
        k: wanted[k] for k in fields + ("model_config",)
    }
    one_train, two_train = _records(one, "train"), _records(two, "train")
    assert [r["step"] for r in two_train] == [1, 2, 3, 4, 5, 6]
    assert len(one_train) == len(two_train) == 6  # zip below compares every step
    assert all(_close(a["loss"], b["loss"]) for a, b in zip(one_train, two_train))
    for split in ("validation", "test"):
        a, b = _records(one, split)[-1], _records(two, split)[-1]
        assert _close(a["loss"], b["loss"]), (split, a, b)
    assert Checkpoints(two).all_steps() == [3, 6]


def test_two_processes_translate_and_decode_as_one(tmp_path, data_dir, tokenizer_dir):
    # The session's tokenizer (conftest.py), so the processes only read it.
    common = [
        "--preset",
        "tiny",
        "--tokenizer_dir",
        str(tokenizer_dir),
        "--steps",
        "3",
        "--log_every",
        "1",
        "--eval_sentences",
        "8",
        "--eval_batch_size",
        "8",
        "--beam_size",
        "2",
        "--plots",
        "false",
        "--progress",
        "false",
        "--data_dir",
        str(data_dir),
        "--model.d_model",
        "32",
        "--model.n_heads",
        "2",
        "--model.d_ff",
        "64",
        "--model.n_encoder_layers",
        "1",
        "--model.n_decoder_layers",
        "1",
    ]
    one = tmp_path / "one"
    _one("train.translate", [*common, "--workdir", str(one)])
    # The two processes' parameters are split over both (fsdp): decoding gathers them from the
    # other host.
    two = str(tmp_path / "two")
    results = _pair("train.translate", [*common, "--workdir", two, "--sharding", "fsdp"])
    for code, out in results:
        assert code == 0, out[-3000:]
    a, b = _records(one, "train"), _records(two, "train")
    assert len(a) == len(b) == 3 and all(_close(x["loss"], y["loss"]) for x, y in zip(a, b))
    test_a, test_b = _records(one, "test_2016_flickr")[-1], _records(two, "test_2016_flickr")[-1]
    assert _close(test_a["loss"], test_b["loss"]) and test_a["bleu"] == test_b["bleu"]
    hypotheses = [
        open(os.path.join(w, "translations", "test_2016_flickr.step3.en")).read()
        for w in (one, two)
    ]
    assert hypotheses[0] == hypotheses[1] and len(hypotheses[0].splitlines()) == 8
    # --translate_file with both processes (weights still split over them): one file, written
    # by process 0, equal to the one-process translation of the one-process run.
    source = tmp_path / "de.txt"
    source.write_text(
        "Ein Mann fährt Fahrrad.\nZwei Hunde spielen im Schnee.\nEine Frau.\n", encoding="utf-8"
    )
    _one(
        "train.translate",
        [
            "--workdir",
            str(one),
            "--translate_file",
            str(source),
            "--output",
            str(tmp_path / "one.en"),
        ],
    )
    for code, out in _pair(
        "train.translate",
        ["--workdir", two, "--translate_file", str(source), "--output", str(tmp_path / "two.en")],
    ):
        assert code == 0, out[-3000:]
    translated = [(tmp_path / f"{w}.en").read_text(encoding="utf-8") for w in ("one", "two")]
    assert translated[0] == translated[1] and len(translated[0].splitlines()) == 3


def test_two_processes_train_on_files_from_one_token_cache_built_by_process_0(tmp_path):
    src, tgt = made_up_corpus(300, 0)
    files = [
        write_lines(tmp_path / "train.xx", src),
        write_lines(tmp_path / "train.yy", tgt),
        write_lines(tmp_path / "valid.xx", src[:16]),
        write_lines(tmp_path / "valid.yy", tgt[:16]),
    ]
    common = [
        *("--preset", "tiny", "--steps", "3", "--log_every", "1", "--vocab_size", "300"),
        *("--eval_sentences", "8", "--eval_batch_size", "8", "--plots", "false"),
        *("--progress", "false", "--src_lang", "xx", "--tgt_lang", "yy"),
        *("--train_src", files[0], "--train_tgt", files[1]),
        *("--valid_src", files[2], "--valid_tgt", files[3]),
        *("--model.d_model", "32", "--model.n_heads", "2", "--model.d_ff", "64"),
        *("--model.n_encoder_layers", "1", "--model.n_decoder_layers", "1"),
    ]
    one, two = tmp_path / "one", tmp_path / "two"
    assert "data: encoded 300 training pairs" in _one(
        "train.translate", [*common, "--workdir", str(one)]
    )
    (code0, out0), (code1, out1) = _pair("train.translate", [*common, "--workdir", str(two)])
    assert code0 == 0 and code1 == 0, out0[-3000:] + out1[-3000:]
    # Process 0 encoded the files while process 1 waited, then read the same cache (the
    # losses: each process fed its own rows of the same batches).
    assert "data: encoded 300 training pairs" in out0
    (cache,) = os.listdir(two / "token_cache")
    with open(two / "token_cache" / cache / "meta.json") as f:
        assert json.load(f)["process_index"] == 0
    a, b = _records(one, "train"), _records(two, "train")
    assert len(a) == len(b) == 3 and all(_close(x["loss"], y["loss"]) for x, y in zip(a, b))


def _signal_one_mid_run(args: list[str], signum: int, *, after: str, timeout: float):
    """Two train.lm processes; once process 0 prints `after`, `signum` to process 1 only ->
    (process 0, process 1, their exit codes, seconds from the signal to both exits)."""
    for _ in range(ATTEMPTS):
        port = _free_port()
        with (
            _start("train.lm", args, process_id=0, port=port) as p0,
            _start("train.lm", args, process_id=1, port=port) as p1,
        ):
            try:
                p0.wait_for(after)
            except AssertionError:
                if _bind_failed(p0):
                    continue  # the port was taken meanwhile: another one
                raise
            p1.send_signal(signum)
            sent = time.monotonic()
            codes = finish_all([p0, p1], timeout=timeout)
            return p0, p1, codes, time.monotonic() - sent
    raise AssertionError(f"the coordinator could not bind in {ATTEMPTS} attempts")


def test_sigterm_to_one_process_stops_both_with_a_checkpoint(tmp_path, data_dir):
    workdir = str(tmp_path / "run")
    # --progress true: off a terminal, process 0 prints a 'step N/M' line per log interval.
    args = [
        *LM_FLAGS,
        "--data_dir",
        str(data_dir),
        "--workdir",
        workdir,
        "--steps",
        "100000",
        "--checkpoint_every",
        "100000",
        "--progress",
        "true",
    ]
    # A preempted host: process 1 only.
    p0, p1, codes, _ = _signal_one_mid_run(args, signal.SIGTERM, after="step 3/", timeout=180)
    out = p0.output
    assert codes == [cli.EXIT_INTERRUPTED] * 2, out[-3000:] + p1.output[-3000:]
    assert "SIGTERM: checkpoint saved" in out
    saved = Checkpoints(workdir).latest_step()
    assert saved is not None and saved >= 3
    assert max(r["step"] for r in _records(workdir, "train")) <= saved


def test_a_killed_process_stops_the_other_at_once_naming_it_and_both_resume(tmp_path, data_dir):
    """kill -9 of process 1 mid-run: process 0's next collective fails, and it exits 69
    (EXIT_PEER_LOST) within seconds with one line naming process 1, instead of waiting in
    JAX's shutdown for the dead process and aborting. The checkpoint saved before is whole:
    both processes started again resume from it and finish."""
    workdir = str(tmp_path / "run")
    args = [*LM_FLAGS, "--data_dir", str(data_dir), "--workdir", workdir, "--progress", "true"]
    p0, _, codes, took = _signal_one_mid_run(
        [*args, "--steps", "100000"], signal.SIGKILL, after="step 4/", timeout=60
    )
    assert codes[0] == EXIT_PEER_LOST == 69, p0.output[-3000:]
    assert took < 15, took  # not JAX's shutdown timeout and abort (about a minute)
    message = [line for line in p0.output.splitlines() if line.startswith("error: ")]
    assert len(message) == 1 and message[0].startswith("error: process 1 (of 2) was lost ("), (
        p0.output[-3000:]
    )
    assert "process 0 stops too" in message[0] and "Check failure" not in p0.output
    saved = Checkpoints(workdir).latest_step()
    assert saved is not None and saved >= 3
    # All processes started again: the run resumes from the saved step and finishes.
    results = _pair("train.lm", [*args, "--steps", str(saved + 3)])
    assert [code for code, _ in results] == [cli.EXIT_OK] * 2, results[0][1] + results[1][1]
    assert f"resumed from {os.path.join(workdir, 'checkpoints', str(saved))}" in results[0][1]
    assert Checkpoints(workdir).latest_step() == saved + 3


def test_a_process_killed_while_the_other_waits_outside_a_collective_stops_it_at_once(
    tmp_path, data_dir
):
    """Process 1 killed while process 0 waits on something that is not a collective (a long
    compilation, say: here a save made to wait ten minutes, tests/lost_outside_a_collective.py):
    no collective fails, yet process 0 stops within seconds with one line naming process 1,
    from its liveness connection (`train.core.peers.Liveness`), not JAX's heartbeat abort."""
    script = os.path.join(REPO, "tests", "lost_outside_a_collective.py")
    args = [*LM_FLAGS, "--data_dir", str(data_dir), "--workdir", str(tmp_path / "run")]
    args += ["--steps", "100000"]
    (code0, out0), (code1, _) = _pair(script, args, timeout=120)
    assert [code0, code1] == [EXIT_PEER_LOST, -signal.SIGKILL], out0[-3000:]
    message = [line for line in out0.splitlines() if line.startswith("error: ")]
    assert message == [
        "error: process 1 (of 2) was lost (its connection closed); process 0 stops too. "
        "Start every process again with the same --workdir: the run resumes from its last "
        "checkpoint"
    ], out0[-3000:]
    assert "Check failure" not in out0


def test_a_spent_time_budget_stops_both_processes_at_the_same_step(tmp_path, data_dir):
    """--minutes 1e-6 is spent during start-up (the budget counts from the start), so both
    processes must agree to stop before the first step: one stopping alone would leave the
    other waiting in a collective. Both exit normally, evaluated, with the one checkpoint both
    took part in saving."""
    workdir = tmp_path / "run"
    results = _pair(
        "train.lm",
        [
            *LM_FLAGS,
            "--data_dir",
            str(data_dir),
            "--workdir",
            str(workdir),
            "--steps",
            "100000",
            "--minutes",
            "1e-6",
        ],
    )
    assert [code for code, _ in results] == [cli.EXIT_OK] * 2, results[0][1] + results[1][1]
    out = results[0][1]
    assert "stopped at step 0 (time)" in out
    assert Checkpoints(str(workdir)).all_steps() == [0]
    assert not _records(workdir, "train")
    assert [r["step"] for r in _records(workdir, "test")] == [0]


def test_different_workdirs_on_two_processes_are_an_error_on_both(tmp_path):
    common = ["--preset", "tiny", "--steps", "3", "--plots", "false", "--progress", "false"]
    results = _pair(
        "train.lm",
        ([*common, "--workdir", str(tmp_path / "a")], [*common, "--workdir", str(tmp_path / "b")]),
        timeout=120,
    )
    a, b = tmp_path / "a", tmp_path / "b"
    for code, out in results:
        # A usage error, naming each process's value.
        assert code == cli.EXIT_USAGE, out[-3000:]
        assert (
            f"--workdir: the processes were given different values: process 0: {a}, "
            f"process 1: {b}" in out
        ), out[-3000:]
        assert "Traceback" not in out
    # Refused before either wrote its run.
    assert not any((tmp_path / w / "config.json").exists() for w in ("a", "b"))


def test_another_flag_on_one_process_names_the_field_and_each_value(tmp_path):
    common = ["--preset", "tiny", "--plots", "false", "--progress", "false"]
    workdir = ["--workdir", str(tmp_path / "run")]
    results = _pair(
        "train.lm",
        ([*common, *workdir, "--steps", "3"], [*common, *workdir, "--steps", "4"]),
        timeout=120,
    )
    for code, out in results:
        assert code == cli.EXIT_USAGE, out[-3000:]
        line = next(x for x in out.splitlines() if "processes were given different" in x)
        # (the LM's decay_steps follows its steps when the config is made: it differs too)
        assert line.endswith(
            "the run's settings (flags): the processes were given different values: "
            "decay_steps (process 0: 3, process 1: 4); steps (process 0: 3, process 1: 4); "
            "give every process the same one"
        ), line
        # Only the field that differs reaches the terminal, not the whole config.
        assert '"batch_size"' not in out and "Traceback" not in out
    assert not (tmp_path / "run" / "config.json").exists()


def test_a_coordinator_without_a_process_count_is_a_clear_error(tmp_path):
    # The timeout guards against a hang; the verdict is the exit code and the message.
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "train.lm",
            "--preset",
            "tiny",
            "--workdir",
            str(tmp_path),
            "--distributed",
            "true",
            "--coordinator_address",
            f"127.0.0.1:{_free_port()}",
        ],
        cwd=REPO,
        env=_env(2),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == cli.EXIT_USAGE
    assert "--num_processes" in done.stderr and "Traceback" not in done.stderr


def test_only_a_collective_whose_peer_went_or_the_services_verdict_is_a_lost_peer(monkeypatch):
    """What `train.core.peers.lost_peer` takes for a lost process: gloo's connection errors
    and the coordination service's heartbeat verdict, in a run of several processes; not a
    storage or network error elsewhere, and nothing in a one-process run."""
    import jax

    from train.core import peers

    monkeypatch.setattr(jax.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(jax, "process_index", lambda: 0)
    gloo = RuntimeError(
        "UNKNOWN: Gloo AllGather failed: [pair.cc:547] Connection closed by peer [1.2.3.4]:5"
    )
    lost = peers.lost_peer(gloo)
    assert lost is not None and lost.exit_code == 69
    assert str(lost).startswith("process 1 (of 2) was lost (UNKNOWN: Gloo AllGather failed")
    verdict = RuntimeError("UNAVAILABLE: Task 1 heartbeat timeout. This indicates ...")
    assert peers.lost_peer(verdict) is not None
    assert peers.lost_peer(OSError("GCS upload: Connection reset by peer")) is None
    assert peers.lost_peer(ValueError("steps: expected >= 0")) is None
    monkeypatch.setattr(jax, "process_count", lambda: 1)
    assert peers.lost_peer(gloo) is None
