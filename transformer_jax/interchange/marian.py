"""Load OPUS-MT (Marian) checkpoints, in the Hugging Face folder format, into `Transformer`.

    model, params, tokenizer = load_marian("opus-mt-de-en")      # a local folder
    logits = model.apply({"params": params}, src, tgt)            # [B, T, V], as any Transformer
    beams, scores = beam_search(model, params, tokenizer.encode(texts), beam_size=4, max_len=64)

The folder: `config.json` (MarianConfig's fields), `model.safetensors` (or `pytorch_model.bin`,
read by torch with `weights_only=True`), optionally `generation_config.json`, and the
tokenizer's `source.spm`, `target.spm`, `vocab.json` (see
`transformer_jax.interchange.marian_tokenizer`). Nothing here needs the `transformers` package.
`transformer_jax.interchange.marian_export.save_marian` writes such a folder.

A Marian model is the paper's post-LN Transformer with these options of `TransformerConfig`:
`positional="sinusoidal_concat"` (sines then cosines, positions from 0), `activation` (swish
for OPUS-MT), `layer_norm_eps=1e-5`, `scale_embeddings` (sqrt(D), OPUS-MT's
`scale_embedding`), tied logits plus `output_bias` (`final_logits_bias`), shared or separate
source/target embeddings, and `bos_id = pad_id`: decoding starts from pad. Attention scales
q by K ** -0.5 like ours, and its projections carry biases, as ours always do.

Name mapping (PyTorch Linear weights are [out, in]; Flax kernels are [in, out]: transposed)::

  | Hugging Face                                         | params                                  |
  |------------------------------------------------------|-----------------------------------------|
  | model.shared.weight [V, D] (or the embed_tokens)     | tgt_embed/embedding                     |
  | model.encoder.embed_tokens.weight (separate)         | src_embed/embedding                     |
  | model.decoder.embed_tokens.weight (separate)         | tgt_embed/embedding                     |
  | model.{encoder,decoder}.layers.{i}.self_attn.        | {encoder,decoder}/layers_{i}/self_attn/ |
  |   {q,k,v,out}_proj.{weight,bias}                     |   {query,key,value,out}/{kernel,bias}   |
  | model.decoder.layers.{i}.encoder_attn.*              | decoder/layers_{i}/cross_attn/*         |
  | ...layers.{i}.fc1, fc2                               | .../layers_{i}/ffn/inner, outer         |
  | ...layers.{i}.self_attn_layer_norm.{weight,bias}     | .../layers_{i}/self_attn_residual/norm/ |
  |                                                      |   {scale,bias}                          |
  | model.decoder.layers.{i}.encoder_attn_layer_norm     | decoder/layers_{i}/cross_attn_residual/ |
  |                                                      |   norm                                  |
  | ...layers.{i}.final_layer_norm                       | .../layers_{i}/ffn_residual/norm        |
  | final_logits_bias [1, V]                             | output_bias [V] (tied), output/bias     |
  | lm_head.weight (tie_word_embeddings false)           | output/kernel                           |

Ignored, as transformers ignores them: `lm_head.weight` and the other embedding names when
tied, and `embed_positions.weight` (older exports save the sinusoid; it is checked against
ours). A missing `final_logits_bias` is zeros, as in transformers. Anything else missing, left
over or of the wrong shape is an error naming it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax.config import ACTIVATIONS, TransformerConfig
from transformer_jax.interchange.marian_tokenizer import (
    MarianTokenizer,
    has_tokenizer_files,
    read_json,
)
from transformer_jax.model import Transformer
from transformer_jax.positional import sinusoidal_positions

CONFIG, GENERATION_CONFIG = "config.json", "generation_config.json"
SAFETENSORS, PYTORCH_BIN = "model.safetensors", "pytorch_model.bin"

# config.json fields without which the architecture is unknown.
_REQUIRED = (
    "vocab_size",
    "d_model",
    "encoder_layers",
    "decoder_layers",
    "encoder_attention_heads",
    "decoder_attention_heads",
    "encoder_ffn_dim",
    "decoder_ffn_dim",
    "pad_token_id",
    "eos_token_id",
    "decoder_start_token_id",
)
# MarianConfig's defaults for the fields an older config.json may leave out.
_DEFAULTS = {
    "activation_function": "gelu",
    "scale_embedding": False,
    "share_encoder_decoder_embeddings": True,
    "tie_word_embeddings": True,
    "max_position_embeddings": 1024,
    "dropout": 0.1,
    "attention_dropout": 0.0,
}
# Options of the BART family that older Marian configs still carry. Marian is post-LN with no
# extra LayerNorms, so any other value describes a model this loader does not build.
_UNSUPPORTED = {
    "normalize_before": False,
    "add_final_layer_norm": False,
    "normalize_embedding": False,
}
# transformers' own generation defaults, for folders that name none.
_HF_NUM_BEAMS, _HF_MAX_LENGTH = 1, 20


@dataclasses.dataclass(frozen=True)
class GenerationDefaults:
    """The decoding settings a checkpoint ships (generation_config.json, else config.json).

    Attributes:
      beam_size: `num_beams`.
      max_len: output positions after the start token, as `greedy_decode` / `beam_search`
        count them: transformers' `max_length` counts the start token too, so this is one less.
    """

    beam_size: int = _HF_NUM_BEAMS
    max_len: int = _HF_MAX_LENGTH - 1


def _field(hf: Mapping[str, Any], name: str, source: str) -> Any:
    value = hf.get(name, _DEFAULTS.get(name))
    if value is None:
        raise ValueError(f"{source} has no {name!r}")
    if name.endswith("token_id") and isinstance(value, list) and len(value) == 1:
        value = value[0]  # eos_token_id may be a one-element list
    if name in _REQUIRED and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
        raise ValueError(f"{source}: {name} must be a non-negative integer, got {value!r}")
    return value


def marian_config(
    hf: Mapping[str, Any], *, dtype: Any = jnp.float32, source: str = CONFIG
) -> TransformerConfig:
    """A MarianConfig's fields (config.json as a dict) -> the `TransformerConfig` that builds
    the same network. An option it cannot build is a ValueError naming the field."""
    model_type = hf.get("model_type", "marian")
    if model_type != "marian":
        raise ValueError(f"{source}: model_type is {model_type!r}, not 'marian'")
    f = {name: _field(hf, name, source) for name in (*_REQUIRED, *_DEFAULTS)}
    for name, supported in _UNSUPPORTED.items():
        if hf.get(name, supported) != supported:
            raise ValueError(
                f"{source}: {name}={hf[name]!r} is not supported (Marian is "
                f"post-LN with {name}={supported!r})"
            )
    for enc, dec in (
        ("encoder_attention_heads", "decoder_attention_heads"),
        ("encoder_ffn_dim", "decoder_ffn_dim"),
    ):
        if f[enc] != f[dec]:
            raise ValueError(
                f"{source}: {enc} ({f[enc]}) != {dec} ({f[dec]}) is not supported: "
                "TransformerConfig has one value for both stacks"
            )
    if f["activation_function"] not in ACTIVATIONS:
        raise ValueError(
            f"{source}: activation_function {f['activation_function']!r} is not "
            f"supported (one of {tuple(ACTIVATIONS)})"
        )
    shared = bool(f["share_encoder_decoder_embeddings"])
    tgt_vocab = f["vocab_size"] if shared else (hf.get("decoder_vocab_size") or f["vocab_size"])
    tied = bool(f["tie_word_embeddings"])
    # transformers 5 ties nothing when tie_word_embeddings is false, not even a shared
    # vocabulary's encoder and decoder tables; two tables load both versions' files.
    shared = shared and tied
    try:
        return TransformerConfig(
            src_vocab_size=f["vocab_size"],
            tgt_vocab_size=tgt_vocab,
            d_model=f["d_model"],
            n_heads=f["encoder_attention_heads"],
            d_ff=f["encoder_ffn_dim"],
            activation=f["activation_function"],
            n_encoder_layers=f["encoder_layers"],
            n_decoder_layers=f["decoder_layers"],
            dropout=f["dropout"],
            attention_dropout=f["attention_dropout"],
            norm_first=False,
            layer_norm_eps=1e-5,
            positional="sinusoidal_concat",
            max_len=f["max_position_embeddings"],
            scale_embeddings=bool(f["scale_embedding"]),
            share_embeddings=shared,
            tie_output=tied,
            output_bias=tied,
            pad_id=f["pad_token_id"],
            bos_id=f["decoder_start_token_id"],
            eos_id=f["eos_token_id"],
            dtype=dtype,
        )
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from None


def marian_generation_defaults(folder: str | Path) -> GenerationDefaults:
    """num_beams and max_length of the folder (generation_config.json over config.json)."""
    folder = Path(folder)
    fields: dict[str, Any] = {}
    for name in (CONFIG, GENERATION_CONFIG):
        if (folder / name).is_file():
            fields.update(read_json(folder / name))
    beams = fields.get("num_beams") or _HF_NUM_BEAMS
    max_length = fields.get("max_length") or _HF_MAX_LENGTH
    if not isinstance(beams, int) or beams < 1:
        raise ValueError(f"{folder}: num_beams must be a positive integer, got {beams!r}")
    if not isinstance(max_length, int) or max_length < 2:
        raise ValueError(f"{folder}: max_length must be an integer >= 2, got {max_length!r}")
    return GenerationDefaults(beam_size=beams, max_len=max_length - 1)


def read_marian_weights(folder: str | Path) -> dict[str, np.ndarray]:
    """The folder's tensors by name, as NumPy float32 arrays: model.safetensors, else
    pytorch_model.bin through torch (weights_only, so no arbitrary pickle runs)."""
    folder = Path(folder)
    if (folder / SAFETENSORS).is_file():
        try:
            from safetensors.numpy import load_file  # optional: the 'pretrained' extra
        except ImportError as e:
            raise ImportError(
                f"reading {folder / SAFETENSORS} needs the safetensors package: "
                'pip install "attention-jax[pretrained]"'
            ) from e
        return {k: np.asarray(v, np.float32) for k, v in load_file(folder / SAFETENSORS).items()}
    path = folder / PYTORCH_BIN
    if not path.is_file():
        raise FileNotFoundError(f"{folder} has no weights: neither {SAFETENSORS} nor {PYTORCH_BIN}")
    try:
        import torch  # optional: only this legacy format needs it
    except ImportError:
        raise ImportError(
            f"{path} is a PyTorch file and torch is not installed: install "
            f"torch, or convert it to {SAFETENSORS} (safetensors.torch.save_file)"
        ) from None
    state = torch.load(path, map_location="cpu", weights_only=True)
    return {k: v.detach().float().numpy() for k, v in state.items()}


def _name_map(config: TransformerConfig, state: Mapping[str, np.ndarray]) -> dict:
    """params path (tuple) -> (Hugging Face name, transposed?) for every parameter."""
    out = {}

    def dense(path, name):
        out[(*path, "kernel")] = (f"{name}.weight", True)
        out[(*path, "bias")] = (f"{name}.bias", False)

    def norm(path, name):
        out[(*path, "norm", "scale")] = (f"{name}.weight", False)
        out[(*path, "norm", "bias")] = (f"{name}.bias", False)

    def attention(path, name):
        for ours, theirs in (
            ("query", "q_proj"),
            ("key", "k_proj"),
            ("value", "v_proj"),
            ("out", "out_proj"),
        ):
            dense((*path, ours), f"{name}.{theirs}")

    for stack, n_layers in (
        ("encoder", config.n_encoder_layers),
        ("decoder", config.n_decoder_layers),
    ):
        for i in range(n_layers):
            ours, theirs = (stack, f"layers_{i}"), f"model.{stack}.layers.{i}"
            attention((*ours, "self_attn"), f"{theirs}.self_attn")
            norm((*ours, "self_attn_residual"), f"{theirs}.self_attn_layer_norm")
            if stack == "decoder":
                attention((*ours, "cross_attn"), f"{theirs}.encoder_attn")
                norm((*ours, "cross_attn_residual"), f"{theirs}.encoder_attn_layer_norm")
            dense((*ours, "ffn", "inner"), f"{theirs}.fc1")
            dense((*ours, "ffn", "outer"), f"{theirs}.fc2")
            norm((*ours, "ffn_residual"), f"{theirs}.final_layer_norm")

    def first(*names):  # the first name the file holds (else the first, to name in errors)
        return next((n for n in names if n in state), names[0]), False

    shared = "model.shared.weight"
    enc, dec = "model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight"
    if config.share_embeddings:  # transformers ties all three names; a file holds any of them
        out[("tgt_embed", "embedding")] = first(shared, enc, dec)
    else:
        out[("src_embed", "embedding")] = first(enc, shared)
        out[("tgt_embed", "embedding")] = first(dec, shared)
    if config.tie_output:
        out[("output_bias",)] = ("final_logits_bias", False)
    else:
        out[("output", "kernel")] = ("lm_head.weight", True)
        out[("output", "bias")] = ("final_logits_bias", False)
    return out


def _check_positions(state: Mapping[str, np.ndarray], config: TransformerConfig) -> None:
    """A stored position table must be the sinusoid `Transformer` computes."""
    for name in ("model.encoder.embed_positions.weight", "model.decoder.embed_positions.weight"):
        if name not in state:
            continue
        table = state[name]
        ours = np.asarray(sinusoidal_positions(table.shape[0], config.d_model, layout="concat"))
        # float32 rounding of pos / 10000 ** (2i / D) reaches ~1e-5 at position 1024; a
        # learned or differently laid-out table differs by O(1).
        if table.shape != ours.shape or not np.allclose(table, ours, atol=1e-3):
            raise ValueError(
                f"{name} is not Marian's sinusoid (sines then cosines, positions "
                "from 0); this loader computes positions and cannot use it"
            )


def marian_params(state: Mapping[str, np.ndarray], config: TransformerConfig) -> dict:
    """Hugging Face Marian tensors by name -> the 'params' of `Transformer(config)` (float32).

    Raises:
      ValueError: a tensor is missing, left over, or of a shape the config does not give.
    """
    tokens = jax.ShapeDtypeStruct((1, 1), jnp.int32)
    expected = jax.eval_shape(Transformer(config).init, jax.random.key(0), tokens, tokens)
    expected = dict(jax.tree_util.tree_flatten_with_path(expected["params"])[0])
    names = _name_map(config, state)
    params: dict = {}
    for key_path, leaf in expected.items():
        path = tuple(k.key for k in key_path)
        name, transposed = names[path]
        if name not in state:
            if name == "final_logits_bias":
                value = np.zeros(leaf.shape, np.float32)
            else:
                raise ValueError(
                    f"the checkpoint has no {name} (needed for "
                    f"{'/'.join(path)} of shape {leaf.shape})"
                )
        else:
            value = np.asarray(state[name], np.float32)
            if name == "final_logits_bias":
                value = value.reshape(value.shape[1:]) if value.ndim == 2 else value
            value = value.T if transposed else value
            if value.shape != leaf.shape:
                want = leaf.shape[::-1] if transposed else leaf.shape
                raise ValueError(
                    f"{name} has shape {state[name].shape}, but config.json makes it {want}"
                )
        node = params
        for k in path[:-1]:
            node = node.setdefault(k, {})
        node[path[-1]] = jnp.asarray(value)
    _check_positions(state, config)
    used = {name for name, _ in names.values()}
    ignored = {"model.encoder.embed_positions.weight", "model.decoder.embed_positions.weight"}
    # Tied copies, and a shared table that transformers 5 keeps but uses for nothing once
    # tie_word_embeddings is false.
    ignored |= {
        "model.shared.weight",
        "model.encoder.embed_tokens.weight",
        "model.decoder.embed_tokens.weight",
    }
    if config.tie_output:
        ignored.add("lm_head.weight")
    left = sorted(set(state) - used - ignored)
    if left:
        raise ValueError(f"checkpoint tensors this config does not use: {left}")
    return params


def check_tokenizer(
    tokenizer: MarianTokenizer, config: TransformerConfig, *, source: str | Path
) -> None:
    """The tokenizer's pad and EOS ids must be the model's, and its source ids inside the
    model's vocabulary: a ValueError naming `source` (its folder) otherwise."""
    ids = {
        "pad_token_id": (tokenizer.pad_id, config.pad_id),
        "eos_token_id": (tokenizer.eos_id, config.eos_id),
    }
    for name, (theirs, ours) in ids.items():
        if theirs != ours:
            raise ValueError(
                f"{source}: the tokenizer's {name} is {theirs}, config.json's is {ours}"
            )
    if tokenizer.source_vocab_size > config.src_vocab_size:
        raise ValueError(
            f"{source}: vocab.json has ids up to "
            f"{tokenizer.source_vocab_size - 1}, beyond config.json's "
            f"vocab_size {config.src_vocab_size}"
        )


def load_marian(
    folder: str | Path, *, dtype: Any = jnp.float32
) -> tuple[Transformer, dict, MarianTokenizer | None]:
    """A local OPUS-MT / Marian folder -> (model, params, tokenizer or None).

    Everything is checked before the weights are converted: config.json, the tokenizer files
    (all three or none) and that the tokenizer's pad and EOS ids are the config's.
    `marian_generation_defaults(folder)` gives the beam size and length it ships with.

    Args:
      folder: holds config.json and model.safetensors (or pytorch_model.bin).
      dtype: the compute dtype of the returned model (parameters stay float32).
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder} is not a folder")
    config = marian_config(read_json(folder / CONFIG), dtype=dtype, source=str(folder / CONFIG))
    tokenizer = MarianTokenizer.from_folder(folder) if has_tokenizer_files(folder) else None
    if tokenizer is not None:
        check_tokenizer(tokenizer, config, source=folder)
    params = marian_params(read_marian_weights(folder), config)
    return Transformer(config), params, tokenizer
