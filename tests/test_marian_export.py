"""`save_marian` against transformers: a Transformer written as an OPUS-MT / Marian folder
must load in transformers' `MarianMTModel` and `MarianTokenizer` and compute what ours does
(logits, greedy tokens, token ids, text), and `load_marian` must read it back exactly.

Every model is random (no downloads); the tokenizer is a SentencePiece model trained here with
the project's options.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    SOURCE_TEXT,
    TARGET_TEXT,
    file_hashes,
    made_up_corpus,
    save_marian,
    save_tokenizer,
)

from train.data.tokenizers import SentencePieceTokenizer, write_model
from transformer_jax import (
    BahdanauSeq2Seq,
    GenerationDefaults,
    RNNSeq2SeqConfig,
    Transformer,
    TransformerConfig,
    greedy_decode,
    load_marian,
    marian_fields,
    marian_generation_defaults,
    read_marian_weights,
)
from transformer_jax import (
    save_marian as export_marian,  # helpers.save_marian writes a transformers-made folder
)
from transformer_jax.interchange.ct2 import ct2_translate, save_ct2

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")
# transformers' MarianTokenizer asks for sacremoses, which it does not use to tokenize.
pytestmark = pytest.mark.filterwarnings("ignore:Recommended. pip install sacremoses")

MAX_LEN = 10  # greedy output positions after the start token


def _relative_error(ours, ref) -> float:
    return float(np.abs(np.asarray(ours) - ref).max() / np.abs(ref).max())


def _marian_config(**overrides) -> TransformerConfig:
    """A tiny model Marian can hold (2 + 3 layers, so the stacks cannot be swapped)."""
    fields = dict(
        src_vocab_size=40,
        tgt_vocab_size=40,
        d_model=32,
        n_heads=4,
        d_ff=64,
        n_encoder_layers=2,
        n_decoder_layers=3,
        positional="sinusoidal_concat",
        layer_norm_eps=1e-5,
        max_len=64,
        dropout=0.2,
        attention_dropout=0.1,
    )
    return TransformerConfig(**{**fields, **overrides})


def _random_params(config: TransformerConfig, seed: int = 0) -> dict:
    """Random params of `Transformer(config)`, drawn in NumPy (no initialiser to compile):
    LayerNorm scales and every bias random too, where initialisers put constants, so that
    any two mixed up give other logits. Pad and bos get the largest output bias, so only
    their exclusion keeps them out of greedy output."""
    tokens = jax.ShapeDtypeStruct((1, 1), jnp.int32)
    shapes = jax.eval_shape(Transformer(config).init, jax.random.key(0), tokens, tokens)
    rng = np.random.default_rng(seed)

    def draw(path, leaf):
        name = path[-1].key
        noise = rng.standard_normal(leaf.shape).astype(np.float32)
        if name == "scale":  # LayerNorm
            return 1.0 + 0.2 * noise
        if name in ("bias", "output_bias"):
            return 0.2 * noise
        return noise * leaf.shape[-1 if name == "embedding" else 0] ** -0.5

    params = jax.tree_util.tree_map_with_path(draw, shapes["params"])
    boost = np.zeros(config.tgt_vocab_size, np.float32)
    boost[[config.pad_id, config.bos_id]] = 10.0
    if config.output_bias:
        params["output_bias"] += boost
    elif not config.tie_output:
        params["output"]["bias"] += boost
    return params


def _source_batch(config: TransformerConfig) -> np.ndarray:
    """[3, 7] source ids ending with EOS, right-padded to three lengths."""
    specials = {config.pad_id, config.bos_id, config.eos_id}
    ordinary = np.array([i for i in range(config.src_vocab_size) if i not in specials])
    src = np.random.default_rng(0).choice(ordinary, size=(3, 7)).astype(np.int32)
    src[:, -1] = config.eos_id
    src[1, 4], src[1, 5:] = config.eos_id, config.pad_id
    src[2, 2], src[2, 3:] = config.eos_id, config.pad_id
    return src


# One exported folder per variant, shared by the logits, greedy and round-trip tests.
VARIANTS = {
    # OPUS-MT's own: one table for everything plus final_logits_bias, decoding from pad.
    "opus": dict(
        share_embeddings=True,
        tie_output=True,
        output_bias=True,
        activation="swish",
        pad_id=39,
        bos_id=39,
        eos_id=0,
    ),
    # Our models' ids (pad 0, bos 1, eos 2); separate vocabularies of two sizes, lm_head.
    "separate-untied": dict(
        tgt_vocab_size=33,
        share_embeddings=False,
        tie_output=False,
        activation="gelu",
        scale_embeddings=False,
    ),
    # Marian writes the shared table under each name, and load_marian reads two tables.
    "shared-untied": dict(share_embeddings=True, tie_output=False, activation="silu"),
}
# (Our own models' combination, shared and tied without output_bias, is spm_model's.)


@pytest.fixture(scope="module", params=list(VARIANTS))
def exported(request, tmp_path_factory):
    config = _marian_config(**VARIANTS[request.param])
    params = _random_params(config)
    folder = tmp_path_factory.mktemp(request.param) / "model"
    export_marian(
        Transformer(config),
        params,
        None,
        folder,
        generation=GenerationDefaults(beam_size=1, max_len=MAX_LEN),
    )
    hf, info = transformers.MarianMTModel.from_pretrained(folder, output_loading_info=True)
    return config, params, folder, hf.eval(), info


def test_transformers_loads_every_tensor_and_computes_our_logits(exported):
    config, params, folder, hf, info = exported
    # Nothing missing (re-initialised), left over or of another shape.
    assert not any(info.values()), info
    pad = config.pad_id
    src = _source_batch(config)
    tgt = np.random.default_rng(1).integers(3, config.tgt_vocab_size, size=(3, 6)).astype(np.int32)
    tgt[:, 0] = config.bos_id
    tgt[1, 3:] = pad
    # Our decoder masks target pads as keys unless decoding starts from pad; tell transformers.
    target_mask = None if config.bos_id == pad else torch.tensor(tgt != pad)
    with torch.no_grad():
        ref = hf(
            input_ids=torch.tensor(src),
            attention_mask=torch.tensor(src != pad),
            decoder_input_ids=torch.tensor(tgt),
            decoder_attention_mask=target_mask,
        ).logits.numpy()
    logits = Transformer(config).apply({"params": params}, jnp.asarray(src), jnp.asarray(tgt))
    assert logits.shape == ref.shape == (3, 6, config.tgt_vocab_size)
    assert _relative_error(logits, ref) < 1e-5


# bad_words_ids [[pad]] (bos is pad), and [[pad], [bos]]; untied outputs give no other case.
@pytest.mark.parametrize("exported", ["opus", "separate-untied"], indirect=True)
def test_transformers_greedy_generate_is_our_greedy_decode(exported):
    """generate() with nothing but the folder's generation_config.json."""
    config, params, folder, hf, _ = exported
    src = _source_batch(config)
    tokens = np.asarray(
        greedy_decode(Transformer(config), params, jnp.asarray(src), max_len=MAX_LEN)
    )
    with torch.no_grad():
        out = hf.generate(
            input_ids=torch.tensor(src), attention_mask=torch.tensor(src != config.pad_id)
        ).numpy()
    assert (out[:, 0] == config.bos_id).all()
    ref = out[:, 1:]  # without the start token; stops once all rows have ended
    np.testing.assert_array_equal(tokens[:, : ref.shape[1]], ref)
    assert (tokens[:, ref.shape[1] :] == config.pad_id).all()
    # A row that runs to max_len is where forced_eos_token_id would have differed.
    assert (tokens != config.eos_id).all(axis=1).any()


