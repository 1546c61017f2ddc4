"""Transformer-XL's relative attention as Mosaic (Pallas TPU) kernels: forward and backward.

Shapes (transformer_jax/shapes.py): B batch, T query (segment) length, M memory length,
S = M + T key length, H heads, K head width; bq = bk the query and key block sizes and
N = bq + bk, the rows of R one (query block, key block) pair reads.

The contract is `xl_jax.fused_attention`'s (read its docstring for the math): the same scores,
masks from indices, online softmax, the same counter-based dropout hash (so a mask is the same
on either backend) and the same custom VJP. What differs is how a TPU wants it:

- The rel-shift of a pair's [bq, N] position tile is a strided lane roll (row a rotated by
  N - (bq - 1) + a, then the first bk columns kept), not a gathered read: Mosaic cannot
  lower a per-row gather across vregs. Interpret mode runs either, so only a TPU compile
  (tests/test_xl_fused_attention_tpu.py) tells them apart.
- The inverse shift (a score gradient back onto R's rows) shifts row a by bq - 1 - a, which
  falls as a rises; Mosaic's strided roll only takes a small non-negative stride. So that
  shift runs with the query rows reversed (row a' = bq - 1 - a is shifted by a'): the score
  gradient's rows are reversed by an exact permutation product, and the query block's qv and
  its qv gradient are passed reversed within each block (XLA flips them outside the kernel).
- The arrays are laid out [B, H, T, K] so a block's last two dims are (rows, K): rows in
  multiples of 8 and K the whole head width, as Mosaic's (8, 128) tiling needs; the score
  tiles are [bq, bk] and [bq, N], lane-dense for bq a multiple of 128.
- R is padded with bq zero rows, so a pair's N rows are always in bounds: the rows past S - 1
  meet only future keys, which are masked.
- The per-(B, H) gradient of R is summed over the query blocks in a VMEM scratch block (the
  query-block grid dimension is sequential, "arbitrary"), then written once.
- Where the arrays are sharded over several devices, the calls run under `jax.shard_map`,
  each device on its own batch rows (R replicated; its gradient summed by shard_map).

Off a TPU the kernels run in Pallas' interpret mode (how the tests check them): the generic
one, which runs `pltpu.roll`; the TPU interpreter (`pltpu.InterpretParams`) works through
callbacks, which the model's rematerialised layers cannot hold.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import PartitionSpec

from transformer_jax.hashed_dropout import drop as _drop
from transformer_jax.hashed_dropout import dropout_keep, dropout_seed
from transformer_jax.platform import compile_devices
from xl_jax.fused_attention import _MASK_VALUE, _Tile

Array = jax.Array

# The block on a TPU (`block_size`'s bounds): the score tiles' key dimension lies along the
# vregs' 128 lanes.
BLOCKS = dict(minimum=128, maximum=128)


def _iota(shape, dim):
    # Indices are made at the 2-D shape of the tiles they index: Mosaic lays vectors out in
    # 2-D tiles, and a 1-D index vector would need a relayout before every broadcast.
    return jax.lax.broadcasted_iota(jnp.int32, shape, dim)


def _nt(a, b):
    """a [x, K] . b [y, K] -> [x, y] float32 (contracting the head width of both)."""
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _tn(a, b):
    """a [x, y] . b [x, K] -> [y, K] float32 (contracting the rows of both)."""
    return jax.lax.dot_general(a, b, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)


class _TpuTile:
    """One (query block, key block) pair's scores, mask and dropout, on `_Tile`'s index
    arithmetic (its mask, visible block ranges), with the shifts done by rolls; and the
    call's H and dropout rate, which the kernels read from it."""

    def __init__(self, tile: _Tile, *, heads: int, rate: float):
        self.tile, self.heads, self.rate = tile, heads, rate
        self.bq, self.bk, self.n = tile.bq, tile.bk, tile.n

    def r_rows(self, r_ref, i0, j0):
        """The N rows of (padded) R the pair spans, [N, K]: rows T - bq - i0 + j0 + e."""
        c0 = self.tile.t - self.bq - i0 + j0
        return r_ref[pl.ds(pl.multiple_of(c0, self.bq), self.n), :]

    def shift(self, position):
        """[bq, N] scores per R row -> [bq, bk] per key: out[a, b] = position[a, b + bq-1-a].

        Row a is rolled by N - (bq - 1) + a, i.e. left by bq - 1 - a (mod N)."""
        rolled = pltpu.roll(position, self.n - (self.bq - 1), 1, stride=1, stride_axis=0)
        return rolled[:, : self.bk]

    def unshift_reversed(self, ds_rev):
        """[bq, bk] score gradients with rows reversed (row a' holds query bq - 1 - a') ->
        [bq, N] per R row, rows still reversed: out[a', e] = ds_rev[a', e - a'] (0 outside).

        The zero columns appended make the rolled-in entries 0."""
        pad = jnp.zeros((self.bq, self.n - self.bk), ds_rev.dtype)
        wide = jnp.concatenate([ds_rev, pad], axis=1)
        return pltpu.roll(wide, 0, 1, stride=1, stride_axis=0)

    def scores(self, qu, qv, kt, rs, i0, j0, kstart):
        """-> (s [bq, bk] float32 scaled scores, masked to _MASK_VALUE; mask [bq, bk])."""
        s = (_nt(qu, kt) + self.shift(_nt(qv, rs))) * self.tile.scale
        shape = (self.bq, self.bk)
        mask = self.tile.mask(i0 + _iota(shape, 0), j0 + _iota(shape, 1), kstart)
        return jnp.where(mask, s, _MASK_VALUE), mask

    def keep(self, seed_ref, bh, i0, j0, rate):
        """The pair's [bq, bk] dropout keep mask: `dropout_keep` of its query and key indices
        (the mask `xl_jax.fused_attention` draws)."""
        u32 = jnp.uint32
        shape = (self.bq, self.bk)
        i = (i0 + _iota(shape, 0)).astype(u32)
        j = (j0 + _iota(shape, 1)).astype(u32)
        return dropout_keep(seed_ref[0].astype(u32), jnp.asarray(bh).astype(u32), i, j, rate)


