"""The paper's optimiser: Adam(0.9, 0.98, 1e-9) on the Noam warm-up schedule (section 5.3)."""
from __future__ import annotations

import jax.numpy as jnp
import optax


def noam_schedule(d_model: int, warmup_steps: int, factor: float = 1.0) -> optax.Schedule:
    """lr(count) = factor * d_model**-0.5 * min(step**-0.5, step * warmup_steps**-1.5),
    with step = count + 1 (optax counts updates from 0; the paper's steps start at 1).

    Linear warm-up for `warmup_steps`, then decay as 1/sqrt(step); the peak, at
    step = warmup_steps, is factor / sqrt(d_model * warmup_steps).
    """
    if d_model <= 0 or warmup_steps <= 0:
        raise ValueError(f"d_model and warmup_steps must be positive, got {d_model}, "
                         f"{warmup_steps}")

    def schedule(count):
        step = jnp.asarray(count, jnp.float32) + 1.0
        return factor * d_model ** -0.5 * jnp.minimum(step ** -0.5, step * warmup_steps ** -1.5)

    return schedule


def make_optimizer(
    d_model: int,
    warmup_steps: int,
    factor: float = 1.0,
    clip_norm: float | None = None,
) -> optax.GradientTransformation:
    """Adam(b1=0.9, b2=0.98, eps=1e-9) on `noam_schedule`, after optional global-norm clipping.

    Args:
      d_model, warmup_steps, factor: as in `noam_schedule` (paper: factor 1, warm-up 4000).
      clip_norm: clip gradients to this global norm first; None (the paper) does not clip.
    """
    adam = optax.adam(noam_schedule(d_model, warmup_steps, factor), b1=0.9, b2=0.98, eps=1e-9)
    if clip_norm is None:
        return adam
    return optax.chain(optax.clip_by_global_norm(clip_norm), adam)
