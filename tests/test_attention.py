"""The attention core and the Transformer's multi-head attention against slow NumPy references."""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import full_size_residuals, needs_gpu, np_multi_head_attention

from transformer_jax import (
    MultiHeadAttention,
    TransformerConfig,
    dot_product_attention,
    make_causal_mask,
    make_padding_mask,
)
from transformer_jax.attention import (
    attend,
    attention_weights,
    beam_attention,
    combine_masks,
    masked_softmax,
    uses_fused_kernel,
)


def _np_attention(q, k, v, mask=None, bias=None, scale=None):
    """Loops over batch and heads: softmax(q k^T * scale + bias) v, masked keys excluded."""
    b_, t_, h_, k_ = q.shape
    s_ = k.shape[1]
    scale = k_**-0.5 if scale is None else scale
    mask = (
        np.ones((b_, h_, t_, s_), bool) if mask is None else np.broadcast_to(mask, (b_, h_, t_, s_))
    )
    bias = np.zeros((b_, h_, t_, s_)) if bias is None else np.broadcast_to(bias, mask.shape)
    out = np.zeros((b_, t_, h_, v.shape[-1]))
    weights = np.zeros((b_, h_, t_, s_))
    for b in range(b_):
        for h in range(h_):
            for t in range(t_):
                keep = mask[b, h, t]
                if not keep.any():
                    continue  # a fully masked query gets zero weights and a zero output
                scores = np.array(
                    [q[b, t, h] @ k[b, s, h] * scale + bias[b, h, t, s] for s in range(s_)],
                    dtype=np.float64,
                )
                e = np.where(keep, np.exp(scores - scores[keep].max()), 0.0)
                weights[b, h, t] = e / e.sum()
                out[b, t, h] = weights[b, h, t] @ v[b, :, h]
    return out, weights


def _qkv(seed=0, b=2, t=3, s=5, h=2, k=4):
    rng = np.random.default_rng(seed)
    return tuple(
        rng.normal(size=shape).astype(np.float32)
        for shape in ((b, t, h, k), (b, s, h, k), (b, s, h, k))
    )


class DotProductAttentionTest(chex.TestCase):
    """The attention core is a pure function: the same numbers eager and under jit."""

    @chex.variants(with_jit=True, without_jit=True)
    def test_dot_product_attention_matches_numpy_with_mask_bias_and_scale(self):
        q, k, v = _qkv()
        rng = np.random.default_rng(1)
        mask = rng.random((2, 1, 3, 5)) > 0.3
        mask[0, 0, 1] = False  # one query with every key masked
        bias = rng.normal(size=(1, 2, 3, 5)).astype(np.float32)
        attend = self.variant(
            functools.partial(dot_product_attention, scale=0.3, return_weights=True)
        )
        out, weights = attend(q, k, v, mask=jnp.asarray(mask), bias=bias)
        ref_out, ref_w = _np_attention(q, k, v, mask, bias, scale=0.3)
        chex.assert_shape(out, (2, 3, 2, 4))
        chex.assert_trees_all_close(np.asarray(out), ref_out.astype(np.float32), atol=1e-5)
        chex.assert_trees_all_close(np.asarray(weights), ref_w.astype(np.float32), atol=1e-6)

    @chex.variants(with_jit=True, without_jit=True)
    def test_masks_have_the_documented_shapes_and_meaning(self):
        tokens = jnp.array([[5, 6, 0], [7, 0, 0]])
        pad = self.variant(functools.partial(make_padding_mask, pad_id=0))(tokens)
        chex.assert_shape(pad, (2, 1, 1, 3))
        np.testing.assert_array_equal(make_padding_mask(tokens), pad)  # pad id 0 by default
        np.testing.assert_array_equal(np.asarray(pad[:, 0, 0]), [[1, 1, 0], [1, 0, 0]])
        causal = make_causal_mask(4)
        chex.assert_shape(causal, (1, 1, 4, 4))
        np.testing.assert_array_equal(
            np.asarray(causal[0, 0]), np.array([[s <= t for s in range(4)] for t in range(4)])
        )


