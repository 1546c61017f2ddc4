"""One optimizer module: the learning-rate schedules (the paper's Noam warm-up, a constant rate,
Transformer-XL's linear warm-up + cosine), Adam, global-norm clipping and `params_ema`, an
exponential moving average of the parameters kept in the optimizer state, all behind one
`make_optimizer(OptimizerConfig)`.

A schedule's length may be chosen while a run trains (`horizon_in_state`): a run fitted to a time
budget learns how many steps fit only after it has timed a few, and its optimizer is compiled
before that. Its length is then a value of the optimizer state, not a constant of the program:
set once with `set_schedule_horizon`, checkpointed with the state, so a resumed run decays over
the same steps.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

SCHEDULES = ("noam", "constant", "cosine")


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """Adam on one of three schedules, with optional clipping and parameter averaging.

    Attributes:
      schedule: 'noam' (section 5.3 of the paper: Adam 0.9 / 0.98 / 1e-9 on
        lr_factor * d_model^-0.5 * min(t^-0.5, t * warmup^-1.5)), 'constant' (Adam with its
        usual betas at learning_rate, after a linear warm-up over warmup_steps where set:
        the usual schedule for fine-tuning a pretrained model) or 'cosine' (the
        Transformer-XL reference: Adam with its usual betas, linear warm-up over
        warmup_steps, then cosine from learning_rate to min_learning_rate over decay_steps).
      learning_rate: the rate of 'constant', the peak of 'cosine' (unused by 'noam').
      d_model: the model width of 'noam'.
      lr_factor: the factor of 'noam'.
      warmup_steps: the warm-up of each schedule (0: none, 'constant' and 'cosine' only).
      decay_steps: the cosine horizon.
      min_learning_rate: the cosine floor.
      clip_norm: clip the gradient to this global norm first (None: no clipping).
      ema_decay: keep an average of the parameters at this decay (0: none); see `params_ema`.
      horizon_in_state: the schedule's length is not decay_steps but a value of the optimizer
        state (`ScheduleState.horizon`), which the run sets once it knows it
        (`set_schedule_horizon`); 0 until then, when the schedule does not decay. Only
        'cosine' reads it; the others keep it for the run, which stops there.
    """

    schedule: str = "constant"
    learning_rate: float = 1e-3
    d_model: int | None = None
    lr_factor: float = 1.0
    warmup_steps: int = 0
    decay_steps: int = 0
    min_learning_rate: float = 0.0
    clip_norm: float | None = None
    ema_decay: float = 0.0
    horizon_in_state: bool = False

    def __post_init__(self):
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule: expected one of {SCHEDULES}, got {self.schedule!r}")
        if self.schedule == "noam":
            if not self.d_model or self.d_model <= 0 or self.warmup_steps <= 0:
                raise ValueError(
                    "noam: d_model and warmup_steps must be positive, got "
                    f"{self.d_model}, {self.warmup_steps}"
                )
        elif not (self.learning_rate > 0 and jnp.isfinite(self.learning_rate)):
            # `> 0` is False for NaN too, but say so: a NaN rate would train to NaN.
            raise ValueError(
                f"learning_rate: must be a finite number > 0, got {self.learning_rate}"
            )
        if self.schedule == "cosine" and self.decay_steps <= 0 and not self.horizon_in_state:
            raise ValueError(f"decay_steps: the cosine horizon must be > 0, got {self.decay_steps}")
        if self.warmup_steps < 0 or self.min_learning_rate < 0:
            raise ValueError("warmup_steps and min_learning_rate: must be >= 0")
        if self.clip_norm is not None and not self.clip_norm > 0:
            raise ValueError(f"clip_norm: must be > 0 or None, got {self.clip_norm}")
        if not 0.0 <= self.ema_decay < 1.0:
            raise ValueError(f"ema_decay: must be in [0, 1) (0 = off), got {self.ema_decay}")


def noam_schedule(d_model: int, warmup_steps: int, factor: float = 1.0) -> optax.Schedule:
    """lr(count) = factor * d_model**-0.5 * min(step**-0.5, step * warmup_steps**-1.5),
    with step = count + 1 (optax counts updates from 0; the paper's steps start at 1).

    Linear warm-up for `warmup_steps`, then decay as 1/sqrt(step); the peak, at
    step = warmup_steps, is factor / sqrt(d_model * warmup_steps).
    """
    if d_model <= 0 or warmup_steps <= 0:
        raise ValueError(
            f"d_model and warmup_steps must be positive, got {d_model}, {warmup_steps}"
        )

    def schedule(count):
        step = jnp.asarray(count, jnp.float32) + 1.0
        return factor * d_model**-0.5 * jnp.minimum(step**-0.5, step * warmup_steps**-1.5)

    return schedule


def warmup_cosine_schedule(
    learning_rate: float, *, warmup_steps: int, decay_steps: int, min_learning_rate: float = 0.0
) -> optax.Schedule:
    """The Transformer-XL reference's schedule with 1-based step t: lr * t / warmup while
    t < warmup, then min_lr + (lr - min_lr) * (1 + cos(pi * t / decay_steps)) / 2, t capped
    at decay_steps.

    Its `horizon` argument, when given (an int32 scalar: `ScheduleState.horizon`), stands for
    decay_steps; 0 means the length is not chosen yet, and the cosine stays at its start (an
    endless horizon)."""
    lr, floor, fixed = learning_rate, min_learning_rate, max(decay_steps, 1)

    def schedule(count, horizon=None):
        t = jnp.asarray(count, jnp.float32) + 1.0
        if horizon is None:
            total = fixed
        else:
            total = jnp.where(horizon > 0, jnp.asarray(horizon, jnp.float32), jnp.inf)
        cosine = floor + (lr - floor) * 0.5 * (
            1.0 + jnp.cos(jnp.pi * jnp.minimum(t, total) / total)
        )
        return jnp.where(t < warmup_steps, lr * t / max(warmup_steps, 1), cosine)

    return schedule


def warmup_constant_schedule(learning_rate: float, *, warmup_steps: int) -> optax.Schedule:
    """lr * min(1, t / warmup_steps) with 1-based step t: a linear warm-up to a constant rate,
    reached at step t = warmup_steps (the cosine schedule's warm-up, without the decay)."""
    if warmup_steps <= 0:
        raise ValueError(f"warmup_steps must be positive, got {warmup_steps}")

    def schedule(count):
        t = jnp.asarray(count, jnp.float32) + 1.0
        return learning_rate * jnp.minimum(t / warmup_steps, 1.0)

    return schedule


def make_schedule(config: OptimizerConfig) -> optax.Schedule:
    """-> schedule(count), or with config.horizon_in_state schedule(count, horizon): the
    horizon is read by 'cosine' and ignored by the others."""
    if config.schedule == "noam":
        schedule = noam_schedule(config.d_model, config.warmup_steps, config.lr_factor)
    elif config.schedule == "cosine":
        return warmup_cosine_schedule(
            config.learning_rate,
            warmup_steps=config.warmup_steps,
            decay_steps=config.decay_steps,
            min_learning_rate=config.min_learning_rate,
        )
    elif config.warmup_steps:
        schedule = warmup_constant_schedule(config.learning_rate, warmup_steps=config.warmup_steps)
    else:
        schedule = optax.constant_schedule(config.learning_rate)
    if not config.horizon_in_state:
        return schedule
    return lambda count, horizon=None: schedule(count)


def make_optimizer(config: OptimizerConfig) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """-> (tx, the learning-rate schedule): [clip] -> Adam -> [params_ema]; the clip is
    `clip_by_global_norm`, whose update takes the gradient's norm from a caller that has it.

    A single transformation is returned unchained, so the optimizer state's tree (and with it
    every checkpoint) is the same as that transformation's own. With horizon_in_state, Adam's
    rate is scaled by `scale_by_schedule_with_horizon` instead of optax's `scale_by_schedule`:
    the same arithmetic, with the schedule's length in its state.
    """
    schedule = make_schedule(config)
    betas = dict(b1=0.9, b2=0.98, eps=1e-9) if config.schedule == "noam" else {}
    if config.horizon_in_state:
        adam = optax.chain(optax.scale_by_adam(**betas), scale_by_schedule_with_horizon(schedule))
    else:
        adam = optax.adam(schedule, **betas)
    parts = [adam]
    if config.clip_norm is not None:
        parts.insert(0, clip_by_global_norm(config.clip_norm))
    if config.ema_decay:
        parts.append(params_ema(config.ema_decay))  # last: it averages the updated params
    return (parts[0] if len(parts) == 1 else optax.chain(*parts)), schedule


class ScheduleState(NamedTuple):
    """count: int32 scalar, updates seen (optax's ScaleByScheduleState.count); horizon: int32
    scalar, the schedule's length in steps, 0 until the run chooses it."""

    count: jax.Array
    horizon: jax.Array


def scale_by_schedule_with_horizon(schedule) -> optax.GradientTransformation:
    """optax's `scale_by_learning_rate(schedule)` (updates times -schedule(count)) for a
    schedule(count, horizon) whose horizon is kept in the state (`ScheduleState`): a program
    compiled before the horizon is known reads it at every step."""

    def init(params):
        del params
        return ScheduleState(count=jnp.zeros([], jnp.int32), horizon=jnp.zeros([], jnp.int32))

    def update(updates, state, params=None):
        del params
        step_size = -1 * schedule(state.count, state.horizon)
        updates = jax.tree.map(lambda g: jnp.array(step_size, dtype=g.dtype) * g, updates)
        return updates, state._replace(count=optax.safe_increment(state.count))

    return optax.GradientTransformation(init, update)


def find_schedule_horizon(opt_state: Any) -> jax.Array | None:
    """The `ScheduleState.horizon` in `opt_state` (a chain's tuple of states, searched depth
    first), or None: the schedule's length is fixed (not horizon_in_state)."""
    found = _find_state(opt_state, ScheduleState)
    return None if found is None else found.horizon


def set_schedule_horizon(opt_state: Any, steps: int) -> Any:
    """`opt_state` with its `ScheduleState.horizon` set to `steps` (host values; the caller
    places them). ValueError when it has none."""
    if find_schedule_horizon(opt_state) is None:
        raise ValueError("set_schedule_horizon: the optimizer state keeps no schedule horizon")

    def replace(node):
        if isinstance(node, ScheduleState):
            return node._replace(horizon=np.asarray(steps, np.int32))
        if isinstance(node, tuple) and not hasattr(node, "_fields"):
            return tuple(replace(x) for x in node)
        if isinstance(node, list):
            return [replace(x) for x in node]
        return node

    return replace(opt_state)


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformationExtraArgs:
    """Scales the updates down to global norm `max_norm` when their norm is above it, as
    `optax.clip_by_global_norm` does and with its (empty) state, so checkpoints are the same.

    Its update takes an optional keyword argument, `global_norm`: the norm of the updates when
    the caller has it already (`train.core.step` computes it for its metrics and its
    finiteness check); without it the norm is computed here. Given it, the clipping reads the
    norm instead of reducing every leaf a second time inside the step's update branch.

    The updates are multiplied by one scalar, min(1, max_norm / norm); optax selects between g
    and g / norm * max_norm, which XLA:CPU wrote out as a divided copy of every gradient leaf,
    then read beside the gradient itself in Adam's moments. The two agree to float rounding.
    """
    if not max_norm > 0:
        raise ValueError(f"max_norm: must be > 0, got {max_norm}")

    def update(updates, state, params=None, *, global_norm=None, **extra_args):
        del params, extra_args
        norm = optax.tree.norm(updates) if global_norm is None else global_norm
        scale = jnp.where(norm < max_norm, 1.0, max_norm / norm)
        return jax.tree.map(lambda g: g * scale.astype(g.dtype), updates), state

    return optax.GradientTransformationExtraArgs(optax.init_empty_state, update)


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
        return ParamsEmaState(count=jnp.zeros((), jnp.int32), ema=jax.tree.map(jnp.copy, params))

    def update(updates, state, params=None):
        if params is None:
            raise ValueError("params_ema needs the params: call tx.update(grads, state, params)")
        new_params = optax.apply_updates(params, updates)  # what the caller will apply
        count = state.count + 1
        n = count.astype(jnp.float32)
        d = jnp.minimum(decay, (n - 1.0) / n)
        ema = jax.tree.map(
            lambda e, p: (d * e + (1.0 - d) * p).astype(e.dtype), state.ema, new_params
        )
        return updates, ParamsEmaState(count=count, ema=ema)

    return optax.GradientTransformation(init, update)


def find_params_ema(opt_state: Any) -> Any | None:
    """The averaged parameters of the first `params_ema` found in `opt_state` (a chain's tuple
    of states, searched depth first), or None when there is none."""
    found = _find_state(opt_state, ParamsEmaState)
    return None if found is None else found.ema


def _find_state(opt_state: Any, kind: type) -> Any | None:
    """The first state of type `kind` in `opt_state` (a chain's tuple of states, searched
    depth first), or None."""
    if isinstance(opt_state, kind):
        return opt_state
    if isinstance(opt_state, (tuple, list)):
        for inner in opt_state:
            found = _find_state(inner, kind)
            if found is not None:
                return found
    return None
