"""Every translation model on Multi30k de-en under one budget, in one table.

    python -m train.compare --preset cpu --minutes 10 --workdir runs/compare-cpu
    python -m train.compare --preset tiny --steps 20 --models gru transformer
    python -m train.compare --models gru bahdanau --set eval_sentences=200

Each model trains with `train.translate.train_and_evaluate` in W/<model>/, with its own
sizes and optimizer from the preset (the Transformer: Noam and label smoothing; the baselines:
their tutorials' Adam 1e-3 and gradient clipping), under the same budget: `minutes` of wall
time from the start of its run (loading the data, compiling and the periodic validation
included) and/or `steps`. The SentencePiece model is trained once, before any clock starts,
in W/tokenizer. Then the test split is also decoded greedily (translate decodes it with beam
search), and the comparison writes::

  W/compare.md                  the table: parameters, training time, steps, validation and
                                test perplexity, test sacreBLEU with greedy decoding and beam
                                search; with the machine, the command and the budget
  W/compare.json                the same rows (unrounded), the validation curves, the setting
  W/plots/compare_val_loss.png  validation loss against training time, one line per model

Perplexities and the plotted loss are the unsmoothed per-token nll: the Transformer trains
with label smoothing, the baselines without, and only the nll compares them fairly.

A model whose row is already in W/<model>/compare_row.json is not trained again (the setting
must be the same), so an interrupted comparison continues where it stopped; a model whose run
was interrupted resumes from its last checkpoint, with a fresh `minutes` budget.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax

from train import plots
from train.core import cli
from train.core.config import config_to_dict
from train.core.metrics import read_metrics
from train.core.run import train_and_evaluate
from train.translate import registry
from train.translate.config import PAPER_PRESETS, PRESETS, TranslateConfig, make_config
from train.translate.evaluate import bleu
from train.translate.infer import translate_text
from train.translate.task import TASK
from train.translate.tokenizer import load_tokenizer

# Oldest first, so the table reads as the history: no attention, additive, multiplicative,
# local, convolutional, self-attention.
ORDER = (
    "gru",
    "bahdanau",
    "luong",
    "luong_local",
    "luong_local_m",
    "hard_attention",
    "convs2s",
    "transformer",
)
# Validation every this many steps when the caller does not say: enough points for the curve
# at a small cost (a teacher-forced pass over the validation split, and a checkpoint).
EVAL_EVERY = {"tiny": 5, "cpu": 100, "base": 1000}
ROW_FILE = "compare_row.json"
TABLE_FILE = "compare.md"
JSON_FILE = "compare.json"
PLOT_FILE = os.path.join("plots", "compare_val_loss.png")
# Fields that do not change a model's result, so a cached row stays valid when they differ.
IGNORED_FIELDS = ("progress", "plots")


def default_models() -> list[str]:
    """Every model of the registry, in ORDER (models ORDER does not know last)."""
    names = registry.names()
    return [n for n in ORDER if n in names] + [n for n in names if n not in ORDER]


def model_configs(
    models: Sequence[str], *, preset: str, workdir: str, overrides: Mapping[str, Any] = ()
) -> dict[str, TranslateConfig]:
    """{model: its translate config}: the preset's, with the shared run `overrides`, a shared
    tokenizer in W/tokenizer and validation every EVAL_EVERY[preset] steps by default."""
    if not models:
        raise ValueError("models: name at least one model")
    if len(set(models)) != len(models):
        raise ValueError(f"models: each model once, got {list(models)}")
    unknown = sorted(set(models) - set(registry.names()))
    if unknown:
        raise ValueError(f"models: {unknown} are not in the registry {registry.names()}")
    fields = {
        "tokenizer_dir": os.path.join(workdir, "tokenizer"),
        "eval_every": EVAL_EVERY.get(preset, 0),
        **dict(overrides),
    }
    return {m: make_config(m, preset, **fields) for m in models}


# ------------------------------------------------------------------------------ one model
def val_curve(model_dir: str) -> dict[str, list[float]]:
    """Validation nll against training seconds, from W/<model>/metrics.jsonl.

    Validation lines carry a step but no time; the time of a point is the `elapsed` of the
    training line logged at that step (the loop logs one right before each evaluation), or
    of the last one before it. -> {'steps', 'seconds', 'val_nll'}, in step order.
    """
    records = read_metrics(model_dir)
    elapsed_at = {
        r["step"]: float(r["elapsed"]) for r in records if r["split"] == "train" and "elapsed" in r
    }
    curve: dict[str, list[float]] = {"steps": [], "seconds": [], "val_nll": []}
    for r in sorted((r for r in records if r["split"] == "validation"), key=lambda r: r["step"]):
        logged = [s for s in elapsed_at if s <= r["step"]]
        if not logged:
            continue
        curve["steps"].append(r["step"])
        curve["seconds"].append(elapsed_at[max(logged)])
        curve["val_nll"].append(float(r["nll"]))  # float(): 'inf' is stored as a string
    return curve


def _read_lines(path: str) -> list[str]:
    with open(path, encoding="utf-8") as f:
        return f.read().splitlines()


def greedy_bleu(model_dir: str, config: TranslateConfig, step: int) -> float:
    """Greedy decoding of the test sentences translate evaluated (its W/translations/ files),
    with the checkpoint of `step`; writes <split>.step<N>.greedy.<tgt_lang> next to the beam
    output and returns the corpus sacreBLEU."""
    directory = os.path.join(model_dir, "translations")
    split = config.test_split
    src_lang, tgt_lang = config.output_languages()
    sources = _read_lines(os.path.join(directory, f"{split}.source.{src_lang}"))
    references = _read_lines(os.path.join(directory, f"{split}.reference.{tgt_lang}"))
    hypotheses = translate_text(model_dir, sources, step=step, greedy=True)
    if jax.process_index() == 0:
        with open(
            os.path.join(directory, f"{split}.step{step}.greedy.{tgt_lang}"),
            "w",
            encoding="utf-8",
        ) as f:
            f.writelines(h.replace("\n", " ") + "\n" for h in hypotheses)
    return bleu(hypotheses, references)


def _comparable(config: TranslateConfig) -> dict[str, Any]:
    values = config_to_dict(config)
    return {k: v for k, v in values.items() if k not in IGNORED_FIELDS}


def run_model(
    config: TranslateConfig, model_dir: str, *, log: Callable[[str], None] = print
) -> dict[str, Any] | None:
    """Trains and evaluates one model (or reuses its cached row) -> {'row', 'curve'}, or None
    when SIGTERM stopped the run (its checkpoint is saved; running again resumes it)."""
    row_path = os.path.join(model_dir, ROW_FILE)
    if os.path.exists(row_path):
        with open(row_path) as f:
            cached = json.load(f)
        if cached["config"] != json.loads(json.dumps(_comparable(config))):
            raise ValueError(
                f"{model_dir} holds a {config.model} run of another setting; "
                "use a new --workdir (or delete that directory) to compare under "
                "this one"
            )
        log(f"{config.model}: reusing the row in {row_path}")
        return {"row": cached["row"], "curve": cached["curve"]}
    final = train_and_evaluate(TASK, config, model_dir)
    if final["reason"] == "sigterm":
        return None
    row = {
        "model": config.model,
        "params": int(final["params"]),
        "train_seconds": float(final["train_seconds"]),
        "steps": int(final["step"]),
        "stopped_by": final["reason"],
        "val_nll": float(final["val_nll"]),
        "val_ppl": float(final["val_ppl"]),
        "test_nll": float(final["test_nll"]),
        "test_ppl": float(final["test_ppl"]),
        "bleu_greedy": greedy_bleu(model_dir, config, final["step"]),
        "bleu_beam": float(final["test_bleu"]),
        "test_sentences": int(final["test_sentences"]),
    }
    log(
        f"{config.model}: test BLEU greedy {row['bleu_greedy']:.2f}, beam "
        f"{config.beam_size} {row['bleu_beam']:.2f}"
    )
    result = {"row": row, "curve": val_curve(model_dir)}
    if jax.process_index() == 0:
        with open(row_path, "w") as f:
            json.dump({"config": _comparable(config), **result}, f, indent=1)
    return result


# ------------------------------------------------------------------------------ outputs
def table_header(beam_size: int) -> list[str]:
    return [
        "model",
        "parameters",
        "train min",
        "steps",
        "val ppl",
        "test ppl",
        "test BLEU greedy",
        f"test BLEU beam {beam_size}",
    ]


def table_cells(row: Mapping[str, Any]) -> list[str]:
    """One row's cells, in table_header order."""
    return [
        row["model"],
        f"{row['params']:,}",
        f"{row['train_seconds'] / 60:.1f}",
        str(row["steps"]),
        f"{row['val_ppl']:.2f}",
        f"{row['test_ppl']:.2f}",
        f"{row['bleu_greedy']:.2f}",
        f"{row['bleu_beam']:.2f}",
    ]


