"""The Transformer model: a NumPy re-implementation, invariants, configuration and positions."""

from __future__ import annotations

import functools
import re

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import full_size_residuals, matmul_dtypes, np_transformer

from transformer_jax import (
    Transformer,
    TransformerConfig,
    layers,
    sinusoidal_positions,
)
from transformer_jax.layers import LayerNorm, dense, dense_product, output_logits

V = 17


def _config(**overrides) -> TransformerConfig:
    fields = dict(
        src_vocab_size=V,
        tgt_vocab_size=V,
        d_model=32,
        n_heads=4,
        d_ff=64,
        n_encoder_layers=2,
        n_decoder_layers=2,
        max_len=16,
    )
    return TransformerConfig.tiny(**{**fields, **overrides})


def _batch(seed=0):
    rng = np.random.default_rng(seed)
    src = rng.integers(3, V, size=(2, 6)).astype(np.int32)
    src[0, 4:] = 0  # padding
    tgt = rng.integers(3, V, size=(2, 5)).astype(np.int32)
    tgt[:, 0] = 1  # BOS
    tgt[1, 4:] = 0
    return jnp.asarray(src), jnp.asarray(tgt)


def _init(cfg, seed=0):
    src, tgt = _batch()
    return Transformer(cfg), Transformer(cfg).init(jax.random.PRNGKey(seed), src, tgt)["params"]


