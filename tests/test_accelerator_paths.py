"""The forms a program compiled for a GPU or TPU takes, computed on the CPU and held to the
CPU's forms (issue 62's levers).

Each lever is chosen from the devices a step is compiled for (`compile_platform`), so a CPU
run never takes it; here the choice is forced, the accelerator's form runs on the CPU, and
it must give the CPU form's numbers (to rounding). tests/test_target.py checks that the
compiled GPU programs take them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from train.core import step as step_module
from transformer_jax import attention as attention_module
from transformer_jax import layers, losses
from transformer_jax.platform import compile_platform
from xl_jax.attention import position_bias


@pytest.fixture
def on_gpu(monkeypatch):
    """The modules' platform choice answers 'gpu', as in a program compiled for one."""
    for module in (losses, layers):
        monkeypatch.setattr(module, "compile_platform", lambda *a: "gpu")


def _logits_and_targets(n=6, v=50, seed=0):
    k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
    logits = 4.0 * jax.random.normal(k1, (2, n, v), jnp.float32)
    targets = jax.random.randint(k2, (2, n), 0, v).at[0, -1].set(0)  # a pad target
    return logits, targets


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_one_pass_loss_equals_the_two_pass_loss_and_gradient(monkeypatch, smoothing):
    logits, targets = _logits_and_targets()
    loss = functools.partial(
        losses.label_smoothed_cross_entropy, targets=targets, smoothing=smoothing, pad_id=0
    )
    value = lambda x: loss(x)[0]  # noqa: E731
    cpu = jax.jit(jax.value_and_grad(value))(logits)
    monkeypatch.setattr(losses, "compile_platform", lambda *a: "gpu")
    gpu = jax.jit(jax.value_and_grad(value))(logits)
    np.testing.assert_allclose(gpu[0], cpu[0], rtol=1e-6)
    np.testing.assert_allclose(gpu[1], cpu[1], atol=1e-7)


def test_one_pass_statistics_on_extreme_rows():
    # A row of equal values, one with a single huge logit, one of large negatives: the
    # online maximum rescales every partial sum and never meets exp(-inf + inf).
    x = jnp.array([[0.0] * 8, [0.0] * 7 + [80.0], [-1e30] * 4 + [-1e30 + 1e24] * 4])
    targets = jnp.array([3, 7, 0])
    lse, total, target = jax.jit(losses._one_pass_statistics)(x, targets)
    np.testing.assert_allclose(lse, jax.nn.logsumexp(x, axis=-1), rtol=1e-6)
    np.testing.assert_allclose(total, x.sum(-1), rtol=1e-6)
    np.testing.assert_array_equal(target, x[jnp.arange(3), targets])
    assert np.all(np.isfinite(lse))


def test_half_precision_logits_come_back_in_half_precision_on_an_accelerator(on_gpu):
    k1, k2 = jax.random.split(jax.random.PRNGKey(1))
    y = jax.random.normal(k1, (3, 16), jnp.float32)
    table = jax.random.normal(k2, (40, 16), jnp.float32)
    half = jax.jit(lambda y, t: layers.output_logits(y, t, jnp.bfloat16))(y, table)
    assert half.dtype == jnp.bfloat16
    full = layers.tied_logits(y.astype(jnp.bfloat16), table.astype(jnp.bfloat16))
    assert full.dtype == jnp.float32
    # The same float32-accumulated products, rounded once.
    np.testing.assert_array_equal(half, full.astype(jnp.bfloat16))
    # float32 models keep float32 logits on any device.
    assert layers.output_logits(y, table, jnp.float32).dtype == jnp.float32


