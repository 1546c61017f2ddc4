"""Position encodings: the paper's sinusoids (two layouts) and a learned table.

Shapes: T positions, D model width.
"""

from __future__ import annotations

from typing import Literal

import flax.linen as nn
import jax
import jax.numpy as jnp

from transformer_jax.config import TransformerConfig

Array = jax.Array
Layout = Literal["interleaved", "concat"]


def sinusoids_at(positions: Array, d_model: int, *, layout: Layout = "interleaved") -> Array:
    """Sinusoidal encodings of arbitrary (possibly traced) integer positions.

    With i = 0 .. D/2 - 1 and angle(pos, i) = pos / 10000 ** (2i / D) (section 3.5)::

      "interleaved" (the paper): PE[pos, 2i] = sin(angle), PE[pos, 2i + 1] = cos(angle);
      "concat" (tensor2tensor's layout): PE[pos, i] = sin(angle), PE[pos, D/2 + i] = cos(angle).

    Both use the paper's frequencies, so one layout is a column permutation of the other
    (tensor2tensor itself spaces the frequencies as 10000 ** (i / (D/2 - 1)), slightly apart).

    Args:
      positions: [...] integer positions.
      d_model: D, even.
    Returns:
      [..., D] float32.
    """
    if d_model % 2:
        raise ValueError(f"d_model must be even for sinusoidal positions, got {d_model}")
    if layout not in ("interleaved", "concat"):
        raise ValueError(f"layout must be 'interleaved' or 'concat', got {layout!r}")
    inv_freq = 10000.0 ** (-jnp.arange(0, d_model, 2, dtype=jnp.float32) / d_model)  # [D/2]
    angle = positions.astype(jnp.float32)[..., None] * inv_freq  # [..., D/2]
    if layout == "concat":
        return jnp.concatenate([jnp.sin(angle), jnp.cos(angle)], axis=-1)
    return jnp.stack([jnp.sin(angle), jnp.cos(angle)], axis=-1).reshape(*angle.shape[:-1], d_model)


def sinusoidal_positions(length: int, d_model: int, *, layout: Layout = "interleaved") -> Array:
    """[T, D] float32 table of positions 0 .. T-1, for any T (see `sinusoids_at`)."""
    return sinusoids_at(jnp.arange(length), d_model, layout=layout)


class PositionalEncoding(nn.Module):
    """Position vectors for given positions, as `config.positional` says.

    Sinusoids are computed on the fly (any length, traced positions fine); "learned" is a
    parameter table of `config.max_len` rows.
    """

    config: TransformerConfig

    @nn.compact
    def __call__(self, positions: Array) -> Array:
        """[...] int positions -> [..., D] float32."""
        cfg = self.config
        if cfg.positional == "learned":
            # GPT/BERT's 0.02: token embeddings enter at about unit scale per coordinate
            # (normal(D**-0.5) times sqrt(D)), so positions start as a small signal.
            table = self.param(
                "table",
                nn.initializers.normal(stddev=0.02),
                (cfg.max_len, cfg.d_model),
                jnp.float32,
            )
            return jnp.take(table, positions, axis=0)
        layout = "concat" if cfg.positional == "sinusoidal_concat" else "interleaved"
        return sinusoids_at(positions, cfg.d_model, layout=layout)
