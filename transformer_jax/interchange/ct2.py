"""Export a trained `Transformer` to CTranslate2, and translate our ids with the export.

    save_ct2(model.config, params, tokenizer, "export/ct2")              # float32 weights
    save_ct2(model.config, params, tokenizer, "export/ct2-int8", quantization="int8")

    translator = ctranslate2.Translator("export/ct2", device="cpu")
    pieces = spm.encode(["Ein Hund läuft."], out_type=str)   # SentencePiece; no EOS: see below
    out = translator.translate_batch(pieces, beam_size=1, min_decoding_length=0)
    tokens = ct2_translate(translator, tokenizer, src, max_len=64)        # [B, O], our ids

The model is described through `ctranslate2.specs` (a `TransformerSpec`) rather than written
as a Hugging Face folder for ctranslate2's transformers converter: the specs take the position
table itself (`position_encodings.encodings`), so every `TransformerConfig` is covered: pre-LN
(each stack's final LayerNorm is the spec's `layer_norm`) or post-LN, both sinusoid layouts
and learned positions, every activation, `scale_embeddings` True or False, shared or separate
embeddings, tied or untied output with or without a bias, and `layer_norm_eps`. No BART/Marian
configuration has all of these, and the conversion needs neither torch nor transformers.

What the export holds (model.bin, config.json and the vocabulary JSON files):
  * Source pieces by id 0 .. src_vocab_size-1, target pieces 0 .. tgt_vocab_size-1 (one
    shared_vocabulary.json when they are equal). Ids the tokenizer has no piece for (the model
    is larger than its tokenizer, or a Marian vocab.json skips ids) are '<unused_N>'.
  * Sources: ctranslate2 appends EOS (`add_source_eos`), so `translate_batch` takes a text's
    SentencePiece pieces as they come, without EOS; our models read the same source ending in
    EOS. `ct2_tokens` turns our [B, S] source ids (which carry the EOS) into such pieces.
  * Decoding starts from the piece of `bos_id` ('<pad>' for Marian-style models) at position
    0, as ours does. pad and bos get an output bias of -65504 (float16's lowest), so they are
    never emitted and the log-probs are renormalised over the rest:
    `transformer_jax.decoding.search`'s rule, with no `suppress_sequences` to pass.
  * Position table: `positions_rows(config)` rows, shared by the encoder and the decoder:
    max_len for learned positions (the table itself; a longer source, or max_decoding_length
    above it, is ctranslate2's "No position encodings" error, as ours refuses it), and for
    sinusoids max(max_len, 1024), so ctranslate2's default max_input_length (1024) never
    overflows it. A table of P rows serves sources of up to P tokens counting the EOS, and
    max_decoding_length up to P (the start token sits at position 0).

Decoding differences to know (`ct2_translate` sets the options that remove the first two):
  * `translate_batch`'s min_decoding_length defaults to 1 (EOS cannot come first): pass 0.
  * max_input_length (default 1024) truncates sources; ours never truncates.
  * A source with no token besides EOS is translated to nothing without running the model.
  * Beam search: ctranslate2 keeps W hypotheses alive and sets finished ones aside, where ours
    keeps finished ones in their slots; and its length_penalty divides by length ** alpha,
    not by the GNMT penalty. With length_penalty 0 both rank by the summed log-probs, EOS
    included, but the two searches can still end on different hypotheses.

ctranslate2 is optional (`pip install "attention-jax[serve]"`); it is imported inside the
functions, so importing transformer_jax does not need it.
"""

from __future__ import annotations

import math
import os
import re
import shutil
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax.config import TransformerConfig
from transformer_jax.files import staged_folder
from transformer_jax.interchange.marian_tokenizer import SOURCE_SPM, TARGET_SPM
from transformer_jax.model import Transformer
from transformer_jax.positional import sinusoidal_positions

# ctranslate2's weight types (ctranslate2.specs.model_spec.ACCEPTED_MODEL_TYPES) an export may be
# quantized to, for checking before anything is built. Not our own decoding's
# (config.DECODE_QUANTIZATIONS).
CT2_QUANTIZATIONS = (
    "float32",
    "int8",
    "int8_float32",
    "int8_float16",
    "int8_bfloat16",
    "int16",
    "float16",
    "bfloat16",
)
# config.activation -> the name of ctranslate2's Activation member; "gelu" is exact (erf).
_ACTIVATIONS = {"relu": "RELU", "gelu": "GELU", "swish": "SWISH", "silu": "SWISH"}
# The sinusoid table's least length: ctranslate2's default max_input_length.
_SINUSOID_ROWS = 1024
# The output bias of pad and bos: float16's lowest value (exp of it is 0 in any precision).
_NEVER = float(np.finfo(np.float16).min)
_PLACEHOLDER = "<unused_{}>"
_PLACEHOLDER_RE = re.compile(r"<unused_(\d+)>")
# The files of an export; a folder holding model.bin is one (see `_check_destination`).
_MODEL_FILE = "model.bin"


