"""xl_jax.attention: rel_shift against an explicit gather, relative attention against NumPy."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from xl_jax import (
    RelativeMultiHeadAttention,
    TransformerXLConfig,
    attention_mask,
    rel_shift,
    sinusoid_embedding,
)


@pytest.mark.parametrize("t,s", [(5, 5), (3, 7), (1, 4), (4, 12)])
def test_rel_shift_equals_gather(t, s):
    x = np.random.default_rng(0).normal(size=(2, 3, t, s)).astype(np.float32)
    got = np.asarray(rel_shift(jnp.asarray(x)))
    m = s - t
    for i in range(t):
        for j in range(s):
            dist = m + i - j
            if dist < 0:
                continue  # future keys: unspecified, masked by the model
            # R runs S-1 ... 0, so distance `dist` is column S - 1 - dist.
            np.testing.assert_array_equal(got[..., i, j], x[..., i, s - 1 - dist])


def test_rel_shift_rejects_fewer_keys_than_queries():
    with pytest.raises(ValueError, match="S >= T"):
        rel_shift(jnp.zeros((3, 2)))


def test_sinusoid_embedding_formula():
    d = 6
    dist = np.array([4.0, 2.0, 0.0])
    got = np.asarray(sinusoid_embedding(jnp.asarray(dist), d))
    for r, p in enumerate(dist):
        for k in range(d // 2):
            freq = 10000.0 ** (-2 * k / d)
            np.testing.assert_allclose(got[r, k], np.sin(p * freq), rtol=1e-6, atol=1e-6)
            np.testing.assert_allclose(got[r, d // 2 + k], np.cos(p * freq), rtol=1e-6, atol=1e-6)


def _layer_norm(x, scale, bias, eps):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * scale + bias


def _slow_relative_attention(p, h, mem, valid, u, v, cfg, clamp_len):
    """Loops over batch, head, query, key: (a) + (b) + (c) + (d), softmax, mix, o, LN."""
    B, T, D = h.shape
    M = mem.shape[1]
    H, K = cfg.n_heads, cfg.d_head
    ln = p["layer_norm"]
    cat = np.concatenate([mem, h], axis=1)
    if cfg.norm_first:
        cat = _layer_norm(cat, ln["scale"], ln["bias"], cfg.layer_norm_eps)
    w = p["qkv"]["kernel"]  # [D, 3, H, K]
    q = np.einsum("bsd,dhk->bshk", cat, w[:, 0])[:, M:]
    k = np.einsum("bsd,dhk->bshk", cat, w[:, 1])
    val = np.einsum("bsd,dhk->bshk", cat, w[:, 2])
    w_r = p["r_net"]["kernel"]  # [D, H, K]
    out = np.zeros((B, T, H, K))
    for b in range(B):
        for n in range(H):
            for i in range(T):
                scores, keys = [], []
                for j in range(M + T):
                    dist = M + i - j
                    if dist < 0 or j < M - valid[b]:
                        continue
                    pd = min(dist, clamp_len) if clamp_len > 0 else dist
                    freqs = 10000.0 ** (-np.arange(0, D, 2) / D)
                    r = np.concatenate([np.sin(pd * freqs), np.cos(pd * freqs)])
                    wr = r @ w_r[:, n]  # W_kR R_{i-j}
                    a = q[b, i, n] @ k[b, j, n]
                    bb = q[b, i, n] @ wr
                    c = u[n] @ k[b, j, n]
                    d = v[n] @ wr
                    scores.append((a + bb + c + d) / np.sqrt(K))
                    keys.append(j)
                e = np.exp(np.array(scores) - max(scores))
                prob = e / e.sum()
                out[b, i, n] = sum(pr * val[b, j, n] for pr, j in zip(prob, keys))
    o = np.einsum("bthk,hkd->btd", out, p["o_net"]["kernel"])
    if cfg.norm_first:
        return h + o
    return _layer_norm(h + o, ln["scale"], ln["bias"], cfg.layer_norm_eps)


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("clamp_len", [-1, 3])
def test_relative_attention_matches_slow_numpy(norm_first, clamp_len):
    cfg = TransformerXLConfig.tiny(
        d_model=16, n_heads=2, d_head=5, norm_first=norm_first, clamp_len=clamp_len
    )
    B, T, M = 2, 3, 4
    rng = np.random.default_rng(1)
    h = rng.normal(size=(B, T, cfg.d_model)).astype(np.float32)
    mem = rng.normal(size=(B, M, cfg.d_model)).astype(np.float32)
    u = rng.normal(size=(cfg.n_heads, cfg.d_head)).astype(np.float32)
    v = rng.normal(size=(cfg.n_heads, cfg.d_head)).astype(np.float32)
    valid = np.array([4, 2], np.int32)  # row 1: two memory slots not yet filled

    from xl_jax.attention import relative_positions

    pos = sinusoid_embedding(relative_positions(cfg, q_len=T, mem_len=M), cfg.d_model)
    mask = attention_mask(jnp.asarray(valid), q_len=T, mem_len=M, same_length=False)
    module = RelativeMultiHeadAttention(cfg)
    params = module.init(jax.random.key(0), h, mem, pos, mask, u, v)["params"]
    # Non-trivial LayerNorm parameters, so a missing or misplaced LN cannot pass.
    params["layer_norm"] = {
        "scale": jnp.asarray(rng.normal(size=cfg.d_model) + 1.0, jnp.float32),
        "bias": jnp.asarray(rng.normal(size=cfg.d_model), jnp.float32),
    }
    got = module.apply({"params": params}, h, mem, pos, mask, u, v)
    np_params = jax.tree.map(lambda x: np.asarray(x, np.float64), params)
    want = _slow_relative_attention(
        np_params,
        h.astype(np.float64),
        mem.astype(np.float64),
        valid,
        u.astype(np.float64),
        v.astype(np.float64),
        cfg,
        clamp_len,
    )
    chex.assert_shape(got, (B, T, cfg.d_model))
    chex.assert_trees_all_close(np.asarray(got, np.float64), want, rtol=2e-5, atol=2e-5)


def _reference_style_mask(*, qlen, mlen, mem_len, same_length):
    """The reference's mask, in its own coordinates (keys = the mlen real memory + segment):
    True = masked, from triu(ones, 1 + mlen) (+ tril(ones, -shift) with same_length)."""
    klen = mlen + qlen
    ones = np.ones((qlen, klen), bool)
    masked = np.triu(ones, 1 + mlen)
    if same_length:
        shift = qlen - (klen - mem_len) if klen - mem_len > 0 else qlen
        masked = masked | np.tril(ones, -shift)
    return masked


@pytest.mark.parametrize("same_length", [False, True])
@pytest.mark.parametrize("qlen,mem_len", [(3, 5), (5, 3), (4, 4), (1, 6)])
def test_mask_matches_reference_for_every_fill_level(same_length, qlen, mem_len):
    for mlen in range(mem_len + 1):
        got = np.asarray(
            attention_mask(jnp.array([mlen]), q_len=qlen, mem_len=mem_len, same_length=same_length)
        )[0, 0]
        ref_masked = _reference_style_mask(
            qlen=qlen, mlen=mlen, mem_len=mem_len, same_length=same_length
        )
        # Our keys: M - mlen unfilled slots, then the reference's keys.
        np.testing.assert_array_equal(got[:, : mem_len - mlen], False)
        np.testing.assert_array_equal(got[:, mem_len - mlen :], ~ref_masked)


@pytest.mark.parametrize(
    "clamp_len, want",
    [
        (-1, [5, 4, 3, 2, 1, 0]),
        (0, [5, 4, 3, 2, 1, 0]),
        (1, [1, 1, 1, 1, 1, 0]),
        (3, [3, 3, 3, 2, 1, 0]),
        (5, [5, 4, 3, 2, 1, 0]),
    ],
)
def test_relative_positions_run_from_s_minus_1_to_0_clamped_only_when_positive(clamp_len, want):
    from xl_jax.attention import relative_positions

    cfg = TransformerXLConfig.tiny(clamp_len=clamp_len)
    assert relative_positions(cfg, q_len=2, mem_len=4).tolist() == want
    assert relative_positions(cfg, q_len=1, mem_len=0).tolist() == [0]
    # Lengths that share bits (3 + 3 is not 3 ^ 3) and a memory as long as the segment.
    seven = relative_positions(cfg, q_len=4, mem_len=3).tolist()
    assert seven == [min(d, clamp_len) if clamp_len > 0 else d for d in range(6, -1, -1)]


def _sublayer_inputs(cfg, *, t=3, m=4, seed=2):
    from xl_jax.attention import relative_positions

    rng = np.random.default_rng(seed)
    h = jnp.asarray(rng.normal(size=(2, t, cfg.d_model)), jnp.float32)
    mem = jnp.asarray(rng.normal(size=(2, m, cfg.d_model)), jnp.float32)
    u = jnp.asarray(rng.normal(size=(cfg.n_heads, cfg.d_head)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(cfg.n_heads, cfg.d_head)), jnp.float32)
    pos = sinusoid_embedding(relative_positions(cfg, q_len=t, mem_len=m), cfg.d_model)
    mask = attention_mask(jnp.array([m, 1]), q_len=t, mem_len=m, same_length=False)
    return h, mem, pos, mask, u, v


def test_dropatt_draws_the_dropout_rng_only_when_training_with_a_rate():
    cfg = TransformerXLConfig.tiny(d_model=16, n_heads=2, d_head=4, dropatt=0.5, dropout=0.0)
    args = _sublayer_inputs(cfg)
    module = RelativeMultiHeadAttention(cfg)
    params = module.init(jax.random.key(0), *args)
    quiet = module.apply(params, *args)  # deterministic: no rng asked
    with pytest.raises(Exception, match="dropout"):
        module.apply(params, *args, deterministic=False)
    drop = lambda key: module.apply(  # noqa: E731
        params, *args, deterministic=False, rngs={"dropout": jax.random.key(key)}
    )
    assert not np.allclose(drop(1), quiet, atol=1e-3)
    np.testing.assert_array_equal(drop(1), drop(1))
    assert not np.allclose(drop(1), drop(2), atol=1e-3)
    # No rate: training asks for no rng and changes nothing.
    still = TransformerXLConfig.tiny(d_model=16, n_heads=2, d_head=4, dropatt=0.0, dropout=0.0)
    module = RelativeMultiHeadAttention(still)
    params = module.init(jax.random.key(0), *args)
    chex.assert_trees_all_close(
        module.apply(params, *args, deterministic=False), module.apply(params, *args)
    )


def test_the_sublayer_s_parameters_are_the_reference_s_without_biases():
    """`qkv` [D, 3, H, K], `r_net` [D, H, K], `o_net` [H, K, D], no biases (the reference's
    qkv_net, r_net and o_net have none), and the LayerNorm; with untie_r, u and v [H, K]."""
    for untie_r in (False, True):
        cfg = TransformerXLConfig.tiny(d_model=16, n_heads=2, d_head=4, untie_r=untie_r)
        h, mem, pos, mask, u, v = _sublayer_inputs(cfg)
        given = () if untie_r else (u, v)
        params = RelativeMultiHeadAttention(cfg).init(jax.random.key(0), h, mem, pos, mask, *given)
        shapes = jax.tree.map(lambda x: x.shape, params["params"])
        want = {
            "qkv": {"kernel": (16, 3, 2, 4)},
            "r_net": {"kernel": (16, 2, 4)},
            "o_net": {"kernel": (2, 4, 16)},
            "layer_norm": {"scale": (16,), "bias": (16,)},
        }
        if untie_r:
            want |= {"r_w_bias": (2, 4), "r_r_bias": (2, 4)}
        assert shapes == want
    # Every weight starts as N(0, 0.02) (the reference's init_std), the LayerNorm at (1, 0).
    cfg = TransformerXLConfig.tiny(d_model=64, n_heads=4, d_head=16, untie_r=True)
    h, mem, pos, mask, _, _ = _sublayer_inputs(cfg)
    params = RelativeMultiHeadAttention(cfg).init(jax.random.key(0), h, mem, pos, mask)["params"]
    for name in ("qkv", "r_net", "o_net"):
        assert np.std(params[name]["kernel"]) == pytest.approx(0.02, rel=0.1), name
    both = np.concatenate([params["r_w_bias"], params["r_r_bias"]])
    assert np.std(both) == pytest.approx(0.02, rel=0.25)
    np.testing.assert_array_equal(params["layer_norm"]["scale"], 1.0)
    np.testing.assert_array_equal(params["layer_norm"]["bias"], 0.0)


def test_the_kernel_s_shape_rules_follow_the_platform_it_is_compiled_for():
    """Which calls take the fused kernels, from the platform's name (made at run time, as a
    device's is) and the shapes: a head width of 8 on a CPU, 16 on a GPU, 64 and blocks of
    128 on a TPU; never without the memory's valid count."""
    from xl_jax.attention import _takes_fused_kernel, use_fused_kernel

    # The names made at run time, as a flag's value is: `is` against a literal would miss them.
    pallas = TransformerXLConfig.tiny(attention_impl="".join(["pal", "las"]))
    valid = jnp.zeros((2,), jnp.int32)

    def take(platform, k, t, m, valid=valid):
        return _takes_fused_kernel(
            pallas, "".join(list(platform)), head_width=k, q_len=t, mem_len=m, valid=valid
        )

    assert take("cpu", 8, 16, 16) and not take("cpu", 8, 16, 16, valid=None)
    assert not take("gpu", 8, 16, 16) and take("gpu", 16, 16, 16)
    assert not take("tpu", 32, 128, 128) and take("tpu", 64, 128, 128)
    assert not take("tpu", 64, 64, 64)  # 128 does not divide T and M
    assert take("gpu", 64, 64, 64) and take("cpu", 64, 64, 64)
    assert not _takes_fused_kernel(
        TransformerXLConfig.tiny(), "cpu", head_width=8, q_len=16, mem_len=16, valid=valid
    )
    with pytest.raises(TypeError):  # the lengths and the count by keyword
        use_fused_kernel(pallas, jnp.zeros((2, 16, 2, 8)), 16, valid)
    with pytest.raises(TypeError):
        _takes_fused_kernel(pallas, "cpu", 8, 16, 16, valid)
    assert use_fused_kernel(pallas, jnp.zeros((2, 16, 2, 8)), mem_len=16, valid=valid)


