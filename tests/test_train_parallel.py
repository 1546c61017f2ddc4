"""Data parallelism: one step on 8 (fake CPU) devices equals one step on 1 device, for the jit
and the pmap paths, and both equal a plain `jax.grad` of the global per-token mean. The bf16
path runs with float32 params and a loss close to float32's.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from train.core.parallel import DataParallel
from train.core.state import TrainState
from train.translate import make_loss_fn
from transformer_jax.config import TransformerConfig
from transformer_jax.model import Transformer

V, ROWS, LEN = 32, 16, 7
LR = 0.5


def make_model(dropout: float, dtype="float32") -> Transformer:
    return Transformer(
        TransformerConfig.tiny(
            src_vocab_size=V,
            tgt_vocab_size=V,
            d_model=32,
            n_heads=2,
            d_ff=64,
            n_encoder_layers=1,
            n_decoder_layers=1,
            dropout=dropout,
            attention_dropout=dropout,
            dtype=dtype,
        )
    )


def make_batch() -> dict[str, np.ndarray]:
    """Rows with very different amounts of padding, so per-shard means differ from the
    global mean: only a step normalised by the GLOBAL token count matches one device."""
    rs = np.random.RandomState(0)
    src = rs.randint(3, V, (ROWS, LEN)).astype(np.int32)
    tgt = rs.randint(3, V, (ROWS, LEN + 1)).astype(np.int32)
    for r in range(ROWS):
        src[r, 2 + r % 5 :] = 0
        tgt[r, 1 + (r * 3) % LEN :] = 0  # rows 0..1 (device 0) keep 1 and 4 tokens, ...
    return {"src": src, "tgt_in": tgt[:, :-1], "tgt_out": tgt[:, 1:]}


def one_step(model, params, batch, *, mode: str, devices=None):
    dp = DataParallel(mode, devices)
    loss_fn = make_loss_fn(model, smoothing=0.1, pad_id=0)
    state = dp.put_state(
        TrainState.create(params=params, tx=optax.sgd(LR), rng=jax.random.PRNGKey(7))
    )
    step = dp.compile_train_step(loss_fn, state)
    state, metrics = step(state, dp.put_batch(batch))
    return jax.device_get(dp.get_state(state).params), dp.fetch([metrics])[0]


def reference_step(model, params, batch):
    """params - LR * grad of (smoothed loss summed over real tokens / their count), no dropout."""
    loss_fn = make_loss_fn(model, smoothing=0.1, pad_id=0)

    def mean_loss(p):
        loss_sum, sums, _ = loss_fn(p, batch, rng=None, extra=None, deterministic=True)
        return loss_sum / sums["n_tokens"]

    grads = jax.grad(mean_loss)(params)
    return jax.tree.map(lambda p, g: p - LR * g, params, grads)


@pytest.fixture(scope="module")
def setup():
    model = make_model(dropout=0.0)
    params = model.init(
        jax.random.PRNGKey(0), jnp.ones((1, LEN), jnp.int32), jnp.ones((1, LEN), jnp.int32)
    )["params"]
    return model, params, make_batch()


@pytest.fixture(scope="module")
def single_device(setup):
    """The one-device step and the plain-grad reference, computed once for the module."""
    model, params, batch = setup
    single, metrics = one_step(model, params, batch, mode="jit", devices=jax.devices()[:1])
    return single, metrics, reference_step(model, params, batch)


def test_device_count(setup):
    assert jax.device_count() == 8


@pytest.mark.parametrize("mode", ["jit", "pmap"])
def test_eight_devices_equal_one_device_and_plain_grad(setup, single_device, mode):
    model, params, batch = setup
    single, m1, expected = single_device
    multi, m8 = one_step(model, params, batch, mode=mode)
    chex.assert_trees_all_close(single, expected, atol=1e-6, rtol=1e-5)
    chex.assert_trees_all_close(multi, single, atol=1e-6, rtol=1e-5)
    assert m8["n_tokens"] == m1["n_tokens"] == float((batch["tgt_out"] != 0).sum())
    np.testing.assert_allclose(m8["loss_sum"], m1["loss_sum"], rtol=1e-6)
    np.testing.assert_allclose(m8["grad_norm"], m1["grad_norm"], rtol=1e-5)


def test_jit_with_dropout_draws_the_same_masks_on_eight_devices(setup, single_device):
    _, params, batch = setup
    model = make_model(dropout=0.3)
    single, _ = one_step(model, params, batch, mode="jit", devices=jax.devices()[:1])
    multi, _ = one_step(model, params, batch, mode="jit")
    chex.assert_trees_all_close(multi, single, atol=1e-6, rtol=1e-5)
    # ... and dropout did something: the result is not the deterministic step's.
    deterministic = single_device[2]
    diff = max(
        float(np.abs(a - b).max())
        for a, b in zip(jax.tree.leaves(single), jax.tree.leaves(deterministic))
    )
    assert diff > 1e-4


def test_bfloat16_runs_with_float32_params_and_a_close_loss(setup, single_device):
    _, params, batch = setup
    f32, bf16 = make_model(0.0, "float32"), make_model(0.0, "bfloat16")
    losses = {}
    for name, model in (("f32", f32), ("bf16", bf16)):
        loss_sum, sums, _ = make_loss_fn(model, smoothing=0.1, pad_id=0)(
            params, batch, rng=None, extra=None, deterministic=True
        )
        losses[name] = float(loss_sum / sums["n_tokens"])
    chex.assert_tree_all_finite(losses)
    np.testing.assert_allclose(losses["bf16"], losses["f32"], rtol=2e-2)
    new_params, metrics = one_step(bf16, params, batch, mode="jit")
    chex.assert_tree_all_finite(metrics)
    assert all(x.dtype == np.float32 for x in jax.tree.leaves(new_params))
    # The float32 step moves the params by up to ~0.11; bf16 keeps 8 significant bits (2^-8 =
    # 0.4%), and a few roundings per layer put its update within ~1.5% of float32's (1.6e-3 at
    # most, measured): 4e-3 leaves room, and is far below how far the step moves.
    expected = single_device[2]
    tolerance = 4e-3
    moved = max(
        float(np.abs(np.asarray(a) - np.asarray(b)).max())
        for a, b in zip(jax.tree.leaves(expected), jax.tree.leaves(params))
    )
    assert moved > 25 * tolerance, moved
    chex.assert_trees_all_close(new_params, expected, atol=tolerance)


def test_batch_rows_must_divide_over_the_devices(setup):
    _, _, batch = setup
    dp = DataParallel("jit")
    with pytest.raises(ValueError, match="divisible by the device count 8"):
        dp.put_batch({k: v[:12] for k, v in batch.items()})


def test_pmap_layout_round_trip_keeps_the_state(setup):
    _, params, _ = setup
    extra = {"memory": np.arange(16 * 3, dtype=np.float32).reshape(16, 3)}
    state = TrainState.create(
        params=params, tx=optax.adam(1e-3), rng=jax.random.PRNGKey(1), extra=extra
    )
    dp = DataParallel("pmap")
    back = dp.get_state(dp.put_state(state))
    chex.assert_trees_all_equal(jax.device_get(back.params), jax.device_get(state.params))
    np.testing.assert_array_equal(jax.device_get(back.extra["memory"]), extra["memory"])
    assert back.extra["memory"].sharding.spec == jax.sharding.PartitionSpec("data")
