"""Relative multi-head attention of Transformer-XL (the reference's attn_type 0).

Shapes (transformer_jax/shapes.py): B batch, T query (segment) length, M memory length, S = M + T
key length, H heads, K head width, D model width.

Paper to code (Dai et al. 2019, section 3.3; reference `RelPartialLearnableMultiHeadAttn`)::

  score(i, j) = (a) q_i . k_j  +  (b) q_i . W_kR R_{i-j}  +  (c) u . k_j  +  (d) v . W_kR R_{i-j}
              = (q_i + u) . k_j  +  rel_shift[(q_i + v) . r]_{ij}

with u = `r_w_bias`, v = `r_r_bias`, W_kR = `r_net`, R = sinusoid embeddings of the distances
S-1 ... 0. (a)+(c) is an ordinary dot product of (q + u) with k, so it goes through the
project's attention core together with (b)+(d) as an additive bias; there is no second softmax.
The reference is time-major ([T, B, H, K]); everything here is batch-major.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax import fused_norm
from transformer_jax.attention import dot_product_attention, uses_fused_kernel
from transformer_jax.layers import Branches, LayerNorm, flat_dot_general
from transformer_jax.platform import compile_platform
from xl_jax import fused_attention
from xl_jax.config import TransformerXLConfig

Array = jax.Array


def rel_shift(x: Array) -> Array:
    """Realign position scores from "per distance" to "per key".

    Args:
      x: [..., T, S] with S >= T, where x[..., i, s] is the score of query i with the
        position embedding at index s, which encodes distance S - 1 - s (R runs S-1 ... 0).
    Returns:
      [..., T, S]: out[..., i, j] = x[..., i, j + T - 1 - i], the score for the distance
      (S - T + i) - j between query i (key position S - T + i) and key j, for every
      j <= i + S - T. Entries with larger j (keys in the query's future) hold unrelated
      values and must be masked.

    Why the pad-and-reshape: gathering a different diagonal per row is a gather; padding one
    zero column and reading the [T, S + 1] buffer as [S + 1, T] (dropping the first row)
    shifts row i left by T - 1 - i with only a reshape and a slice.
    """
    *lead, t, s = x.shape
    if s < t:
        raise ValueError(f"rel_shift needs S >= T (keys include the queries), got T={t} S={s}")
    padded = jnp.pad(x, [(0, 0)] * len(lead) + [(0, 0), (1, 0)])  # [..., T, S + 1]
    flat = padded.reshape(*lead, t * (s + 1))
    # Dropping the first T entries of the flat buffer is dropping the first row of the
    # [S + 1, T] view; the next T * S entries, read as [T, S], are the shifted rows.
    return flat[..., t:].reshape(*lead, t, s)


def position_bias(qv: Array, r: Array, *, scale: float, for_fused_kernel: bool) -> Array:
    """Terms (b) + (d) of the relative scores, aligned to keys: rel_shift(qv . r) * scale.

    Args:
      qv: [B, T, H, K] queries plus v (`r_r_bias`).
      r: [S, H, K] the projected position embeddings for distances S-1 ... 0.
      for_fused_kernel: the bias goes to cuDNN's fused attention, which takes it in qv's dtype.
    Returns:
      [B, H, T, S]: float32 (float64 for float64 inputs), or qv's dtype for the fused kernel.

    For the fused kernel the scores are made in its dtype and batched over (B, H), with R
    broadcast over the batch (B * S * H * K more reads, small beside [B, H, T, S]): the product
    then writes [B, H, T, S] in place, and the shift, scale and mask are one pass over it.
    Made in float32 as [H, S] x [B * T] products, the step moved the scores through float32
    transposes and a padded copy, forward and backward (benchmarks/target_h200_2026-12-02/).
    The values are the same but for one rounding (the scale after it, not before).
    """
    if not for_fused_kernel:
        scores = jnp.einsum(
            "bthk,shk->bhts", qv, r, preferred_element_type=jnp.promote_types(qv.dtype, jnp.float32)
        )
        return rel_shift(scores) * scale
    r = jnp.broadcast_to(r.astype(qv.dtype), (qv.shape[0], *r.shape))  # [B, S, H, K]
    scores = jnp.einsum("bthk,bshk->bhts", qv, r, preferred_element_type=qv.dtype)
    return rel_shift(scores) * jnp.asarray(scale, qv.dtype)


def sinusoid_embedding(distances: Array, d_model: int, dtype=jnp.float32) -> Array:
    """R: [S] distances -> [S, D], sin half then cos half (as the reference).

    inv_freq_k = 1 / 10000^(2k / D) for k < D / 2, a NumPy float32 constant even for a float64
    model: the reference's `inv_freq` is a float32 buffer that `.double()` only casts, and
    float64 results must match it to 1e-9. (Computed by XLA instead, the float32 pow is
    constant-folded differently under jit and eagerly, by an ulp: 1e-8 in R.)
    """
    f32 = np.float32
    inv_freq = f32(1) / f32(10000) ** (np.arange(0, d_model, 2, dtype=f32) / f32(d_model))
    inv_freq = jnp.asarray(inv_freq).astype(dtype)
    angles = distances.astype(dtype)[:, None] * inv_freq[None, :]
    return jnp.concatenate([jnp.sin(angles), jnp.cos(angles)], axis=-1)


def relative_positions(config: TransformerXLConfig, *, q_len: int, mem_len: int) -> Array:
    """[S] float distances S-1 ... 0 for the S = M + T keys, clamped at `clamp_len` if > 0."""
    dist = jnp.arange(mem_len + q_len - 1, -1, -1)
    if config.clamp_len > 0:
        dist = jnp.minimum(dist, config.clamp_len)
    return dist


class RelativeMultiHeadAttention(nn.Module):
    """The attention sublayer: relative attention, output projection, residual, LayerNorm.

    Post-LN (default): out = LN(h + drop(o(attn))). Pre-LN (`norm_first`): LN is applied to
    concat(memory, h) before the q/k/v projections and out = h + drop(o(attn)).

    Parameters (reference names in brackets): `qkv` [D, 3, H, K] (`qkv_net`), `r_net`
    [D, H, K], `o_net` [H, K, D], `layer_norm`; with `untie_r` also `r_w_bias`, `r_r_bias`
    [H, K].
    """

    config: TransformerXLConfig

    @nn.compact
    def __call__(
        self,
        h: Array,  # [B, T, D] layer input over the segment
        memory: Array,  # [B, M, D] this layer's input over the previous M positions
        pos_emb: Array,  # [S, D] R for distances S-1 ... 0
        mask: Array,  # [B, 1, T, S] bool, True = attend
        r_w_bias: Array | None = None,  # [H, K] u, shared across layers; None with untie_r
        r_r_bias: Array | None = None,  # [H, K] v
        *,
        valid: Array | None = None,  # [B] int, the memory's valid count (the fused kernel's mask)
        deterministic: bool = True,
    ) -> Array | Branches:  # [B, T, D]
        cfg = self.config
        H, K = cfg.n_heads, cfg.d_head
        init = nn.initializers.normal(0.02)
        t, mem_len = h.shape[1], memory.shape[1]
        platform = compile_platform(h)
        fused_kernel = _takes_fused_kernel(
            cfg, platform, head_width=K, q_len=t, mem_len=mem_len, valid=valid
        )
        # Forms for a program compiled for a GPU that runs cuDNN's or XLA's attention (the CPU's
        # program is as before): 2-D products, whose kernel gradients come out in the
        # parameters' layout (`flat_dot_general`), and u and v added as one [2, H, K] stack, so
        # their gradients are one reduction. Not with the Pallas kernels: there the 2-D R
        # projection tripled the elementwise bytes of XLA's dR assembly
        # (benchmarks/target_h200_2026-12-03/).
        gpu_forms = platform == "gpu" and not fused_kernel
        dense = dict(
            use_bias=False,
            dtype=cfg.dtype,
            param_dtype=cfg.param_dtype,
            kernel_init=init,
            dot_general=flat_dot_general if gpu_forms else None,
        )
        if cfg.untie_r:
            r_w_bias = self.param("r_w_bias", init, (H, K), cfg.param_dtype)
            r_r_bias = self.param("r_r_bias", init, (H, K), cfg.param_dtype)
        layer_norm = LayerNorm(
            epsilon=cfg.layer_norm_eps,
            dtype=cfg.dtype,
            param_dtype=cfg.param_dtype,
            name="layer_norm",
        )

        cat = jnp.concatenate([memory.astype(h.dtype), h], axis=1)  # [B, S, D]
        if cfg.norm_first:
            cat = layer_norm(cat)
        qkv = nn.DenseGeneral((3, H, K), name="qkv", **dense)(cat)  # [B, S, 3, H, K]
        q = qkv[:, -t:, 0]  # [B, T, H, K]
        k, v = qkv[:, :, 1], qkv[:, :, 2]  # [B, S, H, K]
        r = nn.DenseGeneral((H, K), name="r_net", **dense)(pos_emb)  # [S, H, K]

        scale = K**-0.5
        dropout_rng = None
        if not deterministic and cfg.dropatt > 0.0:
            dropout_rng = self.make_rng("dropout")
        if gpu_forms:  # the same sums in q's dtype
            quv = q[:, :, None] + jnp.stack([r_w_bias, r_r_bias]).astype(q.dtype)  # [B, T, 2, H, K]
            qu, qv = quv[:, :, 0], quv[:, :, 1]
        else:
            qu = q + r_w_bias.astype(q.dtype)  # (a) + (c)
            qv = q + r_r_bias.astype(q.dtype)  # (b) + (d)
        if fused_kernel:
            attn = fused_attention.relative_attention(
                qu,
                qv,
                k,
                v,
                r,
                valid,
                mem_len=mem_len,
                same_length=cfg.same_length,
                scale=scale,
                dropout_rate=cfg.dropatt,
                dropout_rng=dropout_rng,
            )  # [B, T, H, K]
        else:
            implementation = "auto" if cfg.attention_impl == "pallas" else cfg.attention_impl
            fused = uses_fused_kernel(
                qu,
                k,
                dropout_rate=cfg.dropatt,
                deterministic=deterministic,
                implementation=implementation,
            )
            # (b) + (d), once per distance, then aligned to keys.
            pos_bias = position_bias(qv, r, scale=scale, for_fused_kernel=fused)  # [B, H, T, S]
            # (a) + (c) and the softmax/dropatt/mix in the shared core.
            attn = dot_product_attention(
                qu,
                k,
                v,
                mask=mask,
                bias=pos_bias,
                scale=scale,
                dropout_rate=cfg.dropatt,
                dropout_rng=dropout_rng,
                deterministic=deterministic,
                implementation=implementation,
            )  # [B, T, H, K]
        out = nn.DenseGeneral(cfg.d_model, axis=(-2, -1), name="o_net", **dense)(attn)
        if not cfg.norm_first and fused_norm.applies(h):
            # Training: the output twice, for the feed-forward's sublayer and its residual.
            out = layer_norm.after_residual(
                h, out, rate=cfg.dropout, deterministic=deterministic, branches=not deterministic
            )
            return out if deterministic else Branches(*out)
        out = nn.Dropout(cfg.dropout)(out, deterministic=deterministic)
        if cfg.norm_first:
            return h + out
        return layer_norm(h + out)


def use_fused_kernel(
    config: TransformerXLConfig, q: Array, *, mem_len: int, valid: Array | None
) -> bool:
    """Whether this call goes through `xl_jax.fused_attention`'s kernels.

    'pallas' takes them wherever the shapes allow (a power-of-two head width of at least 8,
    16 on a GPU, 64 on a TPU, and a block size dividing T and M, 128 on a TPU; a decoding
    step's single query does not): Triton on a GPU, Mosaic on a TPU, interpreted on a CPU;
    'auto' never, until the device measurements show they pay (benchmarks/README.md); 'xla'
    and 'cudnn' never. Without the memory's valid count (a
    caller of this module that passes only a mask) the XLA path runs.
    """
    return _takes_fused_kernel(
        config,
        compile_platform(q),
        head_width=q.shape[-1],
        q_len=q.shape[1],
        mem_len=mem_len,
        valid=valid,
    )


def _takes_fused_kernel(
    config: TransformerXLConfig,
    platform: str,
    *,
    head_width: int,
    q_len: int,
    mem_len: int,
    valid: Array | None,
) -> bool:
    """`use_fused_kernel` from the shapes and the platform, before q exists."""
    if config.attention_impl != "pallas" or valid is None:
        return False
    return fused_attention.applies(
        head_width=head_width,
        q_len=q_len,
        mem_len=mem_len,
        on_gpu=platform == "gpu",
        on_tpu=platform == "tpu",
    )
