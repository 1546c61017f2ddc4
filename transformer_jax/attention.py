"""The one attention core of the project, plus masks.

Every model here (Transformer, Transformer-XL, the RNN and ConvS2S baselines) computes its
attention through `attend` (scores already made) or `dot_product_attention` (scores from q and
k). There is no second copy of the mask-softmax-dropout-mix code anywhere.

Shapes (the project's one alphabet is transformer_jax/shapes.py; here):
  B: batch          T: query length      S: key/value length     M: memory length
  H: heads          K: head width        D: model width          V: vocabulary

Masks are boolean with True = attend, broadcastable to [B, H, T, S].

dtype policy: q, k, v may be bf16; scores, softmax and the returned weights are float32 (float64
when the inputs are float64); the mixed output comes back in v's dtype.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp

from transformer_jax.platform import compile_platform

Array = jax.Array
# The `implementation` choices of `dot_product_attention` (and of the configs' attention_impl).
IMPLEMENTATIONS = ("auto", "xla", "cudnn")

# A large finite negative instead of -inf: a row with every key masked (a pad query) then gets
# uniform weights instead of NaN, and NaN never enters the backward pass.
_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def _large_negative(dtype) -> Array:
    """The masked score JAX's cuDNN wrapper gives a bool mask in `dtype`: -2^41 in bf16 and
    -2^15 in fp16 (moderate values: cuDNN mishandles the difference of two huge negatives)."""
    value = {jnp.dtype(jnp.bfloat16): -(2.0**41), jnp.dtype(jnp.float16): -(2.0**15)}
    return jnp.asarray(value.get(jnp.dtype(dtype), _MASK_VALUE), dtype)


def make_padding_mask(tokens: Array, pad_id: int = 0) -> Array:
    """[B, S] token ids -> [B, 1, 1, S] bool, True where the key is a real token."""
    return (tokens != pad_id)[:, None, None, :]


def make_causal_mask(length: int) -> Array:
    """-> [1, 1, T, T] bool, True where key position <= query position."""
    return jnp.tril(jnp.ones((length, length), dtype=bool))[None, None]


def combine_masks(*masks: Array | None) -> Array | None:
    """Logical AND of the masks that are not None (broadcasting); None if all are None."""
    out = None
    for m in masks:
        if m is None:
            continue
        out = m if out is None else jnp.logical_and(out, m)
    return out


@jax.custom_vjp
def masked_softmax(scores: Array, mask: Array) -> Array:
    """softmax(scores) over the last axis with masked keys left out: scores [..., T, S], mask
    bool broadcastable to them (True = attend) -> [..., T, S] in scores' dtype; masked keys
    get 0, and a row with every key masked is all 0 (rather than a uniform spread).

    Its VJP reads the weights alone: d_scores = w (g - sum_s g w), which is already 0 where w
    is. Autodiff's saves the row sums broadcast to [..., T, S] (the softmax's division) and
    selects by the mask again on the way back: an array written out and two extra passes for
    each attention of a training step.
    """
    return _masked_softmax_fwd(scores, mask)[0]


def _masked_softmax_fwd(scores, mask):
    weights = jax.nn.softmax(jnp.where(mask, scores, _MASK_VALUE), axis=-1)
    weights = jnp.where(mask, weights, 0.0)
    return weights, (weights, mask)


def _masked_softmax_bwd(saved, grad):
    weights, _ = saved
    d_scores = weights * (grad - jnp.sum(grad * weights, axis=-1, keepdims=True))
    # None: the mask, a boolean, has no cotangent.
    return d_scores, None


masked_softmax.defvjp(_masked_softmax_fwd, _masked_softmax_bwd)


def _check_rate(dropout_rate: float) -> None:
    if not 0.0 <= dropout_rate < 1.0:
        raise ValueError(f"attention dropout_rate must be in [0, 1), got {dropout_rate}")


def attention_weights(
    scores: Array,
    *,
    mask: Array | None = None,
    dropout_rate: float = 0.0,
    dropout_rng: Array | None = None,
    deterministic: bool = True,
) -> Array:
    """Masked softmax over the last axis, in float32, then attention dropout.

    Args:
      scores: [..., T, S] attention logits (any float dtype; upcast to float32).
      mask: bool, broadcastable to `scores`, True = attend.
      dropout_rate: probability of dropping an attention weight (inverted dropout), in
        [0, 1): at 1 the kept weights would be divided by zero.
      dropout_rng: PRNG key, required when dropping.
      deterministic: if True no dropout is applied.
    Returns:
      [..., T, S] float32 weights (float64 for float64 scores); each row sums to 1 before
      dropout, masked keys get 0.
    """
    _check_rate(dropout_rate)
    # At least float32; float64 stays float64 so x64 references can be matched to 1e-9.
    scores = scores.astype(jnp.promote_types(scores.dtype, jnp.float32))
    weights = masked_softmax(scores, jnp.ones((), bool) if mask is None else mask)
    if not deterministic and dropout_rate > 0.0:
        if dropout_rng is None:
            raise ValueError("attention dropout needs a dropout_rng when deterministic=False")
        keep = jax.random.bernoulli(dropout_rng, 1.0 - dropout_rate, weights.shape)
        weights = jnp.where(keep, weights / (1.0 - dropout_rate), 0.0)
    return weights


def attend(
    scores: Array,
    value: Array,
    *,
    mask: Array | None = None,
    dropout_rate: float = 0.0,
    dropout_rng: Array | None = None,
    deterministic: bool = True,
    heads_first: bool = False,
) -> tuple[Array, Array]:
    """Mix values by softmax(scores): the part every attention shares.

    Additive (Bahdanau) and Luong attention compute their own scores and call this.

    Args:
      scores: [B, H, T, S] logits.
      value: [B, S, H, K], or [B, H, S, K] with `heads_first`.
      mask: broadcastable to [B, H, T, S], True = attend.
    Returns:
      out [B, T, H, K] in value's dtype, weights [B, H, T, S] float32.
    """
    weights = attention_weights(
        scores,
        mask=mask,
        dropout_rate=dropout_rate,
        dropout_rng=dropout_rng,
        deterministic=deterministic,
    )
    if heads_first:
        # Mixed into [B, H, T, K], then moved: written straight to [B, T, H, K], XLA:CPU
        # made it a slower batched product (`benchmarks/decode_2026-11-27b/`).
        out = jnp.einsum("bhts,bhsk->bhtk", weights.astype(value.dtype), value).swapaxes(1, 2)
    else:
        out = jnp.einsum("bhts,bshk->bthk", weights.astype(value.dtype), value)
    return out, weights


def uses_fused_kernel(
    query: Array,
    key: Array,
    *,
    dropout_rate: float = 0.0,
    deterministic: bool = True,
    implementation: str = "auto",
) -> bool:
    """Whether `dot_product_attention` with these arguments (and no weights asked for) runs
    cuDNN's fused kernel: a caller that builds a bias for it can then build it in the query's
    dtype, the kernel's, instead of float32."""
    return _use_fused(query, key, dropout_rate, deterministic, False, implementation)


