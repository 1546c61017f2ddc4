"""Transformer layers: multi-head attention, position-wise FFN, encoder and decoder layers.

Shapes (the project's alphabet, transformer_jax/shapes.py):
  B: batch          T: target (query) length     S: source (key/value) length
  H: heads          K: head width (D / H)        D: model width      C: decode-cache positions

Every attention here goes through `transformer_jax.attention.dot_product_attention`.
Dtype policy: parameters float32; activations in `config.dtype`; attention logits and
softmax float32 (inside the attention core).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from transformer_jax import fused_norm
from transformer_jax.attention import beam_attention, dot_product_attention
from transformer_jax.config import ACTIVATIONS, TransformerConfig
from transformer_jax.int8 import Int8Dense
from transformer_jax.platform import compile_platform

Array = jax.Array
DecoderLayerCache = dict[str, Array]


class Deferred(NamedTuple):
    """A product whose bias is still to be added, by the kernel it goes to
    (`LayerNorm.after_residual`): product [..., O] in the layer's dtype and bias [O] as the
    parameter is stored."""

    product: Array
    bias: Array


class Branches(NamedTuple):
    """A post-LN output for its two consumers in a training step: `sublayer`, what the next
    sublayer reads, and `residual`, what the next residual adds. The same values as two
    arrays, so that their gradients reach the fused kernel that wrote them apart and it adds
    them (`transformer_jax.fused_norm`), not a kernel of their own. `unbranched` gives the
    one array."""

    sublayer: Array
    residual: Array


def unbranched(x: Array | Branches) -> Array:
    """A layer's output as one array [..., D] (`Branches`' sublayer array)."""
    return x.sublayer if isinstance(x, Branches) else x


def residual_branch(x: Array | Branches) -> Array:
    """What the next residual adds [..., D] (`Branches`' residual array)."""
    return x.residual if isinstance(x, Branches) else x


class Dense(nn.Dense):
    """`nn.Dense`: the same parameters and the same values. `defer_bias=True` hands the bias
    back unadded, as `Deferred`, for a kernel that adds it on its way (a program compiled for
    a GPU: `Residual`), so the bias add and its gradient's sums are not kernels of their own.
    """

    @nn.compact
    def __call__(
        self,
        inputs: Array,
        *,
        defer_bias: bool = False,
        input_bias: Array | None = None,
        bias_in_product: bool = False,
    ) -> Array | Deferred:
        """[..., I] -> [..., O] (or `Deferred` with `defer_bias`). `input_bias` [I]: a bias
        the inputs still owe (a `Deferred` value's, `MultiHeadAttention.attend_to`), taken
        as `(inputs + input_bias) @ kernel + bias` with `input_bias @ kernel` folded into the
        bias in float32, so the [..., I] sum is never formed. `bias_in_product`: the bias
        added inside the product (`biased_product`; a program compiled for a GPU, where it
        saves the bias add's pass over [..., O])."""
        kernel = self.param(
            "kernel", self.kernel_init, (jnp.shape(inputs)[-1], self.features), self.param_dtype
        )
        bias = (
            self.param("bias", self.bias_init, (self.features,), self.param_dtype)
            if self.use_bias
            else None
        )
        if input_bias is not None:
            folded = jnp.dot(input_bias, kernel, precision=lax.Precision.HIGHEST)
            bias = folded if bias is None else bias + folded
        param_bias = bias
        inputs, kernel, bias = self.promote_dtype(inputs, kernel, bias, dtype=self.dtype)
        if bias is not None and bias_in_product:
            return biased_product(inputs, kernel, bias)
        if self.dot_general_cls is not None:
            dot_general = self.dot_general_cls()
        else:
            dot_general = self.dot_general or lax.dot_general
        y = dot_general(
            inputs, kernel, (((inputs.ndim - 1,), (0,)), ((), ())), precision=self.precision
        )
        if bias is None:
            return y
        if defer_bias:
            # As stored: the kernel adds it in float32, and a cast would be a kernel of its own.
            return Deferred(y, param_bias)
        return y + jnp.reshape(bias, (1,) * (y.ndim - 1) + (-1,))


def dense(features: int, *, dtype, quantize: str | None = None, **kwargs) -> nn.Module:
    """A Dense layer computing in `dtype`, with float32 parameters, the paper code's
    Xavier-uniform kernel and a zero bias, its product `dense_product`; with quantize="int8",
    its int8 form for inference (`transformer_jax.int8.Int8Dense`, same parameter names
    plus the kernel's scale)."""
    if quantize == "int8":
        return Int8Dense(features, **kwargs)
    return Dense(
        features,
        dtype=dtype,
        param_dtype=jnp.float32,
        kernel_init=nn.initializers.xavier_uniform(),
        bias_init=nn.initializers.zeros,
        dot_general=dense_dot_general,
        **kwargs,
    )


@jax.custom_vjp
def dense_product(x: Array, kernel: Array) -> Array:
    """x [..., I] @ kernel [I, O] -> [..., O], as `nn.Dense` multiplies.

    Its VJP contracts the kernel's gradient over the flattened rows, x [N, I]^T g [N, O].
    Autodiff's gradient contracts over the leading axes of x [B, T, I] and g [B, T, O], and
    XLA's CPU backend then copied g into a transposed layout for each Dense of a training step
    (58 such copies in the 64 x 32 Transformer step of `train.bench --only cpu_vs_torch`).
    The flattened form has none of those copies, so the CPU training step is faster
    (`benchmarks/cpu_vs_torch_2026-11-27_intel207/`). The two gradients are the same sums in
    another order.

    A custom VJP is opaque to `jax.checkpoint`'s dot policies (`dots_saveable`,
    `dots_with_no_batch_dims_saveable`): under them its product is recomputed in the backward
    pass, not saved. That is why the Transformer-XL, whose layers run under such a policy,
    keeps `nn.Dense`'s own product.
    """
    return lax.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())))


