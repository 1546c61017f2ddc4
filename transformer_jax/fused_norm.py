"""Post-LN's residual, dropout and LayerNorm, LayerNorm(x + dropout(y)), as one Pallas kernel
forward and one backward, for programs compiled for a GPU.

Shapes (transformer_jax/shapes.py): N rows (every axis but the last, flattened), D features.

XLA:GPU runs the composite as several kernels a site: the dropout mask, the residual add with
the statistics' reductions, the normalisation, the rsqrt; and backward the input gradient, the
scale's and bias's gradients (each of XLA:GPU's column reductions two kernels), and the masked
gradient of y. Here the forward kernel reads x and y once and writes the output and each row's
mean and rsqrt; the backward kernel reads x, y and the output's gradient once and writes the
gradients of x and y with each program's partial sums of the parameters' gradients ([G, 2, D],
or [G, 3, D] with y's bias, summed over the G programs by one small reduction after it). The
bias of the product y can be handed to the kernels (`y_bias`) rather than added before them:
then neither the bias add nor its gradient's reduction is a kernel of its own. The dropout mask is a
counter-based hash of (seed, row, feature) (`transformer_jax.hashed_dropout`), drawn again in
the backward pass, so no mask reaches memory.

The residual sum is computed in float32 (XLA's path rounds x + dropout(y) to the activations'
dtype before the statistics), so a bf16 program's values differ from the XLA path's by that
rounding. The statistics are `transformer_jax.layers.normalize`'s: E[s] and E[s^2] in float32.

On a CPU the kernels run in Pallas interpret mode (how the tests reach them); on a GPU through
Pallas' Triton lowering. `applies` says when a program takes them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.custom_derivatives import SymbolicZero
from jax.experimental import pallas as pl

from transformer_jax.hashed_dropout import drop, dropout_keep, dropout_seed
from transformer_jax.platform import compile_devices, compile_platform, keep_placement

Array = jax.Array

# Triton's launch settings (a benchmark may set others before tracing), the elements of one
# [rows, D] tile a program works on at a time, and the most rows one program covers (its
# partial parameter gradients are one row of the [G, 2 or 3, D] sums XLA reduces after).
TRITON_OPTIONS = {"num_warps": 4, "num_stages": 1}
TILE_ELEMENTS = 8192
PROGRAM_ROWS = 128


def _triton_params():
    from jax.experimental.pallas import triton as plgpu

    return plgpu.CompilerParams(**TRITON_OPTIONS)


def applies(x: Array, *others: Array) -> bool:
    """Whether a program over `x` [..., D] (and `others`, arrays of the same computation:
    a kernel's output carries no mesh, so pass one that does) takes the kernels: compiled
    for one GPU (the kernels are not partitioned: a program over several devices keeps XLA's
    path), D a power of two from 16 to TILE_ELEMENTS, and the rows a multiple of 8."""
    d = x.shape[-1]
    rows = x.size // max(d, 1)
    return (
        compile_platform(x, *others) == "gpu"
        and compile_devices(x, *others) == 1
        and 16 <= d <= TILE_ELEMENTS
        and d & (d - 1) == 0
        and rows % 8 == 0
    )


def _plan(n: int, d: int) -> tuple[int, int]:
    """(rows a tile, tiles a program): powers of two, the tile at most TILE_ELEMENTS and the
    program at most PROGRAM_ROWS rows, both dividing N."""
    tile = max(1, min(TILE_ELEMENTS // d, n & -n))
    program = max(tile, min(PROGRAM_ROWS, n & -n))
    return tile, program // tile


def reference(
    x: Array,
    y: Array,
    scale: Array,
    bias: Array,
    seed: Array,
    *,
    epsilon: float,
    rate: float,
    y_bias: Array | None = None,
) -> Array:
    """What the kernels compute, in plain jnp: x, y [N, D], scale and bias [D], seed [1] int32
    (and y's bias [D]) -> LayerNorm(x + dropout(y + y_bias)) [N, D] in float32, dropout by
    the hash of (seed, row, feature)."""
    if y_bias is not None:
        y = y.astype(jnp.float32) + y_bias.astype(jnp.float32)
    s = x.astype(jnp.float32) + _dropped(y, seed, 0, rate)
    mean = s.mean(-1, keepdims=True)
    var = jnp.maximum(0.0, lax.square(s).mean(-1, keepdims=True) - lax.square(mean))
    return (s - mean) * (lax.rsqrt(var + epsilon) * scale) + bias


def _dropped(y: Array, seed: Array, row0, rate: float) -> Array:
    """dropout(y) in float32 for rows row0 .. row0 + len(y) - 1 of the call."""
    y = y.astype(jnp.float32)
    if rate == 0.0:
        return y
    u32 = jnp.uint32
    rows = (row0 + lax.broadcasted_iota(jnp.int32, y.shape, 0)).astype(u32)
    cols = lax.broadcasted_iota(jnp.int32, y.shape, 1).astype(u32)
    keep = dropout_keep(seed[0].astype(u32), u32(0), rows, cols, rate)
    return drop(y, keep, rate)


# ------------------------------------------------------------------------------- kernels
def _with_bias(y, y_bias_ref):
    """y [rows, D] plus y's bias where the call has one, in float32."""
    y = y.astype(jnp.float32)
    return y + y_bias_ref[0][...].astype(jnp.float32)[None, :] if y_bias_ref else y


def _fwd_kernel(seed_ref, x_ref, y_ref, scale_ref, bias_ref, *refs, plan, eps, rate):
    *y_bias_ref, out_ref, mean_ref, rstd_ref = refs
    tile, tiles = plan
    d = x_ref.shape[-1]
    base = pl.program_id(0) * (tile * tiles)
    scale = scale_ref[...].astype(jnp.float32)[None, :]
    bias = bias_ref[...].astype(jnp.float32)[None, :]
    seed = seed_ref[...]

    def body(i, carry):
        rows = pl.ds(i * tile, tile)
        y = _with_bias(y_ref[rows, :], y_bias_ref)
        y = _dropped(y, seed, base + i * tile, rate)
        s = x_ref[rows, :].astype(jnp.float32) + y
        mean = jnp.sum(s, axis=1) / d
        var = jnp.maximum(0.0, jnp.sum(s * s, axis=1) / d - mean * mean)
        r = lax.rsqrt(var + eps)
        out = (s - mean[:, None]) * (r[:, None] * scale) + bias
        out_ref[rows, :] = out.astype(out_ref.dtype)
        mean_ref[rows] = mean
        rstd_ref[rows] = r
        return carry

    lax.fori_loop(0, tiles, body, 0)


def _bwd_kernel(
    seed_ref,
    x_ref,
    y_ref,
    scale_ref,
    mean_ref,
    rstd_ref,
    *refs,  # the output's cotangents, (y's bias), then dx, (dy unless rate == 0), the sums
    plan,
    rate,
    y_bias: bool,
    cotangents: int,
):
    dout_refs, refs = refs[:cotangents], refs[cotangents:]
    y_bias_ref = refs[:1] if y_bias else ()
    dx_ref, *dy_ref, dparam_ref = refs[len(y_bias_ref) :]
    tile, tiles = plan
    d = x_ref.shape[-1]
    base = pl.program_id(0) * (tile * tiles)
    scale = scale_ref[...].astype(jnp.float32)[None, :]
    seed = seed_ref[...]

    def body(i, carry):
        d_scale, d_bias, d_y_bias = carry
        rows = pl.ds(i * tile, tile)
        y = _with_bias(y_ref[rows, :], y_bias_ref)
        s = x_ref[rows, :].astype(jnp.float32) + _dropped(y, seed, base + i * tile, rate)
        r = rstd_ref[rows][:, None]
        x_hat = (s - mean_ref[rows][:, None]) * r
        dout = dout_refs[0][rows, :].astype(jnp.float32)
        for other in dout_refs[1:]:  # the second branch's (`Branches`): summed here
            dout = dout + other[rows, :].astype(jnp.float32)
        g = dout * scale
        c1 = jnp.sum(g, axis=1)[:, None] / d
        c2 = jnp.sum(g * x_hat, axis=1)[:, None] / d
        ds = r * (g - c1 - x_hat * c2)
        dx_ref[rows, :] = ds.astype(dx_ref.dtype)
        dy = ds
        if dy_ref:  # dropout's VJP is dropout by the same mask: _dropped of ds with y's rows
            dy = _dropped(ds, seed, base + i * tile, rate)
            dy_ref[0][rows, :] = dy.astype(dy_ref[0].dtype)
        return (
            d_scale + jnp.sum(dout * x_hat, axis=0),
            d_bias + jnp.sum(dout, axis=0),
            d_y_bias + jnp.sum(dy, axis=0) if y_bias_ref else d_y_bias,
        )

    zeros = jnp.zeros((d,), jnp.float32)
    d_scale, d_bias, d_y_bias = lax.fori_loop(0, tiles, body, (zeros, zeros, zeros))
    dparam_ref[0, :] = d_scale
    dparam_ref[1, :] = d_bias
    if y_bias_ref:
        dparam_ref[2, :] = d_y_bias


# ------------------------------------------------------------------------- pallas calls
def _specs(n: int, d: int, plan):
    tile, tiles = plan
    rows = tile * tiles
    block = pl.BlockSpec((rows, d), lambda p: (p, 0))
    vector = pl.BlockSpec((d,), lambda p: (0,))
    stat = pl.BlockSpec((rows,), lambda p: (p,))
    seed = pl.BlockSpec((1,), lambda p: (0,))
    return block, vector, stat, seed, n // rows


def _settings(interpret: bool) -> dict:
    return dict(interpret=interpret, compiler_params=None if interpret else _triton_params())


def _forward(x, y, scale, bias, y_bias, seed, statics):
    eps, rate, out_dtype, interpret = statics
    n, d = x.shape
    plan = _plan(n, d)
    block, vector, stat, seed_spec, grid = _specs(n, d, plan)
    f32 = jnp.float32
    y_bias = () if y_bias is None else (y_bias,)
    return pl.pallas_call(
        functools.partial(_fwd_kernel, plan=plan, eps=eps, rate=rate),
        grid=(grid,),
        in_specs=[seed_spec, block, block, vector, vector] + [vector] * len(y_bias),
        out_specs=[block, stat, stat],
        out_shape=[
            jax.ShapeDtypeStruct((n, d), out_dtype),
            jax.ShapeDtypeStruct((n,), f32),
            jax.ShapeDtypeStruct((n,), f32),
        ],
        name="residual_dropout_norm_fwd",
        **_settings(interpret),
    )(seed, x, y, scale, bias, *y_bias)


def _backward(x, y, scale, y_bias, seed, mean, rstd, douts, statics):
    _, rate, _, interpret = statics
    n, d = x.shape
    plan = _plan(n, d)
    block, vector, stat, seed_spec, grid = _specs(n, d, plan)
    y_bias = () if y_bias is None else (y_bias,)
    sums = 2 + len(y_bias)  # the scale's, the bias's (and y's bias's) gradients
    partial = pl.BlockSpec((None, sums, d), lambda p: (p, 0, 0))
    out_shape = [jax.ShapeDtypeStruct((n, d), x.dtype)]
    out_specs = [block]
    if rate > 0.0:
        out_shape.append(jax.ShapeDtypeStruct((n, d), y.dtype))
        out_specs.append(block)
    out_shape.append(jax.ShapeDtypeStruct((grid, sums, d), jnp.float32))
    out_specs.append(partial)
    kernel = functools.partial(
        _bwd_kernel, plan=plan, rate=rate, y_bias=bool(y_bias), cotangents=len(douts)
    )
    dx, *dy, dparams = pl.pallas_call(
        kernel,
        grid=(grid,),
        in_specs=[seed_spec, block, block, vector, stat, stat]
        + [block] * len(douts)
        + [vector] * len(y_bias),
        out_specs=out_specs,
        out_shape=out_shape,
        name="residual_dropout_norm_bwd",
        **_settings(interpret),
    )(seed, x, y, scale, mean, rstd, *douts, *y_bias)
    dy = dy[0] if dy else dx.astype(y.dtype)
    return dx, dy, dparams.sum(0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _fused(x, y, scale, bias, y_bias, seed, statics):
    """-> the output twice (`Branches`' two consumers: their cotangents reach the backward
    kernel apart, and it adds them)."""
    out = _forward(x, y, scale, bias, y_bias, seed, statics)[0]
    return out, out


def _fused_fwd(x, y, scale, bias, y_bias, seed, statics):
    # symbolic_zeros: the primals come wrapped (CustomVJPPrimal), the statics not.
    x, y, scale, bias, y_bias, seed = (
        None if a is None else a.value for a in (x, y, scale, bias, y_bias, seed)
    )
    out, mean, rstd = _forward(x, y, scale, bias, y_bias, seed, statics)
    return (out, out), (x, y, scale, bias, y_bias, seed, mean, rstd)


def _fused_bwd(statics, saved, douts):
    x, y, scale, bias, y_bias, seed, mean, rstd = saved
    # An unused output's cotangent is a symbolic zero: the kernel reads only the others.
    douts = [d for d in douts if not isinstance(d, SymbolicZero)]
    if not douts:
        douts = [jnp.zeros(x.shape, x.dtype)]
    dx, dy, dparams = _backward(x, y, scale, y_bias, seed, mean, rstd, douts, statics)
    d_y_bias = None if y_bias is None else dparams[2].astype(y_bias.dtype)
    return dx, dy, dparams[0].astype(scale.dtype), dparams[1].astype(bias.dtype), d_y_bias, None


_fused.defvjp(_fused_fwd, _fused_bwd, symbolic_zeros=True)


def add_dropout_normalize(
    x: Array,
    y: Array,
    scale: Array,
    bias: Array,
    *,
    epsilon: float,
    y_bias: Array | None = None,
    rate: float = 0.0,
    dropout_rng: Array | None = None,
    dtype=None,
    branches: bool = False,
    interpret: bool | None = None,
) -> Array | tuple[Array, Array]:
    """LayerNorm(x + dropout(y + y_bias)) over the last axis, fused: the kernels above under a
    custom VJP.

    Args:
      x: [..., D] the residual stream.
      y: [..., D] the sublayer's output (dropped).
      scale, bias: [D] LayerNorm's parameters.
      epsilon: LayerNorm's epsilon.
      y_bias: [D] the bias of the product y (None: y has its bias), added in the kernel, so the
        forward pass needs no kernel of its own for it and its gradient's sums come out of the
        backward kernel's.
      rate, dropout_rng: dropout of y, drawn by `hashed_dropout.dropout_keep` of (seed, row,
        feature) from a seed `dropout_rng` gives (None or rate 0: no dropout).
      dtype: the output's dtype (default x's).
      branches: return the output twice, for two consumers (post-LN's next sublayer and next
        residual): the backward kernel then adds their gradients, which XLA would otherwise
        add in a kernel of its own.
      interpret: Pallas interpret mode; default: on unless the program is compiled for a GPU.
    Returns:
      [..., D] in `dtype`: `reference`'s values for the flattened rows (twice, as a pair,
      with `branches`).
    """
    vectors = (scale, bias) if y_bias is None else (scale, bias, y_bias)
    if x.shape != y.shape or any(v.shape != x.shape[-1:] for v in vectors):
        raise ValueError(
            f"x {x.shape}, y {y.shape}, scale {scale.shape}, bias {bias.shape} and y's bias "
            f"{None if y_bias is None else y_bias.shape} do not fit"
        )
    if interpret is None:
        interpret = compile_platform(x, y, scale) != "gpu"
    rate = float(rate) if dropout_rng is not None else 0.0
    seed = dropout_seed(dropout_rng) if rate > 0.0 else jnp.zeros((1,), jnp.int32)
    d = x.shape[-1]
    statics = (float(epsilon), rate, jnp.dtype(dtype or x.dtype), bool(interpret))
    outs = _fused(x.reshape(-1, d), y.reshape(-1, d), scale, bias, y_bias, seed, statics)
    outs = tuple(keep_placement(out.reshape(x.shape), x) for out in outs)
    return outs if branches else outs[0]