def _as_loaded(config: TransformerConfig, params: dict) -> tuple[TransformerConfig, dict]:
    """What load_marian must give back for an export of (config, params): the same, but for
    the two configs Marian writes in its own terms (see marian_export's docstring)."""
    params = jax.tree.map(np.asarray, params)
    if config.share_embeddings and not config.tie_output:
        config = config.replace(share_embeddings=False)
        params = {**params, "src_embed": params["tgt_embed"]}
    if config.tie_output and not config.output_bias:
        config = config.replace(output_bias=True)
        params = {**params, "output_bias": np.zeros(config.tgt_vocab_size, np.float32)}
    return config, params


def test_load_marian_reads_back_the_same_model(exported):
    config, params, folder, _, _ = exported
    model, loaded, tokenizer = load_marian(folder)
    assert tokenizer is None
    want_config, want = _as_loaded(config, params)
    assert model.config == want_config
    # Bit for bit, and the same tree (tree.map raises on another structure).
    jax.tree.map(np.testing.assert_array_equal, loaded, want)
    assert marian_generation_defaults(folder) == GenerationDefaults(beam_size=1, max_len=MAX_LEN)


def test_a_transformers_folder_re_exports_to_the_same_tensors(tmp_path):
    """transformers' own folder -> load_marian -> save_marian: the same tensors, tokenizer
    files and config values (forced_eos_token_id aside: see _generation_fields)."""
    original = tmp_path / "original"
    original.mkdir()
    save_tokenizer(original)
    save_marian(original, vocab_size=len(json.loads((original / "vocab.json").read_text())))
    model, params, tokenizer = load_marian(original)
    again = tmp_path / "again"
    export_marian(model, params, tokenizer, again, generation=marian_generation_defaults(original))

    theirs, ours = read_marian_weights(original), read_marian_weights(again)
    assert theirs.keys() == ours.keys()
    for name in theirs:
        np.testing.assert_array_equal(ours[name], theirs[name], err_msg=name)
    for name in ("source.spm", "target.spm", "vocab.json"):
        assert (again / name).read_bytes() == (original / name).read_bytes(), name
    their_config = json.loads((original / "config.json").read_text())
    our_config = json.loads((again / "config.json").read_text())
    assert (
        our_config.pop("forced_eos_token_id") is None and their_config["forced_eos_token_id"] == 0
    )
    assert {k: their_config[k] for k in our_config} == our_config
    assert marian_generation_defaults(again) == marian_generation_defaults(original)


