"""The paper's optimiser: Adam(0.9, 0.98, 1e-9) on the Noam warm-up schedule (section 5.3),
and `params_ema`, an exponential moving average of the parameters kept in the optimizer state."""
from __future__ import annotations

from typing import Any, NamedTuple

import jax
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


class ParamsEmaState(NamedTuple):
    """count: int32 scalar, updates seen; ema: the averaged parameters (same tree as params)."""

    count: jax.Array
    ema: Any


def params_ema(decay: float) -> optax.GradientTransformation:
    """Tracks an exponential moving average of the parameters AFTER each update (Polyak
    averaging); passes the updates through unchanged, so training is not affected. Chain it
    last, after every transformation that changes the updates.

    ema_n = d_n * ema_{n-1} + (1 - d_n) * params_n with d_n = min(decay, (n - 1) / n): the
    first updates are averaged uniformly (no bias toward the initialisation, which a plain
    EMA started at the initial params would keep for ~1 / (1 - decay) steps), then the
    average forgets at the rate `decay`. It lives in the optimizer state, so checkpoints
    store it and a resumed run continues it exactly.
    """
    if not 0.0 < decay < 1.0:
        raise ValueError(f"decay: must be in (0, 1), got {decay}")

    def init(params):
        # A copy: the train step donates the state, and one buffer must not appear twice.
        return ParamsEmaState(count=jnp.zeros((), jnp.int32),
                              ema=jax.tree.map(jnp.copy, params))

    def update(updates, state, params=None):
        if params is None:
            raise ValueError("params_ema needs the params: call tx.update(grads, state, params)")
        new_params = optax.apply_updates(params, updates)  # what the caller will apply
        count = state.count + 1
        n = count.astype(jnp.float32)
        d = jnp.minimum(decay, (n - 1.0) / n)
        ema = jax.tree.map(lambda e, p: (d * e + (1.0 - d) * p).astype(e.dtype), state.ema,
                           new_params)
        return updates, ParamsEmaState(count=count, ema=ema)

    return optax.GradientTransformation(init, update)


def find_params_ema(opt_state: Any) -> Any | None:
    """The averaged parameters of the first `params_ema` found in `opt_state` (a chain's tuple
    of states, searched depth first), or None when there is none."""
    if isinstance(opt_state, ParamsEmaState):
        return opt_state.ema
    if isinstance(opt_state, (tuple, list)):
        for inner in opt_state:
            found = find_params_ema(inner)
            if found is not None:
                return found
    return None
