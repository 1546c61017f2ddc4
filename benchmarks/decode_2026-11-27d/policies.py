"""One translate pass's time in a fresh process, first and second, under a shrink rule.

The main job's evaluation decodes test_2016_flickr once, in the training process, so its time
is a first pass: tracing, lowering and loading (or compiling) every program the search
reaches. This decodes the test set twice with a trained model's parameters, the first pass
timed as the main job meets it and the second as a steady one:

    POL=floor python benchmarks/decode_2026-11-27d/policies.py WORKDIR

POL picks the rule of `transformer_jax.decoding.decode._smaller_batch`: `floor` (as shipped: halves,
never below a sixteenth of the batch), `half` (the rule before: halves down to one sentence),
`quarter` (a power of two at most a quarter of the batch), `once` (a quarter of a batch of 64
or more, once), `ladder8` (a quarter, then a sixteenth, ..., never below 8 sentences), `never`.
$ATTENTION_JAX_COMPILATION_CACHE names the persistent cache, as for the commands.
"""

import hashlib
import os
import sys
import time

from train.core.compile_cache import enable_compilation_cache
from train.core.host_memory import keep_host_memory
from train.core.task import eval_params, restore_for_inference
from train.translate.evaluate import translate_pairs
from train.translate.sources import encode_pairs, multi30k_pairs
from train.translate.task import TranslationTask
from train.translate.tokenizer import load_tokenizer
from transformer_jax.decoding import decode


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _ladder8(alive: int, rows: int, batch: int) -> int:
    size = rows
    while size // 4 >= max(alive, 8):
        size //= 4
    return size


RULES = {
    "floor": decode._smaller_batch,
    "half": lambda alive, rows, batch: _pow2(alive) if _pow2(alive) <= rows // 2 else rows,
    "quarter": lambda alive, rows, batch: _pow2(alive) if _pow2(alive) <= rows // 4 else rows,
    "once": lambda alive, rows, batch: rows // 4 if rows >= 64 and alive <= rows // 4 else rows,
    "ladder8": _ladder8,
    "never": lambda alive, rows, batch: rows,
}


def main(workdir: str, rule: str) -> None:
    keep_host_memory()
    enable_compilation_cache()
    decode._smaller_batch = RULES[rule]
    task = TranslationTask()
    config, model, state, dp = restore_for_inference(task, workdir)
    tokenizer = load_tokenizer(config, workdir)
    pairs = encode_pairs(tokenizer, multi30k_pairs(config, "test_2016_flickr"))
    params = eval_params(state)
    seconds = []
    for _ in range(2):
        start = time.perf_counter()
        hypotheses = translate_pairs(model, params, dp, config, tokenizer, pairs)
        seconds.append(time.perf_counter() - start)
    digest = hashlib.md5("\n".join(hypotheses).encode()).hexdigest()[:8]
    print(f"{rule:8s} first {seconds[0]:6.2f} s  steady {seconds[1]:5.2f} s  outputs {digest}")


if __name__ == "__main__":
    main(sys.argv[1], os.environ.get("POL", "floor"))
