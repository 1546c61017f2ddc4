"""The command line of `python -m train.translate` (flags from the config dataclasses)."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from functools import partial

import jax
from tqdm.auto import tqdm

from train.core import cli
from train.core.run import train_and_evaluate
from train.data.text_files import read_lines
from train.translate.config import TranslateConfig
from train.translate.evaluate import DecodeOptions, write_lines
from train.translate.export import export_ct2, export_marian, load_exportable
from train.translate.infer import translate_text
from train.translate.pretrained import Pretrained, evaluate_pretrained
from train.translate.task import TASK
from transformer_jax.config import DECODE_QUANTIZATIONS
from transformer_jax.interchange.ct2 import CT2_QUANTIZATIONS, ctranslate2_module

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
    python -m train.translate --pretrained opus-mt-de-en --train_src A.de --train_tgt A.en \\
        --valid_src V.de --valid_tgt V.en --workdir W      # fine-tune on your files

--pretrained DIR: an OPUS-MT / Marian folder (config.json, model.safetensors, source.spm,
target.spm, vocab.json). With --translate, --translate_file or --eval it decodes; otherwise it
is fine-tuned (preset 'finetune': Adam at a constant 5e-5 after a 200-step warm-up), with its
own tokenizer, and scored before the first step and at the end.

Modes and the flags each takes (any other flag given is an error; every mode takes
--distributed, --coordinator_address, --num_processes, --process_id):
  training, resume     every run and model flag (--steps, --beam_size, --model.d_model, --set)
  --translate SENTENCE.., --translate_file PATH     with --workdir W or --pretrained DIR:
                       --output, --quantize, and the decoding flags --beam_size, --greedy,
                       --length_penalty, --decode_margin, --max_output_len, --eval_batch_size
  --eval               with --pretrained DIR: the same, and --test_split, --eval_sentences,
                       --data_dir
  --export_marian DIR, --export_ct2 DIR      with --workdir W or --pretrained DIR:
                       --ct2_quantization (with --export_ct2)
A decoding flag not given keeps the run's own setting (W/config.json), or the folder's
(num_beams; a margin of half its max_length, at most 64; penalty 0.6; 64 sentences a batch).
Outputs are at most the source's padded length + decode_margin pieces, or --max_output_len.

Evaluation: teacher-forced loss and perplexity on validation and test, then sacreBLEU (cased,
13a tokenization, on detokenized text) and chrF of beam-search output on each test set,
written to W/translations/.
"""


# The help of the run fields that decoding takes too (the modes above).
DECODING_HELP = {
    "beam_size": "beams of the search (in training, of its test evaluation); decoding "
    "default: the run's own, or the folder's num_beams",
    "length_penalty": "the search's GNMT length penalty alpha; decoding default: the run's "
    "own, or 0.6",
    "decode_margin": "outputs are at most the source's padded length + this many pieces; "
    "decoding default: the run's own, or half the folder's max_length, at most 64",
    "eval_batch_size": "sentences decoded together; decoding default: the run's own, or 64",
}
# What each mode takes besides cli.PER_PROCESS (argparse dests), and the flags that choose
# it; without any of those the command trains (or resumes --workdir).
DECODING = (
    "beam_size",
    "length_penalty",
    "greedy",
    "decode_margin",
    "max_output_len",
    "eval_batch_size",
    "quantize",
    "output",
)
TRAINING, TRANSLATE, EVAL = "training", "--translate/--translate_file", "--eval"
EXPORT = "--export_marian/--export_ct2"
MODE_FLAGS = {
    TRANSLATE: ("translate", "translate_file"),
    EVAL: ("eval",),
    EXPORT: ("export_marian", "export_ct2"),
}
ONE_MODEL = ("workdir", "pretrained")  # a decoding or export mode takes one of them


def modes() -> dict[str, frozenset[str]]:
    """Each mode's name -> the flags (argparse dests) it takes, besides cli.PER_PROCESS."""
    return {
        TRAINING: cli.training_flags(TASK),
        TRANSLATE: frozenset({*MODE_FLAGS[TRANSLATE], *ONE_MODEL, *DECODING}),
        EVAL: frozenset(
            {*MODE_FLAGS[EVAL], "pretrained", "test_split", "eval_sentences", "data_dir", *DECODING}
        ),
        EXPORT: frozenset({*MODE_FLAGS[EXPORT], *ONE_MODEL, "ct2_quantization"}),
    }


