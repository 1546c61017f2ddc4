"""Evaluation speed of Transformer-XL with memory against a vanilla sliding window (the XL
paper's Table 9)."""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from train.bench.flops import xl_flops
from train.bench.timing import time_calls
from xl_jax.config import TransformerXLConfig
from xl_jax.memory import init_memory
from xl_jax.model import TransformerXL


def xl_eval_bench(
    xl_config: TransformerXLConfig,
    *,
    attn_lengths: Sequence[int],
    tgt_len: int,
    batch: int,
    vanilla_batch: int,
    repeats: int,
    warmup: int = 1,
) -> list[dict[str, Any]]:
    """Per-token evaluation time, Transformer-XL with memory against a vanilla sliding window.

    For each attention length A:
      XL: segments [batch, tgt_len] with a full memory of M = A slots, the memory fed back
        (donated) from call to call: per token = median call / (batch * tgt_len).
      vanilla: the same network with no memory on windows [vanilla_batch, A]; each window
        yields one new prediction (its last position), as a model without memory that slides
        its window by one token: per token = median call / vanilla_batch.
    Also the analytic forward FLOPs per token of each (`train.bench.flops.xl_flops`).
    """

    model = TransformerXL(xl_config)
    dummy = jnp.ones((1, 8), jnp.int32)
    params = jax.jit(
        lambda r: model.init({"params": r}, dummy, init_memory(xl_config, 1))["params"]
    )(jax.random.PRNGKey(0))
    rng = np.random.default_rng(0)
    tokens = lambda b, t: jnp.asarray(  # noqa: E731
        rng.integers(0, xl_config.vocab_size, (b, t), dtype=np.int32)
    )

    # The memory is donated: each call writes the next memory in place of the last.
    @functools.partial(jax.jit, donate_argnums=(2,))
    def xl_step(params, segment, memory):
        nll, memory = model.apply({"params": params}, segment, memory, segment)
        return jnp.sum(nll), memory

    @jax.jit
    def vanilla_step(params, window):
        empty = init_memory(xl_config, window.shape[0], mem_len=0)
        nll, _ = model.apply({"params": params}, window, empty, window)
        return nll[:, -1]

    results = []
    for a in attn_lengths:
        segment = tokens(batch, tgt_len)
        memory = init_memory(xl_config, batch, mem_len=a)
        # A filled memory, one buffer per layer (init_memory shares one zeros array between
        # the layers, and a buffer cannot be donated twice in one call).
        memory = memory.replace(
            hidden=tuple(jnp.array(h, copy=True) for h in memory.hidden),
            valid=jnp.full_like(memory.valid, a),
        )

        def xl_call(segment=segment):
            nonlocal memory
            loss, memory = xl_step(params, segment, memory)
            return loss

        window = tokens(vanilla_batch, a)
        start = time.perf_counter()
        jax.block_until_ready(xl_call())
        xl_first = time.perf_counter() - start
        xl_times = time_calls(xl_call, warmup=warmup, repeats=repeats)
        start = time.perf_counter()
        jax.block_until_ready(vanilla_step(params, window))
        vanilla_first = time.perf_counter() - start
        vanilla_times = time_calls(
            lambda window=window: vanilla_step(params, window), warmup=warmup, repeats=repeats
        )
        xl_token = statistics.median(xl_times) / (batch * tgt_len)
        vanilla_token = statistics.median(vanilla_times) / vanilla_batch
        xl_f = xl_flops(xl_config, batch=batch, tgt_len=tgt_len, mem_len=a)
        vanilla_f = xl_flops(xl_config, batch=vanilla_batch, tgt_len=a, mem_len=0)
        results.append(
            {
                "attn_len": a,
                "xl_tgt_len": tgt_len,
                "xl_batch": batch,
                "vanilla_batch": vanilla_batch,
                "xl_s_per_token": xl_token,
                "vanilla_s_per_token": vanilla_token,
                "speedup": vanilla_token / xl_token,
                "xl_flops_per_token": xl_f.forward(executed=True) / (batch * tgt_len),
                "vanilla_flops_per_token": vanilla_f.forward(executed=True) / vanilla_batch,
                "xl_first_call_s": xl_first,
                "vanilla_first_call_s": vanilla_first,
                "xl_times_s": xl_times,
                "vanilla_times_s": vanilla_times,
            }
        )
        results[-1]["flop_ratio"] = (
            results[-1]["vanilla_flops_per_token"] / results[-1]["xl_flops_per_token"]
        )
    return results
