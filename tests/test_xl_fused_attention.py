"""xl_jax.fused_attention: the Pallas relative-attention kernels (interpreted on the CPU)
against the XLA path of xl_jax.attention: forward and gradients, masks, dropout, bfloat16, a
whole model over segments carrying its memory, and the Triton lowering a GPU would compile."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import calls_to

from xl_jax import TransformerXL, TransformerXLConfig, attention_mask, init_memory, rel_shift
from xl_jax import fused_attention as fa
from xl_jax.attention import use_fused_kernel

B, H, K = 2, 2, 8


def _xla_attention(qu, qv, k, v, r, valid, *, mem_len, same_length, scale, keep=None, rate=0.0):
    """The XLA path's math, written out: content + rel-shifted position scores, the model's
    mask, softmax, optional dropout by a given keep mask, mix."""
    t = qu.shape[1]
    f32 = jnp.promote_types(qu.dtype, jnp.float32)
    pos = rel_shift(jnp.einsum("bthk,shk->bhts", qv, r, preferred_element_type=f32))
    scores = jnp.einsum("bthk,bshk->bhts", qu, k, preferred_element_type=f32) * scale
    scores = scores + pos * scale
    mask = attention_mask(valid, q_len=t, mem_len=mem_len, same_length=same_length)
    weights = jnp.where(mask, jax.nn.softmax(jnp.where(mask, scores, -1e30), -1), 0.0)
    if keep is not None:
        weights = jnp.where(keep, weights / (1.0 - rate), 0.0)
    return jnp.einsum("bhts,bshk->bthk", weights.astype(v.dtype), v)


def _inputs(t, m, dtype=jnp.float32, seed=0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 5)
    s = m + t
    shapes = [(B, t, H, K), (B, t, H, K), (B, s, H, K), (B, s, H, K), (s, H, K)]
    return [jax.random.normal(key, shape).astype(dtype) for key, shape in zip(ks, shapes)]


def _grads(fn, args, cotangent):
    return jax.grad(
        lambda *a: jnp.sum(fn(*a).astype(jnp.float32) * cotangent), argnums=(0, 1, 2, 3, 4)
    )(*args)


@pytest.mark.parametrize(
    "t,m,valid,same_length",
    [
        (16, 16, (16, 5), False),  # one full memory, one partly empty
        (16, 16, (16, 0), True),  # same_length, an empty memory
        (8, 24, (24, 9), False),  # a memory longer than the segment
        (16, 0, (0, 0), False),  # no memory at all
    ],
)
def test_kernels_equal_the_xla_path_in_float32(t, m, valid, same_length):
    args = _inputs(t, m)
    valid = jnp.array(valid)
    kw = dict(mem_len=m, same_length=same_length, scale=K**-0.5)
    fused = lambda *a: fa.relative_attention(*a, valid, block=8, **kw)  # noqa: E731
    plain = lambda *a: _xla_attention(*a, valid, **kw)  # noqa: E731
    chex.assert_trees_all_close(fused(*args), plain(*args), atol=2e-6, rtol=2e-6)
    cotangent = jax.random.normal(jax.random.PRNGKey(9), (B, t, H, K))
    got, want = _grads(fused, args, cotangent), _grads(plain, args, cotangent)
    for name, g, w in zip(("qu", "qv", "k", "v", "r"), got, want):
        assert float(jnp.max(jnp.abs(w))) > 0.1, name  # a gradient that flows
        chex.assert_trees_all_close(g, w, atol=5e-6, rtol=5e-6, custom_message=name)


def test_dropout_is_the_hash_mask_and_drops_at_its_rate():
    t, m, rate = 16, 16, 0.25
    args = _inputs(t, m, seed=1)
    valid = jnp.array([16, 7])
    rng = jax.random.PRNGKey(3)
    kw = dict(mem_len=m, same_length=False, scale=K**-0.5)
    keep = fa.reference_keep_mask(rng, batch=B, heads=H, q_len=t, k_len=m + t, rate=rate)
    # The hash keeps each entry with probability 1 - rate: 2,048 draws land within 4 sigma.
    kept = float(jnp.mean(keep))
    assert abs(kept - (1 - rate)) < 4 * np.sqrt(rate * (1 - rate) / keep.size), kept
    fused = lambda *a: fa.relative_attention(  # noqa: E731
        *a, valid, block=8, dropout_rate=rate, dropout_rng=rng, **kw
    )
    plain = lambda *a: _xla_attention(*a, valid, keep=keep, rate=rate, **kw)  # noqa: E731
    chex.assert_trees_all_close(fused(*args), plain(*args), atol=2e-6, rtol=2e-6)
    cotangent = jax.random.normal(jax.random.PRNGKey(4), (B, t, H, K))
    for g, w in zip(_grads(fused, args, cotangent), _grads(plain, args, cotangent)):
        chex.assert_trees_all_close(g, w, atol=5e-6, rtol=5e-6)
    # Another key, another mask; the same key, the same mask (a resumed step redraws it).
    other = fa.relative_attention(
        *args, valid, block=8, dropout_rate=rate, dropout_rng=jax.random.PRNGKey(5), **kw
    )
    assert float(jnp.max(jnp.abs(other - fused(*args)))) > 1e-2
    chex.assert_trees_all_equal(fused(*args), fused(*args))


def test_bfloat16_agrees_with_float32():
    """bfloat16 inputs: the kernels against the float32 XLA path on the same (rounded) inputs,
    within bfloat16's rounding of the operands and of the weights before the mix."""
    t, m = 16, 16
    args = _inputs(t, m, dtype=jnp.bfloat16, seed=2)
    valid = jnp.array([16, 3])
    kw = dict(mem_len=m, same_length=False, scale=K**-0.5)
    got = fa.relative_attention(*args, valid, block=8, **kw)
    assert got.dtype == jnp.bfloat16
    want = _xla_attention(*[a.astype(jnp.float32) for a in args], valid, **kw)
    err = float(jnp.linalg.norm(got.astype(jnp.float32) - want) / jnp.linalg.norm(want))
    assert err < 1e-2, err
    cotangent = jax.random.normal(jax.random.PRNGKey(6), (B, t, H, K))
    fused = lambda *a: fa.relative_attention(*a, valid, block=8, **kw)  # noqa: E731
    plain = lambda *a: _xla_attention(*a, valid, **kw)  # noqa: E731
    got_g = _grads(fused, args, cotangent)
    want_g = _grads(plain, [a.astype(jnp.float32) for a in args], cotangent)
    for name, g, w in zip(("qu", "qv", "k", "v", "r"), got_g, want_g):
        assert g.dtype == jnp.bfloat16, name
        err = float(jnp.linalg.norm(g.astype(jnp.float32) - w) / jnp.linalg.norm(w))
        assert err < 2e-2, (name, err)


