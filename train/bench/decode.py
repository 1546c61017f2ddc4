"""Decoding: our searches against the serving engines, on the same weights, in one run.

For each model of `config.decode_sizes` (the `cpu` translation preset's Transformer and an
OPUS-MT-sized Marian model, random weights made to decode decisively: `random_models`):

1. Random source sentences (`decode_source_lengths`, a fixed seed), the same for every engine.
2. The engines of `train.bench.engines.ENGINES` load the same float32 weights: ours
   (`greedy_decode`, `beam_search` with the GNMT length penalty), CTranslate2 float32 and int8
   (`save_ct2` folders), transformers' `MarianMTModel` (a `save_marian` folder, where Marian
   can express the model; else the reason is reported). The folders are written under the
   run's cache folder, `CACHE/decode/<size>/`.
3. For each batch size of `decode_batches` (1: `decode_latency_sentences` sentences one at a
   time; larger: `decode_sentences` sentences sorted by length, in batches of that size) and
   each search (greedy, beam `beam_size`): one untimed round, then `decode_rounds` timed rounds;
   in each round every engine decodes all the sentences once, engine after engine, so a change
   in the machine's load falls on all of them alike. Figures are medians over the rounds.

Per model x batch x search x engine: output tokens per second (every token up to and with EOS),
ms per sentence, the ratio of tokens/s to ours, the share of sentences whose tokens equal ours
exactly (greedy: the same model in float32 gives the same tokens, bar near-ties; beam: the
engines' length normalisation differs, so less), load time (engines: loading their folder;
exporting it is reported apart), and first calls minus steady calls: for ours the compile time,
summed over the source shapes (one per bucket and batch), for the engines their warm-up.

Sources are padded to `decode_buckets` (our search compiles a program per shape), outputs get
bucket + `decode_margin` positions in every engine. CTranslate2 and torch get `decode_threads`
CPU threads; XLA:CPU uses all the CPUs this process may run on (it has no thread-count flag).
When JAX runs on a GPU, CTranslate2 and transformers run on CUDA if they see a CUDA device, else
they are reported unavailable (a CPU engine against a GPU search compares nothing).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from train.bench.config import BenchConfig
from train.bench.engines import (
    ENGINES,
    Engine,
    Factory,
    Served,
    Unavailable,
    cpu_model,
    engine_device,
    in_order,
    same_share,
    source_batches,
    until_eos,
    versions,
)
from train.bench.random_models import (
    PiecesTokenizer,
    calibrate_eos,
    describe,
    random_params,
    random_sources,
    sharpen,
    source_batch,
)
from train.bench.timing import time_interleaved
from train.core.state import count_params
from transformer_jax.config import TransformerConfig

SEARCHES = (("greedy", True), ("beam", False))
# Sentences whose greedy outputs set the EOS bias (calibrate_eos): one small batch.
_CALIBRATION_SENTENCES = 8


def decode_section(
    config: BenchConfig,
    *,
    cache_dir: str,
    engines: Sequence[tuple[str, Factory]] = ENGINES,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """The comparison of the module docstring on every model of `config.decode_sizes`."""
    device = engine_device()
    sizes = []
    for name, model_config in config.decode_sizes:
        log(f"[bench] decode: {describe(model_config, name)}")
        sizes.append(
            compare_engines(
                name,
                model_config,
                config,
                folder=os.path.join(cache_dir, "decode", name),
                engines=engines,
                device=device,
                log=log,
            )
        )
    return {
        "backend": jax.default_backend(),
        "engine_device": device,
        "threads": config.decode_threads,
        "rounds": config.decode_rounds,
        "batches": list(config.decode_batches),
        "beam_size": config.beam_size,
        "length_penalty": config.decode_length_penalty,
        "margin": config.decode_margin,
        "buckets": list(config.decode_buckets),
        "source_lengths": list(config.decode_source_lengths),
        "cpu": cpu_model(),
        "versions": versions(),
        "sizes": sizes,
    }


def compare_engines(
    name: str,
    model_config: TransformerConfig,
    config: BenchConfig,
    *,
    folder: str,
    engines: Sequence[tuple[str, Factory]] = ENGINES,
    device: str = "cpu",
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """One model: random sharpened weights, every engine loaded, every batch and search timed
    (the module docstring) -> its figures ('rows', one per batch x search x engine)."""
    cfg = model_config.replace(dtype=jnp.float32, dropout=0.0, attention_dropout=0.0)
    n = max(config.decode_sentences, config.decode_latency_sentences)
    sources = random_sources(cfg, n=n, lengths=config.decode_source_lengths, seed=0)
    ids = dict(pad_id=cfg.pad_id, bos_id=cfg.bos_id, eos_id=cfg.eos_id)

    start = time.perf_counter()
    params = sharpen(cfg, random_params(cfg, seed=0))
    calibration = sources[:_CALIBRATION_SENTENCES]
    length = _bucket(max(map(len, calibration)), config.decode_buckets)
    params, eos = calibrate_eos(
        cfg,
        params,
        source_batch(calibration, cfg.pad_id, length),
        max_len=length + config.decode_margin,
    )
    weights_s = time.perf_counter() - start
    # Calibrating compiled our greedy search at one shape: forget it, so that every shape's
    # compile time is measured below.
    jax.clear_caches()

    served = Served(
        cfg,
        params,
        PiecesTokenizer(cfg),
        folder=folder,
        beam_size=config.beam_size,
        length_penalty=config.decode_length_penalty,
        threads=config.decode_threads,
        device=device,
    )
    loaded: dict[str, Engine] = {}
    unavailable: dict[str, str] = {}
    for engine_name, factory in engines:
        log(f"[bench] decode: {name}: loading {engine_name}")
        try:
            loaded[engine_name] = factory(served)
        except Unavailable as e:
            unavailable[engine_name] = str(e)
            log(f"[bench] decode: {name}: {engine_name} unavailable: {e}")

    rows = []
    for batch_size in config.decode_batches:
        count = config.decode_latency_sentences if batch_size == 1 else config.decode_sentences
        batches = source_batches(
            sources[:count],
            batch_size=batch_size,
            buckets=config.decode_buckets,
            sort_by_length=batch_size > 1,
            **ids,
        )
        for search, greedy in SEARCHES:
            log(f"[bench] decode: {name}: batch {batch_size}, {search}")
            rows += time_engines(
                loaded,
                batches,
                n=count,
                greedy=greedy,
                margin=config.decode_margin,
                rounds=config.decode_rounds,
                eos=cfg.eos_id,
                pad=cfg.pad_id,
                labels=dict(batch=batch_size, search=search),
            )
    greedy_ours = [r for r in rows if r["engine"] == "ours" and r["search"] == "greedy"]
    return {
        "name": name,
        "model": describe(cfg),
        "params": count_params(params),
        "weights": "random, sharpened (train.bench.random_models)",
        "weights_s": weights_s,
        "eos_calibration": eos,
        # How long ours' greedy outputs are at the largest batch: varied, few at the limit.
        "greedy_lengths": greedy_ours[-1]["lengths"] if greedy_ours else None,
        "engines": {
            engine_name: {"export_s": engine.export_s, "load_s": engine.load_s}
            for engine_name, engine in loaded.items()
        },
        "unavailable": unavailable,
        "rows": rows,
    }


def _bucket(length: int, buckets: Sequence[int]) -> int:
    return next((b for b in buckets if b >= length), length)


def time_engines(
    engines: Mapping[str, Engine],
    batches: Sequence[Mapping[str, np.ndarray]],
    *,
    n: int,
    greedy: bool,
    margin: int,
    rounds: int,
    eos: int,
    pad: int,
    labels: Mapping[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """Every engine decodes every batch (src [B, L], output positions L + margin) once per
    round, engines taking turns: one untimed round, then `rounds` timed ones.

    Args:
      batches: dicts with 'src' [B, L] and 'index' [B] (each row's sentence, 0 .. n-1).
      n: the sentences the batches hold.
      labels: fields copied into every row (batch, search).
    Returns:
      one row per engine: median pass seconds and the figures derived from it, the first
      calls' extra seconds (per source shape), output lengths and agreement with the first
      engine (ours).
    """
    batch_times: dict[str, list[list[float]]] = {name: [] for name in engines}
    outputs: dict[str, list[np.ndarray]] = {}

    def arm(name: str, engine: Engine) -> Callable[[int], None]:
        def one_pass(_round: int) -> None:
            times, outs = [], []
            for b in batches:
                src = b["src"]
                start = time.perf_counter()
                outs.append(engine.decode(src, greedy=greedy, max_len=src.shape[1] + margin))
                times.append(time.perf_counter() - start)
            batch_times[name].append(times)
            outputs[name] = outs

        return one_pass

    passes = time_interleaved(
        {name: arm(name, engine) for name, engine in engines.items()}, warmup=1, steps=rounds
    )
    shapes = [tuple(int(d) for d in b["src"].shape) for b in batches]
    # Each sentence's output positions: its batch's bucket + margin.
    limit = {int(i): b["src"].shape[1] + margin for b in batches for i in b["index"]}
    rows = []
    reference = None
    for name in engines:
        ids = [until_eos(row, eos, pad) for row in in_order(batches, outputs[name], n)]
        if reference is None:
            reference = ids  # the first engine: ours
        median = statistics.median(passes[name])
        tokens = sum(map(len, ids))
        first, steady = batch_times[name][0], batch_times[name][1:]
        extra = {}  # the first call of each shape against that same call's steady time
        for j, shape in enumerate(shapes):
            key = f"{shape[0]}x{shape[1]}"
            if key not in extra:
                extra[key] = first[j] - statistics.median(t[j] for t in steady)
        lengths = [len(row) for row in ids]
        unended = [not row or row[-1] != eos for row in ids]
        rows.append(
            {
                **(labels or {}),
                "engine": name,
                "sentences": n,
                "shapes": sorted(set(shapes)),
                "pass_times_s": passes[name],
                "pass_s_median": median,
                "first_pass_s": sum(first),
                "first_calls_extra_s": sum(extra.values()),
                "first_calls_extra_s_by_shape": extra,
                "output_tokens": tokens,
                "tokens_per_s": tokens / median,
                "ms_per_sentence": 1e3 * median / n,
                "same_as_ours": same_share(ids, reference),
                "lengths": {
                    "mean": tokens / n,
                    "min": min(lengths),
                    "max": max(lengths),
                    # Outputs that ran to their limit without EOS.
                    "at_limit": sum(
                        u and len(r) >= limit[i] for i, (u, r) in enumerate(zip(unended, ids))
                    )
                    / n,
                },
            }
        )
    base = rows[0]["tokens_per_s"]
    for row in rows:
        row["x_ours"] = row["tokens_per_s"] / base
    return rows