def test_each_implementation_without_the_kernel_runs_the_shared_attention_core():
    """'pallas' where its kernel cannot run (no memory count given, only the mask) falls back
    to the shared core's own choice, as 'auto' does; 'xla' and 'cudnn' are handed to the core
    as they are. (The core computes with XLA's here: cuDNN's needs a GPU.)"""
    from xl_jax import attention as xl_attention

    cfg = TransformerXLConfig.tiny(d_model=16, n_heads=2, d_head=4)
    args = _sublayer_inputs(cfg)
    params = RelativeMultiHeadAttention(cfg).init(jax.random.key(0), *args)
    want = RelativeMultiHeadAttention(cfg).apply(params, *args)
    core = xl_attention.dot_product_attention
    # Spelled at run time, as a flag's value is: `is` against a literal would miss them.
    cases = [("auto", "auto"), ("xla", "xla"), ("cudnn", "cudnn"), ("pallas", "auto")]
    for impl, handed in cases:
        seen = []

        def spy(*a, implementation, seen=seen, **k):
            seen.append(implementation)
            return core(*a, implementation="xla", **k)

        module = RelativeMultiHeadAttention(cfg.replace(attention_impl="".join(list(impl))))
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(xl_attention, "dot_product_attention", spy)
            got = module.apply(params, *args)
        assert seen == [handed], impl
        chex.assert_trees_all_close(got, want, rtol=1e-6)


