"""Load a state dict of the official PyTorch `MemTransformerLM` (attn_type 0) into xl_jax.

    params = load_pytorch_state_dict(torch_model.state_dict(), config)
    out, memory = TransformerXL(config).apply({'params': params}, tokens, memory)

Values may be NumPy arrays or CPU torch tensors. A `transformer.` prefix (the Hugging Face
port's `TransfoXLLMHeadModel`) is stripped. Torch `Linear` weights are [out, in]; Flax kernels
are [in, out], so every kernel is transposed, then split into heads.

Name mapping (l = layer, c = table/cluster; D d_model, H heads, K d_head, E_c table width)::

  | PyTorch (official)                          | xl_jax params                        | transform
  |---------------------------------------------|--------------------------------------|-------------
  | word_emb.emb_layers.{c}.weight [V_c, E_c]   | word_emb/emb_{c}                     | -
  | word_emb.emb_projs.{c} [D, E_c]             | word_emb/proj_{c} [E_c, D]           | .T
  | r_w_bias, r_r_bias [H, K] (u, v)            | r_w_bias, r_r_bias                   | -
  | layers.{l}.dec_attn.r_w_bias (untie_r)      | layer_{l}/attn/r_w_bias (also r_r_)  | -
  | layers.{l}.dec_attn.qkv_net.weight [3HK, D] | layer_{l}/attn/qkv/kernel [D,3,H,K]  | .T, reshape
  | layers.{l}.dec_attn.r_net.weight [HK, D]    | layer_{l}/attn/r_net/kernel [D,H,K]  | .T, reshape
  | layers.{l}.dec_attn.o_net.weight [D, HK]    | layer_{l}/attn/o_net/kernel [H,K,D]  | .T, reshape
  | layers.{l}.dec_attn.layer_norm.weight/bias  | layer_{l}/attn/layer_norm/scale/bias | -
  | layers.{l}.pos_ff.CoreNet.0.weight/bias     | layer_{l}/ff/dense_in/kernel/bias    | kernel .T
  | layers.{l}.pos_ff.CoreNet.3.weight/bias     | layer_{l}/ff/dense_out/kernel/bias   | kernel .T
  | layers.{l}.pos_ff.layer_norm.weight/bias    | layer_{l}/ff/layer_norm/scale/bias   | -
  | crit.out_layers.{c}.weight (not tied)       | crit/out_{c}                         | -
  | crit.out_layers.{c}.bias                    | crit/bias_{c}                        | -
  | crit.out_projs.{c} [D, E_c] (not tied)      | crit/proj_{c} [E_c, D]               | .T
  | crit.cluster_weight, crit.cluster_bias      | crit/cluster_weight, cluster_bias    | -

Ignored: `pos_emb.inv_freq` (recomputed), and the tied duplicates the state dict repeats
(`crit.out_layers.{c}.weight` with `tie_weights`, `crit.out_projs.{c}` where `tie_projs[c]`).
With `untie_r`, a shared `r_w_bias` of shape [L, H, K] (TensorFlow-converted checkpoints) is
also accepted and split per layer. Anything else left over, missing, or of the wrong shape is
an error: the config must describe the checkpoint.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from xl_jax.config import TransformerXLConfig
from xl_jax.memory import init_memory

_IGNORED = re.compile(r"pos_emb\.inv_freq")


def _to_numpy(value) -> np.ndarray:
    if hasattr(value, "detach"):  # a torch tensor, without importing torch
        value = value.detach().cpu().numpy()
    return np.asarray(value)


def _expected_shapes(config: TransformerXLConfig) -> dict:
    from xl_jax.model import TransformerXL  # model imports nothing from here; avoid a cycle

    tokens = jax.ShapeDtypeStruct((1, 1), jnp.int32)
    variables = jax.eval_shape(
        TransformerXL(config).init, jax.random.key(0), tokens, init_memory(config, 1, mem_len=1)
    )
    return jax.tree.map(lambda x: x.shape, variables["params"])


def load_pytorch_state_dict(state_dict: Mapping[str, Any], config: TransformerXLConfig) -> dict:
    """Official `MemTransformerLM.state_dict()` -> the `'params'` collection of
    `TransformerXL(config)` (arrays in `config.param_dtype`).

    Raises:
      KeyError: a parameter the config needs is missing.
      ValueError: an unused entry is left over, or a shape does not match the config.
    """
    sd = {k.removeprefix("transformer."): _to_numpy(v) for k, v in state_dict.items()}
    used: set[str] = set()
    cfg = config
    H, K = cfg.n_heads, cfg.d_head

    def take(name: str) -> np.ndarray:
        if name not in sd:
            raise KeyError(f"state dict has no {name!r} (needed by the config)")
        used.add(name)
        return sd[name]

    def ln(prefix: str) -> dict:
        return {"scale": take(prefix + ".weight"), "bias": take(prefix + ".bias")}

    def dense(prefix: str) -> dict:
        return {"kernel": take(prefix + ".weight").T, "bias": take(prefix + ".bias")}

    expected = _expected_shapes(cfg)
    params: dict = {"word_emb": {}, "crit": {}}
    for name in expected["word_emb"]:  # emb_{c}, proj_{c}
        kind, c = name.split("_")
        if kind == "emb":
            params["word_emb"][name] = take(f"word_emb.emb_layers.{c}.weight")
        else:
            params["word_emb"][name] = take(f"word_emb.emb_projs.{c}").T

    split_r = cfg.untie_r and "r_w_bias" in sd and sd["r_w_bias"].ndim == 3
    if not cfg.untie_r:
        params["r_w_bias"], params["r_r_bias"] = take("r_w_bias"), take("r_r_bias")
    for i in range(cfg.n_layers):
        p = f"layers.{i}."
        attn = {
            "qkv": {"kernel": take(p + "dec_attn.qkv_net.weight").T.reshape(-1, 3, H, K)},
            "r_net": {"kernel": take(p + "dec_attn.r_net.weight").T.reshape(-1, H, K)},
            "o_net": {"kernel": take(p + "dec_attn.o_net.weight").T.reshape(H, K, -1)},
            "layer_norm": ln(p + "dec_attn.layer_norm"),
        }
        if cfg.untie_r:
            for b in ("r_w_bias", "r_r_bias"):
                attn[b] = take(b)[i] if split_r else take(p + "dec_attn." + b)
        ff = {
            "dense_in": dense(p + "pos_ff.CoreNet.0"),
            "dense_out": dense(p + "pos_ff.CoreNet.3"),
            "layer_norm": ln(p + "pos_ff.layer_norm"),
        }
        params[f"layer_{i}"] = {"attn": attn, "ff": ff}

    for name in expected["crit"]:
        kind, _, c = name.rpartition("_")
        if name.startswith("cluster_"):
            params["crit"][name] = take("crit." + name)
        elif kind == "out":
            params["crit"][name] = take(f"crit.out_layers.{c}.weight")
        elif kind == "bias":
            params["crit"][name] = take(f"crit.out_layers.{c}.bias")
        else:
            params["crit"][name] = take(f"crit.out_projs.{c}").T

    # The state dict repeats tied tensors under the softmax's names; they are not needed.
    n_tables = sum(k.startswith("emb_") for k in expected["word_emb"])
    tied = {f"crit.out_layers.{c}.weight" for c in range(n_tables) if cfg.tie_weights}
    tied |= {f"crit.out_projs.{c}" for c, t in enumerate(cfg.tie_projs) if t}
    left = sorted(k for k in sd if k not in used and k not in tied and not _IGNORED.fullmatch(k))
    if left:
        raise ValueError(f"state dict entries the config does not use: {left}")

    got = jax.tree.map(lambda x: x.shape, params)
    if got != expected:
        bad = [
            f"{jax.tree_util.keystr(path)}: {a} vs {b}"
            for (path, a), b in zip(
                jax.tree_util.tree_leaves_with_path(got, is_leaf=lambda x: isinstance(x, tuple)),
                jax.tree_util.tree_leaves(expected, is_leaf=lambda x: isinstance(x, tuple)),
            )
            if a != b
        ]
        raise ValueError(f"state dict shapes do not match the config: {bad or 'structure'}")
    return jax.tree.map(lambda x: jnp.asarray(x, cfg.param_dtype), params)
