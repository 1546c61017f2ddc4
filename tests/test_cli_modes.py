"""Every mode of `python -m train.translate` and `python -m train.lm` takes its own flags and
refuses every other one with a usage error naming it (issue 48: decoding flags given to
--translate on a work directory were silently ignored). The walk checks each flag of the
parser against the mode tables (`modes()` of each CLI) through `check_modes`, which runs
before anything is read or compiled; two commands show the same error end to end.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys

import pytest
from helpers import REPO, TIMEOUT

import train.lm.cli as lm_cli
import train.translate.cli as translate_cli
from train.core import cli

# A value each flag parses to that its mode accepts; the other run fields take their config
# default, the model fields any text, and flags without a type a word.
SAMPLES = {
    "workdir": "W",
    "pretrained": "P",
    "translate": "Hallo.",
    "translate_file": "de.txt",
    "output": "en.txt",
    "export_marian": "hf",
    "export_ct2": "ct2",
    "quantize": "int8",
    "ct2_quantization": "int8",
    "max_output_len": "20",
    "model": "transformer",
    "dataset": "ptb",
    "preset": "tiny",
    "dtype": "float32",
    "set": "seed=1",
    "generate": "the company said",
    "num_tokens": "5",
    "temperature": "0.5",
    "top_k": "3",
    "top_p": "0.9",
    "coordinator_address": "127.0.0.1:1234",
    "num_processes": "1",
    "process_id": "0",
}


def flag_argv(action: argparse.Action, config_cls) -> list[str]:
    """The flag of `action` with a value it parses."""
    flag = action.option_strings[0]
    if action.nargs == 0:  # store_true
        return [flag]
    defaults = {f.name: f.default for f in dataclasses.fields(config_cls)}
    if action.dest in SAMPLES:
        return [flag, SAMPLES[action.dest]]
    if action.dest in defaults:
        return [flag, str(defaults[action.dest])]
    return [flag, "1"]


def actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    # argparse lists a parser's flags only in its private _actions.
    return [a for a in parser._actions if a.option_strings and a.dest != "help"]


# (CLI, mode, a command line that chooses it)
MODES = [
    (translate_cli, "training", []),
    (translate_cli, "training", ["--workdir", "W"]),  # a resume
    (translate_cli, translate_cli.TRANSLATE, ["--workdir", "W", "--translate", "Hallo."]),
    (translate_cli, translate_cli.TRANSLATE, ["--pretrained", "P", "--translate_file", "f"]),
    (translate_cli, translate_cli.EVAL, ["--pretrained", "P", "--eval"]),
    (translate_cli, translate_cli.EXPORT, ["--workdir", "W", "--export_ct2", "ct2"]),
    (translate_cli, translate_cli.EXPORT, ["--pretrained", "P", "--export_marian", "hf"]),
    (lm_cli, "training", []),
    (lm_cli, "training", ["--workdir", "W"]),
    (lm_cli, lm_cli.GENERATE, ["--workdir", "W", "--generate", "the"]),
]
ONE_MODEL = {"workdir", "pretrained"}
MODE_CHOOSERS = {"translate", "translate_file", "eval", "export_marian", "export_ct2", "generate"}


@pytest.mark.parametrize("module, mode, base", MODES)
def test_each_mode_takes_its_flags_and_refuses_every_other_one(module, mode, base, capsys):
    parser = module.make_parser()
    config_cls = module.TASK.config_cls
    takes = module.modes()[mode] | cli.PER_PROCESS
    chosen = {a.lstrip("-") for a in base if a.startswith("--")}
    checked = 0
    for action in actions(parser):
        dest = action.dest
        if dest in chosen:
            continue
        if mode == "training" and dest in MODE_CHOOSERS:
            continue  # it chooses another mode, walked in its own row
        argv = [*base, *flag_argv(action, config_cls)]
        # A decoding or export mode takes one model: --workdir or --pretrained, not both.
        second_model = mode != "training" and dest in ONE_MODEL and bool(ONE_MODEL & chosen)
        needs = dest == "ct2_quantization" and "export_ct2" not in chosen  # not --export_marian's
        if dest in takes and not second_model and not needs:
            assert module.check_modes(parser, parser.parse_args(argv)) == mode, argv
        else:
            with pytest.raises(SystemExit) as e:
                module.check_modes(parser, parser.parse_args(argv))
            err = capsys.readouterr().err
            assert e.value.code == cli.EXIT_USAGE, argv
            # The message's line (the one before the pointer to --help) names the flag.
            assert f"--{dest}" in err.splitlines()[-2], (argv, err)
        checked += 1
    assert checked > 40  # every run field and model field went through


def test_the_decoding_modes_take_the_decoding_flags():
    """The table itself: what the README's table of modes says."""
    decoding = {"beam_size", "length_penalty", "greedy", "decode_margin", "max_output_len"}
    modes = translate_cli.modes()
    assert decoding <= modes[translate_cli.TRANSLATE] & modes[translate_cli.EVAL]
    assert not {"greedy", "max_output_len", "quantize", "output"} & modes["training"]
    assert not decoding & modes[translate_cli.EXPORT]
    assert {"steps", "set", "model.d_model", "dtype"} <= modes["training"]
    assert lm_cli.modes()[lm_cli.GENERATE] == {
        "generate",
        "workdir",
        "seed",
        "num_tokens",
        "temperature",
        "top_k",
        "top_p",
    }


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--greedy", "--beam_size", "2"], "beam_size, greedy"),
        (["--greedy", "--length_penalty", "1.0"], "length_penalty, greedy"),
        (["--decode_margin", "3", "--max_output_len", "9"], "decode_margin, max_output_len"),
        (["--max_output_len", "0"], "max_output_len: expected an integer >= 1"),
        (
            ["--pretrained", "P"],
            "--translate needs --workdir (a trained run) or --pretrained, not both",
        ),
        (["--eval"], "--translate/--translate_file and --eval: one mode at a time"),
    ],
)
def test_decoding_flags_that_contradict_each_other_are_usage_errors(argv, message, capsys):
    parser = translate_cli.make_parser()
    args = parser.parse_args(["--workdir", "W", "--translate", "Hallo.", *argv])
    with pytest.raises(SystemExit) as e:
        translate_cli.check_modes(parser, args)
    assert e.value.code == cli.EXIT_USAGE
    assert message in capsys.readouterr().err


