"""A trained run's test-set translation at several eval batch sizes, in one process: a
warm-up pass each (are the translations the same as the first size's?), then ROUNDS passes
each, interleaved (the order reversed every other round).

    python benchmarks/decode_2026-11-28/steady_ab.py WORKDIR [ROUNDS [SIZE ...]]
"""

import dataclasses
import sys
import time

from train.core import compile_cache, host_memory

host_memory.keep_host_memory()
compile_cache.enable_compilation_cache()

from train.core.task import params_for_inference  # noqa: E402
from train.translate import evaluate  # noqa: E402
from train.translate.sources import load_split  # noqa: E402
from train.translate.task import TASK  # noqa: E402
from train.translate.tokenizer import trained_tokenizer  # noqa: E402


def main() -> None:
    workdir = sys.argv[1]
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 4
    sizes = tuple(int(a) for a in sys.argv[3:]) or (128, 256)
    config, model, params, dp = params_for_inference(TASK, workdir)
    tokenizer = trained_tokenizer(config, workdir)
    test = load_split(config, tokenizer, config.test_split)

    def one(size: int) -> tuple[float, list[str]]:
        c = dataclasses.replace(config, eval_batch_size=size)
        start = time.perf_counter()
        out = evaluate.translate_pairs(model, params, dp, c, tokenizer, test.pairs)
        return time.perf_counter() - start, out

    first = {}
    for size in sizes:
        took, first[size] = one(size)
        same = first[size] == first[sizes[0]]
        print(f"warm-up, batch {size}: {took:.2f} s, translations as batch {sizes[0]}'s: {same}")
    times: dict[int, list[float]] = {size: [] for size in sizes}
    for r in range(rounds):
        for size in sizes if r % 2 == 0 else sizes[::-1]:
            times[size].append(one(size)[0])
    for size, ts in times.items():
        print(
            f"batch {size}: " + " ".join(f"{t:.2f}" for t in ts),
            f"median {sorted(ts)[len(ts) // 2]:.2f} s",
        )


if __name__ == "__main__":
    main()
