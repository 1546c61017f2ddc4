"""OPUS-MT / Marian checkpoints: `load_marian` against transformers' own `MarianMTModel`.

Every model here is random (no downloads): transformers builds it, `save_pretrained` writes the
folder a user would download, and the loaded Transformer must give the same logits and the same
greedy tokens. The tokenizer is compared with transformers' `MarianTokenizer` on SentencePiece
models trained here.
"""

from __future__ import annotations

import json
import shutil
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    LANGUAGE_CODE,
    MARIAN_EOS,
    SOURCE_TEXT,
    TARGET_TEXT,
    save_marian,
    save_tokenizer,
)

from transformer_jax import (
    GenerationDefaults,
    MarianTokenizer,
    greedy_decode,
    load_marian,
    marian_generation_defaults,
    read_marian_weights,
)

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")
# transformers' MarianTokenizer asks for sacremoses, which it does not use to tokenize.
pytestmark = pytest.mark.filterwarnings("ignore:Recommended. pip install sacremoses")

EOS = MARIAN_EOS
MAX_LEN = 12  # greedy output positions after the start token


def _relative_error(ours, ref) -> float:
    return float(np.abs(np.asarray(ours) - ref).max() / np.abs(ref).max())


def _source_batch(pad, *, high):
    """[3, 7] source ids ending with EOS, right-padded to three lengths."""
    rng = np.random.default_rng(0)
    src = rng.integers(1, high, size=(3, 7)).astype(np.int32)
    src[:, -1] = EOS
    src[1, 4], src[1, 5:] = EOS, pad
    src[2, 2], src[2, 3:] = EOS, pad
    return src


@pytest.mark.parametrize(
    "share,activation,tie",
    [
        (True, "swish", True),  # OPUS-MT's usual checkpoint
        (False, "relu", True),  # separate source / target vocabularies
        (True, "gelu", False),  # an untied output projection (lm_head)
    ],
)
def test_logits_equal_transformers_on_padded_batches(tmp_path, share, activation, tie):
    hf = save_marian(
        tmp_path,
        decoder_vocab_size=None if share else 33,
        share=share,
        activation=activation,
        tie=tie,
    )
    model, params, tokenizer = load_marian(tmp_path)
    assert tokenizer is None  # no tokenizer files in the folder
    cfg = model.config
    assert (cfg.n_encoder_layers, cfg.n_decoder_layers, cfg.activation) == (2, 3, activation)
    assert cfg.bos_id == cfg.pad_id == hf.config.pad_token_id
    pad = cfg.pad_id
    src = _source_batch(pad, high=pad)
    tgt = np.random.default_rng(1).integers(1, pad, size=(3, 6)).astype(np.int32)
    tgt[:, 0] = pad  # Marian's decoder starts from pad
    tgt[1, 3:] = pad  # right padding
    with torch.no_grad():
        ref = hf(
            input_ids=torch.tensor(src),
            attention_mask=torch.tensor(src != pad),
            decoder_input_ids=torch.tensor(tgt),
        ).logits.numpy()
    logits = model.apply({"params": params}, jnp.asarray(src), jnp.asarray(tgt))
    assert logits.shape == ref.shape == (3, 6, cfg.tgt_vocab_size)
    assert _relative_error(logits, ref) < 1e-5


# ------------------------------------------------------------------ tokenizer

ODD_TEXT = [
    "",
    "  Zwei Hunde  spielen im Schnee ",
    f"{LANGUAGE_CODE} Ein Kind lacht.",
    ">>xyz<< Ein Kind",
    "Ein Mann </s> lacht <unk>",
    "Käse 漢字 ✓ Qq",
]