def test_a_flag_the_mode_does_not_take_stops_the_command_with_exit_2(tmp_path):
    """The command itself: exit 2 and one line naming the flag, before anything is read or
    written (the work directory is not even made)."""
    workdir = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-m", "train.translate", "--workdir", str(workdir)]
        + ["--translate", "Ein Mann.", "--steps", "100"],
        cwd=REPO,
        env=dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO),
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert done.returncode == cli.EXIT_USAGE, done.stderr
    assert "error: --steps goes with training, not with --translate" in done.stderr
    assert not workdir.exists()


def test_a_sampling_flag_without_generate_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        lm_cli.main(["--preset", "tiny", "--top_k", "40"])
    assert e.value.code == cli.EXIT_USAGE
    assert "--top_k goes with --generate, not with training" in capsys.readouterr().err


def test_generate_passes_every_sampling_flag_to_the_sampler(tmp_path, monkeypatch, capsys):
    """Each of --num_tokens, --temperature, --top_k, --top_p and --seed reaches generate_text;
    none given, its own defaults apply (the sampler is a stand-in: what it is given is the
    point)."""
    calls = []

    def generate_text(workdir, prompt, **kwargs):
        calls.append((workdir, prompt, kwargs))
        return "sampled"

    monkeypatch.setattr(lm_cli, "generate_text", generate_text)
    flags = ["--num_tokens", "7", "--temperature", "0.5", "--top_k", "3", "--top_p", "0.9"]
    argv = ["--workdir", str(tmp_path), "--generate", "the", *flags, "--seed", "4"]
    assert lm_cli.main(argv) == 0
    assert lm_cli.main(["--workdir", str(tmp_path), "--generate", "the"]) == 0
    assert capsys.readouterr().out == "sampled\nsampled\n"
    options = dict(num_tokens=7, temperature=0.5, top_k=3, top_p=0.9, seed=4)
    assert calls == [(str(tmp_path), "the", options), (str(tmp_path), "the", {})]


# ----------------------------------------------------------------- the error contract, --help
def _usage_error(parser, argv, capsys) -> list[str]:
    with pytest.raises(SystemExit) as e:
        parser.parse_args(argv)
    assert e.value.code == cli.EXIT_USAGE
    return capsys.readouterr().err.strip().splitlines()


def test_a_bad_flag_is_two_lines_with_the_nearest_flag_and_no_usage(capsys):
    parser = translate_cli.make_parser()
    lines = _usage_error(parser, ["--minuts", "1"], capsys)
    assert lines == [
        "python -m train.translate: error: unrecognized arguments: --minuts 1",
        "--minuts: did you mean --minutes?",
        "(python -m train.translate --help lists every flag)",
    ]
    lines = _usage_error(parser, ["--steps", "x"], capsys)
    assert len(lines) == 2 and "--steps" in lines[0] and "usage:" not in " ".join(lines)
    # Nothing near enough: no guess.
    assert len(_usage_error(parser, ["--zzzz"], capsys)) == 2


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--steps", "-1"], "--steps: must be an integer >= 0, got -1"),
        # The cpu preset's cosine decays over the steps: the message names --steps, not the
        # schedule's decay_steps that the user never typed.
        (["--steps", "0"], "--steps: the cosine schedule decays over the run's steps"),
        (["--model.n_heads", "0"], "n_heads"),
    ],
)
def test_a_bad_value_names_the_flag_typed(argv, says, capsys):
    with pytest.raises(SystemExit) as e:
        translate_cli.config_from_args(argv)
    assert e.value.code == cli.EXIT_USAGE
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2 and says in lines[0], lines


