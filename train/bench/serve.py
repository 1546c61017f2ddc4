"""Serving a trained translation model: our own search against the engines its exports load in.

    python -m train.bench.serve --workdir W [--sentences N] [--threads 2] [--out DIR]

On the run's test set (Multi30k test_2016_flickr, or its first test files) and in the same
length-sorted batches for every engine, it decodes greedily and with the run's beam size:

- `ours`: `transformer_jax.decoding.decode` (greedy_decode, beam_search with the GNMT length
  penalty);
- `ctranslate2 float32` and `ctranslate2 int8`: the `--export_ct2` model (`save_ct2`);
- `transformers`: the `--export_marian` folder in `MarianMTModel.generate`, where Marian can
  express the model (post-LN, sin-then-cos positions, LayerNorm epsilon 1e-5); else the reason.

For each: sacreBLEU of the hypotheses (each engine's ids decoded by the run's tokenizer),
output tokens per second (every token up to and with EOS, over the second pass: the first
compiles and warms caches), and for greedy decoding the share of sentences whose tokens equal
ours exactly. The engines' beam searches differ from ours: both others divide the summed
log-probs by length ** alpha (alpha = the run's length_penalty) where ours divides by GNMT's
((5 + length) / 6) ** alpha, and they keep finished hypotheses apart; so beam BLEU may differ.
Every engine runs on `--threads` CPU threads (JAX on all the machine's cores: XLA:CPU has no
thread-count flag; on the 2-core machine that is the same 2). The engines are
`train.bench.engines`' (`python -m train.bench --only decode` compares them on random models);
one whose package is missing is reported as such.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from train.bench.engines import (
    ENGINES,
    Served,
    Unavailable,
    cpu_model,
    in_order,
    same_share,
    source_batches,
    until_eos,
    versions,
)
from train.core.inference import saved_config
from train.translate.evaluate import bleu, special_ids
from train.translate.export import load_exportable
from train.translate.sources import encode_source, translation_source
from train.translate.task import TASK


def _measure(
    name: str,
    run: Callable,
    batches,
    *,
    greedy: bool,
    margin: int,
    n: int,
    tokenizer,
    references: Sequence[str],
    eos: int,
    pad: int,
) -> dict[str, Any]:
    """Two passes of `run` over the batches (the first compiles or warms up; the second is
    timed), each batch's output length its bucket + margin -> BLEU, output tokens per second
    and the outputs."""

    def one_pass():
        return [run(b["src"], greedy=greedy, max_len=b["src"].shape[1] + margin) for b in batches]

    start = time.perf_counter()
    one_pass()
    first = time.perf_counter() - start
    start = time.perf_counter()
    outputs = one_pass()
    seconds = time.perf_counter() - start
    ids = [until_eos(row, eos, pad) for row in in_order(batches, outputs, n)]
    hypotheses = [tokenizer.decode(np.asarray(row, np.int64)) for row in ids]
    tokens = sum(map(len, ids))
    return {
        "engine": name,
        "bleu": bleu(hypotheses, references),
        "output_tokens": tokens,
        "seconds": seconds,
        "first_pass_seconds": first,
        "tokens_per_s": tokens / seconds,
        "ids": ids,
        "hypotheses": hypotheses,
    }


def serve_bench(
    workdir: str, *, sentences: int = 0, threads: int = 2, export_dir: str | None = None
) -> dict[str, Any]:
    """The measurements of this module's docstring for the model of `workdir`."""
    config = saved_config(TASK, workdir)
    exported = load_exportable(workdir=workdir)  # the parameters the run decodes with
    tokenizer = exported.tokenizer
    tests = translation_source(config).test_splits(tokenizer)
    if not tests:
        raise ValueError(f"{workdir}: the run has no test set to measure serving on")
    test = tests[0]  # the run's first: its test_ figures
    sources, references = test.sources, test.references
    if sentences:
        sources, references = sources[:sentences], references[:sentences]
    # The evaluation's length-sorted batches (one device).
    batches = source_batches(
        encode_source(tokenizer, sources),
        batch_size=config.eval_batch_size,
        buckets=config.buckets,
        **special_ids(config.model_config),
    )
    mc = config.model_config
    beam, alpha = config.beam_size, config.length_penalty
    served = Served(
        exported.config,
        exported.params,
        tokenizer,
        folder=export_dir or tempfile.mkdtemp(prefix="serve-bench-"),
        beam_size=beam,
        length_penalty=alpha,
        threads=threads,
        device="cpu",
        marian_tokenizer=tokenizer,
        generation=exported.generation,
        reuse_exports=True,
    )
    engines, unavailable = [], {}
    for name, factory in ENGINES:
        try:
            engines.append((name, factory(served)))
        except Unavailable as e:
            unavailable[name] = str(e)
    measure = dict(
        margin=config.decode_margin,
        n=len(sources),
        tokenizer=tokenizer,
        references=references,
        eos=mc.eos_id,
        pad=mc.pad_id,
    )
    results: dict[str, Any] = {"greedy": [], "beam": []}
    for search, greedy in (("greedy", True), ("beam", False)):
        for name, engine in engines:
            results[search].append(_measure(name, engine.decode, batches, greedy=greedy, **measure))
        reference = results[search][0]["ids"]
        for row in results[search]:
            row["same_as_ours"] = same_share(row["ids"], reference)
    for rows in results.values():
        for row in rows:
            del row["ids"], row["hypotheses"]
    return {
        "workdir": workdir,
        "split": test.name,
        "sentences": len(sources),
        "beam_size": beam,
        "length_penalty": alpha,
        "threads": threads,
        "model": f"{config.model} ({config.preset}), {config.model_config.n_encoder_layers}+"
        f"{config.model_config.n_decoder_layers} x {config.model_config.d_model}",
        "transformers": unavailable.get("transformers", "exported"),
        "unavailable": unavailable,
        "cpu": cpu_model(),
        "date": time.strftime("%Y-%m-%d"),
        "versions": versions(),
        "results": results,
    }