@pytest.mark.slow
@pytest.mark.parametrize("norm_first", [False, True])
def test_forward_matches_numpy_reference(norm_first):
    cfg = _config(norm_first=norm_first)
    model, params = _init(cfg)
    src, tgt = _batch(1)
    logits = model.apply({"params": params}, src, tgt)
    chex.assert_shape(logits, (2, 5, V))
    chex.assert_type(logits, jnp.float32)
    ref = np_transformer(params, cfg, src, tgt)
    chex.assert_trees_all_close(np.asarray(logits), ref.astype(np.float32), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("activation", ["swish", "gelu"])
def test_marian_options_match_numpy_reference(activation):
    """Every option a Marian checkpoint needs, at once, against the reference above."""
    cfg = _config(
        activation=activation,
        layer_norm_eps=1e-5,
        scale_embeddings=False,
        positional="sinusoidal_concat",
        output_bias=True,
        bos_id=0,
    )
    model, params = _init(cfg)
    params = {**params, "output_bias": jax.random.normal(jax.random.PRNGKey(1), (V,))}
    src, tgt = _batch(1)
    tgt = tgt.at[:, 0].set(cfg.pad_id)  # decoding starts from pad
    logits = model.apply({"params": params}, src, tgt)
    ref = np_transformer(params, cfg, src, tgt)
    chex.assert_trees_all_close(np.asarray(logits), ref.astype(np.float32), atol=1e-4, rtol=1e-4)
    # The options change the output (so the comparison above can fail).
    paper = {k: v for k, v in params.items() if k != "output_bias"}
    assert not np.allclose(
        logits, Transformer(_config()).apply({"params": paper}, src, tgt), atol=1e-3
    )


def test_encode_then_decode_equals_call():
    model, params = _init(_config())
    src, tgt = _batch(2)
    encoded = model.apply({"params": params}, src, method="encode")
    chex.assert_shape(encoded, (2, 6, 32))
    logits = model.apply({"params": params}, encoded, src, tgt, method="decode")
    chex.assert_trees_all_close(logits, model.apply({"params": params}, src, tgt), atol=1e-6)


# ------------------------------------------------------------------------------ invariants


@pytest.mark.parametrize("norm_first", [False, True])
def test_causality(norm_first):
    model, params = _init(_config(norm_first=norm_first))
    src, tgt = _batch(3)
    tgt = tgt.at[1, 4].set(9)  # no pad in the target for this test
    base = model.apply({"params": params}, src, tgt)
    for t in range(tgt.shape[1] - 1):
        changed = tgt.at[:, t + 1 :].set((tgt[:, t + 1 :] + 5) % (V - 3) + 3)
        out = model.apply({"params": params}, src, changed)
        chex.assert_trees_all_close(out[:, : t + 1], base[:, : t + 1], atol=1e-5)
        # ... and the later positions do see the change (the test can fail).
        assert not np.allclose(out[:, t + 1 :], base[:, t + 1 :], atol=1e-3)


@pytest.mark.slow
@pytest.mark.parametrize("norm_first", [False, True])
def test_padding_invariance(norm_first):
    model, params = _init(_config(norm_first=norm_first))
    src, tgt = _batch(4)
    base = model.apply({"params": params}, src, tgt)
    more_src_pad = jnp.pad(src, ((0, 0), (0, 3)))  # three more pad positions
    chex.assert_trees_all_close(model.apply({"params": params}, more_src_pad, tgt), base, atol=1e-5)
    # Extra target pad leaves the real target positions unchanged too.
    more_tgt_pad = jnp.pad(tgt, ((0, 0), (0, 2)))
    out = model.apply({"params": params}, src, more_tgt_pad)
    chex.assert_trees_all_close(out[:, :5], base, atol=1e-5)
    # Garbage in pad positions must not matter either (they are masked, not just zero).
    garbage = src.at[0, 4:].set(7)
    assert not np.allclose(model.apply({"params": params}, garbage, tgt)[0], base[0], atol=1e-3), (
        "the source pad mask must be what hides pad positions"
    )


def test_dropout_only_when_not_deterministic():
    model, params = _init(_config(dropout=0.3, attention_dropout=0.2))
    src, tgt = _batch(5)
    a = model.apply({"params": params}, src, tgt)
    b = model.apply({"params": params}, src, tgt, deterministic=True)
    chex.assert_trees_all_equal(a, b)
    d1 = model.apply(
        {"params": params}, src, tgt, deterministic=False, rngs={"dropout": jax.random.PRNGKey(1)}
    )
    d1_again = model.apply(
        {"params": params}, src, tgt, deterministic=False, rngs={"dropout": jax.random.PRNGKey(1)}
    )
    d2 = model.apply(
        {"params": params}, src, tgt, deterministic=False, rngs={"dropout": jax.random.PRNGKey(2)}
    )
    chex.assert_trees_all_equal(d1, d1_again)
    assert not np.allclose(d1, a, atol=1e-3) and not np.allclose(d1, d2, atol=1e-3)


# --------------------------------------------------------------- parameters, init, dtypes


def test_shared_and_separate_embeddings_and_output():
    _, shared = _init(_config())
    assert "src_embed" not in shared and "output" not in shared
    chex.assert_shape(shared["tgt_embed"]["embedding"], (V, 32))
    _, separate = _init(_config(share_embeddings=False, tie_output=False, src_vocab_size=V + 4))
    chex.assert_shape(separate["src_embed"]["embedding"], (V + 4, 32))
    chex.assert_shape(separate["output"]["kernel"], (32, V))


def test_xavier_uniform_init_and_float32_params():
    cfg = _config(d_model=64, d_ff=128)
    _, params = _init(cfg)
    kernel = np.asarray(params["encoder"]["layers_0"]["ffn"]["inner"]["kernel"])
    limit = np.sqrt(6.0 / (64 + 128))  # Glorot & Bengio (2010)
    assert kernel.min() >= -limit and kernel.max() <= limit and kernel.max() > 0.9 * limit
    np.testing.assert_allclose(kernel.std(), limit / np.sqrt(3), rtol=0.1)
    assert np.all(np.asarray(params["encoder"]["layers_0"]["ffn"]["inner"]["bias"]) == 0)
    chex.assert_trees_all_equal_dtypes(
        params, jax.tree_util.tree_map(lambda x: np.zeros((), np.float32), params)
    )


def test_bfloat16_compute_keeps_float32_params_and_logits():
    cfg32 = _config()
    model16 = Transformer(cfg32.replace(dtype="bfloat16"))
    _, params = _init(cfg32)
    src, tgt = _batch(6)
    logits16 = model16.apply({"params": params}, src, tgt)
    chex.assert_type(logits16, jnp.float32)
    logits32 = Transformer(cfg32).apply({"params": params}, src, tgt)
    chex.assert_trees_all_close(logits16, logits32, atol=0.15, rtol=0.05)
    # The closeness above would also pass a model that ignored `dtype`: every product of the
    # bf16 program must take bf16 operands (attention logits and the output projection
    # accumulate in float32), as many as the float32 program has.
    full_dots = matmul_dtypes(lambda p: Transformer(cfg32).apply({"params": p}, src, tgt), params)
    half_dots = matmul_dtypes(lambda p: model16.apply({"params": p}, src, tgt), params)
    assert {d[:2] for d in full_dots} == {("float32", "float32")}
    assert len(half_dots) == len(full_dots)
    assert {d[:2] for d in half_dots} == {("bfloat16", "bfloat16")}
    assert not np.array_equal(logits16, logits32)  # and the rounding shows


def test_half_output_projection_multiplies_in_bf16_and_returns_float32():
    # The tied output layer in bf16: the product of the bf16-rounded operands accumulated in
    # float32, and (custom VJP) both gradient products also on bf16 operands.
    rng = np.random.default_rng(3)
    y = jnp.asarray(rng.normal(size=(2, 5, 16)), jnp.float32)
    table = jnp.asarray(rng.normal(size=(40, 16)), jnp.float32)
    weight = jnp.asarray(rng.normal(size=(2, 5, 40)), jnp.float32)
    r = lambda x: np.asarray(jnp.asarray(x, jnp.bfloat16), np.float64)  # noqa: E731

    logits = output_logits(y, table, jnp.bfloat16)
    chex.assert_type(logits, jnp.float32)
    np.testing.assert_allclose(np.asarray(logits), r(y) @ r(table).T, rtol=1e-5, atol=1e-5)

    d_y, d_table = jax.grad(
        lambda y, t: jnp.sum(output_logits(y, t, jnp.bfloat16) * weight), argnums=(0, 1)
    )(y, table)
    chex.assert_type([d_y, d_table], jnp.float32)
    # d/dy sum(w * y T^T) = w T, d/dT = w^T y, with every operand rounded to bf16 and each
    # result rounded to bf16 once (the cotangent of a bf16 operand is bf16).
    np.testing.assert_allclose(np.asarray(d_y), r(r(weight) @ r(table)), rtol=1e-2, atol=1e-2)
    np.testing.assert_allclose(
        np.asarray(d_table), r(np.einsum("btv,btd->vd", r(weight), r(y))), rtol=1e-2, atol=1e-2
    )
    # float32 stays a float32 product (asked at full precision: a GPU's default is TF32).
    with jax.default_matmul_precision("highest"):
        logits32 = output_logits(y, table, jnp.float32)
    np.testing.assert_allclose(
        np.asarray(logits32),
        np.asarray(y, np.float64) @ np.asarray(table, np.float64).T,
        rtol=1e-5,
        atol=1e-5,
    )
    # and its gradients (the custom VJP's transposed table product) are autodiff's.
    with jax.default_matmul_precision("highest"):
        got = jax.grad(
            lambda y, t: jnp.sum(output_logits(y, t, jnp.float32) * weight), argnums=(0, 1)
        )(y, table)
        want = jax.grad(
            lambda y, t: jnp.sum(jnp.einsum("btd,vd->btv", y, t) * weight), argnums=(0, 1)
        )(y, table)
    chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [(6, 16), (2, 5, 16), (2, 3, 4, 16)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_dense_product_and_its_gradients_are_autodiffs(shape, dtype):
    # The Dense layers' product: its VJP flattens the rows for the kernel's gradient; the
    # value and both gradients are those of autodiff through lax.dot_general, in the operands'
    # dtype (a bf16 product returns bf16, and so do its cotangents).
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.normal(size=shape), dtype)
    kernel = jnp.asarray(rng.normal(size=(16, 24)), dtype)
    weight = jnp.asarray(rng.normal(size=(*shape[:-1], 24)), jnp.float32)
    plain = lambda x, k: jax.lax.dot_general(x, k, (((x.ndim - 1,), (0,)), ((), ())))  # noqa: E731

    def loss(product):
        return lambda x, k: jnp.sum(product(x, k).astype(jnp.float32) * weight)

    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    with jax.default_matmul_precision("highest"):
        chex.assert_trees_all_close(dense_product(x, kernel), plain(x, kernel), rtol=tol, atol=tol)
        got = jax.grad(loss(dense_product), argnums=(0, 1))(x, kernel)
        want = jax.grad(loss(plain), argnums=(0, 1))(x, kernel)
    chex.assert_trees_all_equal_dtypes(got, (x, kernel))
    chex.assert_trees_all_close(got, want, rtol=tol, atol=tol * 8)


def test_dense_layers_use_dense_product_without_a_transposed_copy():
    # The model's Dense gives nn.Dense's outputs, and its kernel gradient on [B, T, D] inputs
    # compiles (XLA:CPU) without the transposed copy of the cotangent that autodiff's has.
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.normal(size=(4, 8, 32)), jnp.float32)
    ours, theirs = dense(64, dtype=jnp.float32), nn.Dense(64)
    params = ours.init(jax.random.PRNGKey(0), x)
    chex.assert_trees_all_close(ours.apply(params, x), theirs.apply(params, x), rtol=1e-6)
    # any other product goes to lax.dot_general as asked
    k = params["params"]["kernel"]
    other = (((0,), (0,)), ((), ()))
    chex.assert_trees_all_close(
        layers.dense_dot_general(x[0].T, k, other), jax.lax.dot_general(x[0].T, k, other)
    )
    half = x.astype(jnp.bfloat16), k.astype(jnp.bfloat16)
    dims = (((2,), (0,)), ((), ()))
    chex.assert_type(layers.dense_dot_general(*half, dims), jnp.bfloat16)
    chex.assert_type(
        layers.dense_dot_general(*half, dims, preferred_element_type=jnp.float32), jnp.float32
    )

    def copies(module):
        grad = jax.jit(jax.grad(lambda p: jnp.sum(jnp.tanh(module.apply(p, x)))))
        text = grad.lower(params).compile().as_text()
        entry = text[text.index("ENTRY") :]
        return [
            op
            for op in re.findall(r"%([\w-]+?)(?:\.\d+)? = ", entry)
            if "copy" in op or "transpose" in op
        ]

    assert copies(theirs), "autodiff's kernel gradient no longer copies: this test is moot"
    assert copies(ours) == []


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_layer_norm_is_flax_s_with_its_statistics_kept_reduced(dtype):
    # The LayerNorm of every model here: flax's parameters, initialisers and output (to the
    # bit in float32), autodiff's gradients, and a backward pass that saves x, not a
    # [..., D] broadcast of the statistics as autodiff does.
    rng = np.random.default_rng(6)
    x = jnp.asarray(rng.normal(size=(3, 5, 32)) * 2 + 1, dtype)
    ours, theirs = LayerNorm(epsilon=1e-5, dtype=dtype), nn.LayerNorm(epsilon=1e-5, dtype=dtype)
    params = theirs.init(jax.random.PRNGKey(0), x)
    chex.assert_trees_all_equal(ours.init(jax.random.PRNGKey(0), x), params)
    params = jax.tree.map(lambda p: p + jnp.asarray(rng.normal(size=p.shape), p.dtype), params)
    got, want = ours.apply(params, x), theirs.apply(params, x)
    chex.assert_type(got, dtype)
    if dtype == jnp.float32:
        chex.assert_trees_all_equal(got, want)
    else:
        chex.assert_trees_all_close(got.astype(float), want.astype(float), atol=2e-2)
    weight = jnp.asarray(rng.normal(size=x.shape), jnp.float32)

    def loss(module):
        return lambda p, x: jnp.sum(jnp.sin(module.apply(p, x).astype(jnp.float32)) * weight)

    got = jax.grad(loss(ours), argnums=(0, 1))(params, x)
    want = jax.grad(loss(theirs), argnums=(0, 1))(params, x)
    chex.assert_trees_all_equal_dtypes(got, (params, x))
    tol = 1e-5 if dtype == jnp.float32 else 5e-2
    chex.assert_trees_all_close(got, want, rtol=tol, atol=tol)
    assert full_size_residuals(theirs.apply, params, x, shape=x.shape) >= 2
    assert full_size_residuals(ours.apply, params, x, shape=x.shape) == 1  # x itself