def test_boolean_flags_stand_alone_or_take_a_value():
    parser = translate_cli.make_parser()
    assert parser.parse_args(["--progress"]).progress is True
    assert parser.parse_args(["--no-progress"]).progress is False
    assert parser.parse_args(["--progress", "false"]).progress is False
    assert parser.parse_args(["--progress", "yes", "--steps", "3"]).steps == 3
    assert parser.parse_args(["--model.norm_first"]).__dict__["model.norm_first"] is True
    with pytest.raises(SystemExit):
        parser.parse_args(["--progress", "maybe"])


def test_help_gives_each_flag_its_meaning_default_and_preset_values():
    text = " ".join(translate_cli.make_parser().format_help().split())
    assert (
        "--steps STEPS stop after this many optimizer steps (a resumed run may change it, not "
        "below its checkpoint's step); "
        "cpu preset 2500, gpu preset 100000 (int; default 100000)" in text
    )
    assert "--progress [BOOL], --no-progress [BOOL] a progress bar on a terminal" in text
    # Model flags grouped by the models that have them, with the first one's meaning.
    assert "model fields of every --model: --model.src_vocab_size" in text
    assert "model fields of convs2s: --model.hid_dim HID_DIM convolution width (D)" in text
    # A choice lists its values.
    lm = " ".join(lm_cli.make_parser().format_help().split())
    assert "(one of attention, full, none; default attention)" in lm
    assert "A.en \\ --valid_src" in text  # an example's line break is shown, not swallowed


def test_bench_help_shows_examples_and_sections():
    from train.bench.options import build_parser

    text = build_parser().format_help()
    assert "python -m train.bench --target h200" in text
    assert "train_xl_wt103      Transformer-XL wt103_base's step" in text
    assert "--quick [BOOL], --no-quick [BOOL]" in text


def test_an_inference_error_leaves_the_training_run_s_error_log_alone(tmp_path, capsys):
    workdir = tmp_path / "W"
    workdir.mkdir()
    (workdir / cli.ERROR_LOG).write_text("the training run's traceback\n")

    def fails(args):
        raise ValueError("the checkpoint cannot be decoded")

    parser = translate_cli.make_parser()
    argv = ["--workdir", str(workdir), "--translate", "Hallo."]
    code = cli.main_of(parser, fails, argv, is_inference=translate_cli._inference)
    assert code == cli.EXIT_ERROR
    assert (workdir / cli.ERROR_LOG).read_text() == "the training run's traceback\n"
    assert "cannot be decoded" in (workdir / cli.INFERENCE_ERROR_LOG).read_text()
    assert "inference_error.log" in capsys.readouterr().err
    # Training's own errors still go to W/error.log.
    assert cli.main_of(parser, fails, ["--workdir", str(workdir)]) == cli.EXIT_ERROR
    assert "cannot be decoded" in (workdir / cli.ERROR_LOG).read_text()


def test_unknown_prompt_words_are_named():
    from train.lm.generate import unknown_in_prompt
    from train.lm.text import TextVocab

    vocab = TextVocab(["<eos>", "<unk>", "the", "cat"], "word")
    assert unknown_in_prompt(vocab, "the dog saw the dog cat", level="word") == ["dog", "saw"]
    assert unknown_in_prompt(vocab, "the cat", level="word") == []


def test_every_flag_says_what_it_does():
    """Every flag of the three commands has a line of help before its type and default: a
    config field without its docstring entry fails here."""
    from train.bench.options import build_parser

    for parser in (translate_cli.make_parser(), lm_cli.make_parser(), build_parser()):
        bare = [a.dest for a in actions(parser) if not a.help or a.help.startswith("(")]
        assert bare == [], (parser.prog, bare)


def test_an_error_class_carries_its_exit_code_label_and_logging(tmp_path, capsys):
    from train.core import errors

    class Unlogged(errors.RunError):
        exit_code, label, logged = 42, "made up", False

    def raises(error):
        def body():
            raise error

        return body

    workdir = tmp_path / "W"
    workdir.mkdir()
    # A new class needs no new except: its own code and label, and no traceback logged.
    assert cli.run_command(raises(Unlogged("what happened")), workdir=str(workdir)) == 42
    assert capsys.readouterr().err.strip() == "made up: what happened"
    assert not (workdir / cli.ERROR_LOG).exists()
    diverged = errors.TrainingDiverged("loss is nan at step 7")
    assert cli.run_command(raises(diverged), workdir=str(workdir)) == cli.EXIT_DIVERGED
    assert capsys.readouterr().err.startswith("training diverged: loss is nan at step 7")
    assert "loss is nan" in (workdir / cli.ERROR_LOG).read_text()
    # A library's own error: exit 1, logged.
    assert cli.run_command(raises(OSError("disk full")), workdir=str(workdir)) == cli.EXIT_ERROR
    assert capsys.readouterr().err.startswith("error: disk full")
