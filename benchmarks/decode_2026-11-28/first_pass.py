"""A trained run's test-set translation (the beam search of the CPU main job's evaluation) in
this process, pass after pass, with JAX's compile events of the first pass added up.

    python benchmarks/decode_2026-11-28/first_pass.py WORKDIR [--eval_batch_size N]
        [--passes P] [--stages wide]

The persistent compilation cache is the commands' own (`train.core.compile_cache`; set
JAX_COMPILATION_CACHE_DIR, with JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0.2, for a cache of
the experiment's own). `--stages wide` decodes in cache stages of 32, 64, ... where the output
can reach twice the stage (a variant tried, not kept).
"""

import argparse
import collections
import dataclasses
import time

import jax.monitoring

from train.core import compile_cache, host_memory

host_memory.keep_host_memory()
compile_cache.enable_compilation_cache()

seconds: dict = collections.defaultdict(float)
events: collections.Counter = collections.Counter()
phase = ["setup"]


def on_event(event: str, duration: float, **kwargs) -> None:
    key = (phase[0], event.rsplit("/", 1)[-1], kwargs.get("fun_name", ""))
    seconds[key] += duration
    events[key] += 1


jax.monitoring.register_event_duration_secs_listener(on_event)

from train.core.task import params_for_inference  # noqa: E402
from train.translate import evaluate  # noqa: E402
from train.translate.sources import load_split  # noqa: E402
from train.translate.task import TASK  # noqa: E402
from train.translate.tokenizer import trained_tokenizer  # noqa: E402
from transformer_jax.decoding import decode  # noqa: E402


def wide_stages(max_len: int, first: int = 32) -> tuple[int, ...]:
    stages = []
    while 2 * first <= max_len:
        stages.append(first)
        first *= 2
    return (*stages, max_len)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("workdir")
    parser.add_argument("--eval_batch_size", type=int, default=None, help="default: the run's")
    parser.add_argument("--passes", type=int, default=1)
    parser.add_argument("--stages", choices=("default", "wide"), default="default")
    args = parser.parse_args()
    if args.stages == "wide":
        decode.cache_stages = wide_stages
    config, model, params, dp = params_for_inference(TASK, args.workdir)
    if args.eval_batch_size:
        config = dataclasses.replace(config, eval_batch_size=args.eval_batch_size)
    tokenizer = trained_tokenizer(config, args.workdir)
    test = load_split(config, tokenizer, config.test_split)
    for p in range(args.passes):
        phase[0] = f"pass {p}"
        start = time.perf_counter()
        hypotheses = evaluate.translate_pairs(model, params, dp, config, tokenizer, test.pairs)
        took = time.perf_counter() - start
        bleu = evaluate.bleu(hypotheses, test.references)
        print(f"eval batch {config.eval_batch_size}, pass {p}: {took:.2f} s, BLEU {bleu:.2f}")
    first = collections.defaultdict(float)
    count: collections.Counter = collections.Counter()
    for key, s in seconds.items():
        if key[0] == "pass 0":
            first[key[1]] += s
            count[key[1]] += events[key]
    print("pass 0:", ", ".join(f"{e} {s:.2f} s x{count[e]}" for e, s in sorted(first.items())))


if __name__ == "__main__":
    main()