def make_parser() -> argparse.ArgumentParser:
    """Every flag of `python -m train.translate` (building it reads no file and starts
    nothing)."""
    parser = cli.task_parser(TASK, description=DESCRIPTION, helps=DECODING_HELP)
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
        choices=DECODE_QUANTIZATIONS,
        default=None,
        help="with --translate, --translate_file or --eval: decode with int8 weights "
        "(transformer_jax.int8)",
    )
    parser.add_argument(
        "--greedy",
        action="store_true",
        help="with --translate, --translate_file or --eval: greedy decoding (equal to the "
        "search of one beam) instead of the beam search",
    )
    parser.add_argument(
        "--max_output_len",
        type=int,
        default=None,
        metavar="N",
        help="with --translate, --translate_file or --eval: outputs of at most N pieces for "
        "every sentence (default: the source's padded length + decode_margin)",
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
        choices=CT2_QUANTIZATIONS,
        default=None,
        help="with --export_ct2: the weights' type (default: float32 as trained)",
    )
    return parser


def check_modes(parser: argparse.ArgumentParser, args: argparse.Namespace) -> str:
    """The mode the flags ask for -> its name (a key of `modes()`). A usage error (exit 2)
    when they ask for two, when its model is missing, or when a flag given is one the mode
    does not take: no flag is silently ignored."""
    given = set(cli.given_flags(parser, args))
    chosen = [name for name, flags in MODE_FLAGS.items() if given & set(flags)]
    if len(chosen) > 1:
        parser.error(f"{chosen[0]} and {chosen[1]}: one mode at a time (each runs and exits)")
    mode = chosen[0] if chosen else TRAINING
    pretrained = getattr(args, "pretrained", None)
    if mode == EVAL and not pretrained:
        parser.error("--eval needs --pretrained (a trained run is evaluated when it ends)")
    if mode in (TRANSLATE, EXPORT):
        named = [f"--{d}" for d in MODE_FLAGS[mode] if d in given]
        subject = " and ".join(named) + (" need" if len(named) > 1 else " needs")
        if not (args.workdir or pretrained):
            parser.error(f"{subject} --workdir (a trained run) or --pretrained")
        if args.workdir and pretrained:
            parser.error(f"{subject} --workdir (a trained run) or --pretrained, not both")
    cli.refuse_unused(parser, args, mode, modes())
    if args.ct2_quantization and not args.export_ct2:
        parser.error("--ct2_quantization goes with --export_ct2")
    try:
        DecodeOptions(**decode_options(args))
    except ValueError as e:
        parser.error(str(e))
    return mode


def decode_options(args: argparse.Namespace) -> dict:
    """The decoding flags given -> `DecodeOptions` fields (the others keep the run's or the
    folder's settings)."""
    names = ("beam_size", "length_penalty", "decode_margin", "max_output_len", "eval_batch_size")
    options = {name: getattr(args, name) for name in names if getattr(args, name, None) is not None}
    return {**options, "greedy": True} if args.greedy else options


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
    return cli.main_of(parser, lambda args: _run(parser, args), argv, is_inference=_inference)


def _inference(args: argparse.Namespace) -> bool:
    """Whether the flags ask for a mode that reads a model and trains nothing."""
    chosen = {name for flags in MODE_FLAGS.values() for name in flags}
    return any(getattr(args, name, None) for name in chosen)


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
    mode = check_modes(parser, args)
    saved = cli.start(args)
    pretrained = getattr(args, "pretrained", None)
    if mode == EVAL:
        result = evaluate_pretrained(
            pretrained,
            split=_given(args, "test_split"),
            data_dir=_given(args, "data_dir"),
            sentences=_given(args, "eval_sentences"),
            quantize=args.quantize,
            **decode_options(args),
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
    if mode == EXPORT:
        return _export(args, pretrained)
    if mode == TRANSLATE:
        sentences = list(args.translate or [])
        if args.translate_file:
            # Checked as training files are: a missing file, or bytes that are not UTF-8
            # (file and line), is a usage error.
            sentences += list(read_lines(args.translate_file))
        # A blank line is translated as a blank line (a model given nothing makes something).
        keep = [i for i, s in enumerate(sentences) if s.strip()]
        options = decode_options(args)  # each given one wins over the run's or the folder's
        if pretrained:
            translate = Pretrained(pretrained, quantize=args.quantize, **options).translate
        else:
            translate = partial(translate_text, args.workdir, quantize=args.quantize, **options)
        lines = [""] * len(sentences)
        # A progress bar on a terminal for a file's sentences (tqdm leaves it out elsewhere).
        with tqdm(
            total=len(keep),
            unit="sentence",
            desc="translating",
            disable=None if args.translate_file and jax.process_index() == 0 else True,
            file=sys.stderr,
        ) as bar:
            translated = translate([sentences[i] for i in keep], progress=bar.update)
        for i, line in zip(keep, translated, strict=True):
            lines[i] = line
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
