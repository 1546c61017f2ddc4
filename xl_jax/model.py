"""Transformer-XL language model (Dai et al. 2019) with memory carried as explicit state.

Shape glossary: B batch, T segment length, M memory length, S = M + T key length, H heads,
K head width, D model width, V vocabulary, L layers.

    out, memory = TransformerXL(config).apply({'params': params}, tokens, memory,
                                              targets=None, deterministic=True)

Faithful to the official PyTorch `MemTransformerLM` with attn_type 0 (which is time-major;
here everything is batch-major):
  * word embedding (adaptive when `cutoffs`), scaled by sqrt(D), dropout;
  * R = sinusoids of the distances S-1 ... 0 (clamped at `clamp_len` if > 0), dropout;
  * L layers of relative attention + position-wise feed-forward, post-LN or pre-LN (no final
    LayerNorm in either, as the reference), each layer attending over concat(memory, input);
  * dropout on the last hidden state, then the (projected adaptive) log-softmax.
The new memory keeps, for each layer, the last M positions of its input.
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from xl_jax.adaptive import AdaptiveEmbedding, ProjectedAdaptiveLogSoftmax
from xl_jax.attention import (RelativeMultiHeadAttention, relative_positions,
                              sinusoid_embedding)
from xl_jax.config import TransformerXLConfig
from xl_jax.memory import Memory, attention_mask, init_memory, update_memory

Array = jax.Array


class PositionwiseFF(nn.Module):
    """relu(x W1 + b1) W2 + b2 with dropout after the relu and after W2; residual and LN.

    Parameters: `dense_in` (reference `CoreNet.0`), `dense_out` (`CoreNet.3`), `layer_norm`.
    """

    config: TransformerXLConfig

    @nn.compact
    def __call__(self, x: Array, *, deterministic: bool = True) -> Array:   # [B, T, D]
        cfg = self.config
        dense = dict(dtype=cfg.dtype, param_dtype=cfg.param_dtype,
                     kernel_init=nn.initializers.normal(0.02))
        layer_norm = nn.LayerNorm(epsilon=cfg.layer_norm_eps, dtype=cfg.dtype,
                                  param_dtype=cfg.param_dtype, name="layer_norm")
        y = layer_norm(x) if cfg.norm_first else x
        y = nn.relu(nn.Dense(cfg.d_inner, name="dense_in", **dense)(y))
        y = nn.Dropout(cfg.dropout)(y, deterministic=deterministic)
        y = nn.Dense(cfg.d_model, name="dense_out", **dense)(y)
        y = nn.Dropout(cfg.dropout)(y, deterministic=deterministic)
        return x + y if cfg.norm_first else layer_norm(x + y)


class DecoderLayer(nn.Module):
    """Relative attention over concat(memory, h), then the feed-forward."""

    config: TransformerXLConfig

    @nn.compact
    def __call__(self, h, memory, pos_emb, mask, r_w_bias, r_r_bias, *,
                 deterministic: bool = True) -> Array:     # [B, T, D]
        h = RelativeMultiHeadAttention(self.config, name="attn")(
            h, memory, pos_emb, mask, r_w_bias, r_r_bias, deterministic=deterministic)
        return PositionwiseFF(self.config, name="ff")(h, deterministic=deterministic)


class TransformerXL(nn.Module):
    """The Transformer-XL language model.

    Parameters: `word_emb` (AdaptiveEmbedding), `r_w_bias` / `r_r_bias` [H, K] (u / v; inside
    each layer's `attn` instead with `untie_r`), `layer_{l}` (DecoderLayer), `crit`
    (ProjectedAdaptiveLogSoftmax, which reuses the embedding tables with `tie_weights`).
    See `xl_jax.pytorch` for the mapping to the reference's names.
    """

    config: TransformerXLConfig

    @nn.compact
    def __call__(
        self,
        tokens: Array,                    # [B, T] int
        memory: Memory | None = None,     # M slots per layer; None = empty config.mem_len
        targets: Array | None = None,     # [B, T] int, next tokens
        deterministic: bool = True,
    ) -> tuple[Array, Memory]:
        """Returns (out, new_memory).

        out: with `targets`, the per-token negative log-likelihood [B, T]; without, the
        log-probabilities [B, T, V] (float32, float64 under a float64 config), token order.
        """
        cfg = self.config
        b, t = tokens.shape
        if memory is None:
            memory = init_memory(cfg, b)
        m = memory.length
        if len(memory.hidden) != cfg.n_layers:
            raise ValueError(f"memory has {len(memory.hidden)} layers, config has "
                             f"{cfg.n_layers}")
        if cfg.same_length and m == 0:
            raise ValueError("same_length needs a memory with at least one slot")

        drop = nn.Dropout(cfg.dropout)
        word_emb = AdaptiveEmbedding(cfg, name="word_emb")
        x = drop(word_emb(tokens), deterministic=deterministic)               # [B, T, D]
        pos = sinusoid_embedding(relative_positions(cfg, q_len=t, mem_len=m), cfg.d_model,
                                 dtype=jnp.promote_types(cfg.dtype, jnp.float32))
        # One dropout mask for R shared by the batch, as the reference's [S, 1, D] R.
        pos = drop(pos.astype(cfg.dtype), deterministic=deterministic)        # [S, D]
        mask = attention_mask(memory.valid, q_len=t, mem_len=m,
                              same_length=cfg.same_length)                    # [B, 1, T, S]

        r_w_bias = r_r_bias = None
        if not cfg.untie_r:
            init = nn.initializers.normal(0.02)
            r_w_bias = self.param("r_w_bias", init, (cfg.n_heads, cfg.d_head),
                                  cfg.param_dtype)
            r_r_bias = self.param("r_r_bias", init, (cfg.n_heads, cfg.d_head),
                                  cfg.param_dtype)

        layer_inputs = []
        for l in range(cfg.n_layers):
            layer_inputs.append(x)
            x = DecoderLayer(cfg, name=f"layer_{l}")(
                x, memory.hidden[l], pos, mask, r_w_bias, r_r_bias,
                deterministic=deterministic)
        x = drop(x, deterministic=deterministic)

        crit = ProjectedAdaptiveLogSoftmax(cfg, name="crit")
        tables, projs = word_emb.tied_parameters()
        out = crit(x, targets, tied_tables=tables, tied_projs=projs)
        return out, update_memory(memory, layer_inputs)