def _use_fused(query, key, dropout_rate, deterministic, return_weights, implementation) -> bool:
    _check_rate(dropout_rate)  # whichever path, the same refusal
    if implementation == "xla" or return_weights:
        return False
    if not deterministic and dropout_rate > 0.0:
        return False
    if implementation == "cudnn":
        return True
    # "auto": cuDNN's fused kernel where it is known to apply: a program compiled for a GPU
    # (the devices it is placed on, not this process's: `compile_platform`), half precision,
    # head width a multiple of 8 up to 128 (wt103_base's 41 is not), more than one query (a
    # decoding step's single row gains nothing). `jax.nn.dot_product_attention` must be told
    # so explicitly: its own default (implementation=None) is the XLA path.
    k = query.shape[-1]
    return (
        compile_platform(query, key) == "gpu"
        and query.dtype in (jnp.bfloat16, jnp.float16)
        and key.dtype == query.dtype
        and k % 8 == 0
        and k <= 128
        and query.shape[1] > 1
    )


def dot_product_attention(
    query: Array,
    key: Array,
    value: Array,
    *,
    mask: Array | None = None,
    bias: Array | None = None,
    scale: float | None = None,
    dropout_rate: float = 0.0,
    dropout_rng: Array | None = None,
    deterministic: bool = True,
    implementation: Literal["auto", "xla", "cudnn"] = "auto",
    return_weights: bool = False,
    heads_first: bool = False,
):
    """Scaled dot-product attention, softmax(q k^T * scale + bias) v.

    Args:
      query: [B, T, H, K].
      key: [B, S, H, K], or [B, H, S, K] with `heads_first`.
      value: as key.
      mask: bool broadcastable to [B, H, T, S], True = attend.
      bias: float broadcastable to [B, H, T, S], added to the scaled scores (Transformer-XL
        passes its position term here).
      scale: defaults to K ** -0.5.
      dropout_rate, dropout_rng, deterministic: attention dropout (on the weights).
      implementation: "xla" computes here; "cudnn" forces `jax.nn.dot_product_attention`'s
        fused cuDNN kernel; "auto" takes it in a program compiled for a GPU, in bf16/fp16,
        when there is no attention dropout, no weights are asked for, and the head width
        suits it (K % 8 == 0, K <= 128).
        A fully masked row (a pad query) gets zero output from the XLA path and, from the
        fused one, a mix of every key; neither is read by a model.
      return_weights: also return the [B, H, T, S] float32 weights.
      heads_first: key and value come as [B, H, S, K], the layout of a decoder's cache: both
        products are then batched over (B, H) without moving them (a decoding step would
        otherwise transpose the whole cache of every layer, the largest cost of a CPU step).
    Returns:
      out [B, T, H, K] (and weights if asked).
    """
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
    if scale is None:
        scale = query.shape[-1] ** -0.5
    if _use_fused(query, key, dropout_rate, deterministic, return_weights, implementation):
        if heads_first:
            key, value = key.transpose(0, 2, 1, 3), value.transpose(0, 2, 1, 3)
        b, t, h, _ = query.shape
        s = key.shape[1]
        if mask is not None:
            mask = jnp.broadcast_to(mask, (b, h, t, s))
            # A query with every key masked (a row of a padding-only sequence) gets all its
            # keys back: its output is never read, and the fused kernel then has a finite
            # softmax to differentiate (else the losses turn NaN: benchmarks/README.md).
            mask = mask | ~jnp.any(mask, axis=-1, keepdims=True)
        if bias is not None:
            bias = jnp.broadcast_to(bias, (b, h, t, s)).astype(query.dtype)
            if mask is not None:
                # The mask folded into the bias here, in the fusion that makes the bias: JAX's
                # wrapper would add a -large array to it in a pass of its own over [B, H, T, S]
                # (the same values: -large plus a finite bias is -large in half precision).
                bias = jnp.where(mask, bias, _large_negative(query.dtype))
                mask = None
        return jax.nn.dot_product_attention(
            query, key, value, bias=bias, mask=mask, scale=scale, implementation="cudnn"
        )
    scores = jnp.einsum(
        "bthk,bhsk->bhts" if heads_first else "bthk,bshk->bhts",
        query,
        key,
        preferred_element_type=jnp.promote_types(query.dtype, jnp.float32),
    )
    scores = scores * scale
    if bias is not None:
        scores = scores + bias.astype(scores.dtype)
    out, weights = attend(
        scores,
        value,
        mask=mask,
        dropout_rate=dropout_rate,
        dropout_rng=dropout_rng,
        deterministic=deterministic,
        heads_first=heads_first,
    )
    return (out, weights) if return_weights else out