def markdown_table(rows: Sequence[Mapping[str, Any]], *, beam_size: int) -> str:
    lines = [table_header(beam_size)]
    lines.append(["---"] + ["---:"] * (len(lines[0]) - 1))  # numbers right-aligned
    lines += [table_cells(r) for r in rows]
    return "\n".join("| " + " | ".join(cells) + " |" for cells in lines) + "\n"


def plot_val_loss(curves: Mapping[str, Mapping[str, Sequence[float]]], path: str) -> str:
    """Validation nll against training minutes, one line per model."""
    plt = plots._pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    for model, curve in curves.items():
        minutes = [s / 60 for s in curve["seconds"]]
        ax.plot(minutes, curve["val_nll"], "o-", markersize=3, label=model)
    ax.set(
        xlabel="training time (minutes)",
        ylabel="validation nll (nats / token)",
        title="Multi30k de-en: validation loss against training time",
    )
    ax.grid(alpha=0.3)
    ax.legend()
    return plots._save(fig, path)


def describe_machine() -> str:
    """CPU model and cores, and the JAX devices the runs used."""
    cpu = platform.processor() or platform.machine()
    if os.path.exists("/proc/cpuinfo"):  # Linux names the CPU model only here
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        cpu = names[0] if names else cpu
    devices = jax.devices()
    return (
        f"{cpu}, {os.cpu_count()} CPU cores; JAX {jax.__version__} on {len(devices)} x "
        f"{devices[0].device_kind} ({devices[0].platform})"
    )


