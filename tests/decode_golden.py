"""The decoding outputs recorded before the searches were made faster (issue 26), and the
cases that produce them. `tests/test_decode_golden.py` decodes the same cases with today's code
and asks for the same tokens and scores.

    python tests/decode_golden.py   # rewrites tests/data/decode_golden.npz: only on purpose

The recording was made at commit bc74487 (the searches of 2026-11-26), with this file, by
running it with that commit's `transformer_jax` first on PYTHONPATH.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax import Transformer, TransformerConfig, beam_search, greedy_decode

PATH = os.path.join(os.path.dirname(__file__), "data", "decode_golden.npz")
V = 48
MAX_LEN = 14
EOS_BOOST = 2.5
MODELS = {
    "post_ln": dict(norm_first=False),
    "pre_ln": dict(norm_first=True),
    # Marian's options: decoding starts from pad, output bias, swish.
    "marian": dict(
        bos_id=0,
        activation="swish",
        layer_norm_eps=1e-5,
        scale_embeddings=False,
        positional="sinusoidal_concat",
        output_bias=True,
    ),
}
SEARCHES = (
    ("greedy", {}),
    ("beam1", dict(beam_size=1, length_penalty=0.6)),
    ("beam3", dict(beam_size=3, length_penalty=0.6)),
    ("beam4_alpha1.3", dict(beam_size=4, length_penalty=1.3)),
    ("beam4_alpha1.3_best_only", dict(beam_size=4, length_penalty=1.3, best_only=True)),
    ("beam5_alpha0", dict(beam_size=5, length_penalty=0.0)),
)


def model_and_source(name: str, seed: int):
    """A tiny random Transformer whose logits are sharp enough to decide (its embeddings at
    scale 1: a near-uniform distribution would make every choice a near-tie), and a source
    batch of 4 with padding."""
    cfg = TransformerConfig.tiny(
        src_vocab_size=V,
        tgt_vocab_size=V,
        d_model=32,
        n_heads=4,
        d_ff=64,
        max_len=32,
        **MODELS[name],
    )
    model = Transformer(cfg)
    rng = np.random.default_rng(seed)
    src = rng.integers(3, V, size=(4, 9)).astype(np.int32)
    for row, length in enumerate((9, 6, 3, 7)):
        src[row, length - 1] = cfg.eos_id
        src[row, length:] = cfg.pad_id
    params = model.init(jax.random.PRNGKey(seed), jnp.asarray(src), jnp.asarray(src[:, :4]))
    params = jax.tree_util.tree_map_with_path(
        lambda path, x: x * 8.0 if "embedding" in jax.tree_util.keystr(path) else x,
        params["params"],
    )
    # EOS made likely enough that hypotheses end at different lengths (else every one runs
    # to MAX_LEN and length penalties and finished slots are never exercised).
    table = params["tgt_embed"]["embedding"]
    params["tgt_embed"]["embedding"] = table.at[cfg.eos_id].multiply(EOS_BOOST)
    return model, params, jnp.asarray(src)


def cases() -> Iterator[tuple[str, str, int, dict]]:
    for name in MODELS:
        for seed in (0, 1, 2):
            for search, kwargs in SEARCHES:
                yield f"{name}/seed{seed}/{search}", name, seed, kwargs


def decode_case(
    name: str, seed: int, kwargs: dict, stages: tuple[int, ...] | None = None
) -> dict[str, np.ndarray]:
    """The case's outputs; `stages` (the cache lengths of a staged search) only where the
    searches take them (those recorded had no stages)."""
    model, params, src = model_and_source(name, seed)
    if stages is not None:
        kwargs = {**kwargs, "stages": stages}
    if "beam_size" not in kwargs:
        return {"tokens": np.asarray(greedy_decode(model, params, src, max_len=MAX_LEN, **kwargs))}
    tokens, scores = beam_search(model, params, src, max_len=MAX_LEN, **kwargs)
    return {"tokens": np.asarray(tokens), "scores": np.asarray(scores)}


def main() -> None:
    arrays = {}
    for key, name, seed, kwargs in cases():
        for field, value in decode_case(name, seed, kwargs).items():
            arrays[f"{key}/{field}"] = value
    os.makedirs(os.path.dirname(PATH), exist_ok=True)
    np.savez(PATH, **arrays)
    print(f"wrote {len(arrays)} arrays to {PATH}")


if __name__ == "__main__":
    main()
