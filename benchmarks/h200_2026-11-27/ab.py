"""Our searches on the bench's OPUS-MT-sized random model (float32), batch 32, with finished
sentences dropped by the host (drop_finished=True, the default on every device when this ran)
against the whole search as one program (drop_finished=False): the first call (compiling),
then 3 interleaved rounds over 3 batches of random sources. From the repository root:

    PYTHONPATH=. python benchmarks/h200_2026-11-27/ab.py
"""

import time

import jax
import jax.numpy as jnp
import numpy as np

from train.bench.random_models import (
    calibrate_eos,
    opus_mt_config,
    random_params,
    random_sources,
    sharpen,
    source_batch,
)
from transformer_jax.decoding import decode
from transformer_jax.model import Transformer

VARIANTS = ("drop", "whole")


def main() -> None:
    cfg = opus_mt_config().replace(dtype=jnp.float32, dropout=0.0, attention_dropout=0.0)
    sources = random_sources(cfg, n=96, lengths=(8, 30), seed=0)
    params = sharpen(cfg, random_params(cfg, seed=0))
    params, _ = calibrate_eos(cfg, params, source_batch(sources[:8], cfg.pad_id, 32), max_len=48)
    model = Transformer(cfg)
    params = jax.block_until_ready(jax.device_put(params))
    batches = [source_batch(sources[i : i + 32], cfg.pad_id, 32) for i in range(0, 96, 32)]

    def run(search: str, variant: str, src: np.ndarray) -> np.ndarray:
        kw = dict(max_len=48, drop_finished=variant == "drop")
        if search == "greedy":
            return np.asarray(decode.greedy_decode(model, params, src, **kw))
        kw.update(beam_size=4, length_penalty=0.6, best_only=True, return_beams=1)
        tokens, _ = decode.beam_search(model, params, src, **kw)
        return np.asarray(tokens[:, 0])

    for search in ("greedy", "beam"):
        outputs, first = {}, {}
        for v in VARIANTS:
            start = time.perf_counter()
            outputs[v] = run(search, v, batches[0])
            first[v] = time.perf_counter() - start
        times = {v: [] for v in VARIANTS}
        for _ in range(3):
            for v in VARIANTS:
                start = time.perf_counter()
                for b in batches:
                    run(search, v, b)
                times[v].append((time.perf_counter() - start) / len(batches))
        for v in VARIANTS:
            same = bool((outputs[v] == outputs["drop"]).all())
            rounds = [round(1e3 * x, 1) for x in times[v]]
            print(
                f"{search:6s} {v:6s} first {first[v]:6.1f} s  batch median "
                f"{1e3 * np.median(times[v]):7.1f} ms  all {rounds}  same as drop {same}",
                flush=True,
            )


if __name__ == "__main__":
    main()
