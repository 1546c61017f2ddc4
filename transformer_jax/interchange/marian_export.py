"""Save a `Transformer` as an OPUS-MT / Marian folder in the Hugging Face format.

    save_marian(model, params, tokenizer, "model-hf", generation=GenerationDefaults(4, 64))
    # transformers: MarianMTModel.from_pretrained("model-hf"), MarianTokenizer.from_pretrained
    # this library: load_marian("model-hf") -> the same config and the same params

The inverse of `transformer_jax.interchange.marian.load_marian` (whose docstring has the name
mapping): config.json, model.safetensors (float32), generation_config.json and the tokenizer's
files. Marian is the post-LN Transformer with `positional="sinusoidal_concat"` and
`layer_norm_eps=1e-5`; `marian_fields(config)` says whether a config is one (a ValueError
naming each field that is not) before anything is converted or written.

The tensors are the ones `MarianMTModel.save_pretrained` writes, so transformers loads them
with nothing missing or left over: no `embed_positions` (transformers computes its sinusoid at
load and leaves it out of its own files). generation_config.json makes `generate` search as
ours: from bos, never emitting pad or bos (`bad_words_ids`), with no forced EOS.

What `load_marian` gives back: the same config and bit-identical params, except for two
configs Marian writes in its own terms, which compute the same logits:

  - tie_output=True, output_bias=False: `final_logits_bias` is zeros, and comes back as
    output_bias=True with a zero bias.
  - share_embeddings=True, tie_output=False: transformers 5 ties no embedding once
    tie_word_embeddings is false, so the folder holds the shared table under each of its
    names (as `save_pretrained` writes it) and comes back as share_embeddings=False with two
    equal tables.

The compute dtype is load_marian's argument, and `attention_impl` comes back as "auto".

Nothing here needs `transformers`; writing needs `safetensors` (the 'pretrained' extra).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax.config import TransformerConfig
from transformer_jax.files import staged_folder
from transformer_jax.interchange.marian import (
    CONFIG,
    GENERATION_CONFIG,
    SAFETENSORS,
    GenerationDefaults,
    _name_map,
)
from transformer_jax.interchange.marian_tokenizer import (
    SOURCE_SPM,
    TARGET_SPM,
    TOKENIZER_CONFIG,
    VOCAB,
    MarianTokenizer,
)
from transformer_jax.model import Transformer

# transformers' Marian LayerNorms are nn.LayerNorm's default.
_MARIAN_EPS = 1e-5
_SHARED = "model.shared.weight"
_ENCODER_EMBED = "model.encoder.embed_tokens.weight"
_DECODER_EMBED = "model.decoder.embed_tokens.weight"


def _unexpressible(config: TransformerConfig) -> list[str]:
    """Why Marian cannot hold `config`: one sentence per field (none if it can)."""
    problems = []
    if config.norm_first:
        problems.append(
            "norm_first=True (pre-LN): Marian is post-LN; export to CTranslate2 instead "
            "(it serves pre-LN)"
        )
    if config.positional == "sinusoidal":
        problems.append(
            "positional='sinusoidal' (sin/cos interleaved): Marian's sinusoid is "
            "'sinusoidal_concat' (all sines, then all cosines)"
        )
    elif config.positional == "learned":
        problems.append(
            "positional='learned': Marian has no learned position table; its positions are "
            "'sinusoidal_concat'"
        )
    if config.layer_norm_eps != _MARIAN_EPS:
        problems.append(
            f"layer_norm_eps={config.layer_norm_eps!r}: transformers' Marian LayerNorms use "
            f"{_MARIAN_EPS!r}"
        )
    return problems


def marian_fields(config: TransformerConfig) -> dict[str, Any]:
    """config.json's fields (MarianConfig) for `config`.

    Raises:
      ValueError: Marian cannot express the config, naming each field, its value and what
        Marian needs; or `config` is not a TransformerConfig (a seq2seq baseline's).
    """
    if not isinstance(config, TransformerConfig):
        raise ValueError(
            f"Marian is a Transformer: a {type(config).__name__} (a seq2seq baseline's "
            "config) cannot be exported to it; only a TransformerConfig can"
        )
    problems = _unexpressible(config)
    if problems:
        raise ValueError("cannot export to Marian: " + "; ".join(problems))
    c = config
    return {
        "model_type": "marian",
        "architectures": ["MarianMTModel"],
        "is_encoder_decoder": True,
        "vocab_size": c.src_vocab_size,
        "decoder_vocab_size": c.tgt_vocab_size,
        "d_model": c.d_model,
        "encoder_layers": c.n_encoder_layers,
        "decoder_layers": c.n_decoder_layers,
        "encoder_attention_heads": c.n_heads,
        "decoder_attention_heads": c.n_heads,
        "encoder_ffn_dim": c.d_ff,
        "decoder_ffn_dim": c.d_ff,
        # transformers' ACT2FN has each of our names ("swish" and "silu" are both there).
        "activation_function": c.activation,
        "dropout": c.dropout,
        "attention_dropout": c.attention_dropout,
        "activation_dropout": 0.0,  # our FFN has no dropout between its two layers
        # The rows of transformers' sinusoid table: the longest sequence it accepts.
        "max_position_embeddings": c.max_len,
        "scale_embedding": c.scale_embeddings,
        "share_encoder_decoder_embeddings": c.share_embeddings,
        "tie_word_embeddings": c.tie_output,
        "pad_token_id": c.pad_id,
        "eos_token_id": c.eos_id,
        "decoder_start_token_id": c.bos_id,
        # MarianConfig's own default: OPUS-MT starts from pad and has no <s>. Ours names it.
        "bos_token_id": None if c.bos_id == c.pad_id else c.bos_id,
        # MarianConfig defaults this to 0; see _generation_fields for why it is None.
        "forced_eos_token_id": None,
        "dtype": "float32",
    }


def _generation_fields(config: TransformerConfig, generation: GenerationDefaults) -> dict:
    """generation_config.json: the settings under which transformers' `generate` searches as
    `greedy_decode` / `beam_search` do."""
    # Our searches never emit pad or bos (search._allowed_log_probs); transformers must be told.
    bad_words = [[config.pad_id]] + ([[config.bos_id]] if config.bos_id != config.pad_id else [])
    return {
        "decoder_start_token_id": config.bos_id,
        "bos_token_id": None if config.bos_id == config.pad_id else config.bos_id,
        "eos_token_id": config.eos_id,
        "pad_token_id": config.pad_id,
        "bad_words_ids": bad_words,
        # OPUS-MT ships forced_eos_token_id = eos: transformers then overwrites the last
        # position (max_length - 1) of an unfinished output with EOS, where our searches keep
        # the model's choice, so greedy outputs that reach max_length would differ.
        "forced_eos_token_id": None,
        "num_beams": generation.beam_size,
        # transformers counts the start token; GenerationDefaults.max_len does not.
        "max_length": generation.max_len + 1,
    }


def marian_state(config: TransformerConfig, params: Mapping) -> dict[str, np.ndarray]:
    """The 'params' of `Transformer(config)` -> Hugging Face Marian tensors by name (float32),
    the names `MarianMTModel.save_pretrained` writes for the config.

    Raises:
      ValueError: a parameter is missing, left over, or of a shape the config does not give.
    """
    tokens = jax.ShapeDtypeStruct((1, 1), jnp.int32)
    expected = jax.eval_shape(Transformer(config).init, jax.random.key(0), tokens, tokens)
    expected = {
        tuple(k.key for k in path): leaf.shape
        for path, leaf in jax.tree_util.tree_flatten_with_path(expected["params"])[0]
    }
    given = {
        tuple(k.key for k in path): leaf
        for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]
    }
    missing, extra = sorted(expected.keys() - given.keys()), sorted(given.keys() - expected.keys())
    if missing or extra:
        raise ValueError(
            f"params do not fit the config: missing {['/'.join(p) for p in missing]}, "
            f"not its parameters {['/'.join(p) for p in extra]}"
        )
    names = _name_map(config, {})  # with no file to look in, the first (canonical) names
    state = {}
    for path, shape in expected.items():
        value = np.asarray(given[path], np.float32)
        if value.shape != shape:
            raise ValueError(
                f"params: {'/'.join(path)} has shape {value.shape}, the config makes it {shape}"
            )
        name, transposed = names[path]
        value = value.T if transposed else value
        if name == "final_logits_bias":
            value = value[None]  # transformers keeps it as [1, V]
        state[name] = np.ascontiguousarray(value)
    if config.share_embeddings and not config.tie_output:
        # transformers 5 unties these three once tie_word_embeddings is false, and
        # save_pretrained writes each of them.
        state[_ENCODER_EMBED] = state[_DECODER_EMBED] = state[_SHARED]
    if "final_logits_bias" not in state:  # tied without output_bias: Marian adds zeros
        state["final_logits_bias"] = np.zeros((1, config.tgt_vocab_size), np.float32)
    return state


def _joint_spm_files(tokenizer: Any) -> dict[str, bytes]:
    """The project's joint SentencePiece tokenizer (`model_path`, `id_to_piece`, `vocab_size`,
    pad/eos/unk ids) as Marian's files: one model for both sides, its own ids as vocab.json."""
    model = Path(tokenizer.model_path).read_bytes()
    vocab = {tokenizer.id_to_piece(i): i for i in range(tokenizer.vocab_size)}
    options = {
        "unk_token": tokenizer.id_to_piece(tokenizer.unk_id),
        "eos_token": tokenizer.id_to_piece(tokenizer.eos_id),
        "pad_token": tokenizer.id_to_piece(tokenizer.pad_id),
        "separate_vocabs": False,
        "tokenizer_class": "MarianTokenizer",
    }
    return {
        SOURCE_SPM: model,
        TARGET_SPM: model,
        VOCAB: _json_bytes(vocab),
        TOKENIZER_CONFIG: _json_bytes(options),
    }


