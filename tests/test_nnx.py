"""Our linen modules from Flax NNX, through `flax.nnx.bridge.ToNNX`.

The models are linen (pure functions of their parameters); an NNX user wraps them. These tests
pin what that user relies on: the wrapped model holds the same parameter tree as linen's `init`,
gives the same outputs as linen's `apply` with those parameters (a method such as `decode_step`
included, and Transformer-XL's memory passed in and returned as with linen), and trains with
`nnx.Optimizer` under `nnx.jit`. The tutorial `docs/tutorials/nnx.md` shows the same.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.nnx import bridge

from transformer_jax import Transformer, TransformerConfig, greedy_decode
from xl_jax import TransformerXL, TransformerXLConfig, init_memory

SRC = jnp.array([[5, 6, 7, 8, 2], [9, 10, 2, 0, 0]])  # [B, S], pad 0, eos 2
TGT_IN = jnp.array([[1, 7, 8, 9], [1, 10, 2, 0]])  # [B, T], bos 1
TGT_OUT = jnp.array([[7, 8, 9, 2], [10, 2, 0, 0]])


def _transformer_config():
    return TransformerConfig.tiny(src_vocab_size=16, tgt_vocab_size=16)


def _wrapped_transformer(cfg, seed=0):
    rngs = nnx.Rngs(params=seed, dropout=seed + 1)
    return bridge.ToNNX(Transformer(cfg), rngs=rngs).lazy_init(SRC, TGT_IN)


def _linen_params(model) -> dict:
    """The wrapped module's parameters as the dict that linen's `apply` takes under 'params'."""
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def test_a_wrapped_transformer_holds_linens_parameter_tree_and_gives_its_logits():
    cfg = _transformer_config()
    model = _wrapped_transformer(cfg)
    params = _linen_params(model)
    linen_params = Transformer(cfg).init(jax.random.key(0), SRC, TGT_IN)["params"]
    chex.assert_trees_all_equal_shapes_and_dtypes(params, linen_params)

    logits = model(SRC, TGT_IN)  # [B, T, V]
    chex.assert_shape(logits, (2, 4, cfg.tgt_vocab_size))
    np.testing.assert_array_equal(logits, Transformer(cfg).apply({"params": params}, SRC, TGT_IN))


def test_a_wrapped_transformers_decode_methods_match_linens():
    cfg = _transformer_config()
    model = _wrapped_transformer(cfg)
    params = {"params": _linen_params(model)}
    linen = Transformer(cfg)

    # ToNNX forwards a method by name: the cache goes in and comes out, as with linen.
    cache = model.init_decode_cache(SRC, max_len=6)
    expected_cache = linen.apply(params, SRC, max_len=6, method=Transformer.init_decode_cache)
    chex.assert_trees_all_equal(cache, expected_cache)
    tokens = jnp.full((2,), cfg.bos_id, jnp.int32)
    logits, cache = model.decode_step(tokens, cache, index=jnp.int32(0))
    expected, expected_cache = linen.apply(
        params, tokens, expected_cache, index=jnp.int32(0), method=Transformer.decode_step
    )
    np.testing.assert_array_equal(logits, expected)
    chex.assert_trees_all_equal(cache, expected_cache)
    # The searches take a linen model and its parameters: the wrapped model's serve as they are.
    greedy = greedy_decode(linen, params["params"], SRC, max_len=6)
    chex.assert_shape(greedy, (2, 6))


def _cross_entropy(logits, labels, pad_id):
    weights = (labels != pad_id).astype(jnp.float32)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    return (losses * weights).sum() / weights.sum()


def test_nnx_optimizer_steps_lower_a_wrapped_transformers_loss():
    cfg = _transformer_config()
    model = _wrapped_transformer(cfg)
    optimizer = nnx.Optimizer(model, optax.adam(3e-3), wrt=nnx.Param)
    before = jax.tree.map(jnp.copy, _linen_params(model))

    @nnx.jit
    def train_step(model, optimizer):
        def loss_fn(model):  # dropout on: the 'dropout' stream of the wrapper's Rngs
            logits = model(SRC, TGT_IN, deterministic=False)
            return _cross_entropy(logits, TGT_OUT, cfg.pad_id)

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    def eval_loss():
        return float(_cross_entropy(model(SRC, TGT_IN), TGT_OUT, cfg.pad_id))

    first = eval_loss()
    for _ in range(10):
        train_step(model, optimizer)
    assert eval_loss() < 0.7 * first
    # The steps changed the wrapped module's own parameters, in place.
    changed = jax.tree.map(lambda a, b: bool(jnp.any(a != b)), before, _linen_params(model))
    assert all(jax.tree.leaves(changed))


@pytest.fixture(scope="module")
def xl_config():
    return TransformerXLConfig.tiny()


def _wrapped_xl(cfg, tokens):
    rngs = nnx.Rngs(params=0, dropout=1)
    memory = init_memory(cfg, tokens.shape[0])
    return bridge.ToNNX(TransformerXL(cfg), rngs=rngs).lazy_init(tokens, memory)


def test_a_wrapped_transformer_xl_carries_its_memory_as_linen_does(xl_config):
    cfg = xl_config
    stream = jax.random.randint(jax.random.key(3), (2, 3 * cfg.tgt_len), 0, cfg.vocab_size)
    segments = jnp.split(stream, 3, axis=1)  # 3 x [B, T]
    model = _wrapped_xl(cfg, segments[0])
    params = {"params": _linen_params(model)}
    linen = TransformerXL(cfg)

    memory = linen_memory = init_memory(cfg, 2)
    for segment in segments:  # memory in, memory out: the same on both sides, segment by segment
        log_probs, memory = model(segment, memory)  # [B, T, V]
        expected, linen_memory = linen.apply(params, segment, linen_memory)
        np.testing.assert_array_equal(log_probs, expected)
        chex.assert_trees_all_equal(memory, linen_memory)
    assert int(memory.valid.sum()) == 2 * cfg.mem_len  # every slot filled after 3 segments


def test_nnx_optimizer_steps_lower_a_wrapped_transformer_xls_loss(xl_config):
    cfg = xl_config
    stream = jax.random.randint(jax.random.key(4), (2, 2 * cfg.tgt_len + 1), 0, 8)
    inputs, targets = stream[:, :-1], stream[:, 1:]  # next-token prediction
    model = _wrapped_xl(cfg, inputs[:, : cfg.tgt_len])
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

    @nnx.jit
    def train_step(model, optimizer, tokens, labels, memory):
        def loss_fn(model):
            nll, new_memory = model(tokens, memory, labels, deterministic=False)  # [B, T]
            return nll.mean(), new_memory

        (loss, new_memory), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
        optimizer.update(model, grads)
        return loss, new_memory

    def epoch_losses():
        memory, losses = init_memory(cfg, 2), []
        for start in range(0, inputs.shape[1], cfg.tgt_len):
            t = slice(start, start + cfg.tgt_len)
            loss, memory = train_step(model, optimizer, inputs[:, t], targets[:, t], memory)
            losses.append(float(loss))
        return losses

    first = epoch_losses()
    for _ in range(8):
        last = epoch_losses()
    assert np.mean(last) < 0.7 * np.mean(first)
