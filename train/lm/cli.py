"""The command line of `python -m train.lm` (flags from the config dataclasses)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import jax

from train.core import cli
from train.core.run import train_and_evaluate
from train.lm.config import LMConfig
from train.lm.generate import generate_text
from train.lm.task import TASK

DESCRIPTION = """Train and evaluate Transformer-XL on Penn Treebank (word, char) or on your text.

    python -m train.lm                                   # word-level PTB: cpu, or gpu on a GPU
    python -m train.lm --dataset ptb_char --preset base --workdir runs/ptb_char
    python -m train.lm --train_text T --valid_text V --test_text E --level word   # your text
    python -m train.lm --train_text enwik8 --level byte --split_bytes 90000000,5000000,5000000
    python -m train.lm --dataset tfds:lm1b --data_dir D --level word --min_count 3   # TFDS
    python -m train.lm --workdir W                       # resume W with its saved config
    python -m train.lm --workdir W --generate "the company said" --top_k 40 --temperature 0.8

Word level reports perplexity, character level bits per character.

Modes and the flags each takes (any other flag given is an error; every mode takes
--distributed, --coordinator_address, --num_processes, --process_id):
  training, resume     every run and model flag (--steps, --model.d_model, --set, ...)
  --generate PROMPT    with --workdir W: --num_tokens, --temperature, --top_k, --top_p, --seed
"""
TRAINING, GENERATE = "training", "--generate"
SAMPLING = ("num_tokens", "temperature", "top_k", "top_p")


def make_parser() -> argparse.ArgumentParser:
    """Every flag of `python -m train.lm` (building it reads no file and starts nothing)."""
    parser = cli.task_parser(
        TASK,
        description=DESCRIPTION,
        helps={"seed": "the run's; with --generate, the sampling's (default: 0)"},
    )
    sample = parser.add_argument_group("generation (with --workdir of a trained run)")
    sample.add_argument(
        "--generate",
        metavar="PROMPT",
        help="print a continuation of PROMPT sampled from the checkpoint",
    )
    # Defaults of None: a flag given is told from one absent (cli.given_flags), so one given
    # without --generate is an error rather than ignored; generate_text has the real defaults.
    sample.add_argument("--num_tokens", type=int, default=None, help="default: 100")
    sample.add_argument(
        "--temperature", type=float, default=None, help="divides the logits (default: 1)"
    )
    sample.add_argument("--top_k", type=int, default=None, help="sample from the k likeliest")
    sample.add_argument(
        "--top_p", type=float, default=None, help="nucleus sampling: the likeliest of mass p"
    )
    return parser


def modes() -> dict[str, frozenset[str]]:
    """Each mode's name -> the flags (argparse dests) it takes, besides cli.PER_PROCESS."""
    return {
        TRAINING: cli.training_flags(TASK),
        GENERATE: frozenset({"generate", "workdir", "seed", *SAMPLING}),
    }


def check_modes(parser: argparse.ArgumentParser, args: argparse.Namespace) -> str:
    """The mode the flags ask for -> its name (a key of `modes()`); a usage error (exit 2)
    for --generate without --workdir, or for a flag the mode does not take."""
    mode = GENERATE if args.generate is not None else TRAINING
    if mode == GENERATE and not args.workdir:
        parser.error("--generate needs --workdir (a trained run)")
    cli.refuse_unused(parser, args, mode, modes())
    return mode


def sampling_options(args: argparse.Namespace) -> dict:
    """The sampling flags given (and --seed) -> `generate_text` keywords; the others keep
    generate_text's defaults."""
    names = (*SAMPLING, "seed")
    return {name: getattr(args, name) for name in names if getattr(args, name, None) is not None}


def config_from_args(argv: Sequence[str] | None) -> tuple[LMConfig, str, argparse.Namespace]:
    """-> (config, workdir, args) of a training command line, as `main` makes them."""
    return cli.config_from_args(TASK, make_parser(), argv)


def main(argv: Sequence[str] | None = None) -> int:
    """-> the exit code (see train.core.cli.main_of)."""
    parser = make_parser()
    return cli.main_of(
        parser, lambda args: _run(parser, args), argv, is_inference=lambda a: a.generate is not None
    )


def _run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    mode = check_modes(parser, args)
    saved = cli.start(args)
    if mode == GENERATE:
        text = generate_text(args.workdir, args.generate, **sampling_options(args))
        if jax.process_index() == 0:  # the same sample on every process (same seed): once
            print(text)
        return cli.EXIT_OK
    config, workdir = cli.resolve(TASK, parser, args, saved)
    print(f"workdir: {workdir}", flush=True)
    final = train_and_evaluate(TASK, config, workdir)
    figure = "bpc" if "test_bpc" in final else "ppl"
    if f"test_{figure}" in final:
        print(
            f"final: step {final['step']}, test {figure} {final['test_' + figure]:.3f}", flush=True
        )
    return cli.finished(final, figure)
