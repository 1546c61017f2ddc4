"""Benchmark: the adaptive softmax's NLL at the wt103_base vocabulary, grouped tails vs dense.

    python -m train.bench.adaptive_softmax [--tokens 300] [--repeats 3]

Times one training step of the softmax layer alone (the mean NLL and its gradients with
respect to the hidden states, the tied table and the softmax's own parameters) under `jit`, for
`softmax_tails='grouped'` and `'dense'`, on targets drawn from a Zipf(1) law over the 267,735
ids (the shape of a word-level unigram distribution: ~80% of tokens fall in the 20k shortlist).
FLOPs are counted from the matrix products (forward, plus twice that backward); the grouped
count uses the capacities the `lax.switch` actually picks for these targets.

The logic is `bench_adaptive_softmax`, importable; the results are recorded in
benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from xl_jax import AdaptiveEmbedding, ProjectedAdaptiveLogSoftmax, TransformerXLConfig
from xl_jax.adaptive import capacity_ladder


def zipf_targets(rng: np.random.Generator, vocab_size: int, n: int) -> np.ndarray:
    """n ids with P(id) proportional to 1 / (id + 1)."""
    p = 1.0 / np.arange(1, vocab_size + 1)
    return rng.choice(vocab_size, size=n, p=p / p.sum()).astype(np.int32)


def matmul_flops(config: TransformerXLConfig, targets: np.ndarray, mode: str) -> float:
    """FLOPs of the softmax's products for one step (forward + backward = 3 x forward)."""
    bounds, e = config.cluster_bounds, config.d_embed
    n = targets.size
    n_clusters = len(config.cutoffs)
    head_rows = bounds[1] + n_clusters
    if mode == "dense":
        rows = n * (head_rows + config.vocab_size - bounds[1])
    else:
        ladder = np.asarray(capacity_ladder(n))
        rows = n * head_rows
        for c in range(1, n_clusters + 1):
            count = int(((targets >= bounds[c]) & (targets < bounds[c + 1])).sum())
            rows += int(ladder[np.searchsorted(ladder, count)]) * (bounds[c + 1] - bounds[c])
    return 3 * 2.0 * e * rows


def bench_adaptive_softmax(
    *, tokens: int = 300, repeats: int = 3, seed: int = 0
) -> dict[str, dict[str, float]]:
    """{'grouped': {...}, 'dense': {...}}: seconds per step (median), GFLOPs per step, and
    the mean NLL (equal in both)."""
    base = TransformerXLConfig.wt103_base()
    rng = np.random.default_rng(seed)
    targets = jnp.asarray(zipf_targets(rng, base.vocab_size, tokens)[None])  # [1, N]
    hidden = jnp.asarray(rng.normal(size=(1, tokens, base.d_model)), jnp.float32)
    emb = AdaptiveEmbedding(base)
    emb_params = emb.init(jax.random.key(0), targets)["params"]
    results = {}
    for mode in ("grouped", "dense"):
        cfg = base.replace(softmax_tails=mode)
        crit = ProjectedAdaptiveLogSoftmax(cfg)

        def loss(emb_params, crit_params, hidden, crit=crit, cfg=cfg):
            tables, projs = AdaptiveEmbedding(cfg).apply(
                {"params": emb_params}, method=AdaptiveEmbedding.tied_parameters
            )
            nll = crit.apply(
                {"params": crit_params}, hidden, targets, tied_tables=tables, tied_projs=projs
            )
            return nll.mean()

        tables, projs = emb.apply({"params": emb_params}, method=AdaptiveEmbedding.tied_parameters)
        crit_params = crit.init(jax.random.key(1), hidden, tied_tables=tables, tied_projs=projs)[
            "params"
        ]
        step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
        value, grads = step(emb_params, crit_params, hidden)  # compile
        jax.block_until_ready(grads)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            jax.block_until_ready(step(emb_params, crit_params, hidden))
            times.append(time.perf_counter() - start)
        results[mode] = {
            "seconds_per_step": float(np.median(times)),
            "gflops_per_step": matmul_flops(cfg, np.asarray(targets), mode) / 1e9,
            "mean_nll": float(value),
        }
    return results


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(
        json.dumps(
            bench_adaptive_softmax(tokens=args.tokens, repeats=args.repeats, seed=args.seed),
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