# ------------------------------------------------------------------ our tokenizer


@pytest.fixture(scope="module")
def spm_model(tmp_path_factory):
    """The project's joint SentencePiece tokenizer, trained on a few dozen sentences, and a
    random model of its vocabulary with our models' defaults (one table for source, target
    and output, no output bias; pad 0, bos 1, eos 2) -> (tokenizer, config, params)."""
    src, tgt = made_up_corpus(40, seed=0)
    path = tmp_path_factory.mktemp("spm") / "joint.model"
    write_model(path, SOURCE_TEXT + TARGET_TEXT + src + tgt, vocab_size=350)
    tokenizer = SentencePieceTokenizer(path)
    size = tokenizer.vocab_size
    config = _marian_config(src_vocab_size=size, tgt_vocab_size=size, activation="relu")
    params = _random_params(config)
    # transformers' decode drops <unk>, SentencePiece's renders it: a zero row gives it
    # logit 0, below the largest of the other 349.
    params["tgt_embed"]["embedding"][tokenizer.unk_id] = 0.0
    return tokenizer, config, params


def test_our_model_and_tokenizer_translate_alike_in_transformers(spm_model, tmp_path):
    tok, config, params = spm_model
    folder = tmp_path / "model"
    generation = GenerationDefaults(beam_size=1, max_len=MAX_LEN)
    export_marian(Transformer(config), params, tok, folder, generation=generation)
    hf_tokenizer = transformers.MarianTokenizer.from_pretrained(folder)
    hf, info = transformers.MarianMTModel.from_pretrained(folder, output_loading_info=True)
    assert not any(info.values()), info
    assert (hf_tokenizer.pad_token_id, hf_tokenizer.eos_token_id) == (tok.pad_id, tok.eos_id)

    # Unseen characters (byte fallback) and doubled spaces included. Differences left: text
    # naming a special token ("</s>") or starting with a language code (">>fra<<") is that
    # token to transformers and plain text to SentencePiece, and transformers' decode strips
    # leading and trailing spaces.
    texts = SOURCE_TEXT + TARGET_TEXT + ["Käse 漢字 ✓ Qq", "Zwei  Hunde\tspielen", "w3 w17 w3"]
    ids = [row + [tok.eos_id] for row in tok.encode_batch(texts)]  # what training reads
    assert hf_tokenizer(texts)["input_ids"] == ids
    assert hf_tokenizer(text_target=texts)["input_ids"] == ids
    assert hf_tokenizer.batch_decode(ids, skip_special_tokens=True) == texts
    assert tok.decode_batch(ids) == texts

    # Translation: transformers' tokenizer, generate and decode against ours.
    inputs = hf_tokenizer(SOURCE_TEXT, padding=True, return_tensors="pt")
    with torch.no_grad():
        generated = hf.generate(**inputs).numpy()[:, 1:]  # without the start token
    src = jnp.asarray(inputs["input_ids"].numpy(), jnp.int32)
    tokens = np.asarray(greedy_decode(Transformer(config), params, src, max_len=MAX_LEN))
    np.testing.assert_array_equal(tokens[:, : generated.shape[1]], generated)
    decoded = [text.strip() for text in tok.decode_batch(tokens)]
    assert all(decoded)  # something to compare in every row
    assert hf_tokenizer.batch_decode(generated, skip_special_tokens=True) == decoded

    # load_marian reads the folder back: the model, and the tokenizer as a MarianTokenizer.
    model, loaded, ours = load_marian(folder)
    want_config, want = _as_loaded(config, params)
    assert model.config == want_config
    jax.tree.map(np.testing.assert_array_equal, loaded, want)
    assert ours.encode_batch(texts) == tok.encode_batch(texts)
    assert ours.decode(tokens) == decoded

    # ... and on to CTranslate2 (`--pretrained DIR --export_ct2`): the decoder starts from the
    # model's bos (1, `<s>`), not from pad as OPUS-MT's, and decodes as ours.
    ctranslate2 = pytest.importorskip("ctranslate2")
    save_ct2(model.config, loaded, ours, tmp_path / "ct2")
    translator = ctranslate2.Translator(str(tmp_path / "ct2"), device="cpu")
    np.testing.assert_array_equal(ct2_translate(translator, ours, src, max_len=MAX_LEN), tokens)