def _dense_product_fwd(x, kernel):
    return dense_product(x, kernel), (x, kernel)


def _dense_product_bwd(saved, grad):
    x, kernel = saved
    rows = grad.reshape(-1, grad.shape[-1])  # [N, O]
    d_x = (rows @ kernel.T).reshape(x.shape)  # [..., I]
    d_kernel = x.reshape(-1, x.shape[-1]).T @ rows  # [I, O]
    return d_x.astype(x.dtype), d_kernel.astype(kernel.dtype)


dense_product.defvjp(_dense_product_fwd, _dense_product_bwd)


@jax.custom_vjp
def biased_product(x: Array, kernel: Array, bias: Array) -> Array:
    """x [..., I] @ kernel [I, O] + bias [O] -> [..., O] as one product: x gains a column of
    ones (and zeros to a multiple of 8, the GEMM's 16-byte rows) and the kernel the bias as
    its row, so the product writes the sum (no bias-add kernel reading and writing [N, O])
    and the bias's gradient is a row of the kernel's gradient product (no reduction over
    [N, O]). The ones column costs [N, I + 8], a quarter of the bias add's traffic where
    O = 4 I (the FFN's inner layer)."""
    return _biased_product_fwd(x, kernel, bias)[0]


def _augmented(x: Array, kernel: Array, bias: Array) -> tuple[Array, Array]:
    """[N, I + 8] rows of x with a ones column and zeros; [I + 8, O] kernel with the bias row."""
    rows = x.reshape(-1, x.shape[-1])
    extra = jnp.zeros((rows.shape[0], 8), rows.dtype).at[:, 0].set(1)
    pad = jnp.zeros((7, kernel.shape[1]), kernel.dtype)
    return (
        jnp.concatenate([rows, extra], axis=1),
        jnp.concatenate([kernel, bias[None].astype(kernel.dtype), pad], axis=0),
    )


def _biased_product_fwd(x, kernel, bias):
    rows, augmented = _augmented(x, kernel, bias)
    out = (rows @ augmented).reshape(*x.shape[:-1], kernel.shape[1])
    return out, (rows, kernel, bias, x.shape)


def _biased_product_bwd(saved, grad):
    rows, kernel, bias, x_shape = saved
    g = grad.reshape(-1, grad.shape[-1])  # [N, O]
    d_x = (g @ kernel.T).reshape(x_shape)
    d_augmented = rows.T @ g  # [I + 8, O]
    i = kernel.shape[0]
    return (
        d_x.astype(rows.dtype),
        d_augmented[:i].astype(kernel.dtype),
        d_augmented[i].astype(bias.dtype),
    )


biased_product.defvjp(_biased_product_fwd, _biased_product_bwd)


def dense_dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None):
    """`nn.Dense`'s dot_general: `dense_product` for the product it asks for (the last axis of
    lhs with the first of a 2-D rhs), `lax.dot_general` for any other."""
    if (
        dimension_numbers == (((lhs.ndim - 1,), (0,)), ((), ()))
        and rhs.ndim == 2
        and precision is None
        and preferred_element_type is None
    ):
        return dense_product(lhs, rhs)
    return lax.dot_general(
        lhs,
        rhs,
        dimension_numbers,
        precision=precision,
        preferred_element_type=preferred_element_type,
    )


