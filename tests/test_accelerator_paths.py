"""The forms a program compiled for a GPU or TPU takes, computed on the CPU and held to the
CPU's forms (issue 62's levers).

Each lever is chosen from the devices a step is compiled for (`compile_platform`), so a CPU
run never takes it; here the choice is forced, the accelerator's form runs on the CPU, and
it must give the CPU form's numbers (to rounding). tests/test_target.py checks that the
compiled GPU programs take them.
"""

from __future__ import annotations

import functools
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import calls_to

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

    # The CPU keeps the two-pass form (and its numbers); only an accelerator's program takes
    # the one-pass reduction, a `reduce` of four operands with its own combiner.
    def reductions():  # the reduction primitives of the gradient's trace, traced afresh
        return re.findall(r"\b(reduce\w*)\[", str(jax.make_jaxpr(jax.grad(value))(logits)))

    assert "reduce" not in reductions() and "reduce_max" in reductions()
    monkeypatch.setattr(losses, "compile_platform", lambda *a: "gpu")
    assert "reduce" in reductions() and "reduce_max" not in reductions()
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


@pytest.mark.parametrize(
    "x_shape, kernel_shape, contracting",
    [
        ((2, 5, 8), (8, 3, 2, 4), 1),  # the q/k/v projection, [B, S, D] x [D, 3, H, K]
        ((2, 5, 2, 4), (2, 4, 8), 2),  # the output projection, [B, T, H, K] x [H, K, D]
        ((7, 8), (8, 6), 1),  # a plain Dense
    ],
)
def test_flat_products_equal_dense_general_and_its_gradients(x_shape, kernel_shape, contracting):
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(5), 3)
    x = jax.random.normal(k1, x_shape)
    kernel = jax.random.normal(k2, kernel_shape)
    n = len(x_shape)
    dims = ((tuple(range(n - contracting, n)), tuple(range(contracting))), ((), ()))
    cotangent = jax.random.normal(k3, x_shape[: n - contracting] + kernel_shape[contracting:])

    def run(dot_general):
        out, vjp = jax.vjp(lambda a, b: dot_general(a, b, dims), x, kernel)
        return (out, *vjp(cotangent))

    flat, nd = run(layers.flat_dot_general), run(jax.lax.dot_general)
    for got, want in zip(flat, nd):
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_flat_products_leave_other_contractions_to_dot_general(monkeypatch):
    calls = []
    original = jax.lax.dot_general
    monkeypatch.setattr(
        layers.lax, "dot_general", lambda *a, **k: calls.append(a[2]) or original(*a, **k)
    )
    x, y = jnp.ones((3, 4, 5)), jnp.ones((3, 5, 2))
    batched = (((2,), (1,)), ((0,), (0,)))  # a batch axis: not a Dense's product
    out = layers.flat_dot_general(x, y, batched)
    assert out.shape == (3, 4, 2) and calls == [batched]
    leading = (((0,), (0,)), ((), ()))  # x's first axis contracted, not its last
    layers.flat_dot_general(jnp.ones((4, 3)), jnp.ones((4, 2)), leading)
    assert calls[-1] == leading


@pytest.mark.parametrize("untie_r", [False, True])
def test_xl_attention_gpu_forms_equal_the_cpu_form(monkeypatch, untie_r):
    """XL's attention sublayer in the forms of a program compiled for a GPU (its projections
    as 2-D products, u and v added as one stack): the same output and gradients, u's and v's
    included, as the CPU's form."""
    from xl_jax import attention as xl_attention
    from xl_jax.config import TransformerXLConfig
    from xl_jax.memory import attention_mask

    cfg = TransformerXLConfig.tiny(d_model=16, n_heads=2, d_head=4, untie_r=untie_r)
    b, t, m = 2, 3, 4
    rng = np.random.default_rng(2)
    h = jnp.asarray(rng.normal(size=(b, t, cfg.d_model)), jnp.float32)
    mem = jnp.asarray(rng.normal(size=(b, m, cfg.d_model)), jnp.float32)
    u, v = (jnp.asarray(rng.normal(size=(2, 4)), jnp.float32) for _ in range(2))
    dist = xl_attention.relative_positions(cfg, q_len=t, mem_len=m)
    pos = xl_attention.sinusoid_embedding(dist, cfg.d_model)
    mask = attention_mask(jnp.array([4, 2]), q_len=t, mem_len=m, same_length=False)
    module = xl_attention.RelativeMultiHeadAttention(cfg)
    params = module.init(jax.random.key(0), h, mem, pos, mask, u, v)["params"]
    products = calls_to(monkeypatch, xl_attention, "flat_dot_general")

    def value_and_grads():
        def loss(p, u, v):
            return jnp.sum(jnp.sin(module.apply({"params": p}, h, mem, pos, mask, u, v)))

        return jax.value_and_grad(loss, argnums=(0, 1, 2))(params, u, v)

    def stacks():  # u and v stacked into one [2, H, K] (the GPU's form)
        apply = lambda u, v: module.apply({"params": params}, h, mem, pos, mask, u, v)  # noqa: E731
        return len(re.findall(r"\bstack\[", str(jax.make_jaxpr(apply)(u, v))))

    cpu = value_and_grads()
    assert stacks() == 0
    assert products == []  # the CPU's program keeps DenseGeneral's own products
    # A TPU's program keeps them too.
    monkeypatch.setattr(xl_attention, "compile_platform", lambda *a: "tpu")
    assert stacks() == 0 and products == []
    # The name made at run time, as a device's is: `is` against the literal would miss it.
    monkeypatch.setattr(xl_attention, "compile_platform", lambda *a: "".join(["g", "pu"]))
    gpu = value_and_grads()
    assert len(products) == 3  # qkv, r_net and o_net
    assert stacks() == 1
    chex.assert_trees_all_close(gpu, cpu, rtol=1e-5, atol=1e-6)