# ------------------------------------------------------------------------------- kernels
def _fwd_kernel(kstart_ref, seed_ref, qu_ref, qv_ref, k_ref, v_ref, r_ref, o_ref, lse_ref, *, t):
    """One query block: o [bq, K] and the log-sum-exp lse [bq, 1] of its scores."""
    tile, heads, rate = t.tile, t.heads, t.rate
    b, h, qi = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    i0 = qi * tile.bq
    kstart = kstart_ref[b]
    qu, qv = qu_ref[...], qv_ref[...]
    lo, hi = tile.key_blocks(i0, kstart)

    def body(jb, carry):
        m, denom, acc = carry
        j0 = pl.multiple_of(jb * tile.bk, tile.bk)
        kt = k_ref[pl.ds(j0, tile.bk), :]
        vt = v_ref[pl.ds(j0, tile.bk), :]
        s, mask = t.scores(qu, qv, kt, t.r_rows(r_ref, i0, j0), i0, j0, kstart)
        m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
        p = jnp.where(mask, jnp.exp(s - m_new), 0.0)
        alpha = jnp.exp(m - m_new)
        denom = denom * alpha + jnp.sum(p, axis=1, keepdims=True)
        if rate > 0.0:
            p = _drop(p, t.keep(seed_ref, b * heads + h, i0, j0, rate), rate)
        acc = acc * alpha + jnp.dot(p.astype(vt.dtype), vt, preferred_element_type=jnp.float32)
        return m_new, denom, acc

    init = (
        jnp.full((tile.bq, 1), _MASK_VALUE, jnp.float32),
        jnp.zeros((tile.bq, 1), jnp.float32),
        jnp.zeros((tile.bq, qu.shape[-1]), jnp.float32),
    )
    m, denom, acc = jax.lax.fori_loop(lo, hi, body, init)
    o_ref[...] = (acc / denom).astype(o_ref.dtype)
    lse_ref[...] = m + jnp.log(denom)