def test_masked_softmax_backward_reads_the_weights_alone():
    # Its gradient is autodiff's through the masked softmax (a fully masked row included), and
    # the forward pass keeps one [B, H, T, S] array for it, the weights, where autodiff's keeps
    # several (the softmax's broadcast row sums, its exponentials, the mask's selects).
    rng = np.random.default_rng(8)
    scores = jnp.asarray(rng.normal(size=(2, 3, 4, 5)), jnp.float32)
    mask = rng.random((2, 1, 4, 5)) > 0.4
    mask[1, 0, 2] = False
    mask = jnp.asarray(mask)
    weight = jnp.asarray(rng.normal(size=scores.shape), jnp.float32)

    def autodiff(s, m):
        return jnp.where(m, jax.nn.softmax(jnp.where(m, s, -1e30), axis=-1), 0.0)

    def grad(f, m):
        return jax.grad(lambda s: jnp.sum(f(s, m) * weight))(scores)

    for m in (mask, jnp.ones((), bool)):
        got, want = grad(masked_softmax, m), grad(autodiff, m)
        chex.assert_trees_all_close(masked_softmax(scores, m), autodiff(scores, m), atol=1e-7)
        chex.assert_trees_all_close(got, want, atol=1e-6)
    # the fully masked row: no weight, no gradient
    np.testing.assert_array_equal(np.asarray(masked_softmax(scores, mask))[1, :, 2], 0.0)
    np.testing.assert_array_equal(np.asarray(grad(masked_softmax, mask))[1, :, 2], 0.0)
    full = scores.shape
    assert full_size_residuals(lambda s: autodiff(s, mask), scores, shape=full) >= 3
    assert full_size_residuals(lambda s: masked_softmax(s, mask), scores, shape=full) == 1


def test_attention_dropout_only_when_not_deterministic():
    q, k, v = _qkv(seed=2, b=4, t=16, s=16, h=8)
    _, ref_w = _np_attention(q, k, v)
    kwargs = dict(dropout_rate=0.25, dropout_rng=jax.random.PRNGKey(0), return_weights=True)
    _, w_det = dot_product_attention(q, k, v, deterministic=True, **kwargs)
    chex.assert_trees_all_close(np.asarray(w_det), ref_w.astype(np.float32), atol=1e-6)
    _, w_drop = dot_product_attention(q, k, v, deterministic=False, **kwargs)
    w_drop = np.asarray(w_drop)
    # Inverted dropout: each weight is dropped (0) or kept and scaled by 1 / (1 - rate), and
    # about 1 - rate of them are kept (8,192 weights: the standard deviation is 0.005).
    kept = w_drop != 0
    assert abs(kept.mean() - 0.75) < 0.02
    np.testing.assert_allclose(w_drop[kept], ref_w[kept] / 0.75, rtol=1e-5)


@needs_gpu
def test_cudnn_and_xla_paths_agree_in_bf16():
    q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in _qkv(seed=3, b=2, t=16, s=16, h=2, k=64))
    mask = make_causal_mask(16)
    fused = dot_product_attention(q, k, v, mask=mask, implementation="cudnn")
    xla = dot_product_attention(q, k, v, mask=mask, implementation="xla")
    chex.assert_trees_all_close(
        np.asarray(fused, np.float32), np.asarray(xla, np.float32), atol=2e-2, rtol=2e-2
    )


