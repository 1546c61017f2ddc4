"""Sharded parameters (sharding='fsdp'): each leaf goes to its largest axis that the device
count divides; a few train steps on 8 (fake CPU) devices give the replicated run's losses with
params, Adam moments and the EMA really split; the compiled step's per-device arguments are
about 1/8 of the replicated ones; bad settings are clear errors.
(Resuming across shardings: tests/test_train_translate.py.)
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from train import translate
from train.core.parallel import DATA_AXIS, DataParallel, fsdp_spec
from train.core.state import TrainState
from train.translate import make_loss_fn
from transformer_jax.config import TransformerConfig
from transformer_jax.model import Transformer
from transformer_jax.optim import OptimizerConfig, find_params_ema, make_optimizer

V, ROWS, LEN, STEPS = 64, 16, 7, 3
LR = 1e-2


@pytest.mark.parametrize(
    "shape, spec",
    [
        ((1000, 64), P(DATA_AXIS)),  # [V, D]: the vocabulary axis is the larger
        ((64, 1000), P(None, DATA_AXIS)),
        ((64, 64), P(DATA_AXIS)),  # a tie: the first axis
        ((7, 24, 5), P(None, DATA_AXIS)),  # the only divisible axis, though not the largest
        ((1000, 60), P(DATA_AXIS)),
        ((30,), P()),  # no axis divides: replicated
        ((), P()),  # a scalar (Adam's step count)
    ],
)
def test_fsdp_spec_splits_the_largest_divisible_axis(shape, spec):
    assert fsdp_spec(shape, 8) == spec


def make_model() -> Transformer:
    return Transformer(
        TransformerConfig.tiny(
            src_vocab_size=V,
            tgt_vocab_size=V,
            d_model=64,
            n_heads=2,
            d_ff=256,
            n_encoder_layers=1,
            n_decoder_layers=1,
            dropout=0.0,
            attention_dropout=0.0,
        )
    )


def make_batch(step: int) -> dict[str, np.ndarray]:
    rs = np.random.RandomState(step)
    src = rs.randint(3, V, (ROWS, LEN)).astype(np.int32)
    tgt = rs.randint(3, V, (ROWS, LEN + 1)).astype(np.int32)
    tgt[::3, 4:] = 0  # some padding, so the token count is not the row count times LEN
    return {"src": src, "tgt_in": tgt[:, :-1], "tgt_out": tgt[:, 1:]}


@pytest.fixture(scope="module")
def runs():
    """{sharding: (per-step losses, final global-layout state, per-device argument bytes of
    the compiled step)} for 'replicated' and 'fsdp', from the same initial state."""
    model = make_model()
    # Adam with clipping and an EMA: every kind of optimizer state is in the tree.
    tx, _ = make_optimizer(OptimizerConfig(learning_rate=LR, clip_norm=1.0, ema_decay=0.5))
    dummy = np.ones((1, LEN), np.int32)
    params = model.init({"params": jax.random.PRNGKey(0)}, dummy, dummy)["params"]
    initial = jax.device_get(TrainState.create(params=params, tx=tx, rng=jax.random.PRNGKey(7)))
    loss_fn = make_loss_fn(model, smoothing=0.1, pad_id=0)
    return {
        sharding: train(DataParallel("jit", sharding=sharding), loss_fn, initial)
        for sharding in ("replicated", "fsdp")
    }


def train(dp: DataParallel, loss_fn, initial: TrainState):
    """STEPS steps from `initial` (host values) -> (losses, state, argument bytes), with the
    step compiled once (compilation is most of this file's time)."""
    state = dp.put_state(initial)
    step = dp.compile_train_step(loss_fn, state)
    compiled = step.lower(state, dp.put_batch(make_batch(0))).compile()
    losses = []
    for i in range(STEPS):
        state, metrics = compiled(state, dp.put_batch(make_batch(i)))
        m = dp.fetch([metrics])[0]
        losses.append(m["loss_sum"] / m["n_tokens"])
    return losses, dp.get_state(state), compiled.memory_analysis().argument_size_in_bytes


def test_fsdp_trains_like_replicated_with_the_state_split(runs):
    replicated, rep_state, _ = runs["replicated"]
    fsdp, state, _ = runs["fsdp"]
    np.testing.assert_allclose(fsdp, replicated, rtol=1e-5)
    # The same parameters after the steps. Not the key biases: softmax over keys ignores them
    # (q . b_k is the same for every key), so their true gradient is 0 and Adam turns the
    # rounding noise of either summation order into steps of the full learning rate.
    for (path, a), b in zip(
        jax.tree_util.tree_flatten_with_path(state.params)[0], jax.tree.leaves(rep_state.params)
    ):
        if "['key']['bias']" not in jax.tree_util.keystr(path):
            np.testing.assert_allclose(
                np.asarray(a),
                np.asarray(b),
                rtol=0,
                atol=LR / 100,
                err_msg=jax.tree_util.keystr(path),
            )
    # Each big leaf is split 8 ways on its largest axis; a replicated run's is whole.
    inner = state.params["encoder"]["layers_0"]["ffn"]["inner"]
    assert inner["kernel"].sharding.spec == P(None, DATA_AXIS)  # [D, F] = [64, 256]
    assert inner["kernel"].addressable_shards[0].data.shape == (64, 256 // 8)
    assert inner["bias"].sharding.spec == P(DATA_AXIS)  # [F]
    assert rep_state.params["encoder"]["layers_0"]["ffn"]["inner"][
        "kernel"
    ].sharding.is_fully_replicated
    # Adam's moments and the EMA are split like the params; the step count is replicated.
    mu = state.opt_state[1][0].mu  # chain(clip, adam, ema): adam's ScaleByAdamState
    ema = find_params_ema(state.opt_state)
    for tree in (mu, ema):
        for leaf, param in zip(jax.tree.leaves(tree), jax.tree.leaves(state.params)):
            assert leaf.sharding.spec == param.sharding.spec
    assert state.step.sharding.is_fully_replicated
    # Decoding wants whole weights: `replicate` gathers them, values unchanged.
    whole = DataParallel("jit", sharding="fsdp").replicate(state.params)
    assert all(x.sharding.is_fully_replicated for x in jax.tree.leaves(whole))
    np.testing.assert_array_equal(
        np.asarray(inner["kernel"]),
        np.asarray(whole["encoder"]["layers_0"]["ffn"]["inner"]["kernel"]),
    )


def test_fsdp_keeps_about_an_eighth_of_the_state_per_device(runs):
    # Per-device bytes of the compiled step's arguments: the state and the batch.
    ratio = runs["fsdp"][2] / runs["replicated"][2]
    print(
        f"fsdp / replicated argument bytes per device: {runs['fsdp'][2]} / "
        f"{runs['replicated'][2]} = {ratio:.4f}"
    )
    # 1/8 = 0.125 plus what stays whole: scalars, the step, the rng, the leaves no axis of
    # which 8 divides (none here) and the batch (split in both).
    assert ratio < 0.2, ratio


def test_bad_sharding_settings_are_clear_errors():
    with pytest.raises(ValueError, match="sharding"):
        translate.make_config("transformer", "tiny", sharding="zero3")
    with pytest.raises(ValueError, match="sharding.*jit"):
        translate.make_config("transformer", "tiny", sharding="fsdp", parallel="pmap")
    with pytest.raises(ValueError, match="sharding.*jit"):
        DataParallel("pmap", sharding="fsdp")
