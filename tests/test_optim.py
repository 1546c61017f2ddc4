"""transformer_jax/optim.py against its docstrings: the config's checks, each schedule's values
against its formula, the optimizer each config builds (its betas, its chain, its state), the
schedule horizon kept in the state, the clip and the parameter average at their edges."""

from __future__ import annotations

import dataclasses
import math
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from transformer_jax.optim import (
    SCHEDULES,
    OptimizerConfig,
    ParamsEmaState,
    ScheduleState,
    clip_by_global_norm,
    find_params_ema,
    find_schedule_horizon,
    make_optimizer,
    make_schedule,
    noam_schedule,
    params_ema,
    scale_by_schedule_with_horizon,
    set_schedule_horizon,
    warmup_constant_schedule,
    warmup_cosine_schedule,
)


@pytest.mark.parametrize(
    "fields,message",
    [
        (dict(schedule="linear"), "schedule: expected one of ('noam', 'constant', 'cosine')"),
        (dict(schedule="noam", warmup_steps=4), "noam: d_model and warmup_steps must be positive"),
        (dict(schedule="noam", d_model=-8, warmup_steps=4), "got -8, 4"),
        (dict(schedule="noam", d_model=8, warmup_steps=0), "got 8, 0"),
        (dict(schedule="noam", d_model=8, warmup_steps=-1), "noam: d_model and warmup_steps must"),
        (dict(learning_rate=0.0), "learning_rate: must be a finite number > 0, got 0.0"),
        (dict(learning_rate=-1e-3), "got -0.001"),
        (dict(learning_rate=float("nan")), "got nan"),
        (dict(learning_rate=float("inf")), "got inf"),
        (dict(schedule="cosine"), "decay_steps: the cosine horizon must be > 0, got 0"),
        (dict(schedule="cosine", decay_steps=-5), "got -5"),
        (dict(warmup_steps=-1), "warmup_steps and min_learning_rate: must be >= 0"),
        (dict(min_learning_rate=-1e-6), "warmup_steps and min_learning_rate: must be >= 0"),
        (dict(clip_norm=0.0), "clip_norm: must be > 0 or None, got 0.0"),
        (dict(clip_norm=-1.0), "got -1.0"),
        (dict(clip_norm=float("nan")), "got nan"),
        (dict(ema_decay=1.0), "ema_decay: must be in [0, 1) (0 = off), got 1.0"),
        (dict(ema_decay=-0.1), "got -0.1"),
        (dict(ema_decay=1.5), "got 1.5"),
    ],
)
def test_a_bad_config_names_its_field_and_value(fields, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        OptimizerConfig(**fields)


@pytest.mark.parametrize(
    "fields",
    [
        dict(),
        dict(schedule="noam", d_model=1, warmup_steps=1, learning_rate=-1.0),  # noam: rate unused
        dict(schedule="cosine", horizon_in_state=True),  # the horizon comes later
        dict(schedule="cosine", decay_steps=1, warmup_steps=0, min_learning_rate=0.0),
        dict(learning_rate=1e-12, clip_norm=1e-12, ema_decay=0.0),
        dict(ema_decay=0.999),
    ],
)
def test_a_config_at_the_edges_of_its_ranges_is_accepted(fields):
    OptimizerConfig(**fields)


def test_the_defaults_are_adam_at_a_constant_1e_3_unclipped_unaveraged():
    config = OptimizerConfig()
    schedule = make_schedule(config)
    assert [float(schedule(c)) for c in (0, 10, 10_000)] == pytest.approx([1e-3] * 3)
    tx, _ = make_optimizer(config)
    params = jnp.zeros(3)
    grads = jnp.array([0.5, -2.0, 1e-3])
    got, state = tx.update(grads, tx.init(params), params)
    adam = optax.adam(optax.constant_schedule(1e-3))
    want, want_state = adam.update(grads, adam.init(params), params)
    chex.assert_trees_all_close(got, want, rtol=1e-6)
    assert jax.tree.structure(state) == jax.tree.structure(want_state)  # one transformation
    assert find_params_ema(state) is None and find_schedule_horizon(state) is None
    assert config.warmup_steps == 0 and config.clip_norm is None and config.ema_decay == 0.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.learning_rate = 1.0


def test_noam_refuses_a_width_or_warm_up_that_is_not_positive():
    for d_model, warmup in ((0, 4), (8, 0), (-8, 4), (8, -4)):
        with pytest.raises(ValueError, match=f"got {d_model}, {warmup}"):
            noam_schedule(d_model, warmup)
    assert float(noam_schedule(1, 1)(0)) == pytest.approx(1.0)


def _cosine(t, lr, warmup, total, floor):
    """The Transformer-XL reference's schedule at 1-based step t, written out."""
    if t < warmup:
        return lr * t / warmup
    return floor + (lr - floor) * 0.5 * (1 + math.cos(math.pi * min(t, total) / total))


@pytest.mark.parametrize("warmup,floor", [(0, 0.0), (1, 0.0), (4, 1e-4)])
def test_the_cosine_schedule_warms_up_then_decays_to_its_floor_and_stays(warmup, floor):
    lr, total = 2e-3, 20
    schedule = warmup_cosine_schedule(
        lr, warmup_steps=warmup, decay_steps=total, min_learning_rate=floor
    )
    for count in (0, 1, 2, 3, 4, 5, 9, 10, 18, 19, 20, 40):
        want = _cosine(count + 1, lr, warmup, total, floor)
        assert float(schedule(count)) == pytest.approx(want, rel=1e-5, abs=1e-9), count
    assert float(schedule(19)) == pytest.approx(floor, abs=1e-9)  # t = decay_steps: the floor
    assert float(schedule(warmup + 100)) == pytest.approx(floor, abs=1e-9)


@pytest.mark.parametrize("decay_steps", [0, 1])
def test_a_cosine_of_one_step_or_none_is_at_its_floor_from_the_first_step(decay_steps):
    schedule = warmup_cosine_schedule(
        1.0, warmup_steps=0, decay_steps=decay_steps, min_learning_rate=0.25
    )
    assert [float(schedule(c)) for c in range(3)] == pytest.approx([0.25] * 3, abs=1e-7)


def test_the_cosine_horizon_in_the_state_stands_for_decay_steps_and_0_is_endless():
    lr = 1e-3
    fixed = warmup_cosine_schedule(lr, warmup_steps=2, decay_steps=10)
    chosen = warmup_cosine_schedule(lr, warmup_steps=2, decay_steps=0)
    for count in range(14):
        assert float(chosen(count, jnp.int32(10))) == pytest.approx(float(fixed(count)), rel=1e-6)
    # Not chosen yet: the warm-up, then the cosine's start (lr) at every step.
    unchosen = [float(chosen(count, jnp.int32(0))) for count in range(6)]
    assert unchosen == pytest.approx([lr / 2, lr, lr, lr, lr, lr], rel=1e-6)


def test_a_cosine_horizon_of_one_step_in_the_state_is_at_its_floor_from_the_first_step():
    chosen = warmup_cosine_schedule(1.0, warmup_steps=0, decay_steps=0, min_learning_rate=0.25)
    assert [float(chosen(c, jnp.int32(1))) for c in range(3)] == pytest.approx([0.25] * 3)


def test_the_schedules_take_their_lengths_by_keyword():
    with pytest.raises(TypeError):
        warmup_cosine_schedule(1.0, 2, 10)
    with pytest.raises(TypeError):
        warmup_constant_schedule(1.0, 2)


def test_a_constant_schedule_warmed_up_over_one_step_is_at_its_rate_at_once():
    schedule = warmup_constant_schedule(0.5, warmup_steps=1)
    assert [float(schedule(c)) for c in range(3)] == [0.5, 0.5, 0.5]


def test_a_schedule_named_by_a_string_built_at_run_time_is_that_schedule():
    """Config values come from JSON and the command line: equal strings, not the same object
    as the literals in optim.py."""
    noam = OptimizerConfig(schedule="".join(["no", "am"]), d_model=16, warmup_steps=2)
    assert noam.schedule == "noam" and noam.schedule is not SCHEDULES[0]  # SCHEDULES[0]: "noam"
    assert float(make_schedule(noam)(0)) == pytest.approx(float(noam_schedule(16, 2)(0)))
    tx, _ = make_optimizer(noam)
    grads = [jnp.array([1.0, -0.5]), jnp.array([1e-4, 2.0])]
    got, _ = _adam_update(tx, grads)
    want, _ = _adam_update(optax.adam(noam_schedule(16, 2), b1=0.9, b2=0.98, eps=1e-9), grads)
    chex.assert_trees_all_close(got, want, rtol=1e-6)
    cosine = OptimizerConfig(
        schedule="".join(["cos", "ine"]), learning_rate=1.0, decay_steps=4, min_learning_rate=0.5
    )
    assert float(make_schedule(cosine)(1)) == pytest.approx(0.75)
    # And the config's own checks read them so.
    with pytest.raises(ValueError, match="noam: d_model and warmup_steps must be positive"):
        OptimizerConfig(schedule="".join(["no", "am"]), warmup_steps=4)
    with pytest.raises(ValueError, match="decay_steps: the cosine horizon must be > 0"):
        OptimizerConfig(schedule="".join(["cos", "ine"]))


def test_the_constant_schedule_warms_up_linearly_to_its_rate():
    schedule = warmup_constant_schedule(0.5, warmup_steps=4)
    got = [float(schedule(count)) for count in range(7)]
    assert got == pytest.approx([0.125, 0.25, 0.375, 0.5, 0.5, 0.5, 0.5])
    for bad in (0, -3):
        with pytest.raises(ValueError, match=f"warmup_steps must be positive, got {bad}"):
            warmup_constant_schedule(0.5, warmup_steps=bad)


@pytest.mark.parametrize("horizon_in_state", [False, True])
def test_make_schedule_gives_each_config_its_schedule(horizon_in_state):
    """'constant' with warm-up takes the linear warm-up, without it optax's constant; the
    horizon (when kept in the state) reaches the cosine alone."""
    cases = [
        (OptimizerConfig(learning_rate=0.5, warmup_steps=4), [0.125, 0.25, 0.5, 0.5]),
        (OptimizerConfig(learning_rate=0.5), [0.5, 0.5, 0.5, 0.5]),
        (
            OptimizerConfig(schedule="noam", d_model=16, warmup_steps=2, lr_factor=2.0),
            [float(noam_schedule(16, 2, 2.0)(c)) for c in (0, 1, 3, 5)],
        ),
    ]
    for config, want in cases:
        schedule = make_schedule(dataclasses.replace(config, horizon_in_state=horizon_in_state))
        args = (jnp.int32(3),) if horizon_in_state else ()
        got = [float(schedule(c, *args)) for c in (0, 1, 3, 5)]
        assert got == pytest.approx(want, rel=1e-6), config
    cosine = OptimizerConfig(
        schedule="cosine", learning_rate=1.0, warmup_steps=0, decay_steps=4, min_learning_rate=0.5
    )
    schedule = make_schedule(dataclasses.replace(cosine, horizon_in_state=horizon_in_state))
    if horizon_in_state:  # the state's horizon, not decay_steps
        assert float(schedule(1, jnp.int32(2))) == pytest.approx(0.5)
    else:
        assert float(schedule(1)) == pytest.approx(0.75)


def _adam_update(tx, grads_list, params=None):
    params = jnp.zeros_like(grads_list[0]) if params is None else params
    state, out = tx.init(params), []
    for g in grads_list:
        u, state = tx.update(g, state, params)
        out.append(u)
    return out, state


@pytest.mark.parametrize("schedule", ["constant", "cosine"])
def test_the_schedules_but_noam_take_adam_s_usual_betas(schedule):
    config = OptimizerConfig(schedule=schedule, learning_rate=0.01, decay_steps=100)
    tx, sched = make_optimizer(config)
    grads = [jnp.array([1.0, -0.5]), jnp.array([1e-4, 2.0]), jnp.array([0.3, 0.3])]
    got, _ = _adam_update(tx, grads)
    want, _ = _adam_update(optax.adam(sched, b1=0.9, b2=0.999, eps=1e-8), grads)
    chex.assert_trees_all_close(got, want, rtol=1e-6)
    noam98, _ = _adam_update(optax.adam(sched, b1=0.9, b2=0.98, eps=1e-9), grads)
    assert not np.allclose(got[1], noam98[1], rtol=1e-4)  # the betas tell them apart


def test_the_chain_is_clip_then_adam_then_the_average_and_each_only_when_asked():
    base = dict(learning_rate=0.1)
    only = make_optimizer(OptimizerConfig(**base))[0].init(jnp.zeros(2))
    assert isinstance(only, tuple) and isinstance(only[0], optax.ScaleByAdamState)
    clip = make_optimizer(OptimizerConfig(**base, clip_norm=1.0))[0].init(jnp.zeros(2))
    assert isinstance(clip[0], optax.EmptyState) and len(clip) == 2
    ema = make_optimizer(OptimizerConfig(**base, ema_decay=0.5))[0].init(jnp.zeros(2))
    assert isinstance(ema[-1], ParamsEmaState) and len(ema) == 2
    both = make_optimizer(OptimizerConfig(**base, clip_norm=1.0, ema_decay=0.5))[0]
    state = both.init(jnp.zeros(2))
    assert isinstance(state[0], optax.EmptyState) and isinstance(state[-1], ParamsEmaState)
    # Clipped before Adam: a gradient of norm 5 moves Adam's first moment by (1 - b1) * g / 5.
    _, state = both.update(jnp.array([3.0, 4.0]), state, jnp.zeros(2))
    chex.assert_trees_all_close(state[1][0].mu, 0.1 * jnp.array([0.6, 0.8]), rtol=1e-6)


def test_a_horizon_in_the_state_scales_adam_as_optax_does_and_counts_updates():
    config = OptimizerConfig(
        schedule="cosine", learning_rate=0.1, warmup_steps=1, decay_steps=6, horizon_in_state=True
    )
    tx, schedule = make_optimizer(config)
    fixed, _ = make_optimizer(
        OptimizerConfig(schedule="cosine", learning_rate=0.1, warmup_steps=1, decay_steps=6)
    )
    params = jnp.zeros(2)
    state = set_schedule_horizon(tx.init(params), 6)
    assert int(find_schedule_horizon(state)) == 6
    fixed_state = fixed.init(params)
    for step in range(8):
        g = jnp.array([1.0, -2.0]) * (step + 1)
        u, state = tx.update(g, state, params)
        v, fixed_state = fixed.update(g, fixed_state, params)
        chex.assert_trees_all_close(u, v, rtol=1e-6)
    (horizon_state,) = [s for s in jax.tree.leaves(state, is_leaf=_is_schedule) if _is_schedule(s)]
    assert int(horizon_state.count) == 8 and int(horizon_state.horizon) == 6


def _is_schedule(node):
    return isinstance(node, ScheduleState)


def test_scale_by_schedule_with_horizon_multiplies_by_minus_the_rate_in_the_updates_dtype():
    seen = []

    def schedule(count, horizon):
        seen.append((count, horizon))
        return 0.5 + count + 10 * horizon

    tx = scale_by_schedule_with_horizon(schedule)
    state = tx.init({"w": jnp.zeros(2)})
    assert int(state.count) == 0 and int(state.horizon) == 0
    state = state._replace(horizon=jnp.int32(1))
    grads = {"w": jnp.array([1.0, -2.0], jnp.bfloat16)}
    u, state = tx.update(grads, state)
    assert u["w"].dtype == jnp.bfloat16
    chex.assert_trees_all_close(u["w"], jnp.array([-10.5, 21.0], jnp.bfloat16))
    u, state = tx.update(grads, state)
    chex.assert_trees_all_close(u["w"], jnp.array([-11.5, 23.0], jnp.bfloat16))
    assert int(state.count) == 2


def test_set_schedule_horizon_finds_the_state_in_any_chain_and_refuses_none():
    inner = ScheduleState(count=jnp.int32(3), horizon=jnp.int32(0))
    nested = (optax.EmptyState(), [inner, (optax.EmptyState(),)])
    out = set_schedule_horizon(nested, 42)
    assert int(find_schedule_horizon(out)) == 42
    assert isinstance(out[1], list) and int(out[1][0].count) == 3
    assert isinstance(out[1][1], tuple) and isinstance(out[1][1][0], optax.EmptyState)
    with pytest.raises(ValueError, match="keeps no schedule horizon"):
        set_schedule_horizon((optax.EmptyState(),), 42)
    ema = ParamsEmaState(count=jnp.int32(0), ema={"w": jnp.ones(1)})
    assert find_params_ema([optax.EmptyState(), (ema,)]) is ema.ema


def test_the_clip_takes_the_norm_by_keyword():
    clip = clip_by_global_norm(1.0)
    with pytest.raises(TypeError):
        clip.update(jnp.ones(2), clip.init(jnp.zeros(2)), None, jnp.float32(2.0))


def test_the_clip_at_its_norm_exactly_changes_nothing_and_above_it_scales_to_it():
    tx = clip_by_global_norm(5.0)
    grads = {"w": jnp.array([3.0, 4.0])}  # norm 5
    at, _ = tx.update(grads, tx.init(grads))
    chex.assert_trees_all_close(at, grads, rtol=1e-7)
    above, _ = tx.update(jax.tree.map(lambda g: 2 * g, grads), tx.init(grads))
    chex.assert_trees_all_close(above, grads, rtol=1e-6)
    # A tree of mixed dtypes (a float32 norm): each leaf keeps its own.
    mixed = {"w": grads["w"].astype(jnp.bfloat16), "b": jnp.array([1.0])}
    out, _ = clip_by_global_norm(1.0).update(mixed, tx.init(mixed))
    assert out["w"].dtype == jnp.bfloat16 and out["b"].dtype == jnp.float32
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match=f"max_norm: must be > 0, got {bad}"):
            clip_by_global_norm(bad)


def test_the_average_starts_at_the_first_update_s_params_and_needs_them():
    tx = params_ema(0.9)
    params = {"w": jnp.array([1.0, 2.0])}
    state = tx.init(params)
    assert state.ema["w"] is not params["w"]  # a copy: the state is donated
    updates = {"w": jnp.array([0.5, -0.5])}
    out, state = tx.update(updates, state, params)
    chex.assert_trees_all_equal(out, updates)
    chex.assert_trees_all_close(state.ema, {"w": jnp.array([1.5, 1.5])})  # d_1 = 0
    _, state = tx.update(updates, state, {"w": jnp.array([1.5, 1.5])})
    chex.assert_trees_all_close(state.ema, {"w": jnp.array([1.75, 1.25])})  # d_2 = 1/2
    assert int(state.count) == 2
    with pytest.raises(ValueError, match="params_ema needs the params"):
        tx.update(updates, state)
    for bad in (0.0, 1.0, 1.5, -0.5):
        with pytest.raises(ValueError, match=f"decay: must be in \\(0, 1\\), got {bad}"):
            params_ema(bad)
