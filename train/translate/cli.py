"""The command line of `python -m train.translate` (flags from the config dataclasses)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence

import jax

from train.core import cli
from train.core.task import train_and_evaluate
from train.translate.config import TranslateConfig
from train.translate.evaluate import write_lines
from train.translate.export import export_ct2, export_marian, load_exportable
from train.translate.infer import translate_text
from train.translate.pretrained import Pretrained, evaluate_pretrained
from train.translate.task import TASK
from transformer_jax import quantize as int8
from transformer_jax.ct2 import QUANTIZATIONS, ctranslate2_module

DESCRIPTION = """Train and evaluate a translation model: Multi30k German -> English, or your files.

    python -m train.translate                          # Transformer: preset cpu, or gpu on a GPU
    python -m train.translate --preset base --workdir runs/base --dtype bfloat16
    python -m train.translate --model bahdanau --preset cpu
    python -m train.translate --src_lang en --tgt_lang de      # Multi30k the other way
    python -m train.translate --train_src A.de --train_tgt A.en --valid_src V.de \\
        --valid_tgt V.en --test_src T1.de,T2.de --test_tgt T1.en,T2.en   # your own files
    python -m train.translate --dataset tfds:wmt14_translate/de-en --data_dir D \\
        --src_lang de --tgt_lang en                    # a prepared TFDS dataset
    python -m train.translate --workdir W              # resume W with its saved config
    python -m train.translate --workdir W --translate "Ein Mann fährt Fahrrad."
    python -m train.translate --workdir W --translate_file de.txt --quantize int8   # int8
    python -m train.translate --pretrained opus-mt-de-en --translate "Ein Mann fährt Fahrrad."
    python -m train.translate --pretrained opus-mt-de-en --eval     # BLEU on Multi30k test
    python -m train.translate --pretrained opus-mt-de-en --workdir W    # fine-tune on Multi30k
    python -m train.translate --pretrained opus-mt-de-en --train_src A.de --train_tgt A.en \
        --valid_src V.de --valid_tgt V.en --workdir W      # fine-tune on your files

--pretrained DIR: an OPUS-MT / Marian folder (config.json, model.safetensors, source.spm,
target.spm, vocab.json). With --translate, --translate_file or --eval it decodes; otherwise it
is fine-tuned (preset 'finetune': Adam at a constant 5e-5 after a 200-step warm-up), with its
own tokenizer, and scored before the first step and at the end.

Evaluation: teacher-forced loss and perplexity on validation and test, then sacreBLEU (cased,
13a tokenization, on detokenized text) and chrF of beam-search output on each test set,
written to W/translations/.
"""


def make_parser() -> argparse.ArgumentParser:
    """Every flag of `python -m train.translate` (building it reads no file and starts
    nothing)."""
    parser = cli.task_parser(TASK, description=DESCRIPTION)
    parser.add_argument(
        "--translate",
        nargs="+",
        metavar="SENTENCE",
        help="translate with the checkpoint in --workdir (or --pretrained) and exit",
    )
    parser.add_argument(
        "--translate_file",
        metavar="PATH",
        help="translate PATH's lines (one sentence a line) and exit",
    )
    parser.add_argument(
        "--output", metavar="PATH", help="write the translations here (default: standard output)"
    )
    parser.add_argument(
        "--eval",
        action="store_true",
        help="with --pretrained: sacreBLEU on the --test_split of Multi30k",
    )
    parser.add_argument(
        "--quantize",
        choices=int8.QUANTIZATIONS,
        default=None,
        help="with --translate, --translate_file or --eval: decode with int8 weights "
        "(transformer_jax.quantize)",
    )
    group = parser.add_argument_group("export (a trained --workdir, or --pretrained)")
    group.add_argument(
        "--export_marian",
        metavar="DIR",
        help="write the model as a Hugging Face Marian folder (transformers' MarianMTModel and "
        "MarianTokenizer load it) and exit",
    )
    group.add_argument(
        "--export_ct2",
        metavar="DIR",
        help='write the model as a CTranslate2 model folder and exit (pip install "attention-jax'
        '[serve]")',
    )
    group.add_argument(
        "--ct2_quantization",
        choices=QUANTIZATIONS,
        default=None,
        help="with --export_ct2: the weights' type (default: float32 as trained)",
    )
    return parser


def check_modes(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The flags that choose what the command does must go together (usage errors)."""
    inference = bool(args.translate or args.translate_file)
    pretrained = getattr(args, "pretrained", None)
    if args.eval and not pretrained:
        parser.error("--eval needs --pretrained (a trained run is evaluated when it ends)")
    if inference and not (args.workdir or pretrained):
        parser.error("--translate needs --workdir (a trained run) or --pretrained")
    export = bool(args.export_marian or args.export_ct2)
    if export and not (args.workdir or pretrained):
        parser.error(
            "--export_marian and --export_ct2 need --workdir (a trained run) or --pretrained"
        )
    if export and (inference or args.eval):
        parser.error("--export_marian / --export_ct2 export and exit: run --translate on its own")
    if args.ct2_quantization and not args.export_ct2:
        parser.error("--ct2_quantization goes with --export_ct2")
    if args.quantize and not (inference or args.eval):
        parser.error("--quantize goes with --translate, --translate_file or --eval")


