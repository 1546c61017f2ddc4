"""train.translate end to end on a tiny Transformer and real Multi30k: loss goes down, outputs
are written, a resumed run repeats an uninterrupted one exactly (also when it changes the
sharding between replicated and fsdp), bad input is a clear error
that leaves the checkpoints alone, and the command line works (flags, SIGTERM, --translate).
"""

from __future__ import annotations

import math
import os
import re
import shutil
import signal
import subprocess
import sys

import jax
import numpy as np
import pytest
import sacrebleu
from helpers import (
    REPO,
    Running,
    epoch_batches,
    file_hashes,
    record_searches,
    subprocess_xla_flags,
    teacher_forced_nll,
    train_losses,
)

from train import translate
from train.core.checkpoint import CheckpointError, Checkpoints
from train.core.inference import params_for_inference, restore_for_inference
from train.core.metrics import read_metrics
from train.core.parallel import DataParallel
from train.data.datasets import load_multi30k
from train.data.tokenizers import PAD_ID
from transformer_jax.decoding import decode
from transformer_jax.model import quantized

SMALL_MODEL = dict(d_model=32, n_heads=2, d_ff=64, n_encoder_layers=1, n_decoder_layers=1)


def tiny_config(data_dir, **overrides):
    fields = dict(
        steps=6,
        log_every=1,
        checkpoint_every=3,
        eval_sentences=16,
        eval_batch_size=16,
        beam_size=2,
        progress=False,
        data_dir=str(data_dir),
    )
    fields.update(overrides)
    return translate.make_config("transformer", "tiny", model_overrides=SMALL_MODEL, **fields)


def decode_alone(workdir: str, sentences: list[str]) -> list[str]:
    """The library's beam search of each sentence alone with the params of `workdir`'s
    checkpoint (the best, else the latest, as translate_text picks)."""
    config, model, state, _ = restore_for_inference(translate.TASK, workdir)
    params = jax.device_get(translate.eval_params(state))
    tokenizer = translate.load_tokenizer(config, workdir)
    out = []
    for ids in translate.encode_source(tokenizer, sentences):
        bucket = min(b for b in config.buckets if b >= len(ids))
        src = np.full((1, bucket), config.model_config.pad_id, np.int32)
        src[0, : len(ids)] = ids
        tokens, _ = decode.beam_search(
            model,
            params,
            src,
            beam_size=config.beam_size,
            max_len=bucket + config.decode_margin,
            length_penalty=config.length_penalty,
        )
        out.append(tokenizer.decode(np.asarray(tokens)[0, 0]))
    return out


@pytest.fixture(scope="module")
def straight(tmp_path_factory, data_dir, tokenizer_dir):
    """One uninterrupted 6-step run with plots: (config, workdir, final metrics). The config
    returned makes no plots (a setting a resumed run may change): the runs the tests derive
    from it skip drawing figures only this run's are checked for."""
    workdir = tmp_path_factory.mktemp("straight")
    config = tiny_config(data_dir, tokenizer_dir=str(tokenizer_dir))
    final = translate.train_and_evaluate(config, str(workdir))
    return translate.replace(config, plots=False), workdir, final


@pytest.mark.slow
def test_training_lowers_the_loss_and_writes_every_output(straight):
    config, workdir, final = straight
    losses = train_losses(workdir)
    assert [s for s, _ in losses] == [1, 2, 3, 4, 5, 6]
    assert losses[-1][1] < losses[0][1] - 0.1
    assert final["reason"] == "steps" and final["step"] == 6
    for key in ("val_loss", "val_ppl", "test_ppl", "test_bleu"):
        assert key in final
    # The BLEU reported is sacreBLEU of the written hypotheses against the shipped references.
    with open(final["hypotheses"], encoding="utf-8") as f:
        hypotheses = f.read().splitlines()
    references = [en for _, en in load_multi30k(config.test_split, data_dir=config.data_dir)[:16]]
    assert len(hypotheses) == len(references) == 16
    assert final["test_bleu"] == pytest.approx(
        sacrebleu.corpus_bleu(hypotheses, [references]).score, abs=1e-9
    )
    splits = [r["split"] for r in read_metrics(str(workdir))]
    assert "validation" in splits and config.test_split in splits
    assert Checkpoints(str(workdir)).all_steps() == [3, 6]
    for name in ("loss.png", "positional_encoding.png"):
        assert os.path.getsize(os.path.join(workdir, "plots", name)) > 1000


