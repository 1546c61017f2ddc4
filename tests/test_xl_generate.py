"""generate: greedy decoding equals step-by-step apply with the carried memory and argmax."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from xl_jax import TransformerXL, TransformerXLConfig, generate, init_memory, sampling_logits


def _model(**overrides):
    cfg = TransformerXLConfig.tiny(tgt_len=4, mem_len=6, **overrides)
    model = TransformerXL(cfg)
    params = model.init(jax.random.key(0), jnp.zeros((2, 4), jnp.int32), init_memory(cfg, 2))[
        "params"
    ]
    # A larger embedding (tied to the softmax) spreads the logits, so argmax has no near-ties.
    params["word_emb"]["emb_0"] = params["word_emb"]["emb_0"] * 20
    return model, params


def _teacher_forced(model, params, prompt, continuation, memory):
    """Prompt in tgt_len segments, then one token at a time: log-probs before each new token."""
    cfg = model.config
    for s in range(0, prompt.shape[1], cfg.tgt_len):
        logprobs, memory = model.apply({"params": params}, prompt[:, s : s + cfg.tgt_len], memory)
    out = [logprobs[:, -1]]
    for i in range(continuation.shape[1] - 1):
        logprobs, memory = model.apply({"params": params}, continuation[:, i : i + 1], memory)
        out.append(logprobs[:, -1])
    return np.stack(out, axis=1)  # [B, N, V]


@pytest.mark.parametrize("prompt_len,mem_len", [(7, None), (4, None), (1, 10)])
def test_greedy_equals_step_by_step_argmax(prompt_len, mem_len):
    model, params = _model()
    prompt = jax.random.randint(jax.random.key(5), (2, prompt_len), 0, 64)
    memory = None if mem_len is None else init_memory(model.config, 2, mem_len=mem_len)
    got = generate(
        model, params, prompt, num_tokens=9, rng=jax.random.key(1), top_k=1, memory=memory
    )
    assert got.shape == (2, 9) and got.dtype == jnp.int32

    # Reference: argmax, then feed that token alone with the carried memory.
    cfg = model.config
    mem = init_memory(cfg, 2, mem_len=mem_len)
    for s in range(0, prompt_len, cfg.tgt_len):
        logprobs, mem = model.apply({"params": params}, prompt[:, s : s + cfg.tgt_len], mem)
    want = []
    for _ in range(9):
        token = jnp.argmax(logprobs[:, -1], axis=-1)
        want.append(np.asarray(token))
        logprobs, mem = model.apply({"params": params}, token[:, None], mem)
    np.testing.assert_array_equal(got, np.stack(want, axis=1))


def test_top_k_samples_stay_in_top_k_and_follow_rng():
    model, params = _model()
    prompt = jax.random.randint(jax.random.key(6), (2, 5), 0, 64)
    a = generate(
        model, params, prompt, num_tokens=12, rng=jax.random.key(1), top_k=3, temperature=2.0
    )
    b = generate(
        model, params, prompt, num_tokens=12, rng=jax.random.key(1), top_k=3, temperature=2.0
    )
    c = generate(
        model, params, prompt, num_tokens=12, rng=jax.random.key(2), top_k=3, temperature=2.0
    )
    np.testing.assert_array_equal(a, b)
    assert (np.asarray(a) != np.asarray(c)).any()
    logprobs = _teacher_forced(model, params, prompt, a, init_memory(model.config, 2))
    top3 = np.argsort(-logprobs, axis=-1)[..., :3]
    assert (top3 == np.asarray(a)[..., None]).any(-1).all()


def test_generate_validates_arguments():
    model, params = _model()
    prompt = jnp.zeros((1, 3), jnp.int32)
    with pytest.raises(ValueError, match="temperature"):
        generate(model, params, prompt, num_tokens=2, rng=jax.random.key(0), temperature=0.0)
    with pytest.raises(ValueError, match="top_k"):
        generate(model, params, prompt, num_tokens=2, rng=jax.random.key(0), top_k=0)
    with pytest.raises(ValueError, match="top_p"):
        generate(model, params, prompt, num_tokens=2, rng=jax.random.key(0), top_p=0.0)
    with pytest.raises(ValueError, match="prompt"):
        generate(model, params, jnp.zeros((1, 0), jnp.int32), num_tokens=2, rng=jax.random.key(0))


LOGPROBS = jax.nn.log_softmax(jnp.array([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]]))  # [1, 6]


def _frequencies(logits, draws=40000):
    samples = jax.random.categorical(jax.random.key(3), logits, shape=(draws, 1))
    return np.bincount(np.asarray(samples[:, 0]), minlength=logits.shape[-1]) / draws


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.5])
def test_temperature_divides_the_logits_and_sets_the_sampled_frequencies(temperature):
    logits = sampling_logits(LOGPROBS, temperature=temperature)
    np.testing.assert_allclose(logits, LOGPROBS / temperature, rtol=1e-6)
    want = np.asarray(jax.nn.softmax(LOGPROBS[0] / temperature))
    # 40000 seeded draws: the frequencies are within 4 standard errors of softmax(logits / T).
    np.testing.assert_array_less(
        np.abs(_frequencies(logits) - want), 4 * np.sqrt(want * (1 - want) / 40000) + 1e-9
    )
    # Below 1 the distribution sharpens (the top token gains), above 1 it flattens.
    plain = float(jax.nn.softmax(LOGPROBS[0])[0])
    assert np.sign(want[0] - plain) == np.sign(1.0 - temperature)


def test_top_p_keeps_the_smallest_nucleus():
    probs = np.asarray(jax.nn.softmax(LOGPROBS[0]))  # descending already
    cumulative = np.cumsum(probs)
    for top_p in (0.1, 0.6, 0.8, 0.95, 1.0):
        kept = np.isfinite(np.asarray(sampling_logits(LOGPROBS, top_p=top_p))[0])
        n = int(np.searchsorted(cumulative, top_p) + 1)  # fewest tokens reaching top_p
        np.testing.assert_array_equal(kept, np.arange(6) < min(n, 6))
    # After top_k the nucleus is taken from the renormalised top k.
    kept = np.isfinite(np.asarray(sampling_logits(LOGPROBS, top_k=2, top_p=0.99))[0])
    np.testing.assert_array_equal(kept, np.arange(6) < 2)
    freq = _frequencies(sampling_logits(LOGPROBS, top_p=0.8))
    assert freq[3:].sum() == 0.0 and np.all(freq[:3] > 0.0)


def test_top_p_generation_stays_in_the_nucleus():
    model, params = _model()
    prompt = jax.random.randint(jax.random.key(6), (2, 5), 0, 64)
    got = generate(model, params, prompt, num_tokens=8, rng=jax.random.key(1), top_p=0.5)
    logprobs = _teacher_forced(model, params, prompt, got, init_memory(model.config, 2))
    allowed = np.isfinite(np.asarray(sampling_logits(jnp.asarray(logprobs), top_p=0.5)))
    assert np.take_along_axis(allowed, np.asarray(got)[..., None], axis=-1).all()