def flat_dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None):
    """`nn.DenseGeneral`'s dot_general as one 2-D product: lhs's trailing contracted axes and
    rhs's leading ones flattened, [N, I] x [I, O], then the output reshaped back.

    The same products and sums as `lax.dot_general` on the n-D operands. In a program compiled
    for a GPU the n-D form's kernel gradient came out of its GEMM in another layout and took a
    transpose kernel per projection to reach the parameter's; the 2-D form's gradient is
    `x^T g` in the parameter's own layout. Any other contraction goes to `lax.dot_general`.
    """
    (lc, rc), (lb, rb) = dimension_numbers
    n = len(lc)
    options = dict(precision=precision, preferred_element_type=preferred_element_type)
    trailing = tuple(lc) == tuple(range(lhs.ndim - n, lhs.ndim)) and tuple(rc) == tuple(range(n))
    if lb or rb or not trailing:
        return lax.dot_general(lhs, rhs, dimension_numbers, **options)
    lead, feats = lhs.shape[: lhs.ndim - n], rhs.shape[n:]
    inner = math.prod(rhs.shape[:n])
    lhs, rhs = lhs.reshape(*lead, inner), rhs.reshape(inner, math.prod(feats))
    out = lax.dot_general(lhs, rhs, (((len(lead),), (0,)), ((), ())), **options)
    return out.reshape(*lead, *feats)


def output_logits(y: Array, table: Array, dtype) -> Array:
    """The tied pre-softmax projection: y [..., D], table [V, D] float32 -> [..., V].

    In float32 it is a float32 product. In half precision both operands are cast to `dtype`,
    the products accumulate in float32, and the backward products take their operands in
    `dtype` too: left to autodiff, the float32 cotangent of the logits pulls both gradient
    products back to float32 (TF32 on a GPU). With V 37000 this layer is about a third of the
    Transformer base step's FLOPs.

    The logits come back in float32 on a CPU, and in `dtype` in a program compiled for a GPU
    or a TPU (`compile_platform`), as Flax's and MaxText's examples return them: the loss's
    passes over the [N, V] array (its largest; softmax and loss still compute in float32)
    then read half the bytes (benchmarks/target_h200_2026-12-02/).
    """
    dtype = jnp.dtype(dtype)
    if dtype not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        dtype = jnp.dtype(jnp.float32)
    half_out = dtype != jnp.dtype(jnp.float32) and compile_platform(y) != "cpu"
    return tied_logits(y.astype(dtype), table.astype(dtype), dtype if half_out else None)


def tied_logits(y: Array, table: Array, out_dtype=None) -> Array:
    """y [..., D], table [V, D], both in one dtype -> y table^T [..., V] in `out_dtype`,
    default float32 (float64 for float64 operands); the products accumulate in float32 either
    way.

    Its VJP keeps the cotangent [..., V] in the operands' dtype and writes the table's
    gradient as (y^T grad)^T, [D, V] transposed, rather than grad^T y: autodiff's form made
    XLA's CPU backend copy the whole [N, V] logits gradient into a transposed layout (the
    largest array of a translation step) where this form transposes y [N, D] and the result.
    """
    out_dtype = jnp.promote_types(y.dtype, jnp.float32) if out_dtype is None else out_dtype
    return _tied_logits(y, table, jnp.dtype(out_dtype))


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def _tied_logits(y: Array, table: Array, out_dtype) -> Array:
    return jnp.einsum("...d,vd->...v", y, table, preferred_element_type=out_dtype)


def _tied_logits_fwd(y, table, out_dtype):
    return _tied_logits(y, table, out_dtype), (y, table)


def _tied_logits_bwd(out_dtype, saved, grad):
    y, table = saved
    grad = grad.astype(y.dtype)  # [..., V]
    acc = jnp.promote_types(y.dtype, jnp.float32)
    d_y = jnp.einsum("...v,vd->...d", grad, table, preferred_element_type=acc)
    d_table = jnp.einsum("...d,...v->dv", y, grad, preferred_element_type=acc).T
    return d_y.astype(y.dtype), d_table.astype(table.dtype)


_tied_logits.defvjp(_tied_logits_fwd, _tied_logits_bwd)