@pytest.mark.slow
def test_resume_repeats_the_uninterrupted_run_exactly(straight, tmp_path):
    config, workdir, final = straight
    first = translate.train_and_evaluate(translate.replace(config, steps=3), str(tmp_path))
    assert first["step"] == 3
    second = translate.train_and_evaluate(config, str(tmp_path))
    assert train_losses(tmp_path) == train_losses(workdir)  # exactly equal, step by step
    assert second["val_loss"] == final["val_loss"]


@pytest.mark.slow
def test_resume_across_shardings_repeats_the_uninterrupted_run(straight, tmp_path):
    """fsdp -> replicated -> fsdp, two steps each: every checkpoint is restored into the other
    layout (orbax reads into the current run's shardings), and the losses are the straight
    replicated run's up to summation order. The last leg decodes its test set from split
    weights, and translate_text restores the fsdp run for inference."""
    config, workdir, final = straight
    for steps, sharding in ((2, "fsdp"), (4, "replicated"), (6, "fsdp")):
        last = translate.train_and_evaluate(
            translate.replace(config, steps=steps, sharding=sharding), str(tmp_path)
        )
    assert [s for s, _ in train_losses(tmp_path)] == [1, 2, 3, 4, 5, 6]
    np.testing.assert_allclose(
        [loss for _, loss in train_losses(tmp_path)],
        [loss for _, loss in train_losses(workdir)],
        rtol=1e-5,
    )
    np.testing.assert_allclose(last["val_loss"], final["val_loss"], rtol=1e-5)
    # translate_text decodes with the fsdp checkpoint's parameters: the library's beam search
    # with them, gathered onto one device. (Not the straight run's strings: after six steps
    # the likeliest tokens are near ties that rounding may order either way; nor its params
    # leaf by leaf: the attention key biases have a zero gradient up to rounding, which Adam
    # scales up to full-size steps, differently in each layout.)
    sentences = ["Zwei Hunde.", "Ein Mann fährt Fahrrad."]
    assert translate.translate_text(str(tmp_path), sentences) == decode_alone(
        str(tmp_path), sentences
    )


@pytest.mark.slow
def test_ema_leaves_training_alone_evaluates_the_average_and_resumes_exactly(straight, tmp_path):
    config, workdir, final = straight
    ema = translate.replace(config, ema_decay=0.5)
    whole = translate.train_and_evaluate(ema, str(tmp_path / "whole"))
    # The average is only read by evaluation: training is step for step the plain run's.
    assert train_losses(tmp_path / "whole") == train_losses(workdir)
    assert whole["val_loss"] != final["val_loss"]
    translate.train_and_evaluate(translate.replace(ema, steps=3), str(tmp_path / "resumed"))
    resumed = translate.train_and_evaluate(ema, str(tmp_path / "resumed"))
    assert train_losses(tmp_path / "resumed") == train_losses(tmp_path / "whole")
    assert resumed["val_loss"] == whole["val_loss"]  # the average was checkpointed too
    assert resumed["test_bleu"] == whole["test_bleu"]


