"""Serving a trained translation model: our own search against the engines its exports load in.

    python -m train.bench.serve --workdir W [--sentences N] [--threads 2] [--out DIR]

On the run's test set (Multi30k test_2016_flickr, or its first test files) and in the same
length-sorted batches for every engine, it decodes greedily and with the run's beam size:

- `ours`: `transformer_jax.decode` (greedy_decode, beam_search with the GNMT length penalty);
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
thread-count flag; on the 2-core machine that is the same 2).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from train.core.task import saved_config
from train.data.batching import eval_batches
from train.translate.evaluate import bleu, special_ids
from train.translate.export import check_exportable, export_ct2, export_marian, load_exportable
from train.translate.task import TASK, encode_source, load_split, tfds_splits
from transformer_jax import decode
from transformer_jax.model import Transformer


def _batches(config, sources: list[list[int]]) -> list[dict[str, np.ndarray]]:
    """The evaluation's length-sorted batches of the sources (one device), without the rows
    that only fill a batch (the engines take ragged batches)."""
    batches = eval_batches(
        [(s, []) for s in sources],
        batch_size=config.eval_batch_size,
        buckets=config.buckets,
        num_devices=1,
        sort_by_length=True,
        **special_ids(config.model_config),
    )
    return [{k: v[b["index"] >= 0] for k, v in b.items()} for b in batches]


def _in_order(batches, outputs: Sequence[np.ndarray], n: int) -> list[np.ndarray]:
    """Each batch's output rows back in the sources' order."""
    out: list[np.ndarray] = [None] * n  # type: ignore[list-item]
    for batch, ids in zip(batches, outputs):
        for row, i in enumerate(batch["index"]):
            out[i] = np.asarray(ids[row])
    return out


def _until_eos(ids: np.ndarray, eos: int, pad: int) -> list[int]:
    """The tokens of one output up to and with its EOS (pad dropped)."""
    out = []
    for t in ids.tolist():
        if t == pad:
            continue
        out.append(t)
        if t == eos:
            break
    return out


def _measure(
    name: str,
    run: Callable[[dict[str, np.ndarray]], np.ndarray],
    batches,
    *,
    n: int,
    tokenizer,
    references: Sequence[str],
    eos: int,
    pad: int,
) -> dict[str, Any]:
    """Two passes of `run` over the batches (the first compiles or warms up; the second is
    timed) -> BLEU, output tokens per second and the outputs."""
    start = time.perf_counter()
    [run(b) for b in batches]
    first = time.perf_counter() - start
    start = time.perf_counter()
    outputs = [run(b) for b in batches]
    seconds = time.perf_counter() - start
    ids = [_until_eos(row, eos, pad) for row in _in_order(batches, outputs, n)]
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
    import ctranslate2

    from transformer_jax.ct2 import ct2_translate

    config = saved_config(TASK, workdir)
    exported = load_exportable(workdir=workdir)  # the parameters the run decodes with
    model, params, tokenizer = Transformer(exported.config), exported.params, exported.tokenizer
    if config.data_source() == "tfds":
        test = tfds_splits(config, tokenizer)[1][0]
    elif config.test_src:
        test = load_split(config, tokenizer, "test", (config.test_src[0], config.test_tgt[0]))
    else:
        test = load_split(config, tokenizer, config.test_split)
    sources, references = test.sources, test.references
    if sentences:
        sources, references = sources[:sentences], references[:sentences]
    batches = _batches(config, encode_source(tokenizer, sources))
    mc = config.model_config
    margin, beam, alpha = config.decode_margin, config.beam_size, config.length_penalty
    measure = dict(
        n=len(sources), tokenizer=tokenizer, references=references, eos=mc.eos_id, pad=mc.pad_id
    )

    def ours(greedy: bool):
        def run(batch):
            src = batch["src"]
            if greedy:
                return np.asarray(
                    decode.greedy_decode(model, params, src, max_len=src.shape[1] + margin)
                )
            tokens, _ = decode.beam_search(
                model,
                params,
                src,
                beam_size=beam,
                max_len=src.shape[1] + margin,
                length_penalty=alpha,
                best_only=True,
            )
            return np.asarray(tokens[:, 0])

        return run

    root = export_dir or tempfile.mkdtemp(prefix="serve-bench-")
    engines: list[tuple[str, Callable[[bool], Callable]]] = [("ours", ours)]
    for quantization in ("float32", "int8"):
        folder = os.path.join(root, f"ct2-{quantization}")
        if not os.path.exists(folder):
            export_ct2(exported, folder, quantization=quantization)
        translator = ctranslate2.Translator(
            folder, device="cpu", compute_type=quantization, inter_threads=1, intra_threads=threads
        )

        def ct2(greedy: bool, translator=translator):
            def run(batch):
                src = batch["src"]
                return ct2_translate(
                    translator,
                    tokenizer,
                    src,
                    max_len=src.shape[1] + margin,
                    beam_size=1 if greedy else beam,
                    length_penalty=alpha,
                    max_batch_size=len(src),
                )

            return run

        engines.append((f"ctranslate2 {quantization}", ct2))

    unexpressible = None
    try:
        check_exportable(config.model_config, marian=True)
    except ValueError as e:
        unexpressible = str(e)
    if unexpressible is None:
        import torch
        import transformers

        torch.set_num_threads(threads)
        folder = os.path.join(root, "marian")
        if not os.path.exists(folder):
            export_marian(exported, folder)
        hf = transformers.MarianMTModel.from_pretrained(folder).eval()

        def transformers_engine(greedy: bool):
            def run(batch):
                src = torch.tensor(batch["src"], dtype=torch.long)
                with torch.no_grad():
                    out = hf.generate(
                        input_ids=src,
                        attention_mask=src != mc.pad_id,
                        num_beams=1 if greedy else beam,
                        do_sample=False,
                        length_penalty=alpha,
                        max_length=src.shape[1] + margin + 1,  # counts the start token
                    )
                return out.numpy()[:, 1:]

            return run

        engines.append(("transformers", transformers_engine))

    results: dict[str, Any] = {"greedy": [], "beam": []}
    for search, greedy in (("greedy", True), ("beam", False)):
        for name, make in engines:
            results[search].append(_measure(name, make(greedy), batches, **measure))
        reference = results[search][0]["ids"]
        for row in results[search]:
            row["same_as_ours"] = sum(a == b for a, b in zip(row["ids"], reference)) / len(
                reference
            )
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
        "transformers": unexpressible or "exported",
        "cpu": _cpu_model(),
        "date": time.strftime("%Y-%m-%d"),
        "versions": _versions(),
        "results": results,
    }


def _cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return platform.processor()
    return next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if "Model name" in ln), "")


def _versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {}
    for name in ("jax", "ctranslate2", "transformers", "torch"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            pass
    return out


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
    if result["transformers"] != "exported":
        lines += ["", f"transformers: not exported ({result['transformers']})"]
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