@partial(jax.custom_vjp, nondiff_argnums=(3,))
def normalize(x: Array, scale: Array, bias: Array, epsilon: float) -> Array:
    """LayerNorm over the last axis: x [..., D], scale and bias [D] -> [..., D], in at least
    float32 (float64 stays float64), as `flax.linen.LayerNorm` computes it: the statistics
    from E[x] and E[x^2], then (x - mean) * (rsqrt(var + epsilon) * scale) + bias.

    Its VJP keeps the statistics in their reduced shape [..., 1]. Autodiff saves the product
    rsqrt(var + epsilon) * scale broadcast to [..., D] for the backward pass, and XLA then
    writes that broadcast out as an array of its own for every LayerNorm of a step (two per
    LayerNorm in the 64 x 32 Transformer step of `train.bench --only cpu_vs_torch`). Here the
    backward pass reads x, its mean and its rsqrt: x-hat = (x - mean) * r, g = dy * scale,
    dx = r (g - mean(g) - x-hat mean(g x-hat)). The same gradient as autodiff's, in another
    order of sums.
    """
    return _normalize_fwd(x, scale, bias, epsilon)[0]


def _normalize_fwd(x, scale, bias, epsilon):
    acc = jnp.promote_types(x.dtype, jnp.float32)
    wide = x.astype(acc)
    mean = wide.mean(-1, keepdims=True)
    var = jnp.maximum(0.0, lax.square(wide).mean(-1, keepdims=True) - lax.square(mean))
    r = lax.rsqrt(var + epsilon)
    y = (x - mean) * (r * scale) + bias
    return y, (x, mean, r, scale, bias)


def _normalize_bwd(epsilon, saved, dy):
    x, mean, r, scale, bias = saved
    dy = dy.astype(r.dtype)
    x_hat = (x - mean) * r
    g = dy * scale
    d_x = r * (g - g.mean(-1, keepdims=True) - x_hat * (g * x_hat).mean(-1, keepdims=True))
    if compile_platform(x) == "gpu":
        # One reduction over [N, 2, D] instead of two over [N, D]: XLA:GPU runs each as two
        # kernels, and keeps these siblings apart (benchmarks/target_h200_2026-12-02/).
        both = jnp.stack([dy * x_hat, dy], -2).reshape(-1, 2, dy.shape[-1]).sum(0)
        d_scale, d_bias = both[0], both[1]
    else:
        rows = (-1, dy.shape[-1])
        d_scale = (dy * x_hat).reshape(rows).sum(0)
        d_bias = dy.reshape(rows).sum(0)
    return d_x.astype(x.dtype), d_scale.astype(scale.dtype), d_bias.astype(bias.dtype)


normalize.defvjp(_normalize_fwd, _normalize_bwd)


class LayerNorm(nn.Module):
    """`flax.linen.LayerNorm` over the last axis (its parameters `scale` and `bias` [D], its
    initialisers and its output), computed by `normalize`, whose VJP keeps the statistics
    reduced. Statistics in at least float32 whatever `dtype`; the output in `dtype` (None:
    the inputs' and parameters' common dtype, as flax's)."""

    epsilon: float = 1e-6
    dtype: jnp.dtype | None = None
    param_dtype: jnp.dtype = jnp.float32

    def _parameters(self, d: int) -> tuple[Array, Array]:
        scale = self.param("scale", nn.initializers.ones, (d,), self.param_dtype)
        bias = self.param("bias", nn.initializers.zeros, (d,), self.param_dtype)
        return scale, bias

    @nn.compact
    def __call__(self, x: Array) -> Array:
        """[..., D] -> [..., D]."""
        scale, bias = self._parameters(x.shape[-1])
        dtype = self.dtype or jnp.result_type(x, scale, bias)
        return normalize(x, scale, bias, self.epsilon).astype(dtype)

    @nn.compact
    def after_residual(
        self,
        x: Array,
        y: Array,
        *,
        rate: float,
        deterministic: bool,
        y_bias: Array | None = None,
        branches: bool = False,
    ) -> Array | tuple[Array, Array]:
        """LayerNorm(x + Dropout(rate)(y + y_bias)) as one kernel forward and one backward
        (`transformer_jax.fused_norm`), for the programs `fused_norm.applies` to: x, y
        [..., D] (y_bias [D] or None) -> [..., D] (twice with `branches`,
        `fused_norm.add_dropout_normalize`), the same parameters as `__call__`. Dropout (unless
        `deterministic` or rate 0) by the kernels' hash of a seed drawn from the 'dropout'
        stream."""
        scale, bias = self._parameters(x.shape[-1])
        dtype = self.dtype or jnp.result_type(x, y, scale, bias)
        rng = None if deterministic or rate == 0.0 else self.make_rng("dropout")
        return fused_norm.add_dropout_normalize(
            x,
            y,
            scale,
            bias,
            epsilon=self.epsilon,
            y_bias=y_bias,
            rate=rate,
            dropout_rng=rng,
            dtype=dtype,
            branches=branches,
        )


