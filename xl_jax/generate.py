"""Sampling from a Transformer-XL: the memory is the only context carried between tokens.

Shapes (transformer_jax/shapes.py): B batch, P prompt length, G tokens to generate, M memory
length, V vocabulary.

The prompt is read in segments of `config.tgt_len` (as in evaluation), then each new token is
one call with T = 1: it attends to the M memory slots and itself, so a token costs O(M), not
O(history). Everything after the prompt runs in one `lax.scan` under `jit`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from xl_jax.config import TransformerXLConfig
from xl_jax.memory import Memory, init_memory
from xl_jax.model import TransformerXL

Array = jax.Array


@functools.partial(jax.jit, static_argnums=0)
def _read(
    config: TransformerXLConfig, params, tokens: Array, memory: Memory
) -> tuple[Array, Memory]:
    """One segment [B, T] -> (log-probs of the next token after it [B, V], memory)."""
    logprobs, memory = TransformerXL(config).apply({"params": params}, tokens, memory)
    return logprobs[:, -1], memory


def sampling_logits(
    logprobs: Array,
    *,
    temperature: Array | float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
) -> Array:
    """The logits `generate` samples from: [B, V] log-probs -> [B, V], -inf where excluded.

    logprobs / temperature, then (if given) only the top_k largest kept, then (if given) only
    the nucleus: the fewest most probable tokens whose probabilities (after temperature and
    top_k) sum to at least top_p (Holtzman et al. 2020). The most probable token is always
    kept, and a token tied with the last one kept is kept too.
    """
    logits = logprobs / temperature
    if top_k is not None:
        kth = jax.lax.top_k(logits, top_k)[0][..., -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if top_p is not None:
        probs = jax.nn.softmax(logits, axis=-1)
        ranked = -jnp.sort(-probs, axis=-1)  # [B, V] descending
        # Keep a ranked token while the mass before it is still short of top_p.
        keep = (jnp.cumsum(ranked, axis=-1) - ranked) < top_p
        smallest_kept = jnp.min(jnp.where(keep, ranked, jnp.inf), axis=-1, keepdims=True)
        logits = jnp.where(probs < smallest_kept, -jnp.inf, logits)
    return logits


def _sample(
    logprobs: Array, rng: Array, temperature: Array, top_k: int | None, top_p: float | None
) -> Array:
    """[B, V] -> [B] int32, drawn from softmax(sampling_logits(...))."""
    logits = sampling_logits(logprobs, temperature=temperature, top_k=top_k, top_p=top_p)
    return jax.random.categorical(rng, logits, axis=-1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnums=(0, 5, 6, 7))
def _decode(
    config: TransformerXLConfig,
    params,
    logprobs: Array,
    memory: Memory,
    rng: Array,
    num_tokens: int,
    top_k: int | None,
    top_p: float | None,
    temperature: Array,
) -> Array:
    first = _sample(logprobs, jax.random.fold_in(rng, 0), temperature, top_k, top_p)

    def step(carry, i):
        token, memory = carry
        logprobs, memory = TransformerXL(config).apply({"params": params}, token[:, None], memory)
        nxt = _sample(logprobs[:, -1], jax.random.fold_in(rng, i), temperature, top_k, top_p)
        return (nxt, memory), nxt

    _, rest = jax.lax.scan(step, (first, memory), jnp.arange(1, num_tokens))
    return jnp.concatenate([first[:, None], rest.T], axis=1)


def generate(
    model: TransformerXL,
    params,
    prompt: Array,  # [B, P] int, P >= 1
    *,
    num_tokens: int,
    rng: Array,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    memory: Memory | None = None,  # default: an empty memory of config.mem_len slots
) -> Array:  # [B, G] int32, the tokens after the prompt
    """Continue `prompt` by `num_tokens` sampled tokens. `top_k=1` is greedy decoding.

    Each token is drawn from softmax(logits / temperature), restricted to the top_k most
    probable tokens and then to the top_p nucleus when those are given (`sampling_logits`).
    """
    cfg = model.config
    prompt = jnp.asarray(prompt, jnp.int32)
    if prompt.ndim != 2 or prompt.shape[1] < 1:
        raise ValueError(f"prompt must be [B, P] with P >= 1, got shape {prompt.shape}")
    if num_tokens < 1:
        raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature} (use top_k=1 for greedy)")
    if top_k is not None and not 1 <= top_k <= cfg.vocab_size:
        raise ValueError(f"top_k must be in [1, vocab_size], got {top_k}")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if memory is None:
        memory = init_memory(cfg, prompt.shape[0])
    for s in range(0, prompt.shape[1], cfg.tgt_len):
        logprobs, memory = _read(cfg, params, prompt[:, s : s + cfg.tgt_len], memory)
    return _decode(
        cfg,
        params,
        logprobs,
        memory,
        rng,
        num_tokens,
        top_k,
        None if top_p is None else float(top_p),
        jnp.asarray(temperature, logprobs.dtype),
    )
