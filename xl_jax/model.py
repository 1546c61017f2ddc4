"""Transformer-XL language model (Dai et al. 2019) with memory carried as explicit state.

Shapes (transformer_jax/shapes.py): B batch, T segment length, M memory length, S = M + T key
length, H heads, K head width, D model width, V vocabulary, L layers.

Usage::

    out, memory = TransformerXL(config).apply({'params': params}, tokens, memory,
                                              targets=None, deterministic=True)

Faithful to the official PyTorch `MemTransformerLM` with attn_type 0 (which is time-major;
here everything is batch-major):

  * word embedding (adaptive when `cutoffs`), scaled by sqrt(D), dropout;
  * R = sinusoids of the distances S-1 ... 0 (clamped at `clamp_len` if > 0), dropout;
  * L layers of relative attention + position-wise feed-forward, post-LN or pre-LN (no final
    LayerNorm in either, as the reference), each layer attending over concat(memory, input);
    the layers run in a scan, rematerialised per `config.remat` (see `_run_layers`);
  * dropout on the last hidden state, then the (projected adaptive) log-softmax.

The new memory keeps, for each layer, the last M positions of its input.
"""

from __future__ import annotations

import re

import flax.linen as nn
import jax
import jax.numpy as jnp

from transformer_jax import fused_norm
from transformer_jax.layers import Branches, Dense, LayerNorm, residual_branch, unbranched
from transformer_jax.shapes import check_token_ids
from xl_jax.adaptive import AdaptiveEmbedding, ProjectedAdaptiveLogSoftmax
from xl_jax.attention import RelativeMultiHeadAttention, relative_positions, sinusoid_embedding
from xl_jax.config import TransformerXLConfig
from xl_jax.memory import Memory, attention_mask, init_memory, update_memory

Array = jax.Array


class PositionwiseFF(nn.Module):
    """relu(x W1 + b1) W2 + b2 with dropout after the relu and after W2; residual and LN.

    Parameters: `dense_in` (reference `CoreNet.0`), `dense_out` (`CoreNet.3`), `layer_norm`.
    """

    config: TransformerXLConfig

    @nn.compact
    def __call__(self, x: Array | Branches, *, deterministic: bool = True) -> Array:  # [B, T, D]
        """x [B, T, D] (or the attention's `Branches`: the sublayer's input and the residual's
        as two arrays) -> [B, T, D]."""
        cfg = self.config
        x, residual = unbranched(x), residual_branch(x)
        # nn.Dense's own product, not transformer_jax.layers.dense_product: a custom VJP hides
        # its dot from the remat policy (`dots_with_no_batch_dims_saveable`), and remat
        # 'attention' would then recompute the FFN in the backward pass (+11.5% FLOPs on
        # enwik8_base's step).
        dense = dict(
            dtype=cfg.dtype, param_dtype=cfg.param_dtype, kernel_init=nn.initializers.normal(0.02)
        )
        layer_norm = LayerNorm(
            epsilon=cfg.layer_norm_eps,
            dtype=cfg.dtype,
            param_dtype=cfg.param_dtype,
            name="layer_norm",
        )
        y = layer_norm(x) if cfg.norm_first else x
        y = nn.relu(nn.Dense(cfg.d_inner, name="dense_in", **dense)(y))
        y = nn.Dropout(cfg.dropout)(y, deterministic=deterministic)
        dense_out = Dense(cfg.d_model, name="dense_out", **dense)
        if not cfg.norm_first and fused_norm.applies(x):
            y, bias = dense_out(y, defer_bias=True)  # the bias added in the fused kernel
            return layer_norm.after_residual(
                residual, y, y_bias=bias, rate=cfg.dropout, deterministic=deterministic
            )
        y = dense_out(y)
        y = nn.Dropout(cfg.dropout)(y, deterministic=deterministic)
        return x + y if cfg.norm_first else layer_norm(x + y)


class DecoderLayer(nn.Module):
    """Relative attention over concat(memory, h), then the feed-forward."""

    config: TransformerXLConfig

    @nn.compact
    def __call__(
        self,
        h,
        memory,
        pos_emb,
        mask,
        r_w_bias,
        r_r_bias,
        *,
        valid=None,
        deterministic: bool = True,
    ) -> Array:  # [B, T, D]
        h = RelativeMultiHeadAttention(self.config, name="attn")(
            h,
            memory,
            pos_emb,
            mask,
            r_w_bias,
            r_r_bias,
            valid=valid,
            deterministic=deterministic,
        )
        return PositionwiseFF(self.config, name="ff")(h, deterministic=deterministic)


