"""ConvS2S: convolutional sequence to sequence learning (Gehring et al. 2017).

Encoder: token + learned position embeddings e -> linear to the hidden width -> layers of
  conv (kernel k, "same" padding) + GLU + residual, each sum scaled by sqrt(0.5) -> linear back to
  the embedding width z. Attention keys are z, values (z + e) * sqrt(0.5).
Decoder: the same, but causal (k - 1 positions of left padding) and every layer attends
  ("multi-step attention"): d = (W h + g) * sqrt(0.5) with g the target embedding, c = softmax(d
  z^T) (z + e), h <- (h + W' c) * sqrt(0.5), then the residual. The last layer goes to the
  embedding width and then to the vocabulary.

Paper -> code: e = `embedded` (encoder), g = `embedded` (decoder), z = `keys`,
z + e = `values`, d = `query`, c = `context`.

Not from the paper: no weight normalisation, flax's default initialisers, no sqrt(S) scaling of
the attention output and no encoder gradient scaling (bentrevett's tutorial omits them too).

Shapes (transformer_jax/shapes.py):
  B: batch   T: target length   S: source length   V: vocabulary
  E: embedding width   D: hidden (convolution) width   L: (decoder) layers   k: kernel size

Decode cache: for every decoder layer the last k - 1 inputs of its convolution (a sliding window,
zeros at the start exactly like the left padding of the full pass), plus the encoder keys, values
and mask. A step costs O(L k D^2 + S E), whatever the target length.

dtype: parameters float32, computation in `config.dtype`; attention scores and softmax float32
(in the attention core) and logits float32.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from transformer_jax.attention import dot_product_attention
from transformer_jax.baselines.seq2seq import BaselinePresets, validate_common

Array = jax.Array

# Gehring et al. scale every sum of two branches by sqrt(0.5) to keep the variance unchanged.
_SQRT_HALF = float(np.sqrt(0.5))
_DTYPES = (np.dtype(jnp.float32), np.dtype(jnp.bfloat16), np.dtype(jnp.float16))


@dataclasses.dataclass(frozen=True)
class ConvS2SConfig(BaselinePresets):
    """Sizes of ConvS2S; defaults are bentrevett's Multi30k tutorial sizes.

    Attributes:
      src_vocab_size: the source vocabulary size (V).
      tgt_vocab_size: the target vocabulary size (V).
      emb_dim: embedding width (E).
      hid_dim: convolution width (D).
      enc_layers: the encoder's conv blocks.
      dec_layers: the decoder's conv blocks.
      kernel_size: convolution width k; odd, so the encoder's "same" padding is symmetric.
      dropout: on the embeddings, on every conv input and before the output layer.
      max_positions: size of the learned position table: the longest source or target.
      pad_id: the padding id, shared by source and target.
      bos_id: the id decoding starts from.
      eos_id: the id that ends a sentence.
      dtype: computation dtype (parameters stay float32).
    """

    src_vocab_size: int
    tgt_vocab_size: int
    emb_dim: int = 256
    hid_dim: int = 512
    enc_layers: int = 10
    dec_layers: int = 10
    kernel_size: int = 3
    dropout: float = 0.25
    # bentrevett uses 100; subword tokenisation makes some Multi30k sentences longer.
    max_positions: int = 256
    pad_id: int = 0
    bos_id: int = 1
    eos_id: int = 2
    dtype: Any = jnp.float32

    _TINY: ClassVar[dict[str, Any]] = dict(
        emb_dim=16,
        hid_dim=32,
        enc_layers=2,
        dec_layers=2,
        kernel_size=3,
        dropout=0.0,
        max_positions=32,
    )

    def __post_init__(self):
        validate_common(
            self,
            (
                "src_vocab_size",
                "tgt_vocab_size",
                "emb_dim",
                "hid_dim",
                "enc_layers",
                "dec_layers",
                "kernel_size",
                "max_positions",
            ),
        )
        if self.kernel_size % 2 == 0:
            raise ValueError(
                f"kernel_size must be odd (symmetric encoder padding), got {self.kernel_size}"
            )
        if np.dtype(self.dtype) not in _DTYPES:
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")


def _check_length(config: ConvS2SConfig, name: str, length: int) -> None:
    if length > config.max_positions:
        raise ValueError(f"{name} length {length} exceeds max_positions={config.max_positions}")


class _Embedding(nn.Module):
    """Token + learned position embedding."""

    vocab_size: int
    config: ConvS2SConfig

    @nn.compact
    def __call__(self, tokens: Array, positions: Array) -> Array:
        """tokens [B, T], positions [B, T] or [1, T] -> [B, T, E]."""
        c = self.config
        tok = nn.Embed(self.vocab_size, c.emb_dim, dtype=c.dtype, name="tokens")(tokens)
        pos = nn.Embed(c.max_positions, c.emb_dim, dtype=c.dtype, name="positions")(positions)
        return tok + pos


def _glu_conv(config: ConvS2SConfig, name: str) -> nn.Conv:
    """Convolution to 2 D channels; `nn.glu` then halves them back to D."""
    return nn.Conv(
        2 * config.hid_dim,
        kernel_size=(config.kernel_size,),
        padding="VALID",
        dtype=config.dtype,
        name=name,
    )


class ConvS2SEncoder(nn.Module):
    config: ConvS2SConfig

    @nn.compact
    def __call__(self, src: Array, *, deterministic: bool = True) -> dict[str, Array]:
        """src [B, S] -> {'keys': z [B, S, E], 'values': (z + e) sqrt(.5) [B, S, E],
        'mask': [B, S] bool}."""
        c = self.config
        _check_length(c, "source", src.shape[1])
        mask = src != c.pad_id
        embedded = _Embedding(c.src_vocab_size, c, name="embed")(
            src, jnp.arange(src.shape[1])[None, :]
        )
        embedded = nn.Dropout(c.dropout)(embedded, deterministic=deterministic)
        x = nn.Dense(c.hid_dim, dtype=c.dtype, name="emb_to_hid")(embedded)  # [B, S, D]
        half = (c.kernel_size - 1) // 2
        for i in range(c.enc_layers):
            # Pad positions are zeroed before every convolution, so a real token next to them
            # sees exactly the zeros the "same" padding gives at the end of a full sentence.
            x = jnp.where(mask[..., None], x, 0.0)
            h = nn.Dropout(c.dropout)(x, deterministic=deterministic)
            h = jnp.pad(h, ((0, 0), (half, half), (0, 0)))
            h = nn.glu(_glu_conv(c, f"conv_{i}")(h), axis=-1)  # [B, S, D]
            x = (h + x) * _SQRT_HALF
        keys = nn.Dense(c.emb_dim, dtype=c.dtype, name="hid_to_emb")(x)  # z [B, S, E]
        return {"keys": keys, "values": (keys + embedded) * _SQRT_HALF, "mask": mask}


class ConvS2SDecoderLayer(nn.Module):
    """Causal conv + GLU + multi-step attention + residual, on a left-padded input."""

    config: ConvS2SConfig

    @nn.compact
    def __call__(
        self,
        padded: Array,
        embedded: Array,
        memory: dict[str, Array],
        *,
        deterministic: bool = True,
        return_weights: bool = False,
    ):
        """
        Args:
          padded: [B, T + k - 1, D]: the layer input x [B, T, D] preceded by k - 1 earlier
            inputs (zeros before the sentence start; the cached window when decoding).
          embedded: [B, T, E] target embeddings g.
          memory: the encoder's {'keys', 'values', 'mask'}.
        Returns:
          [B, T, D] (and the attention weights [B, 1, T, S] if asked).
        """
        c = self.config
        x = padded[:, c.kernel_size - 1 :]  # [B, T, D]
        # Dropout on the whole window keeps step-by-step decoding and the full pass identical
        # under deterministic=True (the only mode decoding uses).
        h = nn.Dropout(c.dropout)(padded, deterministic=deterministic)
        h = nn.glu(_glu_conv(c, "conv")(h), axis=-1)  # [B, T, D]
        query = (nn.Dense(c.emb_dim, dtype=c.dtype, name="attn_in")(h) + embedded) * _SQRT_HALF
        # Dot-product scores with no 1/sqrt(E) factor, as in the paper.
        context, weights = dot_product_attention(
            query[:, :, None, :],
            memory["keys"][:, :, None, :],
            memory["values"][:, :, None, :],
            mask=memory["mask"][:, None, None, :],
            scale=1.0,
            return_weights=True,
        )  # [B, T, 1, E]
        context = nn.Dense(c.hid_dim, dtype=c.dtype, name="attn_out")(context[:, :, 0])
        h = (h + context) * _SQRT_HALF
        out = (h + x) * _SQRT_HALF
        return (out, weights) if return_weights else out


class ConvS2SDecoder(nn.Module):
    """Target embedding -> causal conv layers with attention -> vocabulary logits.

    Works on T positions at once; `windows` holds the k - 1 inputs each layer saw before the
    first of them (zeros for a full pass from position 0; the cache when decoding).
    """

    config: ConvS2SConfig

    @nn.compact
    def __call__(
        self,
        tgt: Array,
        positions: Array,
        windows: tuple[Array, ...],
        memory: dict[str, Array],
        *,
        deterministic: bool = True,
    ):
        """
        Args:
          tgt: [B, T] target tokens.
          positions: [B, T] or [1, T] their positions.
          windows: per layer [B, k - 1, D].
          memory: the encoder's {'keys', 'values', 'mask'}.
        Returns:
          logits [B, T, V] float32, the new windows (per layer the last k - 1 inputs, [B, k - 1,
          D]), attention weights [B, L, T, S].
        """
        c = self.config
        embedded = _Embedding(c.tgt_vocab_size, c, name="embed")(tgt, positions)
        embedded = nn.Dropout(c.dropout)(embedded, deterministic=deterministic)
        x = nn.Dense(c.hid_dim, dtype=c.dtype, name="emb_to_hid")(embedded)  # [B, T, D]
        new_windows, all_weights = [], []
        for i in range(c.dec_layers):
            padded = jnp.concatenate([windows[i].astype(x.dtype), x], axis=1)  # [B, T+k-1, D]
            new_windows.append(padded[:, padded.shape[1] - (c.kernel_size - 1) :])
            x, weights = ConvS2SDecoderLayer(c, name=f"layer_{i}")(
                padded, embedded, memory, deterministic=deterministic, return_weights=True
            )
            all_weights.append(weights[:, 0])
        x = nn.Dense(c.emb_dim, dtype=c.dtype, name="hid_to_emb")(x)
        x = nn.Dropout(c.dropout)(x, deterministic=deterministic)
        logits = nn.Dense(c.tgt_vocab_size, dtype=c.dtype, name="out")(x).astype(jnp.float32)
        return logits, tuple(new_windows), jnp.stack(all_weights, axis=1)


class ConvS2S(nn.Module):
    """The ConvS2S translation model; implements the decode protocol of
    `transformer_jax.decoding.decode`."""

    config: ConvS2SConfig

    def setup(self):
        self.encoder = ConvS2SEncoder(self.config)
        self.decoder = ConvS2SDecoder(self.config)

    def _empty_windows(self, batch: int) -> tuple[Array, ...]:
        c = self.config
        return tuple(
            jnp.zeros((batch, c.kernel_size - 1, c.hid_dim), c.dtype) for _ in range(c.dec_layers)
        )

    def logits_and_attention(
        self, src: Array, tgt: Array, *, deterministic: bool = True
    ) -> tuple[Array, dict[str, Array]]:
        """`__call__`'s logits [B, T, V] and `attention_maps`' dict from one pass."""
        _check_length(self.config, "target", tgt.shape[1])
        memory = self.encoder(src, deterministic=deterministic)
        logits, _, weights = self.decoder(
            tgt,
            jnp.arange(tgt.shape[1])[None, :],
            self._empty_windows(tgt.shape[0]),
            memory,
            deterministic=deterministic,
        )
        return logits, {"weights": weights}

    def __call__(self, src: Array, tgt: Array, *, deterministic: bool = True) -> Array:
        """src [B, S], tgt [B, T] (decoder input, starts with BOS) -> logits [B, T, V] float32."""
        return self.logits_and_attention(src, tgt, deterministic=deterministic)[0]

    def attention_maps(self, src: Array, tgt: Array) -> dict[str, Array]:
        """The attention-map protocol: {'cross': [B, L, 1, T, S]}, each decoder layer's
        (single-head) attention; rows are softmaxes."""
        return {"cross": self.logits_and_attention(src, tgt)[1]["weights"][:, :, None]}

    def init_decode_cache(self, src: Array, *, max_len: int) -> dict[str, Any]:
        """Encodes src once; {'windows': per layer [B, k - 1, D] zeros, 'memory': encoder}."""
        _check_length(self.config, "max_len", max_len)
        return {"windows": self._empty_windows(src.shape[0]), "memory": self.encoder(src)}

    def decode_step(
        self, tokens: Array, cache: dict[str, Any], *, index: Array
    ) -> tuple[Array, dict[str, Any]]:
        """tokens [B] at target position `index` -> next-token logits [B, V] and the new cache."""
        positions = jnp.broadcast_to(jnp.asarray(index, jnp.int32), tokens.shape)[:, None]
        logits, windows, _ = self.decoder(
            tokens[:, None], positions, cache["windows"], cache["memory"]
        )
        return logits[:, 0], {"windows": windows, "memory": cache["memory"]}