def ctranslate2_module():
    try:
        import ctranslate2  # optional: the 'serve' extra
    except ImportError as e:
        raise ImportError(
            "exporting to or translating with CTranslate2 needs the ctranslate2 package: "
            'pip install "attention-jax[serve]"'
        ) from e
    return ctranslate2


def positions_rows(config: TransformerConfig) -> int:
    """Rows of the exported position table: the longest source (EOS included) and the largest
    max_decoding_length the export serves."""
    if config.positional == "learned":
        return config.max_len
    return max(config.max_len, _SINUSOID_ROWS)


def save_ct2(
    config: TransformerConfig,
    params: Mapping[str, Any],
    tokenizer: Any,
    folder: str | os.PathLike,
    *,
    quantization: str | None = None,
    overwrite: bool = False,
) -> None:
    """Writes `Transformer(config)` with `params` as a CTranslate2 model folder.

    Args:
      config: the model's `TransformerConfig`.
      params: its 'params' collection (NumPy or jax arrays, float32).
      tokenizer: the pieces of its ids: a joint tokenizer (`vocab_size`, `id_to_piece(i)`,
        like train.data.tokenizers.SentencePieceTokenizer) or a `MarianTokenizer`
        (`source_vocab`, `target_vocab`: piece -> id).
      folder: the export; written into a temporary sibling folder and renamed into place
        once complete, so a failed export leaves nothing behind.
      quantization: None (as stored: float32), or one of `CT2_QUANTIZATIONS` (ctranslate2's
        weight types; a Translator may also convert at load time with compute_type).
      overwrite: replace an existing export at `folder`. Without it an existing `folder` is
        a FileExistsError; with it, only an export (a folder holding model.bin) or an empty
        folder is replaced: anything else is a ValueError.

    Raises:
      ValueError: what CTranslate2 cannot express or the inputs do not agree on (a config
        other than TransformerConfig, params of other shapes, a tokenizer larger than the
        model's vocabulary), before anything is written.
    """
    if not isinstance(config, TransformerConfig):
        raise ValueError(
            f"save_ct2 exports the Transformer (TransformerConfig); a "
            f"{type(config).__name__} model has no CTranslate2 counterpart"
        )
    if quantization is not None and quantization not in CT2_QUANTIZATIONS:
        raise ValueError(
            f"quantization must be None or one of {CT2_QUANTIZATIONS}, got {quantization!r}"
        )
    folder = Path(folder)
    _check_destination(folder, overwrite=overwrite)
    weights = _checked_params(config, params)
    source, target = _vocabularies(config, tokenizer)
    ct2 = ctranslate2_module()
    spec = _spec(ct2, config, weights)
    spec.register_source_vocabulary(source)
    spec.register_target_vocabulary(target)
    _set_tokens(spec.config, config, tokenizer, source, target)
    spec.config.layer_norm_epsilon = config.layer_norm_eps
    spec.validate()
    spec.optimize(quantization=quantization)

    _check_destination(folder, overwrite=overwrite)  # again: it may have appeared meanwhile
    with staged_folder(folder) as staging:
        spec.save(str(staging))
        # The SentencePiece model(s) beside the weights, named as OPUS-MT's conversions name
        # them: `translate_batch` takes pieces, and the folder then holds all it needs.
        for name, path in _sentencepiece_files(tokenizer).items():
            shutil.copyfile(path, staging / name)


def _sentencepiece_files(tokenizer: Any) -> dict[str, Path]:
    """{file name in the export: path} of the tokenizer's SentencePiece models: a
    MarianTokenizer's source.spm and target.spm, or a joint model (`model_path`) as both;
    none for a tokenizer without a model file."""
    files = getattr(tokenizer, "files", None)
    if isinstance(files, Mapping):
        return {name: Path(p) for name, p in files.items() if str(name).endswith(".spm")}
    model = getattr(tokenizer, "model_path", None)
    if model:
        return {SOURCE_SPM: Path(model), TARGET_SPM: Path(model)}
    return {}