def _probs(t, qu, qv, kt, vt, rs, do, lse, delta, seed_ref, bh, i0, j0, kstart):
    """The backward's recomputation for one pair: (p, p after dropout, ds), each [bq, bk];
    ds = d(loss)/d(unscaled score)."""
    s, mask = t.scores(qu, qv, kt, rs, i0, j0, kstart)
    p = jnp.where(mask, jnp.exp(s - lse), 0.0)
    dp = _nt(do, vt)
    p_drop = p
    if t.rate > 0.0:
        keep = t.keep(seed_ref, bh, i0, j0, t.rate)
        p_drop, dp = _drop(p, keep, t.rate), _drop(dp, keep, t.rate)
    return p, p_drop, p * (dp - delta) * t.tile.scale


def _dq_kernel(
    kstart_ref,
    seed_ref,
    qu_ref,
    qv_ref,
    qv_rev_ref,
    k_ref,
    v_ref,
    r_ref,
    do_ref,
    lse_ref,
    delta_ref,  # inputs
    dqu_ref,
    dqv_rev_ref,
    dr_ref,  # outputs
    dr_acc,  # scratch
    *,
    t,
):
    """One query block: dqu, dqv (rows reversed within the block) [bq, K]; and, over the
    (sequential) query blocks of one (b, h), the gradient of padded R [S + bq, K]."""
    tile = t.tile
    b, h, qi = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    i0 = qi * tile.bq
    kstart = kstart_ref[b]
    qu, qv, qv_rev, do = qu_ref[...], qv_ref[...], qv_rev_ref[...], do_ref[...]
    lse, delta = lse_ref[...], delta_ref[...]
    lo, hi = tile.key_blocks(i0, kstart)
    # The exact row reversal: the anti-diagonal permutation (see the module docstring).
    sq = (tile.bq, tile.bq)
    flip = (_iota(sq, 0) + _iota(sq, 1) == tile.bq - 1).astype(qu.dtype)
    # A 16-bit product is exact in one pass; float32 needs the full-precision product.
    exact = jax.lax.Precision.HIGHEST if qu.dtype == jnp.float32 else None

    @pl.when(qi == 0)
    def _():
        dr_acc[...] = jnp.zeros(dr_acc.shape, jnp.float32)

    def body(jb, carry):
        dqu, dqv_rev = carry
        j0 = pl.multiple_of(jb * tile.bk, tile.bk)
        kt = k_ref[pl.ds(j0, tile.bk), :]
        vt = v_ref[pl.ds(j0, tile.bk), :]
        rs = t.r_rows(r_ref, i0, j0)
        bh = b * t.heads + h
        _, _, ds = _probs(t, qu, qv, kt, vt, rs, do, lse, delta, seed_ref, bh, i0, j0, kstart)
        ds = ds.astype(kt.dtype)
        dqu = dqu + jnp.dot(ds, kt, preferred_element_type=jnp.float32)
        ds_rev = jnp.dot(flip, ds, preferred_element_type=jnp.float32, precision=exact)
        # Rolled in float32: Mosaic does not rotate packed (16-bit) vregs.
        rows_rev = t.unshift_reversed(ds_rev).astype(rs.dtype)  # [bq, N]
        dqv_rev = dqv_rev + jnp.dot(rows_rev, rs, preferred_element_type=jnp.float32)
        c0 = pl.multiple_of(tile.t - tile.bq - i0 + j0, tile.bq)
        dr_acc[pl.ds(c0, tile.n), :] += _tn(rows_rev, qv_rev)
        return dqu, dqv_rev

    zeros = jnp.zeros((tile.bq, qu.shape[-1]), jnp.float32)
    dqu, dqv_rev = jax.lax.fori_loop(lo, hi, body, (zeros, zeros))
    dqu_ref[...] = dqu.astype(dqu_ref.dtype)
    dqv_rev_ref[...] = dqv_rev.astype(dqv_rev_ref.dtype)

    @pl.when(qi == pl.num_programs(2) - 1)
    def _():
        dr_ref[...] = dr_acc[...]


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
    *,
    t,
):
    """One key block: dk, dv [bk, K], over the query blocks that see it."""
    tile = t.tile
    b, h, kb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    j0 = kb * tile.bk
    kstart = kstart_ref[b]
    kt, vt = k_ref[...], v_ref[...]
    lo, hi = tile.query_blocks(j0, kstart)

    def body(qb, carry):
        dk, dv = carry
        i0 = pl.multiple_of(qb * tile.bq, tile.bq)
        rows = pl.ds(i0, tile.bq)
        qu, qv, do = qu_ref[rows, :], qv_ref[rows, :], do_ref[rows, :]
        lse, delta = lse_ref[rows, :], delta_ref[rows, :]
        rs = t.r_rows(r_ref, i0, j0)
        bh = b * t.heads + h
        _, p_drop, ds = _probs(t, qu, qv, kt, vt, rs, do, lse, delta, seed_ref, bh, i0, j0, kstart)
        dv = dv + _tn(p_drop.astype(do.dtype), do)
        dk = dk + _tn(ds.astype(qu.dtype), qu)
        return dk, dv

    zeros = jnp.zeros((tile.bk, kt.shape[-1]), jnp.float32)
    dk, dv = jax.lax.fori_loop(lo, hi, body, (zeros, zeros))
    dk_ref[...] = dk.astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