def _check_tokenizer(tokenizer: Any, config: TransformerConfig) -> None:
    """The tokenizer's pad and EOS must be the model's, and its ids must fit the model."""
    if not isinstance(tokenizer, MarianTokenizer) and not (
        hasattr(tokenizer, "model_path") and hasattr(tokenizer, "id_to_piece")
    ):
        raise TypeError(
            f"tokenizer must be a MarianTokenizer or a SentencePiece tokenizer with model_path "
            f"and id_to_piece, got {type(tokenizer).__name__}"
        )
    for name, theirs, ours in (
        ("pad_id", tokenizer.pad_id, config.pad_id),
        ("eos_id", tokenizer.eos_id, config.eos_id),
    ):
        if theirs != ours:
            raise ValueError(f"the tokenizer's {name} is {theirs}, the model config's is {ours}")
    if isinstance(tokenizer, MarianTokenizer):
        sizes = {
            "source": (tokenizer.source_vocab_size, config.src_vocab_size),
            "target": (max(tokenizer.target_vocab.values()) + 1, config.tgt_vocab_size),
        }
    else:  # one joint vocabulary feeds both sides
        sizes = {
            "source": (tokenizer.vocab_size, config.src_vocab_size),
            "target": (tokenizer.vocab_size, config.tgt_vocab_size),
        }
    for side, (theirs, ours) in sizes.items():
        if theirs > ours:
            raise ValueError(
                f"the tokenizer's {side} vocabulary has ids up to {theirs - 1}, beyond the "
                f"model's {side} vocabulary of {ours}"
            )


