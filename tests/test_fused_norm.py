"""Post-LN's residual, dropout and LayerNorm as one Pallas kernel (transformer_jax/fused_norm.py).

The kernels run here in Pallas interpret mode: the forward pass and every gradient against
the plain-jnp reference, the dropout mask against the hash, and the models' fused path (forced,
as a program compiled for one GPU takes it) against their XLA path. tests/test_target.py checks
that a program compiled for an H200 takes the Triton kernels.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import calls_to

from transformer_jax import Transformer, TransformerConfig, fused_norm
from transformer_jax.hashed_dropout import dropout_keep, dropout_seed
from transformer_jax.layers import Deferred, Dense, biased_product, normalize
from xl_jax import TransformerXL, TransformerXLConfig


def _inputs(n_rows: int, d: int, seed: int = 0):
    k = jax.random.split(jax.random.PRNGKey(seed), 6)
    x = jax.random.normal(k[0], (n_rows, d))
    y = 2.0 * jax.random.normal(k[1], (n_rows, d))
    scale = 1.0 + 0.2 * jax.random.normal(k[2], (d,))
    bias = 0.2 * jax.random.normal(k[3], (d,))
    y_bias = 0.5 * jax.random.normal(k[4], (d,))
    weights = jax.random.normal(k[5], (n_rows, d))
    return x, y, scale, bias, y_bias, weights


@pytest.mark.parametrize("rate", [0.0, 0.3])
@pytest.mark.parametrize("with_y_bias", [False, True])
def test_kernels_equal_the_reference_forward_and_every_gradient(rate, with_y_bias):
    # D = 1024: 8-row tiles, 128-row programs, so 256 rows span two programs of 16 tiles each
    # (the row offsets of the hash and of the partial sums both matter).
    x, y, scale, bias, y_bias, w = _inputs(256, 1024)
    assert fused_norm._plan(256, 1024) == (8, 16)
    y_bias = y_bias if with_y_bias else None
    rng = jax.random.PRNGKey(7)
    seed = dropout_seed(rng) if rate else jnp.zeros((1,), jnp.int32)

    def fused(*a):
        out = fused_norm.add_dropout_normalize(
            *a[:4], epsilon=1e-5, y_bias=a[4], rate=rate, dropout_rng=rng, interpret=True
        )
        return (out * w).sum(), out

    def reference(*a):
        out = fused_norm.reference(*a[:4], seed, epsilon=1e-5, rate=rate, y_bias=a[4])
        return (out * w).sum(), out

    argnums = (0, 1, 2, 3, 4) if with_y_bias else (0, 1, 2, 3)
    (_, got), got_grads = jax.value_and_grad(fused, argnums, has_aux=True)(
        x, y, scale, bias, y_bias
    )
    (_, want), want_grads = jax.value_and_grad(reference, argnums, has_aux=True)(
        x, y, scale, bias, y_bias
    )
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    for name, g, r in zip(("x", "y", "scale", "bias", "y_bias"), got_grads, want_grads):
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-4, err_msg=name)


def test_two_branches_gradients_are_added_in_the_kernel():
    """With `branches` the output comes twice; each copy's gradient reaches the backward
    kernel and the gradients equal those of one output used twice. One copy unused is a
    symbolic zero, which the kernel does not read."""
    x, y, scale, bias, y_bias, w = _inputs(256, 1024, seed=2)
    w2 = jnp.roll(w, 1, axis=0)
    rng = jax.random.PRNGKey(5)
    seed = dropout_seed(rng)
    kw = dict(epsilon=1e-5, y_bias=y_bias, rate=0.1, dropout_rng=rng, interpret=True)

    def both(*a):
        left, right = fused_norm.add_dropout_normalize(*a, **kw, branches=True)
        return (left * w).sum() + (right * w2).sum()

    left, right = fused_norm.add_dropout_normalize(x, y, scale, bias, **kw, branches=True)
    np.testing.assert_array_equal(left, right)

    def one_used(*a):
        return (fused_norm.add_dropout_normalize(*a, **kw, branches=True)[1] * w2).sum()

    def reference(*a, weights):
        out = fused_norm.reference(*a, seed, epsilon=1e-5, rate=0.1, y_bias=y_bias)
        return (out * weights).sum()

    argnums = (0, 1, 2, 3)
    for got, want in zip(
        jax.grad(both, argnums)(x, y, scale, bias),
        jax.grad(functools.partial(reference, weights=w + w2), argnums)(x, y, scale, bias),
    ):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    for got, want in zip(
        jax.grad(one_used, argnums)(x, y, scale, bias),
        jax.grad(functools.partial(reference, weights=w2), argnums)(x, y, scale, bias),
    ):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_reference_without_dropout_is_layer_norm_of_the_sum():
    x, y, scale, bias, y_bias, _ = _inputs(24, 32)
    got = fused_norm.reference(
        x, y, scale, bias, jnp.zeros((1,), jnp.int32), epsilon=1e-6, rate=0.0, y_bias=y_bias
    )
    np.testing.assert_allclose(got, normalize(x + y + y_bias, scale, bias, 1e-6), atol=1e-5)


def test_dropout_is_the_hash_of_seed_row_and_feature_and_drops_at_its_rate():
    """y's gradient is zero exactly where the hash drops (rows across programs and tiles)."""
    rate = 0.25
    x, y, scale, bias, _, w = _inputs(256, 1024, seed=1)
    rng = jax.random.PRNGKey(11)

    def loss(y):
        out = fused_norm.add_dropout_normalize(
            x, y, scale, bias, epsilon=1e-5, rate=rate, dropout_rng=rng, interpret=True
        )
        return (out * w).sum()

    dropped = np.asarray(jax.grad(loss)(y) == 0)
    u32 = jnp.uint32
    rows = jnp.arange(256, dtype=u32)[:, None]
    cols = jnp.arange(1024, dtype=u32)[None, :]
    keep = dropout_keep(dropout_seed(rng)[0].astype(u32), u32(0), rows, cols, rate)
    np.testing.assert_array_equal(dropped, ~np.asarray(keep))
    assert abs(dropped.mean() - rate) < 0.01
    # The same key draws the same mask again (as a resumed step does).
    np.testing.assert_array_equal(np.asarray(jax.grad(loss)(y) == 0), dropped)


