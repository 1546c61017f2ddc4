"""The command line of `python -m train.translate` (flags from the config dataclasses)."""
from __future__ import annotations

import argparse
import sys
from typing import Sequence

from train.core import cli
from train.core.task import default_workdir, train_and_evaluate
from train.translate.config import TranslateConfig
from train.translate.infer import translate_text
from train.translate.task import TASK

DESCRIPTION = """Train and evaluate a translation model on Multi30k German -> English.

    python -m train.translate                          # Transformer: preset cpu, or gpu on a GPU
    python -m train.translate --preset base --workdir runs/base --dtype bfloat16
    python -m train.translate --model bahdanau --preset cpu
    python -m train.translate --workdir W              # resume W with its saved config
    python -m train.translate --workdir W --translate "Ein Mann fährt Fahrrad."

Evaluation: teacher-forced loss and perplexity on validation and test, then sacreBLEU (cased,
13a tokenization, on detokenized text) of beam-search output on the test split, written to
W/translations/.
"""


def config_from_args(argv: Sequence[str] | None
                     ) -> tuple[TranslateConfig | None, str, argparse.Namespace]:
    """-> (config, or None for --translate; workdir; the parsed args)."""
    parser, saved = cli.task_parser(TASK, argv, description=DESCRIPTION)
    parser.add_argument("--translate", nargs="+", metavar="SENTENCE",
                        help="translate with the checkpoint in --workdir and exit")
    args = parser.parse_args(argv)
    if args.translate:
        if not args.workdir:
            parser.error("--translate needs --workdir (a trained run)")
        return None, args.workdir, args
    config = cli.resolve_config(parser, args, saved=saved, task=TASK)
    return config, args.workdir or default_workdir(TASK, config), args


def main(argv: Sequence[str] | None = None) -> int:
    """-> the exit code (train.core.cli: 0 done, 1 error, 2 bad flags, 3 diverged, 75
    stopped by a signal after saving)."""
    config, workdir, args = config_from_args(sys.argv[1:] if argv is None else argv)
    return cli.run_command(lambda: _run(config, workdir, args), workdir=workdir)


def _run(config: TranslateConfig | None, workdir: str, args: argparse.Namespace) -> int:
    if config is None:
        for line in translate_text(workdir, args.translate):
            print(line)
        return cli.EXIT_OK
    print(f"workdir: {workdir}", flush=True)
    final = train_and_evaluate(TASK, config, workdir)
    if "test_bleu" in final:
        print(f"final: step {final['step']}, test BLEU {final['test_bleu']:.2f}, "
              f"test ppl {final['test_ppl']:.2f}", flush=True)
    return cli.finished(final, "ppl")
