"""Transformer-XL's relative attention as blockwise Pallas kernels (forward and backward).

Shapes (transformer_jax/shapes.py): B batch, T query (segment) length, M memory length,
S = M + T key length, H heads, K head width; here also bq = bk the query and key block sizes
and N = bq + bk, the rows of R that one (query block, key block) pair reads.

What `xl_jax.attention` computes with XLA, for query i and key j (d = M + i - j the distance,
R's row T - 1 - i + j encoding it)::

    s_ij = scale * ((q_i + u) . k_j + (q_i + v) . r_{T-1-i+j}),   masked where d < 0,
           j < M - valid (an empty memory slot) or, with same_length, d >= M
    out_i = sum_j dropatt(softmax_j(s_i))_j v_j

The XLA path writes the position scores as a [B, H, T, S] tensor, rel-shifts it in memory and
hands it to the softmax as a bias; the backward pass writes its gradient as another. Here each
program holds one query block: it loops over the key blocks it can see, makes the position
term of a block pair as one [bq, N] product of (q + v) with the N rows of R the pair spans,
and realigns it to keys by index arithmetic (a [bq, bk] gathered read of that product, row a
shifted by bq - 1 - a: the rel-shift of one tile). Masks come from indices and each batch row's
first valid key; the softmax is online; attention dropout is a counter-based hash of
(seed, batch, head, query, key), so a step's mask needs no stored state and a resumed step
draws the same one. No score-sized tensor reaches memory: a program's [bq, N] tile round-trips
through a per-program scratch block (the gather needs it addressable), which stays in cache.

The backward pass is two kernels, as FlashAttention-2's: one per query block (dq, and the
gradient of R, which a query block reaches through its skewed tiles: each program adds its
[N, K] pieces into its own row range of a buffer, summed over programs afterwards) and one per
key block (dk, dv). Both recompute the scores from the saved log-sum-exp.

On a CPU the kernels run in Pallas interpret mode (how the tests reach them); on a GPU they go
through Pallas' Triton lowering.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from transformer_jax.hashed_dropout import drop as _drop
from transformer_jax.hashed_dropout import dropout_keep, dropout_seed
from transformer_jax.platform import compile_platform

Array = jax.Array

# The attention core's masked score (transformer_jax.attention): finite, so a fully masked
# block leaves the online softmax's running maximum finite and its weights exactly 0.
_MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)


# Triton's launch settings for the GPU kernels, and the largest block size tried (a benchmark
# may set other values before tracing). One stage: Triton's software pipelining (num_stages 2)
# gave wrong gradients on an H200 (benchmarks/h200_2026-11-28/), the reads of the scratch
# block presumably issued ahead of the writes they must follow.
TRITON_OPTIONS = {"num_warps": 4, "num_stages": 1}
MAX_BLOCK = 64


def _triton_params():
    from jax.experimental.pallas import triton as plgpu

    return plgpu.CompilerParams(**TRITON_OPTIONS)


def _barrier(interpret: bool) -> None:
    """Orders one program's scratch writes before its other threads' reads (a no-op, and not
    needed, when interpreted: there a program is sequential)."""
    if not interpret:
        from jax.experimental.pallas import triton as plgpu

        plgpu.debug_barrier()


def reference_keep_mask(
    dropout_rng: Array, *, batch: int, heads: int, q_len: int, k_len: int, rate: float
) -> Array:
    """The kernels' dropout mask for a whole call, in plain jnp: [B, H, T, S] bool."""
    seed = dropout_seed(dropout_rng)[0].astype(jnp.uint32)
    bh = jnp.arange(batch * heads, dtype=jnp.uint32).reshape(batch, heads, 1, 1)
    i = jnp.arange(q_len, dtype=jnp.uint32)[:, None]
    j = jnp.arange(k_len, dtype=jnp.uint32)[None, :]
    return dropout_keep(seed, bh, i, j, rate)