def _json_bytes(value: Any) -> bytes:
    return (json.dumps(value, indent=2, ensure_ascii=False) + "\n").encode("utf-8")


def save_marian(
    model_or_config: Transformer | TransformerConfig,
    params: Mapping,
    tokenizer: Any,
    folder: str | Path,
    *,
    generation: GenerationDefaults | None = None,
    overwrite: bool = False,
) -> None:
    """Writes `folder`: config.json, model.safetensors, generation_config.json and the
    tokenizer's source.spm, target.spm, vocab.json, tokenizer_config.json.

    transformers' `MarianMTModel` / `MarianTokenizer.from_pretrained(folder)` read it, and its
    `generate(num_beams=1)` is our `greedy_decode`; `load_marian(folder)` reads it back (see
    the module docstring for the two configs that come back in Marian's terms).

    Args:
      model_or_config: a `Transformer` or its `TransformerConfig`.
      params: its 'params' collection.
      tokenizer: a `MarianTokenizer`, the project's joint SentencePiece tokenizer (anything
        with `model_path` and `id_to_piece`), or None for no tokenizer files.
      folder: created whole: everything is written to a temporary sibling first, which is
        renamed into place once complete.
      generation: the search the folder ships (num_beams, max_length); default
        `GenerationDefaults()`, transformers' own defaults.
      overwrite: replace an existing non-empty `folder` (only once the new one is complete).

    Raises:
      ValueError: Marian cannot express the config (`marian_fields`), the params do not fit
        it, or the tokenizer disagrees with it; all checked before anything is written.
      FileExistsError: `folder` exists, is not empty, and overwrite is False.
    """
    # A model (ours or a baseline) carries its config; marian_fields rejects all but ours.
    config = model_or_config.config if isinstance(model_or_config, nn.Module) else model_or_config
    fields = marian_fields(config)
    generation = GenerationDefaults() if generation is None else generation
    if generation.max_len > config.max_len:
        raise ValueError(
            f"generation max_len {generation.max_len} exceeds the model's max_len "
            f"{config.max_len} (transformers' position table, max_position_embeddings)"
        )
    if tokenizer is not None:
        _check_tokenizer(tokenizer, config)
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise FileExistsError(f"{folder} exists and is not a folder")
    if folder.exists() and not (overwrite or _is_empty_dir(folder)):
        raise FileExistsError(f"{folder} exists and is not empty (overwrite=True replaces it)")
    state = marian_state(config, params)
    try:
        from safetensors.numpy import save_file  # optional: the 'pretrained' extra
    except ImportError as e:
        raise ImportError(
            f"writing {folder / SAFETENSORS} needs the safetensors package: "
            'pip install "attention-jax[pretrained]"'
        ) from e

    with staged_folder(folder) as staging:
        (staging / CONFIG).write_bytes(_json_bytes(fields))
        (staging / GENERATION_CONFIG).write_bytes(
            _json_bytes(_generation_fields(config, generation))
        )
        # The metadata transformers' save_pretrained writes.
        save_file(state, staging / SAFETENSORS, metadata={"format": "pt"})
        if isinstance(tokenizer, MarianTokenizer):
            tokenizer.save(staging)
        elif tokenizer is not None:
            for name, data in _joint_spm_files(tokenizer).items():
                (staging / name).write_bytes(data)


def _is_empty_dir(path: Path) -> bool:
    return path.is_dir() and not any(path.iterdir())