def test_multi_head_attention_matches_numpy_einsum_reference():
    cfg = TransformerConfig.tiny(d_model=32, n_heads=4)
    mha = MultiHeadAttention(cfg)
    rng = np.random.default_rng(4)
    xq = rng.normal(size=(2, 3, 32)).astype(np.float32)
    xkv = rng.normal(size=(2, 5, 32)).astype(np.float32)
    mask = make_padding_mask(jnp.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]), 0)
    params = mha.init(jax.random.PRNGKey(0), xq, xkv, mask=mask)["params"]
    # Full float32 matmuls: on a GPU, XLA's default precision uses TF32 (about 1e-3 relative),
    # which this 1e-5 comparison with NumPy is not meant to measure.
    with jax.default_matmul_precision("highest"):
        out = mha.apply({"params": params}, xq, xkv, mask=mask)
    ref = np_multi_head_attention(xq, xkv, params, np.asarray(mask), cfg.n_heads)
    chex.assert_shape(out, (2, 3, 32))
    chex.assert_trees_all_close(np.asarray(out), ref.astype(np.float32), atol=1e-5)


def test_unknown_implementation_is_refused():
    q, k, v = _qkv(seed=4)
    with pytest.raises(ValueError, match="implementation"):
        dot_product_attention(q, k, v, implementation="flash")


@needs_gpu
def test_auto_takes_the_fused_kernel_on_a_gpu_in_bf16_only_where_it_applies():
    def lowered(q, k, v, **kw):
        return (
            jax.jit(lambda q, k, v: dot_product_attention(q, k, v, **kw)).lower(q, k, v).as_text()
        )

    q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in _qkv(seed=5, b=2, t=16, s=16, h=2, k=64))
    assert "cudnn" in lowered(q, k, v)
    assert "cudnn" not in lowered(q, k, v, implementation="xla")
    assert "cudnn" not in lowered(*(x.astype(jnp.float32) for x in (q, k, v)))
    # A head width cuDNN does not take (wt103_base's 41) stays on the XLA path.
    q41, k41, v41 = (jnp.asarray(x, jnp.bfloat16) for x in _qkv(seed=6, b=2, t=16, s=16, h=2, k=41))
    assert "cudnn" not in lowered(q41, k41, v41)


@needs_gpu
def test_cudnn_and_xla_gradients_agree_with_a_bias_in_bf16():
    # Transformer-XL hands its position term to the core as a [B, H, T, S] bias: the fused
    # kernel must return its gradient too.
    q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in _qkv(seed=7, b=2, t=16, s=32, h=2, k=64))
    bias = jnp.asarray(np.random.default_rng(8).normal(size=(2, 2, 16, 32)), jnp.bfloat16)
    mask = jnp.tril(jnp.ones((16, 32), bool), k=16)[None, None]

    def loss(impl):
        def f(q, k, v, bias):
            out = dot_product_attention(q, k, v, mask=mask, bias=bias, implementation=impl)
            return jnp.sum(out.astype(jnp.float32) ** 2)

        return jax.grad(f, argnums=(0, 1, 2, 3))(q, k, v, bias)

    for fused, xla in zip(loss("cudnn"), loss("xla")):
        chex.assert_trees_all_close(
            np.asarray(fused, np.float32), np.asarray(xla, np.float32), atol=5e-2, rtol=5e-2
        )


@needs_gpu
def test_cudnn_with_fully_masked_rows_stays_finite_and_agrees_on_the_others():
    # A padding-only sequence in the batch masks every key of its rows.
    q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in _qkv(seed=9, b=2, t=16, s=16, h=2, k=64))
    valid = jnp.asarray([[True] * 10 + [False] * 6, [False] * 16])
    mask = valid[:, None, None, :] & valid[:, None, :, None]

    def run(impl):
        def f(q, k, v):
            out = dot_product_attention(q, k, v, mask=mask, implementation=impl)
            return jnp.sum(jnp.where(valid[:, :, None, None], out, 0).astype(jnp.float32) ** 2)

        return jax.value_and_grad(f, argnums=(0, 1, 2))(q, k, v)

    (l_fused, g_fused), (l_xla, g_xla) = run("cudnn"), run("xla")
    chex.assert_tree_all_finite((l_fused, g_fused))
    np.testing.assert_allclose(float(l_fused), float(l_xla), rtol=2e-2)
    for fused, xla in zip(g_fused, g_xla):
        chex.assert_trees_all_close(
            np.asarray(fused, np.float32), np.asarray(xla, np.float32), atol=5e-2, rtol=5e-2
        )


