"""Label-smoothed cross-entropy (section 5.4 of the paper), summed over real tokens.

Shapes: B batch, T target length, V vocabulary.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


def label_smoothed_cross_entropy(
    logits: Array,
    targets: Array,
    *,
    smoothing: float,
    pad_id: int,
) -> tuple[Array, Array]:
    """Summed cross-entropy against a label-smoothed target distribution.

    The target distribution q puts 1 - smoothing on the true token, smoothing / (V - 2) on
    every other token except pad, and 0 on pad (the Annotated Transformer's distribution; its
    KL(q || p) differs from this cross-entropy by the entropy of q, a constant). Positions
    whose target is pad count nothing.

    Args:
      logits: [B, T, V] (any float dtype; computed in float32).
      targets: [B, T] int token ids, pad_id where there is no token.
      smoothing: in [0, 1); 0 gives the plain negative log-likelihood.
      pad_id: the padding id.
    Returns:
      (loss_sum, n_tokens): float32 scalar sum of -sum_v q_v log p_v over real positions,
      and the int32 number of real (non-pad) target positions.
    """
    if not 0.0 <= smoothing < 1.0:
        raise ValueError(f"smoothing must be in [0, 1), got {smoothing!r}")
    vocab = logits.shape[-1]
    if vocab < 3:
        raise ValueError(f"label smoothing needs a vocabulary of at least 3, got {vocab}")
    log_p = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)  # [B, T, V]
    true_lp = jnp.take_along_axis(log_p, targets[..., None], axis=-1)[..., 0]  # [B, T]
    # Sum of log p over the tokens that share the smoothing mass: all but pad and the target.
    rest_lp = jnp.sum(log_p, axis=-1) - log_p[..., pad_id] - true_lp
    loss = -(1.0 - smoothing) * true_lp - (smoothing / (vocab - 2)) * rest_lp
    real = targets != pad_id
    return jnp.sum(jnp.where(real, loss, 0.0)), jnp.sum(real, dtype=jnp.int32)
