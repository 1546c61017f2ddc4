"""Moved to `transformer_jax.int8`, below the model that uses it (the model core imports
nothing from `decoding`). The names stay importable from here."""

from transformer_jax.int8 import Int8Dense, Int8Embed, int8_matmul, quantize_params, quantize_rows

__all__ = ["Int8Dense", "Int8Embed", "int8_matmul", "quantize_params", "quantize_rows"]