@pytest.mark.slow
def test_compiling_ahead_trains_exactly_like_the_lazy_step(
    tmp_path, data_dir, tokenizer_dir, capsys
):
    # Three buckets, so batches come in three shapes; compiled before step 1 in threads, or
    # each at its first batch: the same executables, so the same losses to the last bit.
    runs = {}
    for ahead in (True, False):
        config = tiny_config(
            data_dir,
            steps=8,
            buckets=(16, 32, 64),
            compile_ahead=ahead,
            plots=False,
            checkpoint_every=0,
            eval_sentences=8,
            tokenizer_dir=str(tokenizer_dir),
        )
        translate.train_and_evaluate(config, str(tmp_path / str(ahead)))
        runs[ahead] = train_losses(tmp_path / str(ahead)), capsys.readouterr().out
    (losses, out), (lazy_losses, lazy_out) = runs[True], runs[False]
    assert len(losses) == 8 and losses == lazy_losses
    shapes = int(re.search(r"(\d+) batch shapes to compile", out).group(1))
    # The count is of the shapes an epoch's batches really have (three buckets: several).
    config = tiny_config(data_dir, buckets=(16, 32, 64))
    data = translate.TASK.prepare(
        config,
        str(tmp_path / "True"),
        DataParallel(config.parallel, sharding=config.sharding),
        log=lambda message: None,
    )
    epoch = {(b["src"].shape, b["tgt_in"].shape) for b in epoch_batches(data.batcher, 0)}
    assert shapes == len(epoch) >= 2
    assert f"compiled the train step for {shapes} batch shape(s) ahead" in out
    # The suite's persistent cache (conftest.py) takes every compilation: the log says what
    # it saved, each shape's program a hit or a miss.
    cached = re.search(
        r"batch shape\(s\) ahead in [\d.]+s; (\d+) of (\d+) program\(s\) from the "
        r"persistent compilation cache \(([\d.]+s of compiling saved|reading them took "
        r"[\d.]+s more than compiling them had)\)",
        out,
    )
    assert cached and int(cached.group(2)) >= shapes, out
    assert "compiled the train step for" not in lazy_out
    # No shape was compiled again lazily: the count the trainer logs is the batcher's.
    assert f"the train step compiled {shapes} batch shape(s)" in out


@pytest.mark.slow
def test_a_mismatched_config_is_an_error_and_changes_nothing(straight):
    config, workdir, _ = straight
    before = file_hashes(workdir)
    with pytest.raises(ValueError, match=r"seed: saved 0, given 1"):
        translate.train_and_evaluate(translate.replace(config, seed=1), str(workdir))
    with pytest.raises(ValueError, match=r"model_config.d_model: saved 32, given 48"):
        translate.train_and_evaluate(
            translate.replace(config, model_overrides={"d_model": 48}), str(workdir)
        )
    assert file_hashes(workdir) == before


# orbax's reader leaves an asyncio callback behind when a read fails; it is harmless.
@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_corrupt_checkpoint_is_an_error_naming_it_and_changes_nothing(straight, tmp_path):
    config, workdir, _ = straight
    shutil.copytree(workdir, tmp_path, dirs_exist_ok=True)
    latest = Checkpoints(str(tmp_path)).path(6)
    for root, _, files in os.walk(os.path.join(latest, "state")):
        if os.path.basename(root) == "d":
            for name in files:
                with open(os.path.join(root, name), "r+b") as f:
                    f.truncate(5)
    before = file_hashes(tmp_path)
    with pytest.raises(CheckpointError, match=latest):
        translate.train_and_evaluate(translate.replace(config, steps=9), str(tmp_path))
    assert file_hashes(tmp_path) == before


@pytest.mark.slow
def test_translate_text_uses_the_trained_checkpoint(straight):
    _, workdir, _ = straight
    sentences = ["Ein Mann fährt Fahrrad.", "Zwei Hunde."]
    out = translate.translate_text(str(workdir), sentences)
    # The library's beam search, one sentence at a time, with the checkpoint's params...
    assert out == decode_alone(str(workdir), sentences)
    # ... and not what the initial parameters say.
    config, model, state, _ = restore_for_inference(translate.TASK, str(workdir))
    assert int(state.step) == 6
    tokenizer = translate.load_tokenizer(config, str(workdir))
    untrained, _ = translate.TASK.init_params(config, model, jax.random.PRNGKey(config.seed))
    pairs = [(ids, []) for ids in translate.encode_source(tokenizer, sentences)]
    assert (
        translate.translate_pairs(model, untrained, DataParallel("jit"), config, tokenizer, pairs)
        != out
    )


