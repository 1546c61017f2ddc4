"""Counter-based dropout for kernels: the keep mask is a hash of (seed, stream, row, column).

A kernel that drops entries draws its mask from indices it already has, so a step's mask needs
no stored state, its backward pass draws the same mask again, and a resumed step draws the same
one. `xl_jax.fused_attention` hashes (seed, batch * H + head, query, key);
`transformer_jax.fused_norm` hashes (seed, 0, row, feature). Plain jnp: the same functions run
inside Pallas kernels (Triton or interpreted) and in the references the tests compare against.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


def fmix32(x: Array) -> Array:
    """MurmurHash3's 32-bit finaliser: every input bit moves every output bit."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x85EBCA6B)
    x = x ^ (x >> 13)
    x = x * jnp.uint32(0xC2B2AE35)
    return x ^ (x >> 16)


def dropout_keep(seed: Array, stream: Array, i: Array, j: Array, rate: float) -> Array:
    """The keep mask from a hash of (seed, stream, i, j).

    Args:
      seed: uint32 scalar (drawn from the step's dropout key by `dropout_seed`).
      stream: uint32 scalar or array (attention: b * H + h).
      i, j: uint32 positions (broadcast together).
      rate: the drop probability.
    Returns:
      bool, True = keep, with probability 1 - rate (to 2^-32), independent across entries.
    """
    x = fmix32(seed ^ (stream * jnp.uint32(0x9E3779B1)))
    x = fmix32(x ^ (i * jnp.uint32(0x85EBCA77)))
    x = fmix32(x ^ (j * jnp.uint32(0xC2B2AE3D)))
    threshold = jnp.uint32(min(int(rate * 2.0**32), 2**32 - 1))
    return x >= threshold


def dropout_seed(dropout_rng: Array) -> Array:
    """A kernel's [1] int32 seed (uint32 bits) from a dropout key."""
    return jax.lax.bitcast_convert_type(jax.random.bits(dropout_rng, (1,), jnp.uint32), jnp.int32)


def drop(x: Array, keep: Array, rate: float) -> Array:
    """Inverted dropout by a keep mask: kept entries scaled by 1 / (1 - rate), the rest 0."""
    return jnp.where(keep, x * (1.0 / (1.0 - rate)), 0.0)
