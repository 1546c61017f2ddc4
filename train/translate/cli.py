"""The command line of `python -m train.translate` (flags from the config dataclasses)."""
from __future__ import annotations

import argparse
from typing import Sequence

import jax

from train.core import cli
from train.core.task import default_workdir, train_and_evaluate
from train.translate.config import TranslateConfig
from train.translate.evaluate import write_lines
from train.translate.infer import translate_text
from train.translate.pretrained import Pretrained, evaluate_pretrained
from train.translate.task import TASK

DESCRIPTION = """Train and evaluate a translation model on Multi30k German -> English.

    python -m train.translate                          # Transformer: preset cpu, or gpu on a GPU
    python -m train.translate --preset base --workdir runs/base --dtype bfloat16
    python -m train.translate --model bahdanau --preset cpu
    python -m train.translate --workdir W              # resume W with its saved config
    python -m train.translate --workdir W --translate "Ein Mann fährt Fahrrad."
    python -m train.translate --pretrained opus-mt-de-en --translate "Ein Mann fährt Fahrrad."
    python -m train.translate --pretrained opus-mt-de-en --eval     # BLEU on Multi30k test

Evaluation: teacher-forced loss and perplexity on validation and test, then sacreBLEU (cased,
13a tokenization, on detokenized text) of beam-search output on the test split, written to
W/translations/.
"""


def config_from_args(argv: Sequence[str] | None
                     ) -> tuple[TranslateConfig | None, str, argparse.Namespace]:
    """-> (config, or None for --translate; workdir; the parsed args)."""
    parser, saved = cli.task_parser(TASK, argv, description=DESCRIPTION)
    parser.add_argument("--translate", nargs="+", metavar="SENTENCE",
                        help="translate with the checkpoint in --workdir (or --pretrained) "
                             "and exit")
    parser.add_argument("--translate_file", metavar="PATH",
                        help="translate PATH's lines (one sentence a line) and exit")
    parser.add_argument("--output", metavar="PATH",
                        help="write the translations here (default: standard output)")
    parser.add_argument("--pretrained", metavar="DIR",
                        help="an OPUS-MT / Marian folder (config.json, model.safetensors, "
                             "source.spm, target.spm, vocab.json) to translate or --eval with")
    parser.add_argument("--eval", action="store_true",
                        help="with --pretrained: sacreBLEU on the --test_split of Multi30k")
    args = parser.parse_args(argv)
    if args.pretrained:
        if not (args.translate or args.translate_file or args.eval):
            parser.error("--pretrained needs --translate, --translate_file or --eval")
        return None, args.workdir or "", args
    if args.eval:
        parser.error("--eval needs --pretrained (a trained run is evaluated when it ends)")
    if args.translate or args.translate_file:
        if not args.workdir:
            parser.error("--translate needs --workdir (a trained run) or --pretrained")
        return None, args.workdir, args
    config = cli.resolve_config(parser, args, saved=saved, task=TASK)
    return config, args.workdir or default_workdir(TASK, config), args


def main(argv: Sequence[str] | None = None) -> int:
    """-> the exit code (see train.core.cli.main_of)."""
    return cli.main_of(config_from_args, _run, argv)


def _run(config: TranslateConfig | None, workdir: str, args: argparse.Namespace) -> int:
    if args.pretrained and args.eval:
        result = evaluate_pretrained(args.pretrained, split=getattr(args, "test_split",
                                                                    "test_2016_flickr"),
                                     data_dir=getattr(args, "data_dir", None),
                                     sentences=getattr(args, "eval_sentences", 0),
                                     beam_size=getattr(args, "beam_size", None))
        if jax.process_index() != 0:  # every process decoded its rows; one reports
            return cli.EXIT_OK
        if args.output:
            write_lines(args.output, result["hypotheses"])
        print(f"{result['split']}: BLEU {result['bleu']:.2f} (sacreBLEU, cased, 13a) of "
              f"{args.pretrained} on {result['sentences']} sentences, "
              f"{result['seconds']:.0f}s", flush=True)
        return cli.EXIT_OK
    if config is None:
        sentences = list(args.translate or [])
        if args.translate_file:
            with open(args.translate_file, encoding="utf-8") as f:
                sentences += f.read().splitlines()
        if args.pretrained:
            lines = Pretrained(args.pretrained,
                               beam_size=getattr(args, "beam_size", None)).translate(sentences)
        else:
            lines = translate_text(workdir, sentences)
        # With several processes each holds every line (decoding gathers them); one writes,
        # or two would race on the same output file.
        if jax.process_index() != 0:
            return cli.EXIT_OK
        if args.output:
            write_lines(args.output, lines)
        else:
            for line in lines:
                print(line)
        return cli.EXIT_OK
    print(f"workdir: {workdir}", flush=True)
    final = train_and_evaluate(TASK, config, workdir)
    if "test_bleu" in final:
        print(f"final: step {final['step']}, test BLEU {final['test_bleu']:.2f}, "
              f"test ppl {final['test_ppl']:.2f}", flush=True)
    return cli.finished(final, "ppl")