def beam_attention(
    query: Array,
    key: Array,
    value: Array,
    ancestry: Array,
    *,
    mask: Array | None = None,
    scale: float | None = None,
) -> Array:
    """One decoding step's self-attention for the W beams of each sentence, over caches that
    are never reordered (beam search's index bookkeeping).

    Slot w of a sentence wrote its key and value at every step into its own cache, whatever
    hypothesis it held then; `ancestry` says which slot wrote each position of the hypothesis
    it holds now. Each query is scored against every slot's keys, the ancestral slot's score
    is selected per position, and the values are mixed the same way: the caches are read
    once per step and never moved (a reorder reads and writes all of them every step).

    Args:
      query: [B, W, H, K], one position per beam.
      key, value: [B, H, C * W, K], position-major: row c * W + v is slot v's entry for
        position c (a step writes its W rows at once, and both products are plain batched
        matrix products over (B, H)).
      ancestry: [B, W, C] int, the slot whose entry is position c of beam w's hypothesis.
      mask: bool broadcastable to [B, H, W, C], True = attend.
      scale: defaults to K ** -0.5.
    Returns:
      [B, W, H, K] in value's dtype: what `dot_product_attention` gives each beam over a
      cache reordered to its hypothesis (equal up to float rounding: the same products,
      summed with exact zeros for the other slots).
    """
    b, w, c = ancestry.shape
    if scale is None:
        scale = query.shape[-1] ** -0.5
    acc = jnp.promote_types(query.dtype, jnp.float32)
    h = key.shape[1]
    query = query.swapaxes(1, 2)  # [B, H, W, K]
    # The cache's C * W entries are the rows of each (B, H) product and the W queries its
    # columns. The other way round (W = 4 rows) XLA:CPU's batched products ran 2.8x slower
    # (`benchmarks/decode_2026-11-27b/`).
    every = jnp.einsum("bhnk,bhwk->bhnw", key, query, preferred_element_type=acc)
    every = every.reshape(b, h, c, w, w)  # [B, H, C, W (slot), W (beam)]
    pick = ancestry.swapaxes(1, 2)[:, None, :, None, :]  # [B, 1, C, 1, W]
    scores = jnp.take_along_axis(every, pick, axis=3)[:, :, :, 0, :]  # [B, H, C, W]
    weights = attention_weights(scores.swapaxes(2, 3) * scale, mask=mask)  # [B, H, W, C]
    # The weights spread over (position, slot): nonzero only at the ancestral slot.
    slot = ancestry[:, None, :, :, None] == jnp.arange(w)  # [B, 1, W, C, W]
    spread = jnp.where(slot, weights[..., None], 0.0).reshape(b, h, w, c * w)
    out = jnp.einsum("bhwn,bhnk->bhwk", spread.astype(value.dtype), value)
    return out.swapaxes(1, 2)  # [B, W, H, K]
