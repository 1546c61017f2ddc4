"""Each length-sorted batch's beam search, at eval batches 128 and 256, in one process: a
warm-up pass each, then ROUNDS passes each, interleaved; the median seconds per batch.

    python benchmarks/decode_2026-11-28/per_batch.py WORKDIR [ROUNDS]
"""

import sys
import time

import jax
import numpy as np

from train.core import compile_cache, host_memory

host_memory.keep_host_memory()
compile_cache.enable_compilation_cache()

from train.core.task import params_for_inference  # noqa: E402
from train.data.batching import eval_batches  # noqa: E402
from train.translate.evaluate import special_ids  # noqa: E402
from train.translate.sources import load_split  # noqa: E402
from train.translate.task import TASK  # noqa: E402
from train.translate.tokenizer import trained_tokenizer  # noqa: E402
from transformer_jax.decoding import decode  # noqa: E402

SIZES = (128, 256)


def main() -> None:
    workdir = sys.argv[1]
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    config, model, params, _ = params_for_inference(TASK, workdir)
    tokenizer = trained_tokenizer(config, workdir)
    test = load_split(config, tokenizer, config.test_split)

    sources = [(src, []) for src, _ in test.pairs]
    batches = {
        size: eval_batches(
            sources,
            batch_size=size,
            buckets=config.buckets,
            sort_by_length=True,
            **special_ids(config.model_config),
        )
        for size in SIZES
    }

    def run(batch: dict) -> float:
        src = jax.device_put(batch["src"])
        start = time.perf_counter()
        tokens, _ = decode.beam_search(
            model,
            params,
            src,
            beam_size=config.beam_size,
            max_len=src.shape[1] + config.decode_margin,
            length_penalty=config.length_penalty,
            best_only=True,
            return_beams=1,
        )
        jax.block_until_ready(tokens)
        return time.perf_counter() - start

    for size in SIZES:  # warm-up: every program compiled or loaded
        for batch in batches[size]:
            run(batch)
    times = {size: [[] for _ in batches[size]] for size in SIZES}
    for r in range(rounds):
        for size in SIZES if r % 2 == 0 else SIZES[::-1]:
            for i, batch in enumerate(batches[size]):
                times[size][i].append(run(batch))
    for size in SIZES:
        medians = [float(np.median(t)) for t in times[size]]
        rows = [
            f"{b['src'].shape[1]} x {int((b['index'] >= 0).sum())}: {m:.2f} s"
            for b, m in zip(batches[size], medians)
        ]
        print(f"batch {size}: {sum(medians):.2f} s in all; " + ", ".join(rows))


if __name__ == "__main__":
    main()