# ------------------------------------------------------------------------- pallas calls
class _Plan:
    """What the three pallas_calls share, over [B, H, rows, K] arrays: the tile, the
    BlockSpecs of a grid (B, H, blocks) after the two scalar-prefetch operands (kstart [B],
    seed [1]), and the calls' settings."""

    def __init__(self, qu, k, statics):
        mem_len, same_length, scale, rate, bq, interpret = statics
        self.b, self.h, self.t, kw = qu.shape
        self.s = k.shape[2]
        self.bq = bq
        self.tile = _TpuTile(
            _Tile(
                q_len=self.t,
                mem_len=mem_len,
                bq=bq,
                bk=bq,
                scale=scale,
                same_length=same_length,
                interpret=True,  # _Tile's Triton barrier is not used here
            ),
            heads=self.h,
            rate=rate,
        )
        t, s = self.t, self.s
        self.block = pl.BlockSpec((None, None, bq, kw), lambda b, h, i, *_: (b, h, i, 0))
        self.q_all = pl.BlockSpec((None, None, t, kw), lambda b, h, i, *_: (b, h, 0, 0))
        self.kv_all = pl.BlockSpec((None, None, s, kw), lambda b, h, i, *_: (b, h, 0, 0))
        self.r = pl.BlockSpec((None, s + bq, kw), lambda b, h, i, *_: (h, 0, 0))
        self.row_block = pl.BlockSpec((None, None, bq, 1), lambda b, h, i, *_: (b, h, i, 0))
        self.row_all = pl.BlockSpec((None, None, t, 1), lambda b, h, i, *_: (b, h, 0, 0))
        self.interpret = bool(interpret)

    def call(self, kernel, *, name, blocks, in_specs, out_specs, out_shape, semantics, scratch=()):
        grid_spec = pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(self.b, self.h, blocks),
            in_specs=in_specs,
            out_specs=out_specs,
            scratch_shapes=list(scratch),
        )
        return pl.pallas_call(
            functools.partial(kernel, t=self.tile),
            grid_spec=grid_spec,
            out_shape=out_shape,
            compiler_params=pltpu.CompilerParams(dimension_semantics=semantics),
            interpret=self.interpret,
            name=name,
        )