@pytest.mark.parametrize("update_reads_it", [False, True])
def test_gradient_as_one_vector_gives_optax_norm_and_the_scaled_leaves(update_reads_it):
    tree = {
        "a": jax.random.normal(jax.random.PRNGKey(2), (5, 7)),
        "b": [jnp.arange(4.0), jnp.ones((2, 3), jnp.bfloat16)],
    }
    scale = jnp.float32(0.25)
    cpu_norm, cpu_tree = step_module._scaled_gradient(
        tree, scale, as_one=False, update_reads_it=False
    )

    @jax.jit
    def accelerator(tree, scale):
        norm, scaled = step_module._scaled_gradient(
            tree, scale, as_one=True, update_reads_it=update_reads_it
        )
        return norm, scaled()

    norm, scaled = accelerator(tree, scale)
    np.testing.assert_allclose(norm, cpu_norm, rtol=1e-6)
    expected = cpu_tree()
    assert jax.tree.structure(scaled) == jax.tree.structure(expected)
    for got, want in zip(jax.tree.leaves(scaled), jax.tree.leaves(expected)):
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(got, want)


def test_layer_norm_parameter_gradients_in_one_reduction_equal_the_cpu_ones(monkeypatch):
    """On a GPU LayerNorm's scale and bias gradients are one reduction over [N, 2, D]."""
    keys = jax.random.split(jax.random.PRNGKey(3), 4)
    x = jax.random.normal(keys[0], (3, 5, 16))
    scale = 1.0 + 0.1 * jax.random.normal(keys[1], (16,))
    bias = 0.1 * jax.random.normal(keys[2], (16,))
    dy = jax.random.normal(keys[3], (3, 5, 16))

    def grads():
        _, vjp = jax.vjp(lambda *a: layers.normalize(*a, 1e-6), x, scale, bias)
        return vjp(dy)

    cpu = grads()
    monkeypatch.setattr(layers, "compile_platform", lambda *a: "gpu")
    gpu = grads()
    for got, want in zip(gpu, cpu):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_position_bias_for_the_fused_kernel_equals_the_float32_one(dtype):
    k1, k2 = jax.random.split(jax.random.PRNGKey(3))
    b, t, m, h, k = 2, 8, 8, 2, 16
    qv = jax.random.normal(k1, (b, t, h, k)).astype(dtype)
    r = jax.random.normal(k2, (m + t, h, k)).astype(dtype)
    scale = k**-0.5
    plain = position_bias(qv, r, scale=scale, for_fused_kernel=False)
    fused = position_bias(qv, r, scale=scale, for_fused_kernel=True)
    assert plain.dtype == jnp.float32 and fused.dtype == dtype
    assert fused.shape == plain.shape == (b, h, t, m + t)
    # Keys a query may see (j <= i + M): the same scores, up to one rounding in `dtype`.
    visible = np.tril(np.ones((t, m + t), bool), m)
    tol = 1e-6 if dtype == jnp.float32 else 2 * float(jnp.finfo(dtype).eps)
    got, want = np.asarray(fused, np.float32)[..., visible], np.asarray(plain)[..., visible]
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * np.abs(want).max())


def test_mask_folded_into_the_bias_is_jax_s_own_combination():
    cudnn = pytest.importorskip("jax._src.cudnn.fused_attention_stablehlo")
    if not hasattr(cudnn, "combine_bias_and_mask"):
        pytest.skip("this jax has no combine_bias_and_mask to compare with")
    rng = np.random.default_rng(0)
    bias = jnp.asarray(rng.normal(size=(2, 2, 4, 6)), jnp.bfloat16)
    mask = jnp.asarray(rng.random((2, 1, 4, 6)) < 0.7)
    mask = jnp.broadcast_to(mask, bias.shape)
    ours = jnp.where(mask, bias, attention_module._large_negative(jnp.bfloat16))
    theirs = cudnn.combine_bias_and_mask(bias, mask, jnp.bfloat16)
    np.testing.assert_array_equal(ours, theirs)


def test_cpu_programs_keep_their_forms():
    """On a CPU nothing above is taken: the platform is the CPU's and the logits float32."""
    y = jnp.ones((2, 8), jnp.bfloat16)
    assert compile_platform(y) == "cpu"
    assert layers.output_logits(y, jnp.ones((5, 8)), jnp.bfloat16).dtype == jnp.float32