# ------------------------------------------------------------------ what Marian cannot hold


@pytest.mark.parametrize(
    "overrides,match",
    [
        (dict(norm_first=True), r"norm_first=True \(pre-LN\): Marian is post-LN"),
        (dict(positional="sinusoidal"), "positional='sinusoidal' .*'sinusoidal_concat'"),
        (dict(positional="learned"), "positional='learned'"),
        (dict(layer_norm_eps=1e-6), "layer_norm_eps=1e-06: .* 1e-05"),
    ],
)
def test_a_config_marian_cannot_hold_is_an_error_and_writes_nothing(tmp_path, overrides, match):
    config = _marian_config(**overrides)
    with pytest.raises(ValueError, match=match):
        marian_fields(config)
    with pytest.raises(ValueError, match=match):  # the config is checked before the params
        export_marian(Transformer(config), {}, None, tmp_path / "model")
    assert list(tmp_path.iterdir()) == []


def test_every_unexpressible_field_is_named_at_once():
    config = _marian_config(norm_first=True, positional="learned", layer_norm_eps=1e-6)
    with pytest.raises(ValueError, match="norm_first=True.*positional='learned'.*layer_norm_eps"):
        marian_fields(config)


def test_a_baseline_is_an_error(tmp_path):
    config = RNNSeq2SeqConfig.tiny()
    with pytest.raises(ValueError, match="RNNSeq2SeqConfig .*only a TransformerConfig"):
        marian_fields(config)
    with pytest.raises(ValueError, match="RNNSeq2SeqConfig"):
        export_marian(BahdanauSeq2Seq(config), {}, None, tmp_path / "model")
    assert list(tmp_path.iterdir()) == []


def test_a_tokenizer_that_does_not_fit_the_model_is_an_error(spm_model, tmp_path):
    tok, config, params = spm_model
    with pytest.raises(ValueError, match="pad_id is 0, the model config's is 5"):
        export_marian(config.replace(pad_id=5, bos_id=5), params, tok, tmp_path / "model")
    with pytest.raises(ValueError, match="eos_id is 2, the model config's is 4"):
        export_marian(config.replace(eos_id=4), params, tok, tmp_path / "model")
    with pytest.raises(TypeError, match="MarianTokenizer or a SentencePiece tokenizer"):
        export_marian(config, params, object(), tmp_path / "model")
    # The tokenizer is checked before the params (which would not fit either).
    small = config.replace(share_embeddings=False, tgt_vocab_size=300)
    with pytest.raises(ValueError, match="target vocabulary has ids up to 349.* of 300"):
        export_marian(small, params, tok, tmp_path / "model")
    assert list(tmp_path.iterdir()) == []


def test_params_or_generation_that_do_not_fit_the_config_are_errors(tmp_path):
    config = _marian_config()
    params = _random_params(config)
    with pytest.raises(ValueError, match="missing.*decoder/layers_3"):
        export_marian(config.replace(n_decoder_layers=4), params, None, tmp_path / "model")
    bigger = config.replace(src_vocab_size=41, tgt_vocab_size=41)
    with pytest.raises(
        ValueError, match=r"embedding has shape \(40, 32\), the config makes it \(41"
    ):
        export_marian(bigger, params, None, tmp_path / "model")
    # transformers' position table has max_len rows: a longer output would index past it.
    with pytest.raises(ValueError, match="max_len 65 exceeds the model's max_len 64"):
        export_marian(
            config, params, None, tmp_path / "model", generation=GenerationDefaults(1, 65)
        )
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------ safe writes


def test_an_existing_folder_survives_a_failed_export(spm_model, tmp_path):
    tok, config, params = spm_model
    folder = tmp_path / "model"
    export_marian(config, params, None, folder)
    before = file_hashes(folder)

    with pytest.raises(FileExistsError, match="overwrite=True"):
        export_marian(config, params, None, folder)
    with pytest.raises(ValueError, match="norm_first"):
        export_marian(config.replace(norm_first=True), params, None, folder, overwrite=True)
    # A failure halfway through writing: the tokenizer's model file is gone (it was loaded).
    moved = tok.model_path.rename(tmp_path / "elsewhere.model")
    try:
        with pytest.raises(FileNotFoundError):
            export_marian(config, params, tok, folder, overwrite=True)
    finally:
        moved.rename(tok.model_path)
    assert file_hashes(folder) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # no partial folder left

    export_marian(config, params, tok, folder, overwrite=True)
    assert (folder / "source.spm").read_bytes() == tok.model_path.read_bytes()
    assert file_hashes(folder)["model.safetensors"] == before["model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # the old one is gone