def test_layer_norm_gradient_is_exact_in_float64():
    # The closed-form VJP against autodiff through flax's formula, where rounding is 1e-16.
    with jax.enable_x64(True):
        rng = np.random.default_rng(7)
        x = jnp.asarray(rng.normal(size=(4, 16)) * 3, jnp.float64)
        scale, bias = (jnp.asarray(rng.normal(size=16), jnp.float64) for _ in range(2))
        weight = jnp.asarray(rng.normal(size=x.shape), jnp.float64)

        def flax_formula(x, scale, bias):
            mean = x.mean(-1, keepdims=True)
            var = jnp.maximum(0.0, jnp.square(x).mean(-1, keepdims=True) - jnp.square(mean))
            return (x - mean) * (jax.lax.rsqrt(var + 1e-6) * scale) + bias

        def grads(f):
            return jax.grad(lambda *a: jnp.sum(jnp.sin(f(*a)) * weight), argnums=(0, 1, 2))(
                x, scale, bias
            )

        got = grads(lambda x, s, b: layers.normalize(x, s, b, 1e-6))
        want = grads(flax_formula)
        chex.assert_trees_all_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("positional", ["sinusoidal_concat", "learned"])
def test_other_positionals_run_and_learned_rejects_long_inputs(positional):
    cfg = _config(positional=positional, max_len=6)
    model, params = _init(cfg)
    src, tgt = _batch(7)
    chex.assert_shape(model.apply({"params": params}, src, tgt), (2, 5, V))
    if positional == "learned":
        chex.assert_shape(params["positions"]["table"], (6, 32))
        with pytest.raises(ValueError, match="max_len"):
            model.apply({"params": params}, jnp.pad(src, ((0, 0), (0, 1))), tgt)


