"""The one shape alphabet of the project. Every docstring and shape comment, and the einsum
axes where they are named, use these letters with these meanings and no others.

  B  batch (rows)                     W  beams per sentence
  T  query / target length            S  key / source length (XL: S = M + T)
  M  memory slots (Transformer-XL)    C  decode-cache positions
  O  output positions of a search     R  rows fed to a decode step (B * W)
  P  prompt length                    G  tokens to generate
  N  tokens of a stream               L  layers
  H  heads                            K  head width (D / H)
  D  model width: the stream a model carries between layers (a recurrent model: its state)
  E  embedding width                  A  additive-attention width
  V  vocabulary                       k  convolution kernel size
"""

import jax
import jax.numpy as jnp
import numpy as np

GLOSSARY = __doc__


# The check every model makes of its token-id inputs, with the alphabet it speaks in.


def check_token_ids(ids, vocab_size: int, what: str) -> None:
    """`ids` must be [B, L] integer token ids in [0, vocab_size): a ValueError naming `what`
    otherwise. The rank and dtype are checked always (they are static); the values only when
    they are concrete, outside `jit`, where the check is one small transfer. Inside `jit` an
    id out of range gives NaN logits without a word: `jax.experimental.checkify` is the
    caller's tool there.
    """
    shape = getattr(ids, "shape", None)
    if shape is None or len(shape) != 2:
        raise ValueError(f"{what}: expected [B, L] token ids (batch first), got shape {shape}")
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise ValueError(f"{what}: expected integer token ids, got {ids.dtype}")
    if isinstance(ids, jax.core.Tracer) or 0 in shape:
        return
    values = np.asarray(ids)  # host values: no operation staged into a program being traced
    low, high = int(values.min()), int(values.max())
    if low < 0 or high >= vocab_size:
        raise ValueError(
            f"{what}: token ids must be in [0, {vocab_size}) (the vocabulary), got ids from "
            f"{low} to {high}"
        )