# jax.checkpoint policy per `config.remat` mode. 'attention': matmuls without batch axes are
# the projections (qkv, r_net, o_net, feed-forward), so theirs are kept; the attention
# products contract per (batch, head) and are recomputed with every [B, H, T, S] tensor.
_REMAT_POLICIES = {
    "attention": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "full": jax.checkpoint_policies.nothing_saveable,
}
_LAYER = re.compile(r"layer_(\d+)")


def _stack_layers(variables: dict) -> dict:
    """Stored `layer_{l}` parameter trees -> the scan's view: one `layers` tree whose leaves
    have a leading [L] axis. Other parameters pass through."""
    params = dict(variables.get("params", {}))
    layer_index = {n: int(m.group(1)) for n in params if (m := _LAYER.fullmatch(n))}
    names = sorted(layer_index, key=layer_index.get)
    if names:
        layers = [params.pop(n) for n in names]
        params["layers"] = jax.tree.map(lambda *leaves: jnp.stack(leaves), *layers)
    return {**variables, "params": params}


def _unstack_layers(variables: dict) -> dict:
    """The inverse of `_stack_layers`: a [L, ...] `layers` tree -> `layer_0` ... `layer_{L-1}`."""
    params = dict(variables.get("params", {}))
    if "layers" in params:
        stacked = params.pop("layers")
        n_layers = jax.tree.leaves(stacked)[0].shape[0]
        for i in range(n_layers):
            params[f"layer_{i}"] = jax.tree.map(lambda leaf, i=i: leaf[i], stacked)
    return {**variables, "params": params}


def _run_layers(
    model: nn.Module,
    x: Array,  # [B, T, D] embedded segment
    hidden: tuple[Array, ...],  # L x [B, M, D] memory
    pos: Array,  # [S, D] R
    mask: Array,  # [B, 1, T, S]
    r_w_bias: Array | None,
    r_r_bias: Array | None,
    *,
    valid: Array,  # [B] the memory's valid count (the mask's, for the fused kernel)
    deterministic: bool,
) -> tuple[Array, tuple[Array, ...]]:
    """The L decoder layers of `model` (a bound TransformerXL) as one scan over layers.

    Returns (output [B, T, D], the L layer inputs [B, T, D] for the memory update).

    Why a scan: the backward pass then runs one layer at a time, so with remat only one
    layer's [B, H, T, S] attention tensors exist at once. Unrolled, jax.checkpoint alone does
    not do it: XLA (on CPU at least) drops the optimisation barriers and merges the
    recomputation back into the forward pass. A scan also compiles the layer once
    (except with remat 'none', unrolled: below).

    The scan holds its parameters stacked ([L, ...] leaves), which would rename them
    (`layers/...` instead of `layer_{l}/...`); `nn.map_variables` presents the stored
    per-layer trees to the scan stacked and stores what init creates per layer, so checkpoints
    and `load_pytorch_state_dict` keep the `layer_{l}` names (the price: one stacked copy of
    the layers' weights per call, and of their gradients). Dropout keys are split per layer by
    the scan, the same in every remat mode, so all modes compute the same numbers.
    """
    cfg = model.config

    def layer_step(layer: DecoderLayer, h, memory_l):
        out = layer(
            h,
            memory_l,
            pos,
            mask,
            r_w_bias,
            r_r_bias,
            valid=valid,
            deterministic=deterministic,
        )
        return out, h  # carry the output on; emit the input for the memory

    if cfg.remat != "none":
        # No CSE prevention needed inside a scan (flax and jax docs); it only costs speed.
        layer_step = nn.remat(layer_step, prevent_cse=False, policy=_REMAT_POLICIES[cfg.remat])

    def run(mdl, h, stacked_hidden):
        # 'none' unrolls the scan: with nothing to recompute, a loop only adds copies of each
        # layer's residuals into [L, ...] stacks, a slower step (benchmarks/README.md);
        # unrolled, it is the plain layer stack, the same numbers (same keys).
        unroll = cfg.n_layers if cfg.remat == "none" else 1
        scan = nn.scan(
            layer_step,
            variable_axes={"params": 0},
            split_rngs={"params": True, "dropout": True},
            length=cfg.n_layers,
            unroll=unroll,
        )
        return scan(DecoderLayer(cfg, name="layers", parent=mdl), h, stacked_hidden)

    run = nn.map_variables(
        run,
        "params",
        trans_in_fn=_stack_layers,
        trans_out_fn=_unstack_layers,
        init=model.is_initializing(),
    )
    out, inputs = run(model, x, jnp.stack(hidden))  # inputs: [L, B, T, D]
    return out, tuple(inputs)