def test_beam_attention_equals_attention_over_the_cache_each_hypothesis_would_hold():
    """Index bookkeeping: scoring every slot's keys and selecting the ancestral slot's is
    plain attention over a cache gathered position by position from those slots."""
    rng = np.random.default_rng(0)
    b, w, h, c, k = 2, 3, 4, 5, 4  # every size its own: an axis mixed up shows
    query = jnp.asarray(rng.normal(size=(b, w, h, k)), jnp.float32)
    key = jnp.asarray(rng.normal(size=(b, h, w, c, k)), jnp.float32)
    value = jnp.asarray(rng.normal(size=(b, h, w, c, k)), jnp.float32)
    ancestry = jnp.asarray(rng.integers(0, w, size=(b, w, c)), jnp.int32)
    mask = jnp.asarray(rng.random((b, 1, w, c)) < 0.7).at[..., 0].set(True)
    # The caches position-major, [B, H, C * W, K], as the beam search keeps them.
    got = beam_attention(
        query,
        key.swapaxes(2, 3).reshape(b, h, c * w, k),
        value.swapaxes(2, 3).reshape(b, h, c * w, k),
        ancestry,
        mask=mask,
    )
    key, value = key.swapaxes(1, 2), value.swapaxes(1, 2)  # [B, W (slot), H, C, K]
    # Beam j's own cache: position p read from slot ancestry[., j, p] ([W, C, H, K] each).
    gathered = jax.vmap(lambda kk, a: kk[a, :, jnp.arange(c)])
    own_key = gathered(key, ancestry)  # [B, W, C, H, K]
    own_value = gathered(value, ancestry)
    want = dot_product_attention(
        query.reshape(b * w, 1, h, k),
        own_key.reshape(b * w, c, h, k),
        own_value.reshape(b * w, c, h, k),
        mask=mask.transpose(0, 2, 1, 3).reshape(b * w, 1, 1, c),
    ).reshape(b, w, h, k)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    caches = key.swapaxes(1, 2).swapaxes(2, 3).reshape(b, h, c * w, k)
    with pytest.raises(TypeError):  # the mask is a keyword
        beam_attention(query, caches, caches, ancestry, mask)


def _cudnn_branch_on_this_cpu(monkeypatch):
    """`dot_product_attention`'s cuDNN branch run here: the program counts as one for a GPU,
    and `jax.nn`'s fused kernel is replaced by `jax.nn`'s own XLA implementation of the very
    call the branch makes (its bias, mask and scale as handed over), so what the branch prepares
    for the kernel is checked without a GPU."""
    from transformer_jax import attention

    monkeypatch.setattr(attention, "compile_platform", lambda *arrays: "gpu")
    real = jax.nn.dot_product_attention

    def kernel(q, k, v, *, bias, mask, scale, implementation):
        assert implementation == "cudnn"
        return real(q, k, v, bias=bias, mask=mask, scale=scale, implementation="xla")

    monkeypatch.setattr(jax.nn, "dot_product_attention", kernel)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("heads_first", [False, True])