@pytest.mark.parametrize("separate", [False, True])
def test_tokenizer_equals_transformers(tmp_path, separate):
    hf = save_tokenizer(tmp_path, separate=separate)
    ours = MarianTokenizer.from_folder(tmp_path)
    texts = SOURCE_TEXT + ODD_TEXT
    ids = ours.encode(texts)
    assert ids.dtype == np.int32 and ids.shape[0] == len(texts)
    np.testing.assert_array_equal(ids, hf(texts, padding=True)["input_ids"])
    np.testing.assert_array_equal(
        ours.encode(texts, max_len=5),
        hf(texts, padding=True, truncation=True, max_length=5)["input_ids"],
    )
    assert (ours.pad_id, ours.eos_id) == (hf.pad_token_id, hf.eos_token_id)

    # Target side: what a search returns (tokens, EOS, then pad), and <unk> inside.
    tgt = np.asarray(hf(text_target=TARGET_TEXT, padding=True)["input_ids"])
    tgt[0, 2] = hf.unk_token_id
    decoded = ours.decode(tgt)
    # transformers 5 decodes a joint vocabulary with the *source* SentencePiece model unless
    # told otherwise; 4.x, and this tokenizer, decode the target side with the target model.
    assert decoded == [
        hf.decode(row, skip_special_tokens=True, use_source_tokenizer=False) for row in tgt
    ]
    assert decoded[1] == TARGET_TEXT[1] and ours.decode(tgt[1]) == TARGET_TEXT[1]

    # What fine-tuning trains on: source ids and labels as transformers makes them, less EOS.
    labels = hf(text_target=TARGET_TEXT + ODD_TEXT)["input_ids"]
    assert ours.encode_targets(TARGET_TEXT + ODD_TEXT) == [row[:-1] for row in labels]
    assert ours.encode_batch(texts) == [row[:-1] for row in hf(texts)["input_ids"]]

    # save() writes a folder both tokenizers read back as the same tokenizer.
    ours.save(tmp_path / "saved")
    again = MarianTokenizer.from_folder(tmp_path / "saved")
    assert again.sha256() == ours.sha256() and again.files.keys() == ours.files.keys()
    reloaded = transformers.MarianTokenizer.from_pretrained(tmp_path / "saved")
    np.testing.assert_array_equal(reloaded(texts, padding=True)["input_ids"], ids)
    assert (
        reloaded(text_target=TARGET_TEXT)["input_ids"] == hf(text_target=TARGET_TEXT)["input_ids"]
    )


def test_translation_recipe_equals_transformers_greedy_generate(tmp_path):
    """The README's recipe, load_marian -> encode -> greedy -> decode, as transformers runs it;
    and at every step transformers' cached logits equal our full forward pass."""
    hf_tokenizer = save_tokenizer(tmp_path)
    vocab_size = len(json.loads((tmp_path / "vocab.json").read_text()))
    hf = save_marian(tmp_path, vocab_size=vocab_size)
    model, params, tokenizer = load_marian(tmp_path)
    assert isinstance(tokenizer, MarianTokenizer)
    pad = model.config.pad_id

    src = tokenizer.encode(SOURCE_TEXT[:4])
    tokens = np.asarray(greedy_decode(model, params, jnp.asarray(src), max_len=MAX_LEN))
    with torch.no_grad():
        out = hf.generate(
            input_ids=torch.tensor(src),
            attention_mask=torch.tensor(src != pad),
            num_beams=1,
            do_sample=False,
            max_length=MAX_LEN + 1,
            bad_words_ids=[[pad]],  # as OPUS-MT's generation configs say
            forced_eos_token_id=None,
            output_logits=True,
            return_dict_in_generate=True,
        )
    ref = out.sequences.numpy()[:, 1:]  # without the start token; stops once all have ended
    np.testing.assert_array_equal(tokens[:, : ref.shape[1]], ref)
    assert (tokens[:, ref.shape[1] :] == pad).all()
    assert tokenizer.decode(tokens) == hf_tokenizer.batch_decode(
        ref, skip_special_tokens=True, use_source_tokenizer=False
    )

    step_logits = np.stack([x.numpy() for x in out.logits], axis=1)  # [B, T, V]
    tgt = np.concatenate([np.full((len(src), 1), pad), ref[:, :-1]], axis=1).astype(np.int32)
    logits = model.apply({"params": params}, jnp.asarray(src), jnp.asarray(tgt))
    assert _relative_error(logits, step_logits) < 1e-5