@pytest.mark.slow
def test_the_translate_command_fills_the_compilation_cache_and_a_second_run_reads_it(
    straight, tmp_path
):
    """A command compiles a program once per machine: the first run writes the persistent
    cache, the second finds every program there (it rewrites no entry) and prints the same."""
    _, workdir, _ = straight
    cache = tmp_path / "xla"
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=subprocess_xla_flags(), PYTHONPATH=REPO)
    env.pop("JAX_COMPILATION_CACHE_DIR")  # the suite's cache, which a command leaves alone
    # The suite's JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 stays: every program is cached
    # (which ones pass the commands' 0.2 s threshold would vary from run to run).
    env.update(ATTENTION_JAX_COMPILATION_CACHE=str(cache))
    command = [sys.executable, "-m", "train.translate", "--workdir", str(workdir)]
    command += ["--translate", "Ein Mann fährt Fahrrad.", "Zwei Hunde spielen."]

    def run(**changes):
        done = subprocess.run(
            command, env={**env, **changes}, capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, done.stderr
        return done.stdout

    def entries():
        return {p.name: p.stat().st_mtime_ns for p in cache.iterdir()}

    first = run()
    written = entries()
    assert written
    assert run() == first
    assert entries() == written
    # Turned off: nothing is written, and the translation is the same.
    home = tmp_path / "home"
    assert run(ATTENTION_JAX_COMPILATION_CACHE="off", HOME=str(home), XDG_CACHE_HOME="") == first
    assert not home.exists()


@pytest.mark.slow
def test_translate_text_decodes_with_the_int8_model_when_asked(straight):
    _, workdir, _ = straight
    sentences = ["Ein Mann fährt Fahrrad.", "Zwei Hunde."]
    out = translate.translate_text(str(workdir), sentences, quantize="int8")
    config, model, params, dp = params_for_inference(translate.TASK, str(workdir))
    qmodel, qparams = quantized(model, params)
    assert qmodel.config.quantize == "int8"
    tokenizer = translate.load_tokenizer(config, str(workdir))
    pairs = [(ids, []) for ids in translate.encode_source(tokenizer, sentences)]
    assert out == translate.translate_pairs(qmodel, qparams, dp, config, tokenizer, pairs)
    with pytest.raises(ValueError, match="quantize"):
        translate.translate_text(str(workdir), sentences, quantize="int4")


@pytest.mark.slow
def test_decoding_flags_reach_the_search_from_a_work_directory(straight, monkeypatch, capsys):
    """Issue 48: `--workdir W --translate ... --beam_size 1 --length_penalty 2.0` searched
    with the run's own beam and penalty. Each decoding flag now reaches the search; without
    them the run's saved settings apply."""
    from train.translate.cli import main

    config, workdir, _ = straight
    calls = record_searches(monkeypatch)

    def searched(*flags) -> dict:
        calls.clear()
        assert main(["--workdir", str(workdir), "--translate", "Ein Mann.", *flags]) == 0
        (call,) = calls  # one sentence, one batch
        return call

    call = searched()  # the run's own: beam 2 (tiny_config), penalty 0.6, margin 8 (tiny)
    assert (call["search"], call["beam_size"], call["length_penalty"]) == (
        "beam",
        config.beam_size,
        config.length_penalty,
    )
    assert call["max_len"] == call["src_len"] + config.decode_margin
    assert call["rows"] == config.eval_batch_size
    call = searched("--beam_size", "1", "--length_penalty", "2.0")
    assert (call["search"], call["beam_size"], call["length_penalty"]) == ("beam", 1, 2.0)
    call = searched("--greedy")
    assert (call["search"], call["max_len"]) == ("greedy", call["src_len"] + config.decode_margin)
    call = searched("--max_output_len", "5")
    assert (call["beam_size"], call["max_len"]) == (config.beam_size, 5)
    call = searched("--decode_margin", "3", "--eval_batch_size", "8")
    assert (call["max_len"], call["rows"]) == (call["src_len"] + 3, 8)
    assert config.decode_margin != 3 and config.eval_batch_size != 8
    capsys.readouterr()


@pytest.mark.slow
def test_greedy_from_a_work_directory_is_the_search_of_one_beam(straight, capsys):
    """--greedy --max_output_len N on a trained run: the library's greedy decoding of each
    sentence alone with N output positions, and the same lines as --beam_size 1."""
    from train.translate.cli import main

    _, workdir, _ = straight
    sentences = ["Ein Mann fährt Fahrrad.", "Zwei Hunde spielen im Schnee."]
    argv = ["--workdir", str(workdir), "--translate", *sentences, "--max_output_len", "4"]
    assert main([*argv, "--greedy"]) == 0
    greedy = capsys.readouterr().out.splitlines()
    assert main([*argv, "--beam_size", "1"]) == 0
    assert capsys.readouterr().out.splitlines() == greedy
    config, model, params, _ = params_for_inference(translate.TASK, str(workdir))
    tokenizer = translate.load_tokenizer(config, str(workdir))
    alone = [
        tokenizer.decode(
            np.asarray(decode.greedy_decode(model, params, np.array([ids]), max_len=4))[0]
        )
        for ids in translate.encode_source(tokenizer, sentences)
    ]
    assert greedy == alone
    # The run's own search (beam 2, outputs up to the bucket + 8) says something else.
    assert translate.translate_text(str(workdir), sentences) != greedy


def test_quantize_goes_with_decoding_only(capsys):
    from train.translate.cli import check_modes, make_parser

    parser = make_parser()
    with pytest.raises(SystemExit):
        check_modes(parser, parser.parse_args(["--preset", "tiny", "--quantize", "int8"]))
    assert "--quantize goes with --translate" in capsys.readouterr().err


def test_translate_text_without_a_run_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a train.translate work directory"):
        translate.translate_text(str(tmp_path), ["Hallo."])


def test_flags_reach_run_and_model_fields():
    config, _, _ = translate.config_from_args(
        [
            "--preset",
            "tiny",
            "--model.d_model",
            "48",
            "--set",
            "seed=3",
            "--dtype",
            "bfloat16",
            "--set",
            "model.n_heads=3",
            "--steps",
            "7",
            "--buckets",
            "16,32",
        ]
    )
    assert config.model_config.d_model == 48 and config.model_config.n_heads == 3
    assert config.seed == 3 and config.steps == 7 and config.buckets == (16, 32)
    assert config.model_config.dtype.name == "bfloat16"


def test_without_preset_a_gpu_gets_the_gpu_recipe_and_a_cpu_the_cpu_one(monkeypatch):
    from train import lm

    assert translate.config_from_args([])[0].preset == "cpu"  # the tests run on a CPU
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert translate.config_from_args([])[0].preset == "gpu"
    assert lm.config_from_args(["--dataset", "ptb_char"])[0].preset == "gpu"
    # An explicit --preset wins.
    assert translate.config_from_args(["--preset", "cpu"])[0].preset == "cpu"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--no_such_flag", "1"], "unrecognized arguments: --no_such_flag"),
        (["--model.no_such_field", "1"], "unrecognized arguments: --model.no_such_field"),
        (["--set", "no_such_field=1"], "no run or model config field"),
        (["--model", "nonexistent"], "invalid choice: 'nonexistent'"),
        (["--preset", "tiny", "--model.d_model", "30", "--model.n_heads", "4"], "divisible"),
    ],
)
def test_bad_flags_are_argparse_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        translate.config_from_args(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_baselines_are_built_by_name():
    for name in ("gru", "bahdanau", "luong", "luong_local", "convs2s"):
        config = translate.make_config(name, "tiny")
        assert config.optimizer == "adam" and config.model_config.src_vocab_size == 1000
        assert translate.build_model(config).config == config.model_config


def _cli(*args):
    return [sys.executable, "-m", "train.translate", *args]


@pytest.mark.slow
def test_cli_sigterm_saves_then_workdir_alone_resumes_then_translates(
    tmp_path, data_dir, tokenizer_dir
):
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=subprocess_xla_flags(), PYTHONPATH=REPO)
    workdir = str(tmp_path / "run")
    common = [
        "--data_dir",
        str(data_dir),
        "--tokenizer_dir",
        str(tokenizer_dir),
        "--progress",
        "false",
        "--plots",
        "false",
        "--eval_sentences",
        "8",
        "--eval_batch_size",
        "8",
        "--beam_size",
        "2",
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
    with Running(
        _cli("--preset", "tiny", "--workdir", workdir, "--steps", "1000", *common), env
    ) as proc:
        proc.wait_for("SIGTERM saves a checkpoint")
        proc.send_signal(signal.SIGTERM)
        # A stop by signal is not a completion: the documented EXIT_INTERRUPTED, after the
        # save.
        assert proc.finish() == 75, proc.output
    out = proc.output
    assert "SIGTERM: checkpoint saved" in out
    saved = Checkpoints(workdir).latest_step()
    assert saved is not None and saved < 1000

    # --workdir alone resumes with the saved config; --steps may change.
    done = subprocess.run(
        _cli("--workdir", workdir, "--steps", str(saved + 2)),
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"resumed from {Checkpoints(workdir).path(saved)}" in done.stdout
    assert "test BLEU" in done.stdout
    assert [s for s, _ in train_losses(workdir)][-1] == saved + 2

    said = subprocess.run(
        _cli("--workdir", workdir, "--translate", "Ein Mann fährt Fahrrad."),
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert said.returncode == 0, said.stdout + said.stderr
    assert said.stdout.splitlines() == translate.translate_text(
        workdir, ["Ein Mann fährt Fahrrad."]
    )
    assert jax.device_count() == 8  # the subprocesses had their own single device


def test_translate_pairs_returns_outputs_in_input_order(monkeypatch):
    """Decoding runs in order of source length, over several batches and buckets; each output
    still lands at its input's position. The "model" here returns its source unchanged."""
    monkeypatch.setattr(decode, "greedy_decode", lambda model, params, src, *, max_len: src)

    class Ids:
        def decode(self, ids):
            return " ".join(str(i) for i in ids if i != PAD_ID)

    config = translate.make_config("transformer", "tiny", eval_batch_size=8, buckets=(4, 8, 16))
    lengths = [9, 2, 5, 1, 12, 3, 7, 7, 4, 15, 2, 6, 11, 1, 8, 3, 10, 5, 13, 2]
    pairs = [([10 + k] * n, [5] * (20 - n)) for k, n in enumerate(lengths)]
    out = translate.translate_pairs(
        None, None, DataParallel("jit"), config, Ids(), pairs, greedy=True
    )
    assert out == [" ".join([str(10 + k)] * n) for k, n in enumerate(lengths)]


def test_gpu_preset_builds_for_every_model_with_its_own_optimizer():
    import jax.numpy as jnp

    from train.translate import registry

    config = translate.make_config("transformer", "gpu")
    cfg = config.model_config
    # The measured ten-minute recipe: IWSLT widths, dropout 0.3, pre-LN, bf16, Noam.
    assert (cfg.d_model, cfg.d_ff, cfg.n_heads, cfg.n_encoder_layers) == (512, 1024, 4, 6)
    assert cfg.dtype == jnp.bfloat16 and cfg.norm_first and cfg.dropout == 0.3
    assert config.optimizer == "noam" and config.buckets == (16, 32, 64)
    assert 0 < config.minutes < 10
    for name in registry.names()[1:]:
        # The baselines keep their Adam: the preset sets no optimizer of its own.
        assert translate.make_config(name, "gpu").optimizer == "adam"


@pytest.mark.slow
def test_the_annotated_transformer_figures_are_written(straight):
    _, workdir, _ = straight
    for name in ("masks.png", "lr_schedule.png", "label_smoothing.png"):
        assert os.path.getsize(os.path.join(workdir, "plots", name)) > 1000


RNN_MODEL = dict(emb_dim=16, enc_hidden=16, dec_hidden=16, attn_dim=16)


def _rnn_losses(tmp_path, data_dir, name, **fields):
    config = translate.make_config(
        name,
        "tiny",
        model_overrides=RNN_MODEL,
        steps=6,
        log_every=1,
        eval_sentences=8,
        learning_rate=1e-2,
        eval_batch_size=8,
        beam_size=1,
        progress=False,
        plots=False,
        data_dir=str(data_dir),
        **fields,
    )
    final = translate.train_and_evaluate(config, str(tmp_path / name / str(len(fields))))
    return [loss for _, loss in train_losses(tmp_path / name / str(len(fields)))], final


@pytest.mark.slow
def test_teacher_forcing_below_one_changes_the_loss_path_and_still_trains(tmp_path, data_dir):
    forced, _ = _rnn_losses(tmp_path, data_dir, "gru")
    mixed, _ = _rnn_losses(tmp_path, data_dir, "gru", teacher_forcing=0.5)
    assert len(forced) == len(mixed) == 6
    assert forced != mixed  # the decoder was fed its own guesses at times
    assert mixed[-1] < mixed[0] - 0.1
    config = translate.make_config(
        "gru",
        "tiny",
        teacher_forcing=0.5,
        teacher_forcing_schedule="inverse_sigmoid",
        teacher_forcing_k=10.0,
    )
    ratios = [config.teacher_forcing_at(s) for s in (0, 20, 40)]
    assert 0.5 > ratios[0] > ratios[1] > ratios[2] > 0
    with pytest.raises(ValueError, match="teacher_forcing"):
        translate.make_config("transformer", "tiny", teacher_forcing=0.5)


@pytest.mark.slow
def test_hard_attention_trains_through_the_translation_loss(tmp_path, data_dir):
    losses, final = _rnn_losses(tmp_path, data_dir, "hard_attention")
    assert losses[-1] < losses[0] - 0.1 and final["step"] == 6
    assert math.isfinite(final["test_bleu"])


@pytest.mark.parametrize("split", ["val", "test"])
def test_the_reported_perplexity_is_the_teacher_forced_nll_of_the_saved_model(straight, split):
    """The validation and test nll and perplexity the run reported, recomputed by
    `teacher_forced_nll` from the saved parameters, to 1e-5: a count one token off moves the
    nll by ~3e-3 and the perplexity by ~1.5e-2 on these 16 sentences."""
    config, workdir, final = straight
    _, model, state, _ = restore_for_inference(translate.TASK, str(workdir), step=final["step"])
    params = jax.device_get(translate.eval_params(state))
    tokenizer = translate.load_tokenizer(config, str(workdir))
    name = "validation" if split == "val" else config.test_split
    pairs = translate.load_split(config, tokenizer, name).pairs
    assert len(pairs) == config.eval_sentences
    nll, _ = teacher_forced_nll(params, pairs, config.model_config)
    assert math.isclose(nll, final[f"{split}_nll"], rel_tol=1e-5), (nll, final[f"{split}_nll"])
    assert math.isclose(math.exp(nll), final[f"{split}_ppl"], rel_tol=1e-5)


def test_lr_factor_test_split_and_length_penalty_reach_training_and_evaluation(
    straight, tmp_path, monkeypatch
):
    config, workdir, _ = straight
    flags = ["--lr_factor", "1.0", "--test_split", "test_2017_flickr", "--length_penalty", "1.5"]
    parsed, _, _ = translate.config_from_args(["--preset", "tiny", *flags])
    assert (parsed.lr_factor, parsed.test_split, parsed.length_penalty) == (
        1.0,
        "test_2017_flickr",
        1.5,
    )
    assert config.lr_factor != 1.0 and config.test_split == "test_2016_flickr"
    penalties = []

    def beam_search(*args, **kwargs):  # the real search, noting the penalty it was given
        penalties.append(kwargs["length_penalty"])
        return real_beam_search(*args, **kwargs)

    real_beam_search = decode.beam_search
    monkeypatch.setattr(decode, "beam_search", beam_search)
    final = translate.train_and_evaluate(
        translate.replace(
            config,
            lr_factor=parsed.lr_factor,
            test_split=parsed.test_split,
            length_penalty=parsed.length_penalty,
            plots=False,
        ),
        str(tmp_path),
    )
    # The rate of every step scales with lr_factor (Noam: lr_factor * D^-0.5 * ...).
    rates = {r["step"]: r["lr"] for r in read_metrics(str(tmp_path)) if r["split"] == "train"}
    straight_rates = {
        r["step"]: r["lr"] for r in read_metrics(str(workdir)) if r["split"] == "train"
    }
    assert rates.keys() == straight_rates.keys() == set(range(1, 7))
    for step, rate in rates.items():
        assert math.isclose(rate, straight_rates[step] / config.lr_factor, rel_tol=1e-6)
    # The test figures and translations are of the split given, its first sentences.
    splits = {r["split"] for r in read_metrics(str(tmp_path))}
    assert "test_2017_flickr" in splits and "test_2016_flickr" not in splits
    assert final["hypotheses"].endswith(os.path.join("translations", "test_2017_flickr.step6.en"))
    with open(
        os.path.join(tmp_path, "translations", "test_2017_flickr.reference.en"), encoding="utf-8"
    ) as f:
        references = f.read().splitlines()
    expected = load_multi30k("test_2017_flickr", data_dir=config.data_dir)
    assert references == [en for _, en in expected[: config.eval_sentences]]
    # And the beam search of the test set ran with the penalty given.
    assert penalties and set(penalties) == {1.5}