def block_size(q_len: int, mem_len: int, *, minimum: int, maximum: int | None = None) -> int | None:
    """The largest power of two in [minimum, maximum] (default MAX_BLOCK) dividing both T and M
    (None if none)."""
    size = MAX_BLOCK if maximum is None else maximum
    while size >= minimum:
        if q_len % size == 0 and mem_len % size == 0:
            return size
        size //= 2
    return None


# ------------------------------------------------------------------------------ the tiles
class _Tile:
    """What every kernel computes for one (query block, key block) pair: the scores and mask.

    `scratch` is the program's [bq, N] float32 scratch block.
    """

    def __init__(self, *, q_len, mem_len, bq, bk, scale, same_length, interpret):
        self.t, self.m, self.bq, self.bk = q_len, mem_len, bq, bk
        self.s = mem_len + q_len
        self.n = bq + bk
        self.scale, self.same_length, self.interpret = scale, same_length, interpret

    def r_rows(self, r_ref, i0, j0):
        """The N rows of R the pair spans, [N, K]: rows T - bq - i0 + j0 + e. Rows past S - 1
        belong to future keys only (masked), so they are clamped rather than read out of
        bounds."""
        c0 = self.t - self.bq - i0 + j0
        rows = jnp.minimum(c0 + jnp.arange(self.n, dtype=jnp.int32), self.s - 1)
        return r_ref[rows, :]

    def scores(self, qu, qv, kt, rs, scratch_ref, i0, j0, kstart):
        """-> (s [bq, bk] float32 scaled scores, masked to _MASK_VALUE; mask [bq, bk])."""
        f32 = jnp.float32
        content = jnp.dot(qu, kt.T, preferred_element_type=f32)  # [bq, bk]
        position = jnp.dot(qv, rs.T, preferred_element_type=f32)  # [bq, N]
        scratch_ref[...] = position
        _barrier(self.interpret)
        a = jnp.arange(self.bq, dtype=jnp.int32)[:, None]
        b = jnp.arange(self.bk, dtype=jnp.int32)[None, :]
        # Row a of the tile holds distances for R rows c0 .. c0 + N - 1; key b of it needs row
        # c0 + (bq - 1 - a) + b: the rel-shift, as a gathered read.
        shifted = scratch_ref[a, (self.bq - 1 - a) + b]  # [bq, bk]
        _barrier(self.interpret)
        s = (content + shifted) * self.scale
        mask = self.mask(i0 + a, j0 + b, kstart)
        return jnp.where(mask, s, _MASK_VALUE), mask

    def keep(self, seed_ref, bh, i0, j0, rate):
        """The pair's [bq, bk] dropout keep mask: `dropout_keep` of its query and key positions."""
        u32 = jnp.uint32
        i = (i0 + jnp.arange(self.bq, dtype=jnp.int32)[:, None]).astype(u32)
        j = (j0 + jnp.arange(self.bk, dtype=jnp.int32)[None, :]).astype(u32)
        return dropout_keep(seed_ref[0].astype(u32), bh.astype(u32), i, j, rate)

    def mask(self, i, j, kstart):
        d = self.m + i - j
        mask = (d >= 0) & (j >= kstart)
        if self.same_length:
            mask = mask & (d < self.m)
        return mask

    def unskew(self, ds, scratch_ref):
        """[bq, bk] score gradients -> [bq, N] per R row of the pair (the inverse gather; 0
        where a row and column meet no key)."""
        scratch_ref[:, pl.ds(0, self.bk)] = ds
        _barrier(self.interpret)
        a = jnp.arange(self.bq, dtype=jnp.int32)[:, None]
        e = jnp.arange(self.n, dtype=jnp.int32)[None, :]
        src = e - (self.bq - 1 - a)
        inside = (src >= 0) & (src < self.bk)
        out = jnp.where(inside, scratch_ref[a, jnp.clip(src, 0, self.bk - 1)], 0.0)
        _barrier(self.interpret)
        return out

    def key_blocks(self, i0, kstart):
        """The key blocks [lo, hi) that a query block starting at i0 can see."""
        lo = kstart
        if self.same_length:
            lo = jnp.maximum(lo, i0 + 1)
        return lo // self.bk, (self.m + i0 + self.bq + self.bk - 1) // self.bk

    def query_blocks(self, j0, kstart):
        """The query blocks [lo, hi) that can see the key block starting at j0."""
        n_q = self.t // self.bq
        lo = jnp.maximum(j0 - self.m, 0) // self.bq
        hi = jnp.int32(n_q)
        if self.same_length:
            hi = jnp.minimum(hi, (j0 + self.bk - 2 + self.bq) // self.bq)
        # A block wholly before the first valid key contributes nothing.
        hi = jnp.where(j0 + self.bk <= kstart, lo, hi)
        return lo, jnp.maximum(hi, lo)


# ------------------------------------------------------------------------------- kernels
def _fwd_kernel(
    kstart_ref,
    seed_ref,
    qu_ref,
    qv_ref,
    k_ref,
    v_ref,
    r_ref,  # inputs
    o_ref,
    lse_ref,
    scratch_ref,  # outputs
    *,
    tile: _Tile,
    heads: int,
    rate: float,
):
    b, h, qi = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    i0 = qi * tile.bq
    kstart = kstart_ref[b]
    qu, qv = qu_ref[...], qv_ref[...]  # [bq, K]
    lo, hi = tile.key_blocks(i0, kstart)

    def body(jb, carry):
        m, denom, acc = carry
        j0 = jb * tile.bk
        kt = k_ref[pl.ds(j0, tile.bk), :]
        vt = v_ref[pl.ds(j0, tile.bk), :]
        s, mask = tile.scores(qu, qv, kt, tile.r_rows(r_ref, i0, j0), scratch_ref, i0, j0, kstart)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        p = jnp.where(mask, jnp.exp(s - m_new[:, None]), 0.0)
        alpha = jnp.exp(m - m_new)
        denom = denom * alpha + jnp.sum(p, axis=1)
        if rate > 0.0:
            p = _drop(p, tile.keep(seed_ref, b * heads + h, i0, j0, rate), rate)
        acc = acc * alpha[:, None] + jnp.dot(
            p.astype(vt.dtype), vt, preferred_element_type=jnp.float32
        )
        return m_new, denom, acc

    k_width = qu.shape[-1]
    init = (
        jnp.full((tile.bq,), _MASK_VALUE, jnp.float32),
        jnp.zeros((tile.bq,), jnp.float32),
        jnp.zeros((tile.bq, k_width), jnp.float32),
    )
    m, denom, acc = jax.lax.fori_loop(lo, hi, body, init)
    o_ref[...] = (acc / denom[:, None]).astype(o_ref.dtype)
    lse_ref[...] = m + jnp.log(denom)


def _dq_kernel(
    kstart_ref,
    seed_ref,
    qu_ref,
    qv_ref,
    k_ref,
    v_ref,
    r_ref,
    do_ref,
    lse_ref,
    delta_ref,
    dqu_ref,
    dqv_ref,
    dr_ref,
    scratch_ref,
    *,
    tile: _Tile,
    heads: int,
    rate: float,
):
    b, h, qi = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    i0 = qi * tile.bq
    kstart = kstart_ref[b]
    qu, qv, do = qu_ref[...], qv_ref[...], do_ref[...]
    lse, delta = lse_ref[...], delta_ref[...]
    lo, hi = tile.key_blocks(i0, kstart)
    k_width = qu.shape[-1]

    # This program's R-gradient rows: buffer row x holds R row T - bq - i0 + x.
    def zero(x, _):
        dr_ref[pl.ds(x * tile.bq, tile.bq), :] = jnp.zeros((tile.bq, k_width), jnp.float32)
        return 0

    jax.lax.fori_loop(0, dr_ref.shape[0] // tile.bq, zero, 0)
    _barrier(tile.interpret)

    def body(jb, carry):
        dqu, dqv = carry
        j0 = jb * tile.bk
        kt = k_ref[pl.ds(j0, tile.bk), :]
        vt = v_ref[pl.ds(j0, tile.bk), :]
        rs = tile.r_rows(r_ref, i0, j0)
        s, mask = tile.scores(qu, qv, kt, rs, scratch_ref, i0, j0, kstart)
        p = jnp.where(mask, jnp.exp(s - lse[:, None]), 0.0)
        dp = jnp.dot(do, vt.T, preferred_element_type=jnp.float32)
        if rate > 0.0:
            dp = _drop(dp, tile.keep(seed_ref, b * heads + h, i0, j0, rate), rate)
        ds = p * (dp - delta[:, None]) * tile.scale  # d(loss)/d(unscaled score)
        dqu = dqu + jnp.dot(ds.astype(kt.dtype), kt, preferred_element_type=jnp.float32)
        ds_rows = tile.unskew(ds, scratch_ref)  # [bq, N]
        dqv = dqv + jnp.dot(ds_rows.astype(rs.dtype), rs, preferred_element_type=jnp.float32)
        dr = jnp.dot(ds_rows.T.astype(qv.dtype), qv, preferred_element_type=jnp.float32)
        dr_ref[pl.ds(j0, tile.n), :] = dr_ref[pl.ds(j0, tile.n), :] + dr
        _barrier(tile.interpret)
        return dqu, dqv

    zeros = jnp.zeros((tile.bq, k_width), jnp.float32)
    dqu, dqv = jax.lax.fori_loop(lo, hi, body, (zeros, zeros))
    dqu_ref[...] = dqu.astype(dqu_ref.dtype)
    dqv_ref[...] = dqv.astype(dqv_ref.dtype)


def _dkv_kernel(
    kstart_ref,
    seed_ref,
    qu_ref,
    qv_ref,
    k_ref,
    v_ref,
    r_ref,
    do_ref,
    lse_ref,
    delta_ref,
    dk_ref,
    dv_ref,
    scratch_ref,
    *,
    tile: _Tile,
    heads: int,
    rate: float,
):
    b, h, kb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    j0 = kb * tile.bk
    kstart = kstart_ref[b]
    kt, vt = k_ref[...], v_ref[...]  # [bk, K]
    lo, hi = tile.query_blocks(j0, kstart)
    k_width = kt.shape[-1]

    def body(qb, carry):
        dk, dv = carry
        i0 = qb * tile.bq
        qu = qu_ref[pl.ds(i0, tile.bq), :]
        qv = qv_ref[pl.ds(i0, tile.bq), :]
        do = do_ref[pl.ds(i0, tile.bq), :]
        lse = lse_ref[pl.ds(i0, tile.bq)]
        delta = delta_ref[pl.ds(i0, tile.bq)]
        s, mask = tile.scores(qu, qv, kt, tile.r_rows(r_ref, i0, j0), scratch_ref, i0, j0, kstart)
        p = jnp.where(mask, jnp.exp(s - lse[:, None]), 0.0)
        dp = jnp.dot(do, vt.T, preferred_element_type=jnp.float32)
        if rate > 0.0:
            keep = tile.keep(seed_ref, b * heads + h, i0, j0, rate)
            p_drop, dp = _drop(p, keep, rate), _drop(dp, keep, rate)
        else:
            p_drop = p
        dv = dv + jnp.dot(p_drop.T.astype(do.dtype), do, preferred_element_type=jnp.float32)
        ds = p * (dp - delta[:, None]) * tile.scale
        dk = dk + jnp.dot(ds.T.astype(qu.dtype), qu, preferred_element_type=jnp.float32)
        return dk, dv

    zeros = jnp.zeros((tile.bk, k_width), jnp.float32)
    dk, dv = jax.lax.fori_loop(lo, hi, body, (zeros, zeros))
    dk_ref[...] = dk.astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


# ------------------------------------------------------------------------- pallas calls
class _Plan:
    """What the three pallas_calls of one call share: its tile, the BlockSpecs of a grid
    (B, H, blocks), the first two inputs' (kstart, seed) and the calls' settings."""

    def __init__(self, qu, k, statics):
        mem_len, same_length, scale, self.rate, bq, interpret = statics
        self.b, self.t, self.h, kw = qu.shape
        self.s = k.shape[1]
        self.bq = bq
        self.tile = _Tile(
            q_len=self.t,
            mem_len=mem_len,
            bq=bq,
            bk=bq,
            scale=scale,
            same_length=same_length,
            interpret=interpret,
        )
        t, s = self.t, self.s
        self.q_block = pl.BlockSpec((None, bq, None, kw), lambda b, h, i: (b, i, h, 0))
        self.q_all = pl.BlockSpec((None, t, None, kw), lambda b, h, i: (b, 0, h, 0))
        self.kv_all = pl.BlockSpec((None, s, None, kw), lambda b, h, i: (b, 0, h, 0))
        self.kv_block = self.q_block  # bk = bq
        self.r = pl.BlockSpec((s, None, kw), lambda b, h, i: (0, h, 0))
        self.row_block = pl.BlockSpec((None, None, bq), lambda b, h, i: (b, h, i))
        self.row_all = pl.BlockSpec((None, None, t), lambda b, h, i: (b, h, 0))
        # kstart [B] and seed [1], read by scalar index.
        self.scalars = [
            pl.BlockSpec((self.b,), lambda b, h, i: (0,)),
            pl.BlockSpec((1,), lambda b, h, i: (0,)),
        ]
        self.settings = dict(
            interpret=interpret, compiler_params=None if interpret else _triton_params()
        )

    def scratch(self, blocks: int):
        """The per-program [bq, N] scratch output over `blocks` blocks: (spec, shape)."""
        n = 2 * self.bq
        spec = pl.BlockSpec((None, None, None, self.bq, n), lambda b, h, i: (b, h, i, 0, 0))
        return spec, jax.ShapeDtypeStruct((self.b, self.h, blocks, self.bq, n), jnp.float32)

    def kernel(self, fn):
        return functools.partial(fn, tile=self.tile, heads=self.h, rate=self.rate)


def _forward(qu, qv, k, v, r, kstart, seed, *, statics):
    plan = _Plan(qu, k, statics)
    n_q = plan.t // plan.bq
    scratch_spec, scratch_shape = plan.scratch(n_q)
    o, lse, _ = pl.pallas_call(
        plan.kernel(_fwd_kernel),
        grid=(plan.b, plan.h, n_q),
        in_specs=[
            *plan.scalars,
            plan.q_block,
            plan.q_block,
            plan.kv_all,
            plan.kv_all,
            plan.r,
        ],
        out_specs=[plan.q_block, plan.row_block, scratch_spec],
        out_shape=[
            jax.ShapeDtypeStruct(qu.shape, qu.dtype),
            jax.ShapeDtypeStruct((plan.b, plan.h, plan.t), jnp.float32),
            scratch_shape,
        ],
        name="xl_relative_attention_fwd",
        **plan.settings,
    )(kstart, seed, qu, qv, k, v, r)
    return o, lse


def _backward(qu, qv, k, v, r, kstart, seed, o, lse, do, *, statics):
    plan = _Plan(qu, k, statics)
    b, t, h, kw = qu.shape
    s, bq = plan.s, plan.bq
    n_q, n_k = t // bq, s // bq
    delta = jnp.einsum("bthk,bthk->bht", do.astype(jnp.float32), o.astype(jnp.float32))
    # Query block qi's R-gradient rows: its buffer row x is R row T - bq - qi * bq + x.
    dr_spec = pl.BlockSpec((None, None, None, s + bq, kw), lambda b, h, i: (b, h, i, 0, 0))
    scratch_spec, scratch_shape = plan.scratch(n_q)
    dqu, dqv, dr_buf, _ = pl.pallas_call(
        plan.kernel(_dq_kernel),
        grid=(b, h, n_q),
        in_specs=[
            *plan.scalars,
            plan.q_block,
            plan.q_block,
            plan.kv_all,
            plan.kv_all,
            plan.r,
            plan.q_block,
            plan.row_block,
            plan.row_block,
        ],
        out_specs=[plan.q_block, plan.q_block, dr_spec, scratch_spec],
        out_shape=[
            jax.ShapeDtypeStruct(qu.shape, jnp.float32),
            jax.ShapeDtypeStruct(qu.shape, jnp.float32),
            jax.ShapeDtypeStruct((b, h, n_q, s + bq, kw), jnp.float32),
            scratch_shape,
        ],
        name="xl_relative_attention_dq",
        **plan.settings,
    )(kstart, seed, qu, qv, k, v, r, do, lse, delta)
    scratch_spec, scratch_shape = plan.scratch(n_k)
    dk, dv, _ = pl.pallas_call(
        plan.kernel(_dkv_kernel),
        grid=(b, h, n_k),
        in_specs=[
            *plan.scalars,
            plan.q_all,
            plan.q_all,
            plan.kv_block,
            plan.kv_block,
            plan.r,
            plan.q_all,
            plan.row_all,
            plan.row_all,
        ],
        out_specs=[plan.kv_block, plan.kv_block, scratch_spec],
        out_shape=[
            jax.ShapeDtypeStruct(k.shape, jnp.float32),
            jax.ShapeDtypeStruct(v.shape, jnp.float32),
            scratch_shape,
        ],
        name="xl_relative_attention_dkv",
        **plan.settings,
    )(kstart, seed, qu, qv, k, v, r, do, lse, delta)
    per_block = dr_buf.sum(axis=0)  # [H, n_q, S + bq, K]
    dr = jnp.zeros((h, s, kw), jnp.float32)
    for qi in range(n_q):
        off = t - bq - qi * bq
        dr = dr.at[:, off:].add(per_block[:, qi, : s - off])
    dr = dr.transpose(1, 0, 2)  # [S, H, K]
    return (
        dqu.astype(qu.dtype),
        dqv.astype(qv.dtype),
        dk.astype(k.dtype),
        dv.astype(v.dtype),
        dr.astype(r.dtype),
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _attention(qu, qv, k, v, r, kstart, seed, statics):
    return _forward(qu, qv, k, v, r, kstart, seed, statics=statics)[0]


def _attention_fwd(qu, qv, k, v, r, kstart, seed, statics):
    o, lse = _forward(qu, qv, k, v, r, kstart, seed, statics=statics)
    return o, (qu, qv, k, v, r, kstart, seed, o, lse)


def _attention_bwd(statics, saved, do):
    qu, qv, k, v, r, kstart, seed, o, lse = saved
    grads = _backward(qu, qv, k, v, r, kstart, seed, o, lse, do, statics=statics)
    return (*grads, None, None)


_attention.defvjp(_attention_fwd, _attention_bwd)


def relative_attention(
    qu: Array,
    qv: Array,
    k: Array,
    v: Array,
    r: Array,
    valid: Array,
    *,
    mem_len: int,
    same_length: bool,
    scale: float,
    dropout_rate: float = 0.0,
    dropout_rng: Array | None = None,
    block: int | None = None,
    interpret: bool | None = None,
) -> Array:
    """Transformer-XL's relative attention, fused: the kernels above under a custom VJP.

    Args:
      qu: [B, T, H, K] queries plus u (`r_w_bias`).
      qv: [B, T, H, K] queries plus v (`r_r_bias`).
      k, v: [B, S, H, K] keys and values over concat(memory, segment), S = M + T.
      r: [S, H, K] the projected position embeddings for distances S-1 ... 0.
      valid: [B] int, how many of the M memory slots hold real positions.
      mem_len: M.
      same_length: each query sees only its last M positions (`xl_jax.memory.attention_mask`).
      scale: multiplies both score terms (K ** -0.5).
      dropout_rate, dropout_rng: attention dropout, drawn by `dropout_keep` from a seed that
        `dropout_rng` gives (None or rate 0: no dropout).
      block: query and key block size (a power of two dividing T and M); default: the
        largest up to MAX_BLOCK (at least 16 on a GPU, 8 interpreted).
      interpret: Pallas interpret mode; default: on unless the program is compiled for a GPU
        or a TPU (`transformer_jax.platform.compile_platform`).

    The kernels follow the program's platform: a GPU's are the Triton kernels above, a TPU's
    the Mosaic kernels of `xl_jax.fused_attention_tpu` (block a multiple of 128, default
    128); a CPU interprets the Triton kernels (the Mosaic ones are interpreted by their
    tests).
    Returns:
      [B, T, H, K] in qu's dtype: what `xl_jax.attention`'s XLA path gives with the same
      mask (and, with dropout, the mask of `reference_keep_mask`).
    """
    platform = compile_platform(qu, k)
    if platform == "tpu":
        # A TPU program takes the Mosaic kernels, under the same contract.
        from xl_jax import fused_attention_tpu

        if block is None:
            block = block_size(qu.shape[1], mem_len, **fused_attention_tpu.BLOCKS)
            if block is None:
                raise ValueError(f"no TPU block size divides T={qu.shape[1]} and M={mem_len}")
        return fused_attention_tpu.relative_attention(
            qu,
            qv,
            k,
            v,
            r,
            valid,
            mem_len=mem_len,
            same_length=same_length,
            scale=scale,
            dropout_rate=dropout_rate,
            dropout_rng=dropout_rng,
            block=block,
            interpret=bool(interpret),
        )
    if interpret is None:
        interpret = platform != "gpu"
    b, t, h, kw = qu.shape
    s = k.shape[1]
    if s != mem_len + t or r.shape != (s, h, kw):
        raise ValueError(f"keys {k.shape} and R {r.shape} do not fit T={t}, M={mem_len}")
    if block is None:
        block = block_size(t, mem_len, minimum=8 if interpret else 16)
        if block is None:
            raise ValueError(f"no block size divides T={t} and M={mem_len}")
    elif t % block or mem_len % block:
        raise ValueError(f"block {block} must divide T={t} and M={mem_len}")
    rate = float(dropout_rate) if dropout_rng is not None else 0.0
    if rate > 0.0:
        seed = dropout_seed(dropout_rng)
    else:
        seed = jnp.zeros((1,), jnp.int32)
    kstart = (mem_len - jnp.asarray(valid, jnp.int32)).reshape(b)
    statics = (int(mem_len), bool(same_length), float(scale), rate, int(block), bool(interpret))
    return _attention(qu, qv, k, v, r, kstart, seed, statics)


def applies(
    *, head_width: int, q_len: int, mem_len: int, on_gpu: bool, on_tpu: bool = False
) -> bool:
    """Whether the kernels take these shapes: a power-of-two head width of at least 16 (the
    matrix units' smallest), and a block size dividing T and M. On a TPU: a head width of at
    least 64 (the width the TPU compile is tested at) and 128 dividing T and M (the lanes a
    score tile spans)."""
    if on_tpu:
        from xl_jax import fused_attention_tpu

        width, blocks = 64, fused_attention_tpu.BLOCKS
    else:
        width = 16 if on_gpu else 8
        blocks = dict(minimum=width)
    return (
        head_width >= width
        and head_width & (head_width - 1) == 0
        and block_size(q_len, mem_len, **blocks) is not None
    )