# --------------------------------------------------------------------------- positions


@pytest.mark.parametrize("length,d", [(7, 8), (50, 16)])
def test_sinusoids_equal_the_formula_in_both_layouts(length, d):
    interleaved = np.asarray(sinusoidal_positions(length, d))
    concat = np.asarray(sinusoidal_positions(length, d, layout="concat"))
    chex.assert_shape(interleaved, (length, d))
    for pos in range(length):
        for i in range(d // 2):
            angle = pos / 10000 ** (2 * i / d)
            np.testing.assert_allclose(interleaved[pos, 2 * i], np.sin(angle), atol=2e-5)
            np.testing.assert_allclose(interleaved[pos, 2 * i + 1], np.cos(angle), atol=2e-5)
            np.testing.assert_allclose(concat[pos, i], np.sin(angle), atol=2e-5)
            np.testing.assert_allclose(concat[pos, d // 2 + i], np.cos(angle), atol=2e-5)


def test_sinusoids_work_past_max_len():
    cfg = _config(max_len=4)  # sinusoidal positions ignore max_len
    model, params = _init(cfg)
    src, tgt = _batch(8)
    chex.assert_shape(model.apply({"params": params}, src, tgt), (2, 5, V))
    big = np.asarray(sinusoidal_positions(5000, 8))
    np.testing.assert_allclose(big[4999, 0], np.sin(4999.0), atol=1e-3)


# ------------------------------------------------------------------------------- config


def test_presets():
    base = TransformerConfig.base()
    assert (
        base.d_model,
        base.n_heads,
        base.d_ff,
        base.n_encoder_layers,
        base.n_decoder_layers,
        base.dropout,
    ) == (512, 8, 2048, 6, 6, 0.1)
    big = TransformerConfig.big(src_vocab_size=100, tgt_vocab_size=100)
    assert (big.d_model, big.n_heads, big.d_ff, big.dropout, big.src_vocab_size) == (
        1024,
        16,
        4096,
        0.3,
        100,
    )
    tiny = TransformerConfig.tiny(norm_first=True)
    assert tiny.norm_first and tiny.d_model <= 128 and tiny.head_dim == tiny.d_model // 4
    assert TransformerConfig.base(dtype="bfloat16").dtype == jnp.bfloat16
    hash(tiny)  # usable as a static jit argument


@pytest.mark.parametrize(
    "overrides,field",
    [
        (dict(d_model=30, n_heads=4), "d_model"),
        (dict(d_model=0), "d_model"),
        (dict(n_heads=-1), "n_heads"),
        (dict(d_ff=0), "d_ff"),
        (dict(n_encoder_layers=0), "n_encoder_layers"),
        (dict(src_vocab_size=0), "src_vocab_size"),
        (dict(max_len=0), "max_len"),
        (dict(dropout=1.0), "dropout"),
        (dict(attention_dropout=-0.1), "attention_dropout"),
        (dict(positional="rotary"), "positional"),
        (dict(d_model=27, n_heads=3, positional="sinusoidal"), "d_model must be even"),
        (dict(src_vocab_size=10, tgt_vocab_size=12, share_embeddings=True), "share_embeddings"),
        (dict(bos_id=2), "pad_id, bos_id and eos_id"),
        (dict(eos_id=0), "pad_id, bos_id and eos_id"),
        (dict(eos_id=32), "eos_id"),
        (dict(dtype="int32"), "dtype"),
        (dict(activation="tanh"), "activation"),
        (dict(layer_norm_eps=0.0), "layer_norm_eps"),
        (dict(output_bias=True, tie_output=False), "output_bias"),
        (dict(attention_impl="flash"), "attention_impl"),
    ],
)
def test_bad_configs_raise_value_error_naming_the_field(overrides, field):
    with pytest.raises(ValueError, match=field):
        TransformerConfig.tiny(**overrides)


def test_bad_token_inputs_are_errors_that_say_so():
    cfg = _config()
    model, params = _init(cfg)
    src, tgt = _batch()
    apply = functools.partial(model.apply, {"params": params})
    with pytest.raises(ValueError, match=r"src: expected \[B, L\] token ids .* shape \(6,\)"):
        apply(src[0], tgt)
    with pytest.raises(ValueError, match=rf"tgt: token ids must be in \[0, {V}\) .* to {V}"):
        apply(src, tgt.at[1, 2].set(V))
    with pytest.raises(ValueError, match="src: token ids must be in .* from -1"):
        apply(src.at[0, 0].set(-1), tgt)
    with pytest.raises(ValueError, match="integer token ids, got float32"):
        apply(src.astype(jnp.float32), tgt)
    # Under jit only what is static is checked (a value check would cost a transfer).
    assert jax.jit(lambda s: apply(s, tgt))(src.at[0, 0].set(V)).shape == (2, 5, V)