def test_the_sublayer_s_options_are_keyword_only():
    from xl_jax.attention import position_bias, relative_positions

    cfg = TransformerXLConfig.tiny(d_model=16, n_heads=2, d_head=4)
    h, mem, pos, mask, u, v = _sublayer_inputs(cfg)
    module = RelativeMultiHeadAttention(cfg)
    params = module.init(jax.random.key(0), h, mem, pos, mask, u, v)
    with pytest.raises(TypeError):  # valid, then deterministic, by keyword
        module.apply(params, h, mem, pos, mask, u, v, jnp.array([4, 1]))
    with pytest.raises(TypeError):
        relative_positions(cfg, 2, 4)
    qv, r = jnp.zeros((2, 3, 2, 4)), jnp.zeros((7, 2, 4))
    with pytest.raises(TypeError):
        position_bias(qv, r, 0.5, False)
    assert position_bias(qv, r, scale=0.5, for_fused_kernel=False).shape == (2, 2, 3, 7)


def test_untied_biases_are_parameters_of_the_layer_and_the_given_ones_are_unused():
    tied = TransformerXLConfig.tiny(d_model=16, n_heads=2, d_head=4, untie_r=False)
    untied = TransformerXLConfig.tiny(d_model=16, n_heads=2, d_head=4, untie_r=True)
    h, mem, pos, mask, u, v = _sublayer_inputs(tied)
    params = RelativeMultiHeadAttention(tied).init(jax.random.key(0), h, mem, pos, mask, u, v)
    want = RelativeMultiHeadAttention(tied).apply(params, h, mem, pos, mask, u, v)
    module = RelativeMultiHeadAttention(untied)
    own = module.init(jax.random.key(0), h, mem, pos, mask)["params"]
    assert own["r_w_bias"].shape == own["r_r_bias"].shape == (2, 4)
    own = {**params["params"], "r_w_bias": u, "r_r_bias": v}
    got = module.apply({"params": own}, h, mem, pos, mask, v, u)  # swapped: unused
    chex.assert_trees_all_close(got, want, rtol=1e-6)
    swapped = {**own, "r_w_bias": v, "r_r_bias": u}
    assert not np.allclose(module.apply({"params": swapped}, h, mem, pos, mask), want, atol=1e-4)