def test_generation_defaults(tmp_path):
    save_marian(tmp_path)
    assert marian_generation_defaults(tmp_path) == GenerationDefaults(beam_size=1, max_len=19)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_beams": 6, "max_length": 512}))
    generation = json.loads((tmp_path / "generation_config.json").read_text())
    (tmp_path / "generation_config.json").write_text(json.dumps({**generation, "num_beams": 4}))
    assert marian_generation_defaults(tmp_path) == GenerationDefaults(beam_size=4, max_len=511)


# ------------------------------------------------------------------ formats and errors


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("marian")
    save_marian(folder)
    return folder


def _copy(saved, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(saved, folder)
    return folder


def test_pytorch_bin_loads_like_safetensors(saved, tmp_path):
    folder = _copy(saved, tmp_path)
    hf = transformers.MarianMTModel.from_pretrained(folder)
    # The full state dict: tied copies, lm_head and the stored sinusoid tables included.
    torch.save(hf.state_dict(), folder / "pytorch_model.bin")
    (folder / "model.safetensors").unlink()
    _, from_bin, _ = load_marian(folder)
    _, from_safetensors, _ = load_marian(saved)
    jax.tree.map(np.testing.assert_array_equal, from_bin, from_safetensors)


def test_pytorch_bin_without_torch_says_to_convert(saved, tmp_path, monkeypatch):
    folder = _copy(saved, tmp_path)
    torch.save(
        transformers.MarianMTModel.from_pretrained(folder).state_dict(),
        folder / "pytorch_model.bin",
    )
    (folder / "model.safetensors").unlink()
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` now fails
    with pytest.raises(ImportError, match="pytorch_model.bin.*model.safetensors"):
        read_marian_weights(folder)


def _edit_config(folder, **fields):
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **fields}))


@pytest.mark.parametrize(
    "fields,error,match",
    [
        (dict(activation_function="gelu_new"), ValueError, "activation_function 'gelu_new'"),
        (dict(normalize_before=True), ValueError, "normalize_before"),
        (dict(decoder_attention_heads=2), ValueError, "decoder_attention_heads"),
        (dict(d_model=None), ValueError, "'d_model'"),
        (dict(eos_token_id=39), ValueError, "eos_id"),
        (dict(model_type="bart"), ValueError, "model_type"),
        (
            dict(encoder_ffn_dim=48, decoder_ffn_dim=48),
            ValueError,
            r"layers.0.fc1.bias has shape \(64,\), but config.json makes it \(48,\)",
        ),
    ],
)
def test_bad_config_is_an_error_naming_it(saved, tmp_path, fields, error, match):
    folder = _copy(saved, tmp_path)
    _edit_config(folder, **fields)
    with pytest.raises(error, match=match):
        load_marian(folder)


def test_missing_and_unexpected_files_are_errors_naming_them(saved, tmp_path):
    folder = _copy(saved, tmp_path)
    with pytest.raises(FileNotFoundError, match="is not a folder"):
        load_marian(tmp_path / "nowhere")
    (folder / "source.spm").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="target.spm, vocab.json"):
        load_marian(folder)
    (folder / "source.spm").unlink()
    (folder / "model.safetensors").rename(tmp_path / "weights.safetensors")
    with pytest.raises(FileNotFoundError, match="model.safetensors nor pytorch_model.bin"):
        load_marian(folder)

    from safetensors.numpy import load_file, save_file

    state = load_file(tmp_path / "weights.safetensors")
    save_file(
        {**state, "model.encoder.layernorm_embedding.weight": np.ones(32, np.float32)},
        folder / "model.safetensors",
    )
    with pytest.raises(ValueError, match="layernorm_embedding"):
        load_marian(folder)
    del state["model.decoder.layers.2.fc2.bias"]
    save_file(state, folder / "model.safetensors")
    with pytest.raises(ValueError, match="model.decoder.layers.2.fc2.bias"):
        load_marian(folder)
    (folder / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_marian(folder)


def test_tokenizer_that_disagrees_with_the_config_is_an_error(saved, tmp_path):
    folder = _copy(saved, tmp_path)
    save_tokenizer(folder)  # its <pad> is not the model's id 39
    with pytest.raises(ValueError, match="pad_token_id"):
        load_marian(folder)