def config_from_args(argv: Sequence[str] | None) -> tuple[TranslateConfig, str, argparse.Namespace]:
    """-> (config, workdir, args) of a training command line, as `main` makes them."""
    parser = make_parser()
    args = parser.parse_args(argv)
    saved = cli.start(args)
    config, workdir = cli.resolve(TASK, parser, finetune_default(args, saved), saved)
    return config, workdir, args


def finetune_default(args: argparse.Namespace, saved) -> argparse.Namespace:
    """A new run with --pretrained and no --preset fine-tunes with its own recipe ('finetune'),
    not the CPU or GPU one of a model trained from scratch."""
    if getattr(args, "pretrained", None) and saved is None and "preset" not in args:
        args.preset = "finetune"
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """-> the exit code (see train.core.cli.main_of)."""
    parser = make_parser()
    return cli.main_of(parser, lambda args: _run(parser, args), argv)


def _given(args: argparse.Namespace, name: str):
    """A run field's flag, else its TranslateConfig default (for the commands that make no
    run config: --pretrained)."""
    return getattr(args, name, getattr(TranslateConfig, name))


def _export(args: argparse.Namespace, pretrained: str | None) -> int:
    """--export_marian / --export_ct2: every check (the config Marian can express, ctranslate2
    installed, the folders free) before the checkpoint is read, then the exports."""
    if args.export_ct2:
        ctranslate2_module()  # an ImportError saying what to install, before any work
    for folder in (args.export_marian, args.export_ct2):
        if folder and os.path.exists(folder) and os.listdir(folder):
            raise FileExistsError(f"{folder} exists and is not empty: choose a new folder")
    model = load_exportable(
        workdir=None if pretrained else args.workdir,
        pretrained=pretrained,
        marian=bool(args.export_marian),
    )
    if jax.process_index() != 0:  # one process writes
        return cli.EXIT_OK
    if args.export_marian:
        export_marian(model, args.export_marian)
        print(f"wrote the Hugging Face Marian folder {args.export_marian}", flush=True)
    if args.export_ct2:
        export_ct2(model, args.export_ct2, quantization=args.ct2_quantization)
        print(
            f"wrote the CTranslate2 model {args.export_ct2} ({args.ct2_quantization or 'float32'})",
            flush=True,
        )
    return cli.EXIT_OK


def _run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    check_modes(parser, args)
    saved = cli.start(args)
    pretrained = getattr(args, "pretrained", None)
    if pretrained and args.eval:
        result = evaluate_pretrained(
            pretrained,
            split=_given(args, "test_split"),
            data_dir=_given(args, "data_dir"),
            sentences=_given(args, "eval_sentences"),
            # None: the checkpoint's own generation default
            beam_size=getattr(args, "beam_size", None),
            quantize=args.quantize,
        )
        if jax.process_index() != 0:  # every process decoded its rows; one reports
            return cli.EXIT_OK
        if args.output:
            write_lines(args.output, result["hypotheses"])
        print(
            f"{result['split']}: BLEU {result['bleu']:.2f} (sacreBLEU, cased, 13a) of "
            f"{pretrained} on {result['sentences']} sentences, "
            f"{result['seconds']:.0f}s",
            flush=True,
        )
        return cli.EXIT_OK
    if args.export_marian or args.export_ct2:
        return _export(args, pretrained)
    if args.translate or args.translate_file:
        sentences = list(args.translate or [])
        if args.translate_file:
            with open(args.translate_file, encoding="utf-8") as f:
                sentences += f.read().splitlines()
        if pretrained:
            lines = Pretrained(
                pretrained, beam_size=getattr(args, "beam_size", None), quantize=args.quantize
            ).translate(sentences)
        else:
            lines = translate_text(args.workdir, sentences, quantize=args.quantize)
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
    config, workdir = cli.resolve(TASK, parser, finetune_default(args, saved), saved)
    print(f"workdir: {workdir}", flush=True)
    final = train_and_evaluate(TASK, config, workdir)
    if "test_bleu" in final:
        print(
            f"final: step {final['step']}, test BLEU {final['test_bleu']:.2f}, "
            f"test ppl {final['test_ppl']:.2f}",
            flush=True,
        )
    return cli.finished(final, "ppl")