_PARALLEL = ("parallel", "parallel", "parallel")


def _flip_blocks(x, bq):
    """[B, H, T, K] -> the same with the rows of each bq block reversed (its own inverse)."""
    b, h, t, kw = x.shape
    return x.reshape(b, h, t // bq, bq, kw)[:, :, :, ::-1].reshape(b, h, t, kw)


def _forward(qu, qv, k, v, r, kstart, seed, *, statics):
    """[B, H, *, K] layout, r [H, S + bq, K] padded -> (o [B, H, T, K], lse [B, H, T, 1])."""
    plan = _Plan(qu, k, statics)
    return plan.call(
        _fwd_kernel,
        name="xl_relative_attention_fwd_tpu",
        blocks=plan.t // plan.bq,
        in_specs=[plan.block, plan.block, plan.kv_all, plan.kv_all, plan.r],
        out_specs=[plan.block, plan.row_block],
        out_shape=[
            jax.ShapeDtypeStruct(qu.shape, qu.dtype),
            jax.ShapeDtypeStruct((plan.b, plan.h, plan.t, 1), jnp.float32),
        ],
        semantics=_PARALLEL,
    )(kstart, seed, qu, qv, k, v, r)


def _backward(qu, qv, k, v, r, kstart, seed, o, lse, do, *, statics):
    plan = _Plan(qu, k, statics)
    b, h, t, kw = qu.shape
    s, bq = plan.s, plan.bq
    f32 = jnp.float32
    delta = jnp.sum(do.astype(f32) * o.astype(f32), axis=-1, keepdims=True)  # [B, H, T, 1]
    dr_spec = pl.BlockSpec((None, None, s + bq, kw), lambda b, h, i, *_: (b, h, 0, 0))
    dqu, dqv_rev, dr = plan.call(
        _dq_kernel,
        name="xl_relative_attention_dq_tpu",
        blocks=t // bq,
        in_specs=[
            plan.block,
            plan.block,
            plan.block,
            plan.kv_all,
            plan.kv_all,
            plan.r,
            plan.block,
            plan.row_block,
            plan.row_block,
        ],
        out_specs=[plan.block, plan.block, dr_spec],
        out_shape=[
            jax.ShapeDtypeStruct(qu.shape, f32),
            jax.ShapeDtypeStruct(qu.shape, f32),
            jax.ShapeDtypeStruct((b, h, s + bq, kw), f32),
        ],
        # The query blocks of one (b, h) add into one R-gradient block: sequential.
        semantics=("parallel", "parallel", "arbitrary"),
        scratch=[pltpu.VMEM((s + bq, kw), f32)],
    )(kstart, seed, qu, qv, _flip_blocks(qv, bq), k, v, r, do, lse, delta)
    dk, dv = plan.call(
        _dkv_kernel,
        name="xl_relative_attention_dkv_tpu",
        blocks=s // bq,
        in_specs=[
            plan.q_all,
            plan.q_all,
            plan.block,
            plan.block,
            plan.r,
            plan.q_all,
            plan.row_all,
            plan.row_all,
        ],
        out_specs=[plan.block, plan.block],
        out_shape=[jax.ShapeDtypeStruct(k.shape, f32), jax.ShapeDtypeStruct(v.shape, f32)],
        semantics=_PARALLEL,
    )(kstart, seed, qu, qv, k, v, r, do, lse, delta)
    dqv = _flip_blocks(dqv_rev, bq)
    return dqu, dqv, dk, dv, dr.sum(axis=0)  # dR over the batch: [H, S + bq, K]


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _attention(qu, qv, k, v, r, kstart, seed, statics):
    return _forward(qu, qv, k, v, r, kstart, seed, statics=statics)[0]


def _attention_fwd(qu, qv, k, v, r, kstart, seed, statics):
    o, lse = _forward(qu, qv, k, v, r, kstart, seed, statics=statics)
    return o, (qu, qv, k, v, r, kstart, seed, o, lse)


def _attention_bwd(statics, saved, do):
    qu, qv, k, v, r, kstart, seed, o, lse = saved
    grads = _backward(qu, qv, k, v, r, kstart, seed, o, lse, do, statics=statics)
    cast = tuple(g.astype(x.dtype) for g, x in zip(grads, (qu, qv, k, v, r)))
    return (*cast, None, None)


_attention.defvjp(_attention_fwd, _attention_bwd)


def _batch_mesh(x):
    """(mesh, batch axes) where `x`'s traced value is placed on several devices; else None.

    The batch axes are those `x`'s sharding names for its first dimension; where it names
    none (a mesh of automatic axes does not say), all the mesh's axes if they divide the batch
    (the project's data-parallel mesh has one, over which it splits the batch), else none
    (each device then runs the whole batch)."""
    sharding = getattr(getattr(x, "aval", None), "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or getattr(mesh, "empty", True) or compile_devices(x) <= 1:
        return None
    spec = getattr(sharding, "spec", None)
    if spec and spec[0] is not None:
        return mesh, spec[0]
    if x.shape[0] % mesh.size == 0:
        return mesh, tuple(mesh.axis_names)
    return mesh, None


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
    block: int,
    interpret: bool = False,
) -> Array:
    """Transformer-XL's relative attention on a TPU: the Mosaic kernels under a custom VJP.

    Args: as `xl_jax.fused_attention.relative_attention` (qu, qv [B, T, H, K]; k, v
      [B, S, H, K]; r [S, H, K]; valid [B]), but `block` is required: a divisor of T and M
      (a multiple of 128 for a TPU compile; any multiple of 8 interpreted).
      interpret: run Pallas' interpreter (on a host without a TPU).
    Returns:
      [B, T, H, K] in qu's dtype, as `xl_jax.fused_attention.relative_attention`.
    """
    b, t, h, kw = qu.shape
    s = k.shape[1]
    if s != mem_len + t or r.shape != (s, h, kw):
        raise ValueError(f"keys {k.shape} and R {r.shape} do not fit T={t}, M={mem_len}")
    if t % block or mem_len % block or block % 8:
        raise ValueError(f"block {block} must be a multiple of 8 dividing T={t} and M={mem_len}")
    rate = float(dropout_rate) if dropout_rng is not None else 0.0
    seed = dropout_seed(dropout_rng) if rate > 0.0 else jnp.zeros((1,), jnp.int32)
    kstart = (mem_len - jnp.asarray(valid, jnp.int32)).reshape(b)
    statics = (int(mem_len), bool(same_length), float(scale), rate, int(block), bool(interpret))

    def run(qu, qv, k, v, r, kstart, seed):
        heads_first = lambda x: x.transpose(0, 2, 1, 3)  # noqa: E731  [B, *, H, K] -> [B, H, *, K]
        # bq zero rows after R's last: the rows a pair may read past S - 1 (future keys only).
        r_pad = jnp.pad(r.transpose(1, 0, 2), ((0, 0), (0, block), (0, 0)))
        out = _attention(
            heads_first(qu),
            heads_first(qv),
            heads_first(k),
            heads_first(v),
            r_pad,
            kstart,
            seed,
            statics,
        )
        return heads_first(out)

    placed = _batch_mesh(qu)
    if placed is None:
        return run(qu, qv, k, v, r, kstart, seed)
    mesh, batch = placed
    rows, same = PartitionSpec(batch), PartitionSpec()
    # Each device runs the kernels on its own batch rows; R and the seed are whole on each
    # (shard_map sums R's gradient over the devices).
    return jax.shard_map(
        run,
        mesh=mesh,
        in_specs=(rows, rows, rows, rows, same, rows, same),
        out_specs=rows,
        check_vma=False,
    )(qu, qv, k, v, r, kstart, seed)