def _check_destination(folder: Path, *, overwrite: bool) -> None:
    """An existing `folder` is replaced only when asked to, and only if it is an export (or
    empty)."""
    if not (folder.exists() or folder.is_symlink()):
        return
    if not overwrite:
        raise FileExistsError(f"{folder} exists; pass overwrite=True to replace it")
    if not folder.is_dir() or folder.is_symlink():
        raise ValueError(f"{folder} is not a folder; not replacing it with an export")
    if any(folder.iterdir()) and not (folder / _MODEL_FILE).is_file():
        raise ValueError(
            f"{folder} is not a CTranslate2 export (it has no {_MODEL_FILE}); not replacing it"
        )


def _checked_params(config: TransformerConfig, params: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """params -> {'a/b/c': float32 array}, checked leaf by leaf against `Transformer(config)`."""
    tokens = jax.ShapeDtypeStruct((1, 1), jnp.int32)
    expected = jax.eval_shape(Transformer(config).init, jax.random.key(0), tokens, tokens)
    expected = {
        "/".join(k.key for k in path): leaf.shape
        for path, leaf in jax.tree_util.tree_flatten_with_path(expected["params"])[0]
    }
    try:
        flat = jax.tree_util.tree_flatten_with_path(params)[0]
        given = {"/".join(str(k.key) for k in path): leaf for path, leaf in flat}
    except AttributeError:  # a path entry without .key: not a tree of dicts
        raise ValueError("params must be the model's 'params' collection (nested dicts)") from None
    missing, extra = sorted(set(expected) - set(given)), sorted(set(given) - set(expected))
    if missing or extra:
        raise ValueError(
            f"params do not match Transformer(config): missing {missing or 'nothing'}, "
            f"not in the model {extra or 'nothing'}"
        )
    weights = {}
    for name, shape in expected.items():
        # A copy: ctranslate2 quantizes the arrays it is given in place.
        value = np.array(jax.device_get(given[name]), np.float32)
        if value.shape != shape:
            raise ValueError(f"params {name} has shape {value.shape}, config gives {shape}")
        weights[name] = value
    return weights


def _vocabularies(config: TransformerConfig, tokenizer: Any) -> tuple[list[str], list[str]]:
    """-> (source pieces by id, target pieces by id), src_vocab_size and tgt_vocab_size long."""
    if hasattr(tokenizer, "source_vocab") and hasattr(tokenizer, "target_vocab"):
        sides = (
            ("source", _by_id(tokenizer.source_vocab), config.src_vocab_size),
            ("target", _by_id(tokenizer.target_vocab), config.tgt_vocab_size),
        )
    elif hasattr(tokenizer, "id_to_piece") and hasattr(tokenizer, "vocab_size"):
        joint = {i: tokenizer.id_to_piece(i) for i in range(int(tokenizer.vocab_size))}
        sides = (
            ("source", joint, config.src_vocab_size),
            ("target", joint, config.tgt_vocab_size),
        )
    else:
        raise ValueError(
            f"tokenizer must have id_to_piece and vocab_size (a joint SentencePiece "
            f"tokenizer) or source_vocab and target_vocab (a MarianTokenizer), got "
            f"{type(tokenizer).__name__}"
        )
    out = []
    for side, pieces, model_size in sides:
        size = max(pieces, default=-1) + 1
        if size > model_size:
            raise ValueError(
                f"the tokenizer's {side} vocabulary has {size} ids, more than the model's "
                f"{side} vocabulary ({model_size})"
            )
        by_id = [pieces.get(i, _PLACEHOLDER.format(i)) for i in range(model_size)]
        twice = sorted(p for p, n in Counter(by_id).items() if n > 1)
        if twice:
            raise ValueError(
                f"the {side} vocabulary names several ids with one piece: {twice[:10]}; "
                "CTranslate2 looks tokens up by their piece"
            )
        out.append(by_id)
    return out[0], out[1]


def _by_id(vocab: Mapping[str, int]) -> dict[int, str]:
    """piece -> id (a vocab.json) -> id -> piece."""
    out: dict[int, str] = {}
    for piece, i in vocab.items():
        if i in out:
            raise ValueError(f"vocabulary id {i} has two pieces: {out[i]!r} and {piece!r}")
        out[int(i)] = piece
    return out


def _set_tokens(ct2_config, config: TransformerConfig, tokenizer, source, target) -> None:
    """The special pieces of ctranslate2's model config, checked against both vocabularies.
    The decoder's start is the config's bos_id (the model's, whatever a tokenizer says)."""
    for name in ("pad_id", "eos_id"):
        theirs = getattr(tokenizer, name, None)
        if theirs is not None and int(theirs) != getattr(config, name):
            raise ValueError(
                f"the tokenizer's {name} is {theirs}, the config's is {getattr(config, name)}"
            )
    eos = target[config.eos_id]
    if source[config.eos_id] != eos:
        raise ValueError(
            f"EOS (id {config.eos_id}) is {source[config.eos_id]!r} in the source vocabulary "
            f"but {eos!r} in the target one; CTranslate2 has one EOS piece"
        )
    unk_id = getattr(tokenizer, "unk_id", None)  # a source id (Marian's target may differ)
    unk = source[unk_id] if unk_id is not None and 0 <= unk_id < len(source) else "<unk>"
    # ctranslate2 appends an unknown token missing from a vocabulary: one more id than the
    # model's embedding has.
    if unk not in source or unk not in target:
        raise ValueError(f"the unknown token {unk!r} must be in both vocabularies")
    ct2_config.unk_token = unk
    ct2_config.eos_token = eos
    ct2_config.bos_token = target[config.bos_id]
    ct2_config.decoder_start_token = target[config.bos_id]
    ct2_config.add_source_bos = False
    ct2_config.add_source_eos = True


def _spec(ct2, config: TransformerConfig, w: Mapping[str, np.ndarray]):
    """The TransformerSpec of `config` holding the weights `w` (flat names, float32)."""
    activation = getattr(ct2.specs.Activation, _ACTIVATIONS[config.activation])
    spec = ct2.specs.TransformerSpec.from_config(
        (config.n_encoder_layers, config.n_decoder_layers),
        config.n_heads,
        pre_norm=config.norm_first,
        activation=activation,
    )
    if config.positional == "learned":
        positions = w["positions/table"]
    else:
        layout = "concat" if config.positional == "sinusoidal_concat" else "interleaved"
        rows = positions_rows(config)
        positions = np.array(sinusoidal_positions(rows, config.d_model, layout=layout))
    scale = math.sqrt(config.d_model) if config.scale_embeddings else 1.0
    tgt_embed = w["tgt_embed/embedding"]
    src_embed = tgt_embed if config.share_embeddings else w["src_embed/embedding"]

    encoder, decoder = spec.encoder, spec.decoder
    encoder.embeddings[0].weight = src_embed
    decoder.embeddings.weight = tgt_embed
    for name, stack in (("encoder", encoder), ("decoder", decoder)):
        stack.scale_embeddings = scale
        stack.position_encodings.encodings = positions
        if config.norm_first:  # pre-LN stacks end with a LayerNorm
            _layer_norm(stack.layer_norm, w, f"{name}/final_norm")
    for i, layer in enumerate(encoder.layer):
        scope = f"encoder/layers_{i}"
        _attention(layer.self_attention, w, f"{scope}/self_attn", self_attention=True)
        _layer_norm(layer.self_attention.layer_norm, w, f"{scope}/self_attn_residual/norm")
        _ffn(layer.ffn, w, scope)
    for i, layer in enumerate(decoder.layer):
        scope = f"decoder/layers_{i}"
        _attention(layer.self_attention, w, f"{scope}/self_attn", self_attention=True)
        _layer_norm(layer.self_attention.layer_norm, w, f"{scope}/self_attn_residual/norm")
        _attention(layer.attention, w, f"{scope}/cross_attn", self_attention=False)
        _layer_norm(layer.attention.layer_norm, w, f"{scope}/cross_attn_residual/norm")
        _ffn(layer.ffn, w, scope)

    if config.tie_output:
        decoder.projection.weight = tgt_embed
        bias = w.get("output_bias", np.zeros(config.tgt_vocab_size, np.float32))
    else:
        decoder.projection.weight = w["output/kernel"].T
        bias = w["output/bias"]
    # Our searches never emit pad or bos (-inf before the softmax): a bias no logit overcomes,
    # and the lowest value a float16 export can hold, keeps them out here too.
    bias = bias.copy()
    bias[[config.pad_id, config.bos_id]] = _NEVER
    decoder.projection.bias = bias
    return spec


def _linear(spec, w: Mapping[str, np.ndarray], *scopes: str) -> None:
    """Flax Dense layers [in, out] -> one ctranslate2 linear [sum of outs, in] (PyTorch's
    layout): several scopes are fused along the output axis (q, k, v)."""
    spec.weight = np.concatenate([w[f"{s}/kernel"].T for s in scopes], axis=0)
    spec.bias = np.concatenate([w[f"{s}/bias"] for s in scopes], axis=0)


def _attention(spec, w, scope: str, *, self_attention: bool) -> None:
    """Self-attention: linear[0] = q,k,v fused, linear[1] = out. Cross-attention: linear[0] =
    q, linear[1] = k,v fused (they read the encoder output), linear[2] = out."""
    q, k, v, out = (f"{scope}/{name}" for name in ("query", "key", "value", "out"))
    if self_attention:
        _linear(spec.linear[0], w, q, k, v)
    else:
        _linear(spec.linear[0], w, q)
        _linear(spec.linear[1], w, k, v)
    _linear(spec.linear[-1], w, out)


def _layer_norm(spec, w, scope: str) -> None:
    spec.gamma = w[f"{scope}/scale"]
    spec.beta = w[f"{scope}/bias"]


def _ffn(spec, w, scope: str) -> None:
    _linear(spec.linear_0, w, f"{scope}/ffn/inner")
    _linear(spec.linear_1, w, f"{scope}/ffn/outer")
    _layer_norm(spec.layer_norm, w, f"{scope}/ffn_residual/norm")


# ---------------------------------------------------------------------------- translating


def _source_pieces(tokenizer: Any) -> dict[int, str]:
    if hasattr(tokenizer, "source_vocab"):
        return _by_id(tokenizer.source_vocab)
    return {i: tokenizer.id_to_piece(i) for i in range(int(tokenizer.vocab_size))}


def _target_ids(tokenizer: Any) -> dict[str, int]:
    if hasattr(tokenizer, "target_vocab"):
        return {piece: int(i) for piece, i in tokenizer.target_vocab.items()}
    return {tokenizer.id_to_piece(i): i for i in range(int(tokenizer.vocab_size))}


def ct2_tokens(tokenizer: Any, src_ids) -> list[list[str]]:
    """Our source ids [B, S] (pad-padded, each row ending with EOS, as the models read them)
    -> the pieces `translate_batch` takes: padding and the final EOS dropped (the export
    appends EOS itself). An id the tokenizer has no piece for is its '<unused_N>', as in the
    export's vocabulary."""
    src_ids = np.asarray(src_ids)
    if src_ids.ndim != 2:
        raise ValueError(f"src_ids must be [B, S], got shape {src_ids.shape}")
    pieces = _source_pieces(tokenizer)
    pad, eos = int(tokenizer.pad_id), int(tokenizer.eos_id)
    out = []
    for b, row in enumerate(src_ids.tolist()):
        row = [i for i in row if i != pad]
        if not row or row[-1] != eos:
            raise ValueError(f"source row {b} does not end with EOS ({eos}): {row}")
        out.append([pieces.get(i, _PLACEHOLDER.format(i)) for i in row[:-1]])
    return out


def ct2_translate(
    translator: Any,
    tokenizer: Any,
    src_ids,
    *,
    max_len: int,
    beam_size: int = 1,
    length_penalty: float = 0.0,
    return_scores: bool = False,
    **options: Any,
) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """Translates our ids with a `ctranslate2.Translator` of a `save_ct2` export.

    Args:
      translator: `ctranslate2.Translator(folder, ...)`.
      tokenizer: the tokenizer the export was written with.
      src_ids: [B, S] int source ids, pad-padded, each row ending with EOS.
      max_len: O, output positions (max_decoding_length).
      beam_size: 1 is greedy.
      length_penalty: ctranslate2's (the score divided by length ** length_penalty); 0 ranks
        by the summed log-probs, as `beam_search(..., length_penalty=0.0)`.
      return_scores: also return the best hypothesis' score [B] float32.
      options: more `translate_batch` options (max_batch_size, ...).
    Returns:
      [B, O] int32 ids, as `greedy_decode` / beam 0 of `beam_search` give them: the tokens,
      EOS where the hypothesis ended, then pad (and the scores [B] with `return_scores`).
      A source with no token besides EOS comes back as all pad: ctranslate2 translates it to
      nothing without running the model.
    """
    ids = _target_ids(tokenizer)
    results = translator.translate_batch(
        ct2_tokens(tokenizer, src_ids),
        beam_size=beam_size,
        length_penalty=length_penalty,
        max_decoding_length=max_len,
        min_decoding_length=0,  # EOS may come first, as in ours
        max_input_length=0,  # never truncate the source, as ours does not
        return_end_token=True,
        return_scores=return_scores,
        **options,
    )
    out = np.full((len(results), max_len), int(tokenizer.pad_id), np.int32)
    for b, result in enumerate(results):
        row = [_target_id(ids, piece) for piece in result.hypotheses[0]]
        out[b, : len(row)] = row
    if not return_scores:
        return out
    return out, np.asarray([r.scores[0] for r in results], np.float32)


def _target_id(ids: Mapping[str, int], piece: str) -> int:
    if piece in ids:
        return ids[piece]
    if m := _PLACEHOLDER_RE.fullmatch(piece):
        return int(m.group(1))
    raise ValueError(f"ctranslate2 returned {piece!r}, which the tokenizer does not have")