def layer_norm(config: TransformerConfig, **kwargs) -> LayerNorm:
    return LayerNorm(epsilon=config.layer_norm_eps, dtype=config.dtype, **kwargs)


class MultiHeadAttention(nn.Module):
    """Multi-head attention, split into its two halves so a decoder can cache keys/values.

    `project_kv` maps the attended sequence to per-head keys and values; `attend_to` projects
    the queries, calls the attention core and mixes heads back to D. `__call__` does both.
    Parameters: query, key, value, out, each a [D, D] Dense (heads are reshaped out of D).
    """

    config: TransformerConfig

    def setup(self):
        d, dtype = self.config.d_model, self.config.dtype
        q = self.config.quantize
        self.query = dense(d, dtype=dtype, quantize=q)
        self.key = dense(d, dtype=dtype, quantize=q)
        self.value = dense(d, dtype=dtype, quantize=q)
        self.out = dense(d, dtype=dtype, quantize=q)

    def _split_heads(self, x: Array) -> Array:
        """[B, T, D] -> [B, T, H, K]."""
        return x.reshape(*x.shape[:-1], self.config.n_heads, self.config.head_dim)

    def project_kv(
        self, inputs_kv: Array, *, heads_first: bool = False, defer_bias: bool = False
    ) -> tuple[Array, Array | Deferred]:
        """[B, S, D] -> key, value [B, S, H, K] (or [B, H, S, K] with `heads_first`).

        `defer_bias` (a program whose residual adds the output projection's bias in its
        kernel, `Residual`): the key without its bias, which moves every score of a query by
        the same q . b_k and so leaves the softmax as it is (its gradient is zero); the value
        as `Deferred` [B, S, H, K] with its bias [D], which `attend_to` folds into the output
        projection's bias. Neither bias add is then a kernel of its own.
        """
        value_bias = None
        if defer_bias:
            key = self.key(inputs_kv, defer_bias=True).product
            value, value_bias = self.value(inputs_kv, defer_bias=True)
        else:
            key, value = self.key(inputs_kv), self.value(inputs_kv)
        key, value = self._split_heads(key), self._split_heads(value)
        if heads_first:
            key, value = key.swapaxes(1, 2), value.swapaxes(1, 2)
        return key, (value if value_bias is None else Deferred(value, value_bias))

    def attend_to(
        self,
        inputs_q: Array,
        key: Array,
        value: Array,
        *,
        mask: Array | None,
        deterministic: bool,
        return_weights: bool = False,
        heads_first: bool = False,
        defer_bias: bool = False,
    ):
        """inputs_q [B, T, D], key/value [B, S, H, K] (or [B, H, S, K] with `heads_first`;
        the value may be `project_kv`'s `Deferred`), mask -> [B, T, H, K] -> [B, T, D] (and the
        weights [B, H, T, S] float32 if `return_weights`: `attention_maps` asks; it takes the
        XLA path, so only then is the fused kernel ruled out). `defer_bias`: the output
        projection's bias unadded (`Deferred`)."""
        cfg = self.config
        query = self._split_heads(self.query(inputs_q))
        rate = cfg.attention_dropout
        dropping = not deterministic and rate > 0.0
        value_bias = None
        if isinstance(value, Deferred):
            value, value_bias = value
            if dropping or not defer_bias:
                # Dropped weights no longer sum to one, so the bias would not pass through
                # the attention unchanged (and without `defer_bias` there is no bias of the
                # output projection's to fold it into): add it to the values.
                h, k = cfg.n_heads, cfg.head_dim
                value_bias = value_bias.reshape((h, 1, k) if heads_first else (h, k))
                value = value + value_bias.astype(value.dtype)
                value_bias = None
        out = dot_product_attention(
            query,
            key,
            value,
            mask=mask,
            dropout_rate=rate,
            dropout_rng=self.make_rng("dropout") if dropping else None,
            deterministic=deterministic,
            return_weights=return_weights,
            implementation=cfg.attention_impl,
            heads_first=heads_first,
        )
        out, weights = out if return_weights else (out, None)
        out = out.reshape(*out.shape[:-2], cfg.d_model)
        # Each query's weights sum to one, so softmax(s) (v + b_v) = softmax(s) v + b_v, and
        # b_v goes through the output projection as b_v @ W_o.
        out = self.out(out, defer_bias=True, input_bias=value_bias) if defer_bias else self.out(out)
        return (out, weights) if return_weights else out

    def attend_to_beams(
        self, inputs_q: Array, key: Array, value: Array, ancestry: Array, *, mask: Array
    ) -> Array:
        """A beam search's step: inputs_q [B * W, 1, D], per-slot caches key/value
        [B, H, C * W, K] (position-major), ancestry [B, W, C], mask [B * W, 1, 1, C]
        -> [B * W, 1, D] (`transformer_jax.attention.beam_attention`)."""
        cfg = self.config
        b, w, c = ancestry.shape
        query = self._split_heads(self.query(inputs_q)).reshape(b, w, cfg.n_heads, -1)
        out = beam_attention(query, key, value, ancestry, mask=mask.reshape(b, w, c)[:, None])
        return self.out(out.reshape(b * w, 1, cfg.d_model))

    def __call__(
        self,
        inputs_q: Array,
        inputs_kv: Array,
        *,
        mask: Array | None = None,
        deterministic: bool = True,
        return_weights: bool = False,
        defer_bias: bool = False,
    ):
        """inputs_q [B, T, D] attends to inputs_kv [B, S, D] -> [B, T, D] (and the weights
        [B, H, T, S] if `return_weights`; `defer_bias` as `attend_to`'s)."""
        key, value = self.project_kv(inputs_kv, defer_bias=defer_bias)
        return self.attend_to(
            inputs_q,
            key,
            value,
            mask=mask,
            deterministic=deterministic,
            return_weights=return_weights,
            defer_bias=defer_bias,
        )


