"""Beam-search speed: sentences per second of `transformer_jax.decode.beam_search` over
Multi30k test_2016_flickr."""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from train.bench.config import BenchConfig
from train.bench.timing import time_calls
from train.data.batching import DEFAULT_BUCKETS, eval_batches
from train.data.tokenizers import multi30k_tokenizer
from train.translate import encode_source
from transformer_jax.config import TransformerConfig
from transformer_jax.decode import beam_search
from transformer_jax.model import Transformer


def decode_bench(
    model,
    params,
    sources: Sequence[Sequence[int]],
    *,
    beam_size: int,
    batch_size: int,
    margin: int,
    repeats: int,
    buckets: Sequence[int] | None = None,
) -> dict[str, Any]:
    """Beam search over every source (token ids ending in EOS), in the evaluation batches of
    `train.data.batching.eval_batches` (one compiled shape per bucket in use), output length
    bucket + margin as `train.translate`. A first pass compiles every shape; then `repeats`
    timed passes (each blocked at its end) -> sentences per second of the median pass."""

    batches = eval_batches(
        [(list(s), []) for s in sources], batch_size=batch_size, buckets=buckets or DEFAULT_BUCKETS
    )
    device = jax.local_devices()[0]
    srcs = [jax.device_put(batch["src"], device) for batch in batches]

    def decode_all():
        return [
            beam_search(model, params, src, beam_size=beam_size, max_len=src.shape[1] + margin)[0]
            for src in srcs
        ]

    start = time.perf_counter()
    outputs = jax.block_until_ready(decode_all())
    first_pass_s = time.perf_counter() - start
    times = time_calls(decode_all, warmup=0, repeats=repeats)
    median = statistics.median(times)
    pad = model.config.pad_id
    real = [batch["index"] >= 0 for batch in batches]
    generated = sum(
        int(np.sum(np.asarray(out)[:, 0][keep] != pad)) for out, keep in zip(outputs, real)
    )
    return {
        "sentences": len(sources),
        "beam_size": beam_size,
        "batch": batch_size,
        "shapes": sorted({tuple(int(n) for n in s.shape) for s in srcs}),
        "first_pass_s": first_pass_s,  # compiling every shape + one pass
        "pass_s_median": median,
        "pass_times_s": times,
        "sentences_per_s": len(sources) / median,
        "output_tokens": generated,
        "output_tokens_per_s": generated / median,
    }


def multi30k_decode_bench(config: BenchConfig, *, cache_dir: str) -> dict[str, Any]:
    """`decode_bench` on Multi30k test_2016_flickr with a random-init `config.decode_model`."""
    from train.data.datasets import load_multi30k  # lazy: importing TFDS is not free

    tokenizer = multi30k_tokenizer(
        os.path.join(cache_dir, "tokenizer"), vocab_size=config.decode_vocab_size
    )
    pairs = load_multi30k("test_2016_flickr")
    if config.decode_sentences:
        pairs = pairs[: config.decode_sentences]
    sources = encode_source(tokenizer, [de for de, _ in pairs])
    cfg = config.decode_model.replace(
        src_vocab_size=tokenizer.vocab_size, tgt_vocab_size=tokenizer.vocab_size
    )
    model = Transformer(cfg)
    dummy = jnp.ones((1, 8), jnp.int32)
    params = jax.jit(lambda r: model.init({"params": r}, dummy, dummy)["params"])(
        jax.random.PRNGKey(0)
    )
    result = decode_bench(
        model,
        params,
        sources,
        beam_size=config.beam_size,
        batch_size=config.decode_batch,
        margin=config.decode_margin,
        repeats=config.decode_repeats,
    )
    result.update(
        split="test_2016_flickr",
        model=_transformer_name(cfg),
        dtype=config.dtype,
        weights="random init",
    )
    return result


def _transformer_name(cfg: TransformerConfig) -> str:
    return (
        f"Transformer {cfg.n_encoder_layers}+{cfg.n_decoder_layers} x {cfg.d_model}, "
        f"V {cfg.tgt_vocab_size}"
    )