class TransformerXL(nn.Module):
    """The Transformer-XL language model.

    Parameters: `word_emb` (AdaptiveEmbedding), `r_w_bias` / `r_r_bias` [H, K] (u / v; inside
    each layer's `attn` instead with `untie_r`), `layer_{l}` (DecoderLayer, l < L), `crit`
    (ProjectedAdaptiveLogSoftmax, which reuses the embedding tables with `tie_weights`).
    See `xl_jax.pytorch` for the mapping to the reference's names.
    """

    config: TransformerXLConfig

    @nn.compact
    def __call__(
        self,
        tokens: Array,  # [B, T] int
        memory: Memory | None = None,  # M slots per layer; None = empty config.mem_len
        targets: Array | None = None,  # [B, T] int, next tokens
        deterministic: bool = True,
    ) -> tuple[Array, Memory]:
        """Returns (out, new_memory).

        out: with `targets`, the per-token negative log-likelihood [B, T]; without, the
        log-probabilities [B, T, V] (float32, float64 under a float64 config), token order.
        """
        cfg = self.config
        check_token_ids(tokens, cfg.vocab_size, "tokens")
        if targets is not None:
            check_token_ids(targets, cfg.vocab_size, "targets")
        b, t = tokens.shape
        if memory is None:
            memory = init_memory(cfg, b)
        m = memory.length
        if len(memory.hidden) != cfg.n_layers:
            raise ValueError(f"memory has {len(memory.hidden)} layers, config has {cfg.n_layers}")
        rows = {x.shape[0] for x in (*memory.hidden, memory.valid)}
        if rows != {b}:
            raise ValueError(
                f"memory: {sorted(rows)} rows for tokens of batch {b}; make it with "
                f"init_memory(config, batch_size={b}), or carry the one this batch returned"
            )
        if cfg.same_length and m == 0:
            raise ValueError("same_length needs a memory with at least one slot")

        drop = nn.Dropout(cfg.dropout)
        word_emb = AdaptiveEmbedding(cfg, name="word_emb")
        x = drop(word_emb(tokens), deterministic=deterministic)  # [B, T, D]
        pos = sinusoid_embedding(
            relative_positions(cfg, q_len=t, mem_len=m),
            cfg.d_model,
            dtype=jnp.promote_types(cfg.dtype, jnp.float32),
        )
        # One dropout mask for R shared by the batch, as the reference's [S, 1, D] R.
        pos = drop(pos.astype(cfg.dtype), deterministic=deterministic)  # [S, D]
        mask = attention_mask(
            memory.valid, q_len=t, mem_len=m, same_length=cfg.same_length
        )  # [B, 1, T, S]

        r_w_bias = r_r_bias = None
        if not cfg.untie_r:
            init = nn.initializers.normal(0.02)
            r_w_bias = self.param("r_w_bias", init, (cfg.n_heads, cfg.d_head), cfg.param_dtype)
            r_r_bias = self.param("r_r_bias", init, (cfg.n_heads, cfg.d_head), cfg.param_dtype)

        x, layer_inputs = _run_layers(
            self,
            x,
            memory.hidden,
            pos,
            mask,
            r_w_bias,
            r_r_bias,
            valid=memory.valid,
            deterministic=deterministic,
        )
        x = drop(x, deterministic=deterministic)

        crit = ProjectedAdaptiveLogSoftmax(cfg, name="crit")
        tables, projs = word_emb.tied_parameters()
        out = crit(x, targets, tied_tables=tables, tied_projs=projs)
        return out, update_memory(memory, layer_inputs)
