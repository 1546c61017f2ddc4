"""Decoding a trained translation model: the pure, jittable searches (`search`), the driver that
runs them on a model's `decode_step` and lets finished sentences leave the batch (`decode`),
and the int8 form a model decodes with (`quantize`, now `transformer_jax.int8`)."""
