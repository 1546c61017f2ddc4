"""int8 inference: weights stored as int8 with one float32 scale per output channel.

    qparams = quantize_params(params)                     # a trained model's 'params'
    model = Transformer(config.replace(quantize="int8"))
    tokens = greedy_decode(model, qparams, src, max_len=64)

What is quantized: every Dense kernel [in, out] (attention projections, the FFN, an untied
output layer), with a scale per output column, and the token embedding tables [V, D], with a
scale per row (per token): the tied output projection multiplies by that table, so each
logit has its own scale. Biases, LayerNorms and positions stay float32.

How a product is computed (`int8_matmul`): the activations are quantized too, per row (per
token), to int8 with scale max|x| / 127, when the product runs; the int8 x int8 product
accumulates exactly in int32 and is scaled back to float32 by both scales. This is how
CTranslate2 computes its int8 models. Dequantizing the weights to float32 for a float product
would keep the activations exact, but on XLA:CPU it measured slower than the float32 model
itself, and the int8 product far faster (`benchmarks/decode_2026-11-26/`).

Shapes: N rows, I inputs, O outputs, V vocabulary, D model width.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array
__all__ = [
    "Int8Dense",
    "Int8Embed",
    "int8_matmul",
    "quantize_params",
    "quantize_rows",
]
_INT8_MAX = 127.0


def quantize_rows(x: Array, axis: int = -1) -> tuple[Array, Array]:
    """Symmetric int8 quantization with one scale per slice along `axis`.

    Args:
      x: float array.
      axis: the axis each scale covers (-1: one scale per row of the last axis).
    Returns:
      q int8 (x's shape) and scale float32 (x's shape without `axis`), x ~= q * scale. An
      all-zero slice gets scale 1 (q 0), never a division by zero.
    """
    x = jnp.asarray(x, jnp.float32)
    peak = jnp.max(jnp.abs(x), axis=axis, keepdims=True)
    scale = jnp.where(peak > 0, peak / _INT8_MAX, 1.0)
    q = jnp.clip(jnp.round(x / scale), -_INT8_MAX, _INT8_MAX).astype(jnp.int8)
    return q, jnp.squeeze(scale, axis)


def int8_matmul(x: Array, kernel: Array, scale: Array, *, transposed: bool = False) -> Array:
    """x [..., I] float times an int8 weight, in float32.

    Args:
      x: [..., I] activations (quantized here per row).
      kernel: int8 [I, O], or [O, I] with `transposed` (an embedding table used as the output
        projection: [V, D]).
      scale: [O] float32, the weight's scale per output channel.
    Returns:
      [..., O] float32 ~= x @ (kernel * scale).
    """
    xq, x_scale = quantize_rows(x)
    spec = "...i,oi->...o" if transposed else "...i,io->...o"
    acc = jnp.einsum(spec, xq, kernel, preferred_element_type=jnp.int32)
    return acc.astype(jnp.float32) * x_scale[..., None] * scale


class Int8Dense(nn.Module):
    """nn.Dense's computation with an int8 kernel [I, O] and its scale [O] (`quantize_params`
    writes both from a Dense's float kernel); the bias stays float32.

    Its parameters have no initializer worth training: build it from `quantize_params`.
    """

    features: int
    use_bias: bool = True

    @nn.compact
    def __call__(self, x: Array) -> Array:
        """x [..., I] -> [..., O] float32."""
        kernel = self.param("kernel", nn.initializers.zeros, (x.shape[-1], self.features), jnp.int8)
        scale = self.param("scale", nn.initializers.ones, (self.features,), jnp.float32)
        y = int8_matmul(x, kernel, scale)
        if self.use_bias:
            y = y + self.param("bias", nn.initializers.zeros, (self.features,), jnp.float32)
        return y


class Int8Embed(nn.Module):
    """A token table [V, D] stored int8 with a scale per token: `__call__` looks rows up,
    `attend` is the tied output projection (y table^T), as nn.Embed's two uses."""

    num_embeddings: int
    features: int

    def setup(self):
        shape = (self.num_embeddings, self.features)
        self.embedding = self.param("embedding", nn.initializers.zeros, shape, jnp.int8)
        self.scale = self.param("scale", nn.initializers.ones, (self.num_embeddings,), jnp.float32)

    def __call__(self, tokens: Array) -> Array:
        """tokens [...] int -> [..., D] float32."""
        return self.embedding[tokens].astype(jnp.float32) * self.scale[tokens][..., None]

    def attend(self, y: Array) -> Array:
        """y [..., D] -> logits [..., V] float32."""
        return int8_matmul(y, self.embedding, self.scale, transposed=True)


# The token tables a Transformer's params hold (model.py's tgt_embed / src_embed).
_TABLES = ("tgt_embed", "src_embed")


def quantize_params(params: Mapping[str, Any]) -> dict[str, Any]:
    """A Transformer's float 'params' -> the 'params' of `Transformer(config.replace(
    quantize="int8"))`: every Dense kernel [I, O] as int8 'kernel' and a float32 'scale' [O]
    beside it; each token table ('tgt_embed', 'src_embed') as int8 'embedding' [V, D] and
    'scale' [V]. Everything else is returned as it was (as float32 NumPy arrays here: the
    quantization is done once, on the host).

    Raises:
      ValueError: params that are already quantized (an int8 kernel).
    """

    def walk(tree: Mapping[str, Any], name: str) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in tree.items():
            if isinstance(value, Mapping):
                out[key] = walk(value, key)
            else:
                out[key] = value
        if "kernel" in out and np.ndim(out["kernel"]) == 2:
            if np.asarray(out["kernel"]).dtype == np.int8:
                raise ValueError(f"{name}: the kernel is int8 already (quantized params)")
            q, scale = quantize_rows(np.asarray(out["kernel"], np.float32), axis=0)
            out["kernel"], out["scale"] = np.asarray(q), np.asarray(scale)
        if name in _TABLES and "embedding" in out:
            if np.asarray(out["embedding"]).dtype == np.int8:
                raise ValueError(f"{name}: the table is int8 already (quantized params)")
            q, scale = quantize_rows(np.asarray(out["embedding"], np.float32), axis=1)
            out["embedding"], out["scale"] = np.asarray(q), np.asarray(scale)
        return out

    return walk(jax.device_get(params), "params")