def test_the_cudnn_branch_hands_its_kernel_the_same_attention(
    monkeypatch, dtype, with_bias, heads_first
):
    q, k, v = _qkv(seed=10, b=2, t=4, s=6, h=2, k=8)
    rng = np.random.default_rng(11)
    mask = rng.random((2, 1, 4, 6)) > 0.4
    mask[:, :, :, 0] = True
    mask[1, 0, 2] = False  # one query with every key masked
    # Scores far below zero where attended: a masked score that is merely "large" (not the
    # kernel's -2^41 in bf16, -2^15 in fp16) would then outweigh them.
    bias = (rng.normal(size=(1, 2, 4, 6)) - 100.0).astype(np.float32) if with_bias else None
    # The reference in float32 from the values the kernel gets (a bias near -100 has steps of
    # 0.5 in bf16).
    q, k, v, bias = (
        None if x is None else np.float32(jnp.asarray(x, dtype)) for x in (q, k, v, bias)
    )
    want = dot_product_attention(q, k, v, mask=mask, bias=bias, implementation="xla")
    unmasked = dot_product_attention(q, k, v, bias=bias, implementation="xla")
    _cudnn_branch_on_this_cpu(monkeypatch)
    cast = [jnp.asarray(x, dtype) for x in (q, k, v)]
    if heads_first:
        cast[1], cast[2] = cast[1].swapaxes(1, 2), cast[2].swapaxes(1, 2)
    got = dot_product_attention(
        *cast,
        mask=jnp.asarray(mask),
        bias=bias,
        implementation="cudnn",
        heads_first=heads_first,
    )
    assert got.dtype == dtype and got.shape == (2, 4, 2, 8)
    got = np.asarray(got, np.float32)
    rows = np.ones((2, 4), bool)
    rows[1, 2] = False
    np.testing.assert_allclose(got[rows], np.asarray(want)[rows], atol=3e-2, rtol=3e-2)
    # The fully masked query gets every key back (a finite softmax for the kernel).
    np.testing.assert_allclose(got[1, 2], np.asarray(unmasked)[1, 2], atol=3e-2, rtol=3e-2)


def test_auto_takes_the_fused_kernel_in_a_gpu_program_only_where_it_applies(monkeypatch):
    from transformer_jax.attention import uses_fused_kernel

    def qk(width=64, t=16, dtype=jnp.bfloat16, key_dtype=None):
        q, k, _ = _qkv(seed=12, b=2, t=t, s=16, h=2, k=width)
        return jnp.asarray(q, dtype), jnp.asarray(k, key_dtype or dtype)

    assert not uses_fused_kernel(*qk())  # a CPU program
    monkeypatch.setattr("transformer_jax.attention.compile_platform", lambda *a: "tpu")
    assert not uses_fused_kernel(*qk())
    # The platform's name made at run time, as the devices give it (not an interned literal).
    gpu = "".join(["g", "pu"])
    monkeypatch.setattr("transformer_jax.attention.compile_platform", lambda *a: gpu)
    assert uses_fused_kernel(*qk())
    assert uses_fused_kernel(*qk(), deterministic=False)  # no dropout unless a rate is given
    assert uses_fused_kernel(*qk(dtype=jnp.float16))
    assert uses_fused_kernel(*qk(width=128)) and uses_fused_kernel(*qk(width=8))
    assert not uses_fused_kernel(*qk(width=136))  # wider than the kernel takes
    assert not uses_fused_kernel(*qk(width=41)) and not uses_fused_kernel(*qk(width=12))
    assert not uses_fused_kernel(*qk(dtype=jnp.float32))
    assert not uses_fused_kernel(*qk(key_dtype=jnp.float16))
    # Keys wider than the query (its dtype safely castable to theirs) are no match either.
    assert not uses_fused_kernel(*qk(key_dtype=jnp.float32))
    assert not uses_fused_kernel(*qk(dtype=jnp.float16, key_dtype=jnp.float32))
    assert not uses_fused_kernel(*qk(key_dtype=jnp.float8_e4m3fn))  # narrower ones neither
    assert not uses_fused_kernel(*qk(t=1))  # a decoding step's single query
    assert uses_fused_kernel(*qk(t=2))
    assert not uses_fused_kernel(*qk(t=0))  # no query at all
    assert not uses_fused_kernel(*qk(), implementation="xla")
    assert not uses_fused_kernel(*qk(), implementation="".join(["x", "la"]))  # made at run time
    with pytest.raises(TypeError):
        uses_fused_kernel(*qk(), 0.1)  # the options are keywords
    assert uses_fused_kernel(*qk(dtype=jnp.float32), implementation="cudnn")
    assert uses_fused_kernel(*qk(dtype=jnp.float32), implementation="".join(["cu", "dnn"]))
    assert not uses_fused_kernel(*qk(), dropout_rate=0.1, deterministic=False)
    assert uses_fused_kernel(*qk(), dropout_rate=0.1)  # deterministic unless told
    assert uses_fused_kernel(*qk(), dropout_rate=0.1, deterministic=True)
    assert uses_fused_kernel(*qk(), dropout_rate=0.0, deterministic=False)