def describe_budget(config: TranslateConfig) -> str:
    parts = []
    if config.minutes:
        parts.append(
            f"{config.minutes:g} minutes of wall time (data loading, compilation and "
            "validation included)"
        )
    parts.append(f"at most {config.steps} steps")
    validation = (
        f"validation every {config.eval_every} steps and at the end"
        if config.eval_every
        else "validation at the end"
    )
    return f"preset {config.preset}, per model: {' or '.join(parts)}; {validation}"


def write_outputs(
    workdir: str, results: Mapping[str, Mapping[str, Any]], *, setting: Mapping[str, Any]
) -> dict[str, Any]:
    """W/compare.md, W/compare.json and the plot from {model: {'row', 'curve'}}."""
    rows = [r["row"] for r in results.values()]
    curves = {m: r["curve"] for m, r in results.items()}
    summary = {**setting, "rows": rows, "curves": curves}
    if jax.process_index() != 0:
        return summary
    os.makedirs(workdir, exist_ok=True)
    plot = plot_val_loss(curves, os.path.join(workdir, PLOT_FILE))
    lines = ["# Multi30k de-en: every translation model under one budget", ""]
    if setting.get("command"):
        lines.append(f"Command: `{setting['command']}`  ")
    lines += [
        f"Machine: {setting['machine']}  ",
        f"Budget: {setting['budget']}  ",
        f"Test: {setting['test_split']} ({rows[0]['test_sentences'] if rows else 0} "
        "sentences), sacreBLEU (cased, 13a) of detokenized output; beam search with "
        f"length penalty {setting['length_penalty']}. Perplexities are exp of the "
        "unsmoothed nll.",
        "",
        markdown_table(rows, beam_size=setting["beam_size"]),
        f"![validation loss against training time]({os.path.relpath(plot, workdir)})",
        "",
    ]
    with open(os.path.join(workdir, TABLE_FILE), "w", encoding="utf-8") as f:
        f.write("\n".join(lines))
    with open(os.path.join(workdir, JSON_FILE), "w") as f:
        json.dump(summary, f, indent=1)
    return summary


