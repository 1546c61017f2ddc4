"""The layers of TransformerXL run in a scan, rematerialised per `config.remat`: every mode
gives the same loss, gradients, memory and dropout masks as keeping everything ('none'), the
gradients equal PyTorch autograd through the reference model, and the parameters keep their
per-layer `layer_{l}` names. (Peak memory: tests/test_efficiency.py.)"""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import torch_xl_model

from xl_jax import Memory, TransformerXL, TransformerXLConfig, init_memory, load_pytorch_state_dict

MODES = ("none", "attention", "full")
B, T = 2, 4


def _init(cfg, seed=0):
    init = jax.jit(TransformerXL(cfg).init)
    return init(jax.random.key(seed), jnp.zeros((1, T), jnp.int32), init_memory(cfg, 1))["params"]


def _loss_and_grads(cfg, params, segments, memory, rng=None):
    """Summed NLL over consecutive segments (the memory carried on without gradient, as in
    training), its gradient and the final memory; dropout on when `rng` is given."""
    return _value_and_grad(cfg, rng is None, params, segments, memory, rng)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _value_and_grad(cfg, deterministic, params, segments, memory, rng):
    model = TransformerXL(cfg)

    def loss(p, memory):
        total = 0.0
        for i, (inputs, targets) in enumerate(segments):
            rngs = None if deterministic else {"dropout": jax.random.fold_in(rng, i)}
            nll, memory = model.apply(
                {"params": p},
                inputs,
                memory,
                targets=targets,
                deterministic=deterministic,
                rngs=rngs,
            )
            total = total + nll.sum()
        return total, memory

    (value, memory), grads = jax.value_and_grad(loss, has_aux=True)(params, memory)
    return value, grads, memory


def _segments(cfg, n, seed=0):
    """n (inputs, targets) pairs [B, T] of one token stream."""
    data = np.random.default_rng(seed).integers(0, cfg.vocab_size, (B, T * n + 1))
    return tuple((data[:, s : s + T], data[:, s + 1 : s + T + 1]) for s in range(0, T * n, T))


def _partial_memory(cfg, seed=0):
    """6 slots holding random states, 2 of them valid in row 0 and 5 in row 1."""
    rng = np.random.default_rng(seed)
    hidden = tuple(
        jnp.asarray(rng.normal(size=(B, 6, cfg.d_model)), cfg.dtype) for _ in range(cfg.n_layers)
    )
    return Memory(hidden=hidden, valid=jnp.array([2, 5], jnp.int32))


# Recomputation repeats the same operations on the same values (dropout masks drawn from the
# same keys); XLA may fuse and order float additions differently, so float32 agrees to
# rounding and float64 to 1e-12.
TOLERANCE = {jnp.float32: dict(rtol=1e-5, atol=1e-6), jnp.float64: dict(rtol=1e-12, atol=1e-14)}


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides,dropout,dtype",
    [
        # Another dropout or dropatt mask in the recomputation would move the loss by far more
        # than float32 rounding.
        (dict(dropout=0.3, dropatt=0.3, untie_r=True), True, jnp.float32),
        (dict(norm_first=True, same_length=True), False, jnp.float64),
    ],
)
def test_every_remat_mode_gives_the_same_loss_gradients_and_memory(overrides, dropout, dtype):
    with jax.enable_x64(dtype == jnp.float64):
        base = TransformerXLConfig.tiny(mem_len=6, tgt_len=T, dtype=dtype, **overrides)
        params = _init(base)
        segments = _segments(base, 1)
        memory = _partial_memory(base)
        rng = jax.random.key(7) if dropout else None
        want = _loss_and_grads(base.replace(remat="none"), params, segments, memory, rng)
        assert want[0].dtype == dtype and np.isfinite(want[0]) and want[0] > 0
        # Every parameter gets a gradient (nothing is cut off by the scan or the view).
        assert all(float(jnp.abs(g).max()) > 0 for g in jax.tree.leaves(want[1]))
        for mode in MODES[1:]:
            got = _loss_and_grads(base.replace(remat=mode), params, segments, memory, rng)
            chex.assert_trees_all_close(got, want, **TOLERANCE[dtype])
        if dropout:
            # Dropout is on: another key changes the loss.
            other = _loss_and_grads(base, params, segments, memory, jax.random.key(8))[0]
            assert abs(float(other - want[0])) > 1e-3


@pytest.mark.parametrize("overrides", [dict(), dict(untie_r=True, norm_first=True)])
def test_gradients_match_pytorch_autograd_float64(overrides):
    """The backward pass of the scanned, rematerialised layers (the default mode; the others
    equal it, above) against an independent one: PyTorch autograd through the reference
    model, the same weights, two segments with memory."""
    torch = pytest.importorskip("torch")

    with jax.enable_x64(True):
        cfg = TransformerXLConfig.tiny(
            n_heads=2, d_head=8, mem_len=6, tgt_len=T, dtype=jnp.float64, **overrides
        )
        assert cfg.remat != "none"
        model = torch_xl_model(cfg).double()
        segments = _segments(cfg, 2, seed=3)
        mems, total = None, 0.0
        for inputs, targets in segments:
            nll, mems = model(torch.tensor(inputs.T), torch.tensor(targets.T), mems)  # [T, B]
            total = total + nll.sum()
        total.backward()
        # The loader's renaming and reshaping is linear, so it maps gradients as it maps
        # weights (a tied table's gradient is one tensor in both frameworks).
        want = load_pytorch_state_dict({name: p.grad for name, p in model.named_parameters()}, cfg)
        params = load_pytorch_state_dict(model.state_dict(), cfg)
        value, grads, _ = _loss_and_grads(cfg, params, segments, init_memory(cfg, B))
        np.testing.assert_allclose(float(value), total.item(), rtol=1e-10)
        chex.assert_trees_all_close(grads, want, rtol=1e-8, atol=1e-10)


def test_parameters_keep_their_per_layer_names_and_shapes():
    cfg = TransformerXLConfig.tiny(n_layers=3, untie_r=True)
    params = _init(cfg)
    assert {"layer_0", "layer_1", "layer_2"} <= set(params) and "layers" not in params
    H, K, D = cfg.n_heads, cfg.d_head, cfg.d_model
    for i in range(3):
        attn = params[f"layer_{i}"]["attn"]
        chex.assert_shape([attn["qkv"]["kernel"], attn["r_w_bias"]], [(D, 3, H, K), (H, K)])
    # Each layer is initialised with its own key, not a copy of the first one.
    assert not np.allclose(
        params["layer_0"]["attn"]["qkv"]["kernel"], params["layer_1"]["attn"]["qkv"]["kernel"]
    )