class FeedForward(nn.Module):
    """Position-wise FFN: Dense(d_ff), ReLU (or `config.activation`), Dense(D) (section 3.3)."""

    config: TransformerConfig

    @nn.compact
    def __call__(self, x: Array, *, defer_bias: bool = False) -> Array | Deferred:
        """[B, T, D] -> [B, T, D] (`defer_bias`, a program compiled for a GPU: the outer bias
        unadded, `Deferred`, and the inner one added inside its product)."""
        cfg = self.config
        q = cfg.quantize
        inner = dense(cfg.d_ff, dtype=cfg.dtype, quantize=q, name="inner")
        h = ACTIVATIONS[cfg.activation](inner(x, bias_in_product=True) if defer_bias else inner(x))
        outer = dense(cfg.d_model, dtype=cfg.dtype, quantize=q, name="outer")
        return outer(h, defer_bias=True) if defer_bias else outer(h)


class Residual(nn.Module):
    """Residual connection, dropout and LayerNorm around one sublayer, placed by norm_first.

    post-LN (paper): out = LayerNorm(x + Dropout(sublayer(x)));
    pre-LN:          out = x + Dropout(sublayer(LayerNorm(x))).
    `r(x, sublayer)` is the whole thing; `h = r.pre(x); out = r.post(x, sublayer(h))` lets a
    caller keep what the sublayer computes from `h` (a decoding step's keys and values).
    """

    config: TransformerConfig

    def setup(self):
        self.norm = layer_norm(self.config)
        self.dropout = nn.Dropout(self.config.dropout)

    def pre(self, x: Array | Branches) -> Array:
        """The sublayer's input: [B, T, D] -> [B, T, D]."""
        x = unbranched(x)
        return self.norm(x) if self.config.norm_first else x

    def fused(self, x: Array | Branches) -> bool:
        """Whether `post` runs as one kernel (`LayerNorm.after_residual`): post-LN in a program
        for one GPU (`transformer_jax.fused_norm.applies`)."""
        return not self.config.norm_first and fused_norm.applies(unbranched(x))

    def sublayer_options(self, x: Array | Branches) -> dict:
        """What the sublayer is asked: its output projection's bias unadded where `post`'s
        kernel adds it (not for int8 layers, which add their own)."""
        return {"defer_bias": True} if self.fused(x) and not self.config.quantize else {}

    def post(
        self, x: Array | Branches, sublayer_out: Array | Deferred, *, deterministic: bool
    ) -> Array | Branches:
        """x [B, T, D], the sublayer's output [B, T, D] (or `Deferred`) -> [B, T, D]; as
        `Branches` where the fused kernel trains (their gradients meet in its backward)."""
        bias = None
        if isinstance(sublayer_out, Deferred):
            sublayer_out, bias = sublayer_out
        if self.fused(x):
            out = self.norm.after_residual(
                residual_branch(x),
                sublayer_out,
                y_bias=bias,
                rate=self.config.dropout,
                deterministic=deterministic,
                branches=not deterministic,
            )
            return out if deterministic else Branches(*out)
        x = unbranched(x)
        if bias is not None:
            sublayer_out = sublayer_out + bias.astype(sublayer_out.dtype)
        y = x + self.dropout(sublayer_out, deterministic=deterministic)
        return y if self.config.norm_first else self.norm(y)

    def __call__(self, x: Array, sublayer: Callable[..., Array], *, deterministic: bool) -> Array:
        """x [B, T, D] -> [B, T, D] (or `Branches`, as `post`), the whole wrapper around
        `sublayer` ([B, T, D] -> same; it takes `defer_bias=True` where `post` adds its output
        projection's bias)."""
        out = sublayer(self.pre(x), **self.sublayer_options(x))
        return self.post(x, out, deterministic=deterministic)

    def with_weights(
        self, x: Array, attention: Callable, *, deterministic: bool, return_weights: bool
    ) -> tuple[Array, Array | None]:
        """`__call__` around an attention sublayer that returns (out, weights) when
        `return_weights`, else out -> (x [B, T, D], weights or None)."""
        out = attention(self.pre(x), **self.sublayer_options(x))
        out, weights = out if return_weights else (out, None)
        return self.post(x, out, deterministic=deterministic), weights