def test_inputs_that_do_not_fit_are_refused_by_name():
    x, y, scale, bias, _, _ = _inputs(8, 16)
    with pytest.raises(ValueError, match="y's bias"):
        fused_norm.add_dropout_normalize(x, y[:, :8], scale, bias, epsilon=1e-6)
    with pytest.raises(ValueError, match="scale"):
        fused_norm.add_dropout_normalize(x, y, scale[:8], bias, epsilon=1e-6)


def test_applies_only_to_a_program_for_one_gpu_with_shapes_the_kernels_take(monkeypatch):
    x = jnp.ones((4, 8, 32))
    assert not fused_norm.applies(x)  # a CPU program
    monkeypatch.setattr(fused_norm, "compile_platform", lambda *a: "gpu")
    assert fused_norm.applies(x)
    assert not fused_norm.applies(jnp.ones((4, 8, 48)))  # D not a power of two
    assert not fused_norm.applies(jnp.ones((4, 8, 8)))  # D below the tile's smallest
    assert not fused_norm.applies(jnp.ones((3, 3, 32)))  # rows not a multiple of 8
    if jax.device_count() >= 2:
        mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:2]), ("data",))
        sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
        seen = []
        jax.jit(lambda a: seen.append(fused_norm.applies(a)) or a)(jax.device_put(x, sharding))
        assert seen == [False]  # two devices: the kernels are not partitioned


def test_dense_is_flax_dense_and_defers_its_bias_exactly():
    x = jax.random.normal(jax.random.PRNGKey(0), (3, 5, 16), jnp.bfloat16)
    kwargs = dict(features=8, dtype=jnp.bfloat16, bias_init=nn.initializers.normal(1.0))
    params = nn.Dense(**kwargs).init(jax.random.PRNGKey(1), x)
    ours = Dense(**kwargs)
    assert jax.tree.structure(ours.init(jax.random.PRNGKey(1), x)) == jax.tree.structure(params)
    want = nn.Dense(**kwargs).apply(params, x)
    np.testing.assert_array_equal(ours.apply(params, x), want)
    deferred = ours.apply(params, x, defer_bias=True)
    # The bias as stored (float32), for the kernel to add in float32.
    assert isinstance(deferred, Deferred) and deferred.bias.dtype == jnp.float32
    np.testing.assert_array_equal(deferred.product + deferred.bias.astype(jnp.bfloat16), want)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_biased_product_is_the_product_plus_the_bias_with_their_gradients(dtype):
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    x = jax.random.normal(keys[0], (3, 5, 16), dtype)
    kernel = jax.random.normal(keys[1], (16, 24), dtype)
    bias = jax.random.normal(keys[2], (24,), dtype)
    g = jax.random.normal(keys[3], (3, 5, 24), dtype)

    def reference(x, kernel, bias):
        return x @ kernel + bias

    out, vjp = jax.vjp(biased_product, x, kernel, bias)
    want, want_vjp = jax.vjp(reference, x, kernel, bias)
    assert out.dtype == dtype and out.shape == want.shape
    tol = dict(rtol=2e-2, atol=5e-2) if dtype == jnp.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.float32(out), np.float32(want), **tol)
    for got, expected in zip(vjp(g), want_vjp(g)):
        assert got.dtype == expected.dtype and got.shape == expected.shape
        np.testing.assert_allclose(np.float32(got), np.float32(expected), **tol)


def _force_fused(monkeypatch):
    """The models take the fused path, as in a program compiled for one GPU (the kernels
    interpreted, since this process's backend is the CPU)."""
    monkeypatch.setattr(fused_norm, "applies", lambda *a: True)