# ------------------------------------------------------------------------------ the run
def compare(
    workdir: str,
    *,
    models: Sequence[str] | None = None,
    preset: str = "cpu",
    overrides: Mapping[str, Any] = (),
    command: str | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Trains and evaluates `models` (default: all, in ORDER) under one budget, writes the
    table, json and plot to `workdir`, and returns the json's content.

    overrides: TranslateConfig fields for every model (minutes, steps, eval_every,
      eval_sentences, data_dir, ...). command: the command line, recorded in the outputs.
    """
    models = list(models) if models else default_models()
    configs = model_configs(models, preset=preset, workdir=workdir, overrides=overrides)
    first = configs[models[0]]
    t0 = time.monotonic()
    # Train the shared SentencePiece model (and prepare the data set) before any clock starts.
    load_tokenizer(first, workdir)
    log(f"tokenizer ready in {time.monotonic() - t0:.1f}s; comparing {', '.join(models)}")
    setting = {
        "preset": preset,
        "command": command,
        "machine": describe_machine(),
        "budget": describe_budget(first),
        "minutes": first.minutes,
        "steps": first.steps,
        "eval_every": first.eval_every,
        "test_split": first.test_split,
        "beam_size": first.beam_size,
        "length_penalty": first.length_penalty,
    }
    results: dict[str, dict[str, Any]] = {}
    for name in models:
        log(f"=== {name}")
        result = run_model(configs[name], os.path.join(workdir, name), log=log)
        if result is None:
            log(f"SIGTERM: stopped during {name}; run the same command to continue")
            break
        results[name] = result
    summary = write_outputs(workdir, results, setting=setting)
    log(
        f"table in {os.path.join(workdir, TABLE_FILE)}:\n"
        + markdown_table(summary["rows"], beam_size=first.beam_size)
    )
    return summary


# ------------------------------------------------------------------------------ CLI
def parse_args(argv: Sequence[str] | None) -> tuple[str, dict[str, Any]]:
    """-> (workdir, keyword arguments of `compare`)."""
    parser = argparse.ArgumentParser(
        prog="python -m train.compare",
        # The docstring's reStructuredText "::" (a literal block on the site) reads as ":" here.
        description=__doc__.replace("::\n", ":\n"),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--workdir", default=None, help="output directory (default: a new one under runs/)"
    )
    parser.add_argument(
        "--models",
        nargs="+",
        choices=default_models(),
        default=None,
        help="a subset, in the order given (default: all)",
    )
    # The papers' recipes size the Transformer only, on the user's files: no comparison.
    parser.add_argument(
        "--preset", choices=[p for p in PRESETS if p not in PAPER_PRESETS], default="cpu"
    )
    parser.add_argument(
        "--minutes",
        type=float,
        default=None,
        help="wall-clock budget per model (default: the preset's; 0 = none)",
    )
    parser.add_argument(
        "--steps", type=int, default=None, help="step budget per model (default: the preset's)"
    )
    parser.add_argument(
        "--eval_every",
        type=int,
        default=None,
        help="validate every N steps (default: EVAL_EVERY of the preset)",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="any other train.translate run field, for every model",
    )
    args = parser.parse_args(argv)
    try:
        overrides, _ = cli.split_given(
            argparse.Namespace(), run_cls=TranslateConfig, model_cls=None, sets=args.set
        )
    except ValueError as e:
        parser.error(str(e))
    for name in ("minutes", "steps", "eval_every"):
        if getattr(args, name) is not None:
            overrides[name] = getattr(args, name)
    workdir = args.workdir or os.path.join(
        "runs", f"compare-{args.preset}-{time.strftime('%Y%m%d-%H%M%S')}"
    )
    command = shlex.join(
        ["python", "-m", "train.compare", *(sys.argv[1:] if argv is None else argv)]
    )
    return workdir, {
        "models": args.models,
        "preset": args.preset,
        "overrides": overrides,
        "command": command,
    }


def main(argv: Sequence[str] | None = None) -> int:
    workdir, kwargs = parse_args(argv)
    print(f"workdir: {workdir}", flush=True)
    summary = compare(workdir, **kwargs)
    return 0 if len(summary["rows"]) == len(kwargs["models"] or default_models()) else 1
