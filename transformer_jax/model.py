"""The encoder-decoder Transformer of "Attention Is All You Need" (Vaswani et al., 2017).

Shapes (the project's alphabet, transformer_jax/shapes.py):
  B: batch     S: source length     T: target length     C: decode-cache positions
  H: heads     K: head width        D: model width       V: target vocabulary   L: layers

Follows the translation-model protocol (see `transformer_jax.decoding.decode`):
`__call__(src, tgt)`, `init_decode_cache(src, *, max_len)`, `decode_step(tokens, cache, *,
index)`, and the attention-map protocol every translation model answers:
`attention_maps(src, tgt) -> {kind: [B, layers, H, T, S]}`, kind in encoder_self /
decoder_self / cross.

Dtype policy: parameters float32; activations in `config.dtype`; attention logits/softmax
and the logits in float32; the tied output projection multiplies in `config.dtype` with
float32 accumulation (an untied one is float32). In a program compiled for a GPU or TPU in
half precision, the tied projection returns the logits in `config.dtype` (the loss still
computes in float32: `layers.output_logits`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from transformer_jax.attention import combine_masks, make_causal_mask, make_padding_mask
from transformer_jax.config import DECODE_QUANTIZATIONS, TransformerConfig
from transformer_jax.int8 import Int8Embed, quantize_params
from transformer_jax.layers import (
    Branches,
    DecoderLayer,
    EncoderLayer,
    dense,
    layer_norm,
    output_logits,
    unbranched,
)
from transformer_jax.positional import PositionalEncoding
from transformer_jax.shapes import check_token_ids

Array = jax.Array
DecodeCache = dict[str, Any]


class Encoder(nn.Module):
    """A stack of encoder layers (`EncoderLayer`, plus a final LayerNorm when pre-LN)."""

    config: TransformerConfig

    def setup(self):
        cfg = self.config
        # In setup a list of submodules is named layers_0, layers_1, ... (stable paths).
        self.layers = [EncoderLayer(cfg) for _ in range(cfg.n_encoder_layers)]
        self.final_norm = layer_norm(cfg) if cfg.norm_first else None

    def __call__(
        self, x: Array, *, mask: Array, deterministic: bool = True, return_weights: bool = False
    ):
        """x [B, S, D] embedded source, mask [B, 1, 1, S] -> [B, S, D] (and, if
        `return_weights`, every layer's self-attention weights [B, L, H, S, S])."""
        weights = []
        for layer in self.layers:
            x = layer(x, mask=mask, deterministic=deterministic, return_weights=return_weights)
            if return_weights:
                x, w = x
                weights.append(w)
        x = unbranched(x)
        x = self.final_norm(x) if self.final_norm is not None else x
        return (x, jnp.stack(weights, axis=1)) if return_weights else x


class Decoder(nn.Module):
    """A stack of decoder layers (`DecoderLayer`, plus a final LayerNorm when pre-LN), whole or
    step by step."""

    config: TransformerConfig

    def setup(self):
        cfg = self.config
        self.layers = [DecoderLayer(cfg) for _ in range(cfg.n_decoder_layers)]  # layers_i
        self.final_norm = layer_norm(cfg) if cfg.norm_first else None

    def _finish(self, y: Array | Branches) -> Array:
        y = unbranched(y)
        return self.final_norm(y) if self.final_norm is not None else y

    def __call__(
        self,
        y: Array,
        encoded: Array,
        *,
        self_mask: Array,
        src_mask: Array,
        deterministic: bool = True,
        return_weights: bool = False,
    ):
        """y [B, T, D] embedded target, encoded [B, S, D], self_mask [B, 1, T, T],
        src_mask [B, 1, 1, S] -> [B, T, D] (and, if `return_weights`, {'decoder_self':
        [B, L, H, T, T], 'cross': [B, L, H, T, S]} over the L layers)."""
        weights = []
        for layer in self.layers:
            y = layer(
                y,
                encoded,
                self_mask=self_mask,
                src_mask=src_mask,
                deterministic=deterministic,
                return_weights=return_weights,
            )
            if return_weights:
                y, w = y
                weights.append(w)
        if not return_weights:
            return self._finish(y)
        return self._finish(y), jax.tree_util.tree_map(lambda *w: jnp.stack(w, axis=1), *weights)

    def init_cache(self, encoded: Array, *, max_len: int) -> tuple[dict[str, Array], ...]:
        """One cache per layer (see `DecoderLayer.init_cache`)."""
        return tuple(layer.init_cache(encoded, max_len=max_len) for layer in self.layers)

    def grow_cache(
        self, cache: tuple[dict[str, Array], ...], *, max_len: int, slots: int = 1
    ) -> tuple[dict[str, Array], ...]:
        """Each layer's cache with room for `max_len` positions (`DecoderLayer.grow_cache`)."""
        return tuple(
            layer.grow_cache(layer_cache, max_len=max_len, slots=slots)
            for layer, layer_cache in zip(self.layers, cache)
        )

    def step(
        self,
        y: Array,
        cache: tuple[dict[str, Array], ...],
        *,
        index: Array,
        self_mask: Array,
        src_mask: Array,
        ancestry: Array | None = None,
    ) -> tuple[Array, tuple[dict[str, Array], ...]]:
        """y [R, 1, D] at position `index` -> [R, 1, D] and the updated per-layer caches
        (`ancestry`: a beam search's slot bookkeeping, see `DecoderLayer.step`)."""
        new_cache = []
        for layer, layer_cache in zip(self.layers, cache):
            y, layer_cache = layer.step(
                y,
                layer_cache,
                index=index,
                self_mask=self_mask,
                src_mask=src_mask,
                ancestry=ancestry,
            )
            new_cache.append(layer_cache)
        return self._finish(y), tuple(new_cache)


class Transformer(nn.Module):
    """Encoder-decoder Transformer.

    Usage::

      model = Transformer(TransformerConfig.tiny(src_vocab_size=V, tgt_vocab_size=V))
      params = model.init(rng, src, tgt)["params"]
      logits = model.apply({"params": params}, src, tgt)                   # [B, T, V]
      logits = model.apply({"params": params}, src, tgt, deterministic=False,
                           rngs={"dropout": key})                           # training

    Token embeddings are scaled by sqrt(D) (section 3.4; `scale_embeddings`) and summed with
    the positions, then dropped out. With `tie_output` the logits are y @ E^T with the target
    embedding E (plus a learned bias with `output_bias`).
    """

    config: TransformerConfig

    def setup(self):
        cfg = self.config
        d = cfg.d_model

        def embed(vocab_size):
            if cfg.quantize == "int8":
                return Int8Embed(vocab_size, d)
            # Normal(0, D**-0.5) as tensor2tensor: after the sqrt(D) scaling the embeddings
            # enter at unit scale. Kept in float32 because the tied output projection uses it.
            return nn.Embed(
                vocab_size,
                d,
                dtype=jnp.float32,
                param_dtype=jnp.float32,
                embedding_init=nn.initializers.normal(stddev=d**-0.5),
            )

        self.tgt_embed = embed(cfg.tgt_vocab_size)
        self.src_embed = self.tgt_embed if cfg.share_embeddings else embed(cfg.src_vocab_size)
        self.positions = PositionalEncoding(cfg)
        self.embed_dropout = nn.Dropout(cfg.dropout)
        self.encoder = Encoder(cfg)
        self.decoder = Decoder(cfg)
        if not cfg.tie_output:
            self.output = dense(cfg.tgt_vocab_size, dtype=jnp.float32, quantize=cfg.quantize)
        elif cfg.output_bias:
            self.output_bias = self.param(
                "output_bias", nn.initializers.zeros, (cfg.tgt_vocab_size,), jnp.float32
            )

    def _check_length(self, length: int, what: str) -> None:
        cfg = self.config
        if cfg.positional == "learned" and length > cfg.max_len:
            raise ValueError(
                f"{what} ({length}) exceeds config.max_len ({cfg.max_len}), the "
                "rows of the learned position table"
            )

    def _embed(
        self, table: nn.Embed, tokens: Array, positions: Array, *, deterministic: bool
    ) -> Array:
        """tokens [B, T], positions [T] -> [B, T, D] in config.dtype."""
        cfg = self.config
        x = table(tokens)
        if cfg.scale_embeddings:
            x = x * math.sqrt(cfg.d_model)
        x = x + self.positions(positions)
        return self.embed_dropout(x.astype(cfg.dtype), deterministic=deterministic)

    def _logits(self, y: Array) -> Array:
        """[..., D] -> [..., V] float32 (tied: multiplied in config.dtype, and returned in it
        on a GPU or TPU in half precision: `output_logits`)."""
        cfg = self.config
        if not cfg.tie_output:
            return self.output(y.astype(jnp.float32))
        if cfg.quantize:
            logits = self.tgt_embed.attend(y)
        else:
            logits = output_logits(y, self.tgt_embed.embedding, cfg.dtype)
        return logits + self.output_bias.astype(logits.dtype) if cfg.output_bias else logits

    def _target_keys(self, tgt: Array) -> Array:
        """tgt [B, T] -> [B, T] bool: which target positions the decoder may attend to.

        Pad is masked, unless decoding starts from pad (bos_id == pad_id, Marian): the start
        token must stay visible, and a pad elsewhere could not be told from it. Causal masking
        alone then suffices, since right-padding puts every pad after the real positions.
        """
        cfg = self.config
        if cfg.bos_id == cfg.pad_id:
            return jnp.ones(tgt.shape, bool)
        return tgt != cfg.pad_id

    def encode(self, src: Array, *, deterministic: bool = True, return_weights: bool = False):
        """src [B, S] int32 (pad_id padded) -> encoded [B, S, D] (and the encoder's
        self-attention weights [B, L, H, S, S] if `return_weights`)."""
        check_token_ids(src, self.config.src_vocab_size, "src")
        self._check_length(src.shape[1], "source length")
        x = self._embed(self.src_embed, src, jnp.arange(src.shape[1]), deterministic=deterministic)
        return self.encoder(
            x,
            mask=make_padding_mask(src, self.config.pad_id),
            deterministic=deterministic,
            return_weights=return_weights,
        )

    def decode(
        self,
        encoded: Array,
        src: Array,
        tgt: Array,
        *,
        deterministic: bool = True,
        return_weights: bool = False,
    ):
        """encoded [B, S, D], src [B, S] (for its padding), tgt [B, T] decoder input starting
        with BOS -> logits [B, T, V] float32; logits[:, t] predict the token after tgt[:, t].
        With `return_weights`, also {'decoder_self': [B, L, H, T, T], 'cross':
        [B, L, H, T, S]}."""
        cfg = self.config
        check_token_ids(tgt, cfg.tgt_vocab_size, "tgt")
        self._check_length(tgt.shape[1], "target length")
        y = self._embed(self.tgt_embed, tgt, jnp.arange(tgt.shape[1]), deterministic=deterministic)
        # The decoder's self-attention sees neither future positions nor pad.
        self_mask = combine_masks(
            make_causal_mask(tgt.shape[1]), self._target_keys(tgt)[:, None, None, :]
        )
        y = self.decoder(
            y,
            encoded,
            self_mask=self_mask,
            src_mask=make_padding_mask(src, cfg.pad_id),
            deterministic=deterministic,
            return_weights=return_weights,
        )
        if return_weights:
            y, weights = y
            return self._logits(y), weights
        return self._logits(y)

    def __call__(self, src: Array, tgt: Array, *, deterministic: bool = True) -> Array:
        """src [B, S], tgt [B, T] int32 -> logits [B, T, V] float32."""
        return self.decode(
            self.encode(src, deterministic=deterministic), src, tgt, deterministic=deterministic
        )

    def attention_maps(self, src: Array, tgt: Array) -> dict[str, Array]:
        """The attention-map protocol (deterministic, teacher-forced):
        {'encoder_self': [B, L, H, S, S], 'decoder_self': [B, L, H, T, T],
        'cross': [B, L, H, T, S]}, rows softmaxes (a pad query's row is 0)."""
        encoded, encoder_self = self.encode(src, return_weights=True)
        _, decoder = self.decode(encoded, src, tgt, return_weights=True)
        return {"encoder_self": encoder_self, **decoder}

    def init_decode_cache(self, src: Array, *, max_len: int) -> DecodeCache:
        """Encodes src [B, S] once -> the cache for `decode_step` (every leaf leads with B).

        Holds src_valid [B, S] bool, tgt_valid [B, C] bool (which target positions written so
        far may be attended to: not pad, see `_target_keys`) and, per decoder layer,
        self-attention keys/values [B, H, C, K] and cross-attention keys/values [B, H, S, K].
        """
        self._check_length(max_len, "max_len")
        encoded = self.encode(src)
        return {
            "src_valid": src != self.config.pad_id,
            "tgt_valid": jnp.zeros((src.shape[0], max_len), bool),
            "layers": self.decoder.init_cache(encoded, max_len=max_len),
        }

    def expand_decode_cache(self, cache: DecodeCache, *, beams: int) -> DecodeCache:
        """The cache of B sentences -> the cache of B * beams rows for a beam search (row
        b * beams + w: beam slot w of sentence b).

        The source side (src_valid, cross-attention keys/values) is the same for every beam
        of a sentence and stays at B rows: `decode_step` attends from all the beams of a
        sentence at once, reading its encoder keys/values once rather than once per beam.
        The self-attention keys/values become per slot, [B, H, C * beams, K], and are never
        reordered: 'ancestry' [B * beams, C] int32 records which slot of the
        sentence wrote each position of the hypothesis a slot holds
        (`transformer_jax.attention.beam_attention`), and `reorder_decode_cache` moves only
        it and tgt_valid.
        """

        def per_slot(x: Array) -> Array:  # [B, H, C, K] -> [B, H, C * W, K], position-major
            return jnp.repeat(x, beams, axis=2)

        layers = tuple(
            {
                **layer,
                "self_key": per_slot(layer["self_key"]),
                "self_value": per_slot(layer["self_value"]),
            }
            for layer in cache["layers"]
        )
        tgt_valid = jnp.repeat(cache["tgt_valid"], beams, axis=0)
        ancestry = jnp.zeros(tgt_valid.shape, jnp.int32)
        return {**cache, "tgt_valid": tgt_valid, "ancestry": ancestry, "layers": layers}

    def reorder_decode_cache(self, cache: DecodeCache, parent: Array) -> DecodeCache:
        """After a beam search's step: slot w of sentence b now holds the hypothesis of slot
        parent[b, w] ([B, W] int). Only the per-hypothesis bookkeeping moves (ancestry and
        tgt_valid, [B * W, C]); the keys and values stay in the slots that wrote them."""
        b, w = parent.shape

        def take(x: Array) -> Array:
            rows = x.reshape(b, w, -1)
            return jnp.take_along_axis(rows, parent[..., None], axis=1).reshape(x.shape)

        return {**cache, "tgt_valid": take(cache["tgt_valid"]), "ancestry": take(cache["ancestry"])}

    def grow_decode_cache(self, cache: DecodeCache, *, max_len: int) -> DecodeCache:
        """The cache of `init_decode_cache(src, max_len=C)` -> the same state with room for
        `max_len` >= C positions (the new ones empty): what `init_decode_cache(src,
        max_len=max_len)` and the same steps would hold. The searches start with a short cache
        and grow it (`transformer_jax.decoding.search.cache_stages`), so that a step attends
        to, and a beam reorders, about as many positions as are written, not the longest
        output's."""
        self._check_length(max_len, "max_len")
        grow = max_len - cache["tgt_valid"].shape[1]
        if grow < 0:
            raise ValueError(f"cannot shrink a decode cache to {max_len} positions")
        # A beam search's per-slot caches hold W entries a position (expand_decode_cache).
        beams = "ancestry" in cache
        slots = cache["tgt_valid"].shape[0] // cache["src_valid"].shape[0] if beams else 1
        grown = {
            **cache,
            "tgt_valid": jnp.pad(cache["tgt_valid"], ((0, 0), (0, grow))),
            "layers": self.decoder.grow_cache(cache["layers"], max_len=max_len, slots=slots),
        }
        if beams:
            grown["ancestry"] = jnp.pad(cache["ancestry"], ((0, 0), (0, grow)))
        return grown

    def decode_step(
        self, tokens: Array, cache: DecodeCache, *, index: Array
    ) -> tuple[Array, DecodeCache]:
        """tokens [B] int32 at target position `index` (int32 scalar, BOS at 0)
        -> next-token logits [B, V] float32 and the updated cache. Cost O(C), not O(C^2).

        After `expand_decode_cache`, tokens are [B * W] rows and the logits [B * W, V]."""
        max_len = cache["tgt_valid"].shape[1]
        tgt_valid = lax.dynamic_update_slice(
            cache["tgt_valid"], self._target_keys(tokens[:, None]), (0, index)
        )
        # Same keys as the full pass's causal & padding mask, restricted to row `index`.
        self_mask = (tgt_valid & (jnp.arange(max_len) <= index))[:, None, None, :]
        y = self._embed(
            self.tgt_embed, tokens[:, None], jnp.reshape(index, (1,)), deterministic=True
        )
        ancestry = cache.get("ancestry")
        if ancestry is not None:
            # This step's position is written by each slot into its own cache.
            rows, sentences = tokens.shape[0], cache["src_valid"].shape[0]
            slot = jnp.tile(jnp.arange(rows // sentences, dtype=jnp.int32), sentences)
            ancestry = lax.dynamic_update_slice(ancestry, slot[:, None], (0, index))
        y, layers = self.decoder.step(
            y,
            cache["layers"],
            index=index,
            self_mask=self_mask,
            src_mask=cache["src_valid"][:, None, None, :],
            ancestry=None
            if ancestry is None
            else ancestry.reshape(cache["src_valid"].shape[0], -1, max_len),
        )
        logits = self._logits(y[:, 0])
        new = {"src_valid": cache["src_valid"], "tgt_valid": tgt_valid, "layers": layers}
        if ancestry is not None:
            new["ancestry"] = ancestry
        return logits, new


def quantized(model: Any, params: Mapping[str, Any], scheme: str = "int8") -> tuple[Any, dict]:
    """A float Transformer and its params -> the int8 model and params that decode in its
    place (`greedy_decode`, `beam_search`).

    Raises:
      ValueError: an unknown scheme, or a model that is not a float Transformer (the seq2seq
        baselines have no int8 form).
    """
    if scheme not in DECODE_QUANTIZATIONS:
        raise ValueError(f"quantize: expected one of {DECODE_QUANTIZATIONS}, got {scheme!r}")
    if not isinstance(model, Transformer):
        raise ValueError(f"int8 decoding is for the Transformer, not {type(model).__name__}")
    if model.config.quantize:
        raise ValueError(f"the model is quantized already ({model.config.quantize})")
    config = model.config.replace(quantize=scheme, dtype="float32")
    return Transformer(config), quantize_params(params)