def _lm_config(**overrides):
    return TransformerXLConfig.tiny(
        d_head=8, tgt_len=8, mem_len=16, clamp_len=12, dropout=0.0, **overrides
    )


def test_a_model_over_segments_gives_the_same_losses_and_gradients(monkeypatch):
    """Three segments carrying the memory (empty, partly filled, full), clamp_len on: the
    'pallas' model's per-token losses and parameter gradients equal the 'xla' model's, and
    each of its layers went through the kernels."""
    xla_cfg = _lm_config(attention_impl="xla")
    fused_cfg = _lm_config(attention_impl="pallas")
    tokens = jax.random.randint(jax.random.PRNGKey(0), (B, 3, 8), 0, xla_cfg.vocab_size)
    params = TransformerXL(xla_cfg).init(jax.random.PRNGKey(1), tokens[:, 0])["params"]

    def run(cfg, params):
        memory, losses = init_memory(cfg, B), []
        for seg in range(3):
            nll, memory = TransformerXL(cfg).apply(
                {"params": params}, tokens[:, seg], memory, targets=tokens[:, seg]
            )
            losses.append(nll)
        return jnp.stack(losses)

    calls = calls_to(monkeypatch, fa, "relative_attention")
    chex.assert_trees_all_close(run(fused_cfg, params), run(xla_cfg, params), atol=1e-5)
    assert len(calls) == 3 * fused_cfg.n_layers  # the xla model's none
    grad = lambda cfg: jax.grad(lambda p: jnp.mean(run(cfg, p)))(params)  # noqa: E731
    chex.assert_trees_all_close(grad(fused_cfg), grad(xla_cfg), atol=1e-6, rtol=1e-5)


def test_only_pallas_takes_the_kernels_and_only_where_shapes_allow():
    q = jnp.zeros((B, 8, H, 8))
    valid = jnp.zeros((B,), jnp.int32)
    assert use_fused_kernel(_lm_config(attention_impl="pallas"), q, mem_len=16, valid=valid)
    for impl in ("auto", "xla", "cudnn"):
        assert not use_fused_kernel(_lm_config(attention_impl=impl), q, mem_len=16, valid=valid)
    pallas = _lm_config(attention_impl="pallas")
    assert not use_fused_kernel(pallas, q[:, :1], mem_len=16, valid=valid)  # a decoding step
    assert not use_fused_kernel(pallas, q[..., :6], mem_len=16, valid=valid)  # K not 2^n
    assert not use_fused_kernel(pallas, q, mem_len=16, valid=None)
    with pytest.raises(ValueError, match="attention_impl"):
        _lm_config(attention_impl="flash")


def test_the_kernels_lower_to_triton_for_a_gpu():
    """The forward and both backward kernels go through Pallas' Triton lowering (what a GPU
    compiles), at the enwik8 model's head width in bfloat16: an operation that lowering lacks
    fails here, on a CPU, rather than on the device."""
    t, m, k = 64, 64, 64
    bf = jnp.bfloat16
    shapes = [(B, t, H, k), (B, t, H, k), (B, t + m, H, k), (B, t + m, H, k), (t + m, H, k)]
    args = [jax.ShapeDtypeStruct(s, bf) for s in shapes]

    def loss(*a):
        out = fa.relative_attention(
            *a,
            jnp.array([m, 5]),
            mem_len=m,
            same_length=True,
            scale=k**-0.5,
            dropout_rate=0.1,
            dropout_rng=jax.random.PRNGKey(0),
            block=32,
            interpret=False,
        )
        return jnp.sum(out.astype(jnp.float32))

    lowered = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4))).trace(*args)
    text = lowered.lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("xla.gpu.triton") == 3