def report(result: dict[str, Any]) -> str:
    """A markdown table of the results."""
    lines = [
        f"Model: {result['model']}; {result['split']}, {result['sentences']} sentences; "
        f"{result['threads']} threads; {result['cpu']}; {result['date']}; "
        + ", ".join(f"{k} {v}" for k, v in result["versions"].items()),
        "",
        "| search | engine | BLEU | output tokens/s | x ours | same tokens as ours |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for search, rows in result["results"].items():
        base = rows[0]["tokens_per_s"]
        for row in rows:
            lines.append(
                f"| {search} | {row['engine']} | {row['bleu']:.2f} | {row['tokens_per_s']:,.0f} "
                f"| {row['tokens_per_s'] / base:.2f} | {100 * row['same_as_ours']:.1f}% |"
            )
    unavailable = result.get("unavailable") or (
        {} if result["transformers"] == "exported" else {"transformers": result["transformers"]}
    )
    if unavailable:
        lines.append("")
    lines += [f"{name}: not exported ({why})" for name, why in unavailable.items()]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m train.bench.serve", description=__doc__)
    parser.add_argument("--workdir", required=True, help="a trained translation run")
    parser.add_argument("--sentences", type=int, default=0, help="the first N (0: all)")
    parser.add_argument("--threads", type=int, default=2, help="CPU threads of each engine")
    parser.add_argument("--out", default=None, help="write serve.json and serve.md here")
    parser.add_argument("--export_dir", default=None, help="keep the exports here")
    args = parser.parse_args(argv)
    result = serve_bench(
        args.workdir, sentences=args.sentences, threads=args.threads, export_dir=args.export_dir
    )
    text = report(result)
    print(text, end="")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "serve.json"), "w") as f:
            json.dump(result, f, indent=2)
        with open(os.path.join(args.out, "serve.md"), "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