@pytest.mark.parametrize("attention_dropout", [0.0, 0.3])
def test_transformer_fused_path_equals_its_xla_path(monkeypatch, attention_dropout):
    cfg = TransformerConfig.tiny(
        src_vocab_size=40, tgt_vocab_size=40, dropout=0.0, attention_dropout=attention_dropout
    )
    src = jax.random.randint(jax.random.PRNGKey(0), (2, 8), 1, 40)
    tgt = jax.random.randint(jax.random.PRNGKey(1), (2, 8), 1, 40)
    model = Transformer(cfg)
    params = _with_random_biases(model.init(jax.random.PRNGKey(2), src, tgt))

    def loss(p):
        rngs = {"dropout": jax.random.PRNGKey(3)}
        logits = model.apply(p, src, tgt, deterministic=False, rngs=rngs)
        return (logits.astype(jnp.float32) ** 2).mean(), logits

    (want, want_logits), want_grads = jax.value_and_grad(loss, has_aux=True)(params)
    _force_fused(monkeypatch)
    assert jax.tree.structure(model.init(jax.random.PRNGKey(2), src, tgt)) == (
        jax.tree.structure(params)
    )
    (got, got_logits), got_grads = jax.value_and_grad(loss, has_aux=True)(params)
    np.testing.assert_allclose(got_logits, want_logits, rtol=1e-4, atol=1e-4)
    flat_got, flat_want = jax.tree.leaves_with_path(got_grads), jax.tree.leaves(want_grads)
    for (path, g), w in zip(flat_got, flat_want):
        np.testing.assert_allclose(g, w, rtol=1e-3, atol=1e-5, err_msg=jax.tree_util.keystr(path))
    key_biases = [
        g for path, g in flat_got if "'key'" in jax.tree_util.keystr(path) and g.ndim == 1
    ]
    assert len(key_biases) == cfg.n_encoder_layers + 2 * cfg.n_decoder_layers
    # The keys' biases do not move the softmax: the fused path does not add them at all.
    for g in key_biases:
        np.testing.assert_array_equal(g, 0.0)


def _with_random_biases(params):
    """The parameters with every bias drawn (they start at zero), so a bias that a path adds
    in the wrong place, or not at all, changes its outputs."""
    leaves, tree = jax.tree.flatten_with_path(params)
    keys = jax.random.split(jax.random.PRNGKey(7), len(leaves))
    return jax.tree.unflatten(
        tree,
        [
            x + 0.5 * jax.random.normal(k, x.shape, x.dtype)
            if jax.tree_util.keystr(path).endswith("['bias']")
            else x
            for (path, x), k in zip(leaves, keys)
        ],
    )


def test_transformer_fused_path_drops_with_dropout(monkeypatch):
    cfg = TransformerConfig.tiny(src_vocab_size=40, tgt_vocab_size=40, dropout=0.5)
    src = jnp.ones((2, 8), jnp.int32)
    model = Transformer(cfg)
    params = model.init(jax.random.PRNGKey(2), src, src)
    _force_fused(monkeypatch)

    def run(key):
        return model.apply(params, src, src, deterministic=False, rngs={"dropout": key})

    a, b = run(jax.random.PRNGKey(0)), run(jax.random.PRNGKey(1))
    assert not np.allclose(a, b)
    np.testing.assert_array_equal(a, run(jax.random.PRNGKey(0)))
    np.testing.assert_array_equal(
        model.apply(params, src, src), model.apply(params, src, src, deterministic=True)
    )


@pytest.mark.parametrize("norm_first", [False, True])
def test_xl_fused_path_equals_its_xla_path(monkeypatch, norm_first):
    """Post-LN's attention sublayer goes through the kernel; pre-LN's (its residual after the
    norm) never does; both give the XLA path's losses and gradients."""
    cfg = TransformerXLConfig.tiny(norm_first=norm_first)
    tokens = jax.random.randint(jax.random.PRNGKey(0), (2, cfg.tgt_len), 0, cfg.vocab_size)
    model = TransformerXL(cfg)
    variables = model.init(jax.random.PRNGKey(1), tokens, targets=tokens)

    def loss(p):
        nll, memory = model.apply(p, tokens, targets=tokens, deterministic=False)
        return nll.mean(), memory

    (want, want_memory), want_grads = jax.value_and_grad(loss, has_aux=True)(variables)
    _force_fused(monkeypatch)
    calls = calls_to(monkeypatch, fused_norm, "add_dropout_normalize")
    (got, got_memory), got_grads = jax.value_and_grad(loss, has_aux=True)(variables)
    assert len(calls) == (0 if norm_first else 2 * cfg.n_layers)  # attention and feed-forward
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for g, w in zip(jax.tree.leaves(got_memory), jax.tree.leaves(want_memory)):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)
    for g, w in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads)):
        np.testing.assert_allclose(g, w, rtol=1e-3, atol=1e-5)
