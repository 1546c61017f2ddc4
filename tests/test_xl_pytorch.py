"""load_pytorch_state_dict: the same weights give the reference's per-token NLL, segment after
segment, in float32 (1e-5 relative) and float64 (1e-9 relative)."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import torch_xl_model

from xl_jax import TransformerXL, TransformerXLConfig, init_memory, load_pytorch_state_dict

torch = pytest.importorskip("torch")

B, T, N_SEGMENTS = 2, 4, 4

VARIANTS = {
    "post_ln": dict(),
    "same_length": dict(same_length=True),
    "clamp_len": dict(clamp_len=3),
    "pre_ln_same_length_clamp": dict(norm_first=True, same_length=True, clamp_len=2),
    "adaptive_div2": dict(cutoffs=(10, 30), div_val=2, d_embed=32, tie_projs=(False, True, True)),
    "adaptive_div1_proj_untied": dict(
        cutoffs=(10, 30), d_embed=24, tie_weights=False, tie_projs=(True, False, True)
    ),
    "untie_r_pre_ln": dict(untie_r=True, norm_first=True),
}


def _config(overrides, dtype=jnp.float32):
    # mem_len 6 with T 4: the memory is partly filled in segment 2, then slides.
    return TransformerXLConfig.tiny(
        n_heads=2, d_head=8, mem_len=6, tgt_len=T, dtype=dtype, **overrides
    )


def _data(cfg, seed=0):
    return np.random.default_rng(seed).integers(0, cfg.vocab_size, (B, T * N_SEGMENTS + 1))


def _torch_nll(model, data):
    mems, out = None, []
    with torch.no_grad():
        for s in range(0, T * N_SEGMENTS, T):
            inp = torch.as_tensor(data[:, s : s + T].T)  # time-major [T, B]
            tgt = torch.as_tensor(data[:, s + 1 : s + T + 1].T)
            nll, mems = model(inp, tgt, mems)
            out.append(nll.numpy().T)
    return np.concatenate(out, axis=1)  # [B, T * N]


def _jax_nll(cfg, params, data):
    step = jax.jit(lambda p, x, m, y: TransformerXL(cfg).apply({"params": p}, x, m, targets=y))
    mem, out = init_memory(cfg, B), []
    for s in range(0, T * N_SEGMENTS, T):
        nll, mem = step(
            params, jnp.asarray(data[:, s : s + T]), mem, jnp.asarray(data[:, s + 1 : s + T + 1])
        )
        out.append(np.asarray(nll))
    return np.concatenate(out, axis=1)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_nll_matches_reference_float32(variant):
    cfg = _config(VARIANTS[variant])
    model = torch_xl_model(cfg)
    data = _data(cfg)
    params = load_pytorch_state_dict(model.state_dict(), cfg)
    want = _torch_nll(model, data)
    got = _jax_nll(cfg, params, data)
    # Finite and varying from token to token: the comparison is not between constants.
    assert np.isfinite(want).all() and want.std() > 0.1
    chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "variant", ["post_ln", "pre_ln_same_length_clamp", "adaptive_div2", "untie_r_pre_ln"]
)
def test_nll_matches_reference_float64(variant):
    with jax.enable_x64(True):
        cfg = _config(VARIANTS[variant], dtype=jnp.float64)
        model = torch_xl_model(cfg).double()
        data = _data(cfg, seed=1)
        params = load_pytorch_state_dict(model.state_dict(), cfg)
        assert jax.tree.leaves(params)[0].dtype == jnp.float64
        want = _torch_nll(model, data)
        got = _jax_nll(cfg, params, data)
        assert got.dtype == np.float64
        chex.assert_trees_all_close(got, want, rtol=1e-9, atol=1e-12)


def test_eval_with_other_memory_length_matches_reference_reset_length():
    # The reference's reset_length: the same weights, evaluated with mem_len 9 instead of 6.
    cfg = _config({})
    model = torch_xl_model(cfg)
    model.mem_len = 9
    data = _data(cfg, seed=2)
    want = _torch_nll(model, data)
    params = load_pytorch_state_dict(model.state_dict(), cfg)
    got = _jax_nll(cfg.replace(mem_len=9), params, data)
    chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-6)


def test_loader_accepts_official_extras_and_prefix():
    cfg = _config({})
    sd = {k: v.numpy() for k, v in torch_xl_model(cfg).state_dict().items()}
    sd["pos_emb.inv_freq"] = np.zeros(cfg.d_model // 2)  # the official buffer
    plain = load_pytorch_state_dict(sd, cfg)
    prefixed = load_pytorch_state_dict({"transformer." + k: v for k, v in sd.items()}, cfg)
    chex.assert_trees_all_close(plain, prefixed)


def test_loader_rejects_mismatches():
    cfg = _config({})
    sd = dict(torch_xl_model(cfg).state_dict())
    with pytest.raises(KeyError, match="r_net"):
        load_pytorch_state_dict({k: v for k, v in sd.items() if "1.dec_attn.r_net" not in k}, cfg)
    with pytest.raises(ValueError, match="does not use"):
        load_pytorch_state_dict({**sd, "layers.7.pos_ff.CoreNet.0.bias": sd["r_w_bias"]}, cfg)
    with pytest.raises(ValueError, match="shapes"):
        load_pytorch_state_dict(sd, cfg.replace(d_inner=48))


def test_untie_r_accepts_stacked_biases():
    # TensorFlow-converted checkpoints keep u and v as one [L, H, K] tensor each.
    cfg = _config(VARIANTS["untie_r_pre_ln"])
    sd = {k: v.numpy() for k, v in torch_xl_model(cfg).state_dict().items()}
    per_layer = load_pytorch_state_dict(sd, cfg)
    stacked = {k: v for k, v in sd.items() if not k.endswith(("r_w_bias", "r_r_bias"))}
    for b in ("r_w_bias", "r_r_bias"):
        stacked[b] = np.stack([sd[f"layers.{i}.dec_attn.{b}"] for i in range(cfg.n_layers)])
    chex.assert_trees_all_close(load_pytorch_state_dict(stacked, cfg), per_layer)