def test_weights_asked_for_take_the_xla_path_whatever_the_implementation():
    q, k, v = _qkv(seed=13)
    out, weights = dot_product_attention(q, k, v, implementation="cudnn", return_weights=True)
    ref_out, ref_w = _np_attention(q, k, v)
    np.testing.assert_allclose(np.asarray(weights), ref_w, atol=1e-6)
    np.testing.assert_allclose(np.asarray(out), ref_out, atol=1e-5)


def test_no_dropout_unless_a_rate_is_given():
    q, k, v = _qkv(seed=14)
    np.testing.assert_array_equal(
        dot_product_attention(q, k, v, deterministic=False), dot_product_attention(q, k, v)
    )


@pytest.mark.parametrize("with_weights", [False, True])
def test_heads_first_keys_and_values_give_the_same_attention(with_weights):
    q, k, v = _qkv(seed=15, b=2, t=3, s=5, h=4, k=6)
    mask = jnp.asarray(np.random.default_rng(16).random((2, 1, 3, 5)) > 0.3)
    kw = dict(mask=mask, return_weights=with_weights)
    want = dot_product_attention(q, k, v, **kw)
    got = dot_product_attention(q, k.swapaxes(1, 2), v.swapaxes(1, 2), heads_first=True, **kw)
    chex.assert_trees_all_close(got, want, atol=1e-6)


def test_no_dropout_of_the_weights_unless_a_rate_is_given():
    scores = jnp.asarray(np.random.default_rng(17).normal(size=(2, 3, 5)), jnp.float32)
    np.testing.assert_array_equal(
        attention_weights(scores, deterministic=False), attention_weights(scores)
    )


def test_combine_masks_ands_the_masks_given_and_skips_none():
    a = jnp.asarray([[True, True, False, False]])
    b = jnp.asarray([[True], [False]])
    assert combine_masks() is None and combine_masks(None, None) is None
    assert combine_masks(None, a) is a
    np.testing.assert_array_equal(combine_masks(a, None, b), a & b)
    np.testing.assert_array_equal(combine_masks(b, a, a), a & b)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_the_masked_score_folded_into_a_bias_is_the_one_jaxs_cudnn_wrapper_uses(dtype):
    # The value cuDNN is known to handle (it mishandles the difference of two huge
    # negatives): JAX's wrapper turns a bool mask into it, and only a device would show another.
    from jax._src.cudnn import fused_attention_stablehlo as wrapper

    from transformer_jax.attention import _large_negative

    if not hasattr(wrapper, "get_large_negative_number"):
        pytest.skip("this jax keeps its masked score elsewhere")
    assert _large_negative(dtype).dtype == dtype
    np.testing.assert_array_equal(_large_negative(dtype), wrapper.get_large_negative_number(dtype))


def test_no_dropout_of_the_weights_unless_not_deterministic():
    scores = jnp.asarray(np.random.default_rng(18).normal(size=(2, 3, 5)), jnp.float32)
    kw = dict(dropout_rate=0.5, dropout_rng=jax.random.PRNGKey(0))
    np.testing.assert_array_equal(attention_weights(scores, **kw), attention_weights(scores))


def test_attend_mixes_values_laid_out_batch_first_unless_told():
    rng = np.random.default_rng(19)
    scores = jnp.asarray(rng.normal(size=(2, 4, 3, 5)), jnp.float32)  # [B, H, T, S]
    value = jnp.asarray(rng.normal(size=(2, 5, 4, 6)), jnp.float32)  # [B, S, H, K]
    out, weights = attend(scores, value)
    want = np.einsum("bhts,bshk->bthk", np.asarray(jax.nn.softmax(scores)), value)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(weights, jax.nn.softmax(scores), rtol=1e-6)
    out_first, _ = attend(scores, value.swapaxes(1, 2), heads_first=True)
    np.testing.assert_allclose(out_first, want, rtol=1e-5, atol=1e-6)