class EncoderLayer(nn.Module):
    """Self-attention then FFN, each wrapped in a `Residual`."""

    config: TransformerConfig

    def setup(self):
        self.self_attn = MultiHeadAttention(self.config)
        self.self_attn_residual = Residual(self.config)
        self.ffn = FeedForward(self.config)
        self.ffn_residual = Residual(self.config)

    def __call__(
        self, x: Array, *, mask: Array, deterministic: bool = True, return_weights: bool = False
    ):
        """x [B, S, D], mask [B, 1, 1, S] (source padding) -> [B, S, D] (and the
        self-attention weights [B, H, S, S] if `return_weights`)."""
        x, weights = self.self_attn_residual.with_weights(
            x,
            lambda h, **kw: self.self_attn(
                h, h, mask=mask, deterministic=deterministic, return_weights=return_weights, **kw
            ),
            deterministic=deterministic,
            return_weights=return_weights,
        )
        x = self.ffn_residual(x, self.ffn, deterministic=deterministic)
        return (x, weights) if return_weights else x


class DecoderLayer(nn.Module):
    """Masked self-attention, cross-attention to the encoder output, FFN; each in a `Residual`.

    `__call__` runs a whole target sequence; `init_cache` + `step` run one position at a time
    with a cache holding this layer's self-attention keys/values [B, H, C, K] (written at
    `index`) and the cross-attention keys/values [B, H, S, K] (computed once from the encoder
    output, so a step does not project it again). Heads come before positions in the cache so
    that a step's attention reads it in place (`dot_product_attention(heads_first=True)`).
    """

    config: TransformerConfig

    def setup(self):
        self.self_attn = MultiHeadAttention(self.config)
        self.self_attn_residual = Residual(self.config)
        self.cross_attn = MultiHeadAttention(self.config)
        self.cross_attn_residual = Residual(self.config)
        self.ffn = FeedForward(self.config)
        self.ffn_residual = Residual(self.config)

    def _cross_attention_and_ffn(
        self,
        y: Array,
        cross_key: Array,
        cross_value: Array,
        *,
        src_mask: Array,
        deterministic: bool,
        return_weights: bool = False,
        heads_first: bool = False,
    ):
        """y [B, T, D], cross key/value [B, S, H, K] (or [B, H, S, K] with `heads_first`),
        src_mask [B, 1, 1, S] -> [B, T, D] (and the cross-attention weights [B, H, T, S] if
        `return_weights`)."""
        y, weights = self.cross_attn_residual.with_weights(
            y,
            lambda h, **kw: self.cross_attn.attend_to(
                h,
                cross_key,
                cross_value,
                mask=src_mask,
                deterministic=deterministic,
                return_weights=return_weights,
                heads_first=heads_first,
                **kw,
            ),
            deterministic=deterministic,
            return_weights=return_weights,
        )
        y = self.ffn_residual(y, self.ffn, deterministic=deterministic)
        return (y, weights) if return_weights else y

    def __call__(
        self,
        y: Array,
        encoded: Array,
        *,
        self_mask: Array,
        src_mask: Array,
        deterministic: bool = True,
        return_weights: bool = False,
    ):
        """y [B, T, D], encoded [B, S, D], self_mask [B, 1, T, T], src_mask [B, 1, 1, S]
        -> [B, T, D] (and, if `return_weights`, {'decoder_self': [B, H, T, T],
        'cross': [B, H, T, S]})."""
        y, self_weights = self.self_attn_residual.with_weights(
            y,
            lambda h, **kw: self.self_attn(
                h,
                h,
                mask=self_mask,
                deterministic=deterministic,
                return_weights=return_weights,
                **kw,
            ),
            deterministic=deterministic,
            return_weights=return_weights,
        )
        cross_key, cross_value = self.cross_attn.project_kv(
            encoded, **self.cross_attn_residual.sublayer_options(y)
        )
        y = self._cross_attention_and_ffn(
            y,
            cross_key,
            cross_value,
            src_mask=src_mask,
            deterministic=deterministic,
            return_weights=return_weights,
        )
        if not return_weights:
            return y
        y, cross_weights = y
        return y, {"decoder_self": self_weights, "cross": cross_weights}

    def init_cache(self, encoded: Array, *, max_len: int) -> DecoderLayerCache:
        """encoded [B, S, D] -> {self_key, self_value: [B, H, C, K] zeros,
        cross_key, cross_value: [B, H, S, K]}."""
        cfg = self.config
        cross_key, cross_value = self.cross_attn.project_kv(encoded, heads_first=True)
        shape = (encoded.shape[0], cfg.n_heads, max_len, cfg.head_dim)
        return {
            "self_key": jnp.zeros(shape, cross_key.dtype),
            "self_value": jnp.zeros(shape, cross_value.dtype),
            "cross_key": cross_key,
            "cross_value": cross_value,
        }

    def grow_cache(
        self, cache: DecoderLayerCache, *, max_len: int, slots: int = 1
    ) -> DecoderLayerCache:
        """The cache with room for `max_len` >= C self-attention positions, the new ones
        zeros as `init_cache` writes them (the cross-attention keys/values are kept). `slots`:
        W for a beam search's position-major [B, H, C * W, K] caches (`beam_attention`)."""
        widths = ((0, 0), (0, 0), (0, max_len * slots - cache["self_key"].shape[2]), (0, 0))
        return {
            **cache,
            "self_key": jnp.pad(cache["self_key"], widths),
            "self_value": jnp.pad(cache["self_value"], widths),
        }

    def step(
        self,
        y: Array,
        cache: DecoderLayerCache,
        *,
        index: Array,
        self_mask: Array,
        src_mask: Array,
        ancestry: Array | None = None,
    ) -> tuple[Array, DecoderLayerCache]:
        """One target position (no dropout).

        Args:
          y: [R, 1, D] the layer input at position `index`: R = B rows, or B * W for a
            beam search whose cross-attention keys/values are at B rows.
          cache: from `init_cache` or the previous step.
          index: int32 scalar, the position being decoded.
          self_mask: [R, 1, 1, C], True for cached positions to attend (<= index, not pad).
          src_mask: [B, 1, 1, S].
          ancestry: a beam search's [B, W, C] slot bookkeeping (`beam_attention`): the
            self-attention caches are then per slot, never reordered; None: per row.
        Returns:
          [R, 1, D] and the cache with this position's key/value written at `index`.
        """
        h = self.self_attn_residual.pre(y)
        key, value = self.self_attn.project_kv(h, heads_first=True)  # [R, H, 1, K]
        cache = dict(cache)
        at = (0, 0, index, 0)
        if ancestry is not None:  # per-slot caches [B, H, C * W, K], position-major
            b, w, _ = ancestry.shape
            # [B * W, H, 1, K] -> [B, H, W, K]: this position's W rows, one per slot.
            key, value = (
                x.reshape(b, w, x.shape[1], x.shape[-1]).swapaxes(1, 2) for x in (key, value)
            )
            at = (0, 0, index * w, 0)
        cache["self_key"] = lax.dynamic_update_slice(cache["self_key"], key, at)
        cache["self_value"] = lax.dynamic_update_slice(cache["self_value"], value, at)
        if ancestry is None:
            attended = self.self_attn.attend_to(
                h,
                cache["self_key"],
                cache["self_value"],
                mask=self_mask,
                deterministic=True,
                heads_first=True,
            )
        else:
            attended = self.self_attn.attend_to_beams(
                h, cache["self_key"], cache["self_value"], ancestry, mask=self_mask
            )
        y = self.self_attn_residual.post(y, attended, deterministic=True)
        # A beam search's W rows per sentence share their sentence's cross-attention keys and
        # values (`Transformer.expand_decode_cache` leaves them at B rows): the rows attend as
        # W query positions of that sentence, [B * W, 1, D] -> [B, W, D] and back.
        rows, sentences = y.shape[0], cache["cross_key"].shape[0]
        y = self._cross_attention_and_ffn(
            y.reshape(sentences, rows // sentences, y.shape[-1]),
            cache["cross_key"],
            cache["cross_value"],
            src_mask=src_mask,
            deterministic=True,
            heads_first=True,
        )
        return y.reshape(rows, 1, y.shape[-1]), cache