def test_a_padding_mask_is_every_id_but_the_pad_id():
    # A pad id inside the range of ids (Marian's is the vocabulary's last one): ids below it
    # are tokens too.
    tokens = jnp.array([[5, 1, 3, 3], [3, 0, 7, 2]])
    got = make_padding_mask(tokens, pad_id=3)
    assert got.shape == (2, 1, 1, 4)
    np.testing.assert_array_equal(got[:, 0, 0], [[True, True, False, False], [False] + [True] * 3])


def test_the_core_takes_its_options_by_keyword():
    scores, mask = jnp.zeros((1, 1, 2, 3)), jnp.ones((1, 1, 2, 3), bool)
    q, k, v = _qkv(b=1, t=2, s=3, h=1, k=4)
    for positional in (
        lambda: attention_weights(scores, mask),
        lambda: attend(scores, v, mask),
        lambda: dot_product_attention(q, k, v, mask),
    ):
        with pytest.raises(TypeError):
            positional()


@pytest.mark.parametrize("rate", [-0.1, 1.0, 1.5])
def test_a_dropout_rate_outside_0_to_1_is_refused(rate):
    scores = jnp.zeros((1, 2, 3))
    value = jnp.zeros((1, 3, 1, 4))
    for call in (
        lambda: attention_weights(scores, dropout_rate=rate),
        lambda: attend(scores[:, None], value, dropout_rate=rate, deterministic=False),
        # The fused kernel's path too (it drops nothing itself).
        lambda: uses_fused_kernel(
            jnp.zeros((1, 2, 1, 8)), jnp.zeros((1, 3, 1, 8)), dropout_rate=rate
        ),
    ):
        with pytest.raises(ValueError, match=rf"dropout_rate must be in \[0, 1\), got {rate}"):
            call()


@pytest.mark.parametrize("with_mask", [False, True])
def test_the_cudnn_branch_folds_the_mask_into_the_bias_it_hands_the_kernel(monkeypatch, with_mask):
    """One [B, H, T, S] array for the kernel: the mask becomes the bias's masked scores (the
    kernel is handed no mask), and a bias with no mask goes as it is."""
    q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in _qkv(seed=20, b=1, t=2, s=3, h=1, k=8))
    bias = jnp.asarray(np.random.default_rng(21).normal(size=(1, 1, 2, 3)), jnp.float32)
    mask = jnp.array([[[[True, False, True], [True, True, False]]]])
    _cudnn_branch_on_this_cpu(monkeypatch)
    handed = {}
    kernel = jax.nn.dot_product_attention

    def spy(q, k, v, **kwargs):
        handed.update(kwargs)
        return kernel(q, k, v, **kwargs)

    monkeypatch.setattr(jax.nn, "dot_product_attention", spy)
    dot_product_attention(
        q, k, v, bias=bias, mask=mask if with_mask else None, implementation="cudnn"
    )
    assert handed["mask"] is None
    want = jnp.asarray(bias, jnp.bfloat16)
    if with_mask:
        want = jnp.where(mask, want, -(2.0**41))
    np.testing.assert_array_equal(handed["bias"], want)


def test_attend_and_attention_drop_nothing_unless_not_deterministic():
    q, k, v = _qkv(seed=22, b=1, t=3, s=5, h=2, k=4)
    scores = jnp.asarray(np.random.default_rng(23).normal(size=(1, 2, 3, 5)), jnp.float32)
    kw = dict(dropout_rate=0.5, dropout_rng=jax.random.PRNGKey(1))
    for call in (
        lambda **o: attend(scores, v, **o)[0],
        lambda **o: dot_product_attention(q, k, v, **o),
    ):
        np.testing.assert_array_equal(call(**kw), call())
        assert not np.array_equal(call(**kw, deterministic=False), call())
