"""CTranslate2 export (`transformer_jax.interchange.ct2`): ctranslate2's greedy and beam
outputs on the exported model must be ours token for token, for every kind of config the export
maps differently; and the export's vocabularies, special tokens, position table, quantization and
folder handling.

Every model is tiny and random. Random models decode degenerately (one token repeated, or EOS
at once), which would let a wrong export pass; `distinct_params` scales the weights so that
the outputs depend on the source and the position, and each comparison asserts that they do.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import SOURCE_TEXT, TARGET_TEXT, made_up_corpus, marian_vocab, train_spm

from transformer_jax import (
    MarianTokenizer,
    Transformer,
    TransformerConfig,
    beam_search,
    greedy_decode,
    save_ct2,
)
from transformer_jax.baselines.seq2seq import RNNSeq2SeqConfig
from transformer_jax.interchange.ct2 import ct2_tokens, ct2_translate, positions_rows

ctranslate2 = pytest.importorskip("ctranslate2")

BATCH, SRC_LEN, MAX_LEN = 10, 9, 12  # sentences, longest source (EOS included), outputs


class JointTokenizer:
    """The calls save_ct2 makes of train.data.tokenizers.SentencePieceTokenizer (pad 0, bos 1,
    eos 2, unk 3), over made-up pieces."""

    pad_id, bos_id, eos_id, unk_id = 0, 1, 2, 3

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self._pieces = ["<pad>", "<s>", "</s>", "<unk>"] + [f"▁w{i}" for i in range(4, vocab_size)]

    def id_to_piece(self, i: int) -> str:
        return self._pieces[int(i)]


def marian_tokenizer(folder) -> MarianTokenizer:
    """A MarianTokenizer with separate source and target vocabularies (</s> 0, <unk> 1,
    <pad> 2, as helpers.marian_vocab lays them out)."""
    source = train_spm(folder / "source.spm", SOURCE_TEXT)
    target = train_spm(folder / "target.spm", TARGET_TEXT)
    for name, pieces in (("vocab.json", source), ("target_vocab.json", target)):
        (folder / name).write_text(json.dumps(marian_vocab(pieces, pad_last=False)))
    return MarianTokenizer(
        folder / "source.spm",
        folder / "target.spm",
        folder / "vocab.json",
        folder / "target_vocab.json",
    )


def distinct_params(config: TransformerConfig, seed: int) -> dict:
    """Random params whose greedy outputs vary with the source and the position.

    Left as initialised, the token fed back dominates the decoder's state and the tied output
    repeats it. Sharp attention (query and key kernels x6) and a strong cross-attention (its
    value and output kernels x5) make each step read a different part of the source. Every
    LayerNorm and bias is random, so a mix-up of any two shows.
    """
    tokens = jnp.zeros((1, 1), jnp.int32)
    params = Transformer(config).init(jax.random.key(seed), tokens, tokens)["params"]
    flat, tree = jax.tree_util.tree_flatten_with_path(params)
    rng = np.random.default_rng(seed)
    out = []
    for path, x in flat:
        name = "/".join(k.key for k in path)
        noise = rng.standard_normal(x.shape).astype(np.float32)
        if name.endswith("norm/scale"):
            x = 1.0 + 0.3 * noise
        elif name in ("output_bias", "output/bias"):
            x = 0.3 * noise
        elif name == "positions/table":
            x = noise  # the sinusoids' scale: positions must matter
        elif name.endswith("/bias"):
            x = 0.1 * noise
        elif name.endswith(("query/kernel", "key/kernel")):
            x = 6.0 * x
        elif "cross_attn" in name and name.endswith(("value/kernel", "out/kernel")):
            x = 5.0 * x
        out.append(jnp.asarray(x))
    return jax.tree_util.tree_unflatten(tree, out)


def random_sources(config: TransformerConfig, tokenizer, seed: int) -> np.ndarray:
    """[BATCH, SRC_LEN] sources of lengths 2 .. SRC_LEN (EOS included), pad-padded."""
    rng = np.random.default_rng(seed)
    specials = {config.pad_id, config.bos_id, config.eos_id, tokenizer.unk_id}
    words = [i for i in range(_source_size(tokenizer)) if i not in specials]
    src = np.full((BATCH, SRC_LEN), config.pad_id, np.int32)
    for b in range(BATCH):
        n = SRC_LEN if b == 0 else int(rng.integers(2, SRC_LEN + 1))
        src[b, : n - 1] = rng.choice(words, n - 1)
        src[b, n - 1] = config.eos_id
    return src


def _source_size(tokenizer) -> int:
    if isinstance(tokenizer, MarianTokenizer):
        return tokenizer.source_vocab_size
    return tokenizer.vocab_size


@dataclasses.dataclass
class Case:
    config: TransformerConfig
    params: dict
    tokenizer: object
    src: np.ndarray
    folder: str

    @property
    def model(self) -> Transformer:
        return Transformer(self.config)

    def translator(self, **kwargs):
        kwargs = {"device": "cpu", "compute_type": "float32", **kwargs}
        return ctranslate2.Translator(self.folder, **kwargs)


def _pre_ln(tmp):
    """The cpu preset's shape: pre-LN, interleaved sinusoids, relu, one shared tied table."""
    config = TransformerConfig.tiny(
        src_vocab_size=40, tgt_vocab_size=40, d_model=32, norm_first=True, layer_norm_eps=1e-6
    )
    return config, JointTokenizer(40)


def _marian_like(tmp):
    """Marian's shape: post-LN, sines then cosines, swish, separate vocabularies (the model's
    source side 3 ids larger than the tokenizer's), tied output plus a bias, decoding from pad.
    Pad is made the likeliest output: only its exclusion keeps it out."""
    tokenizer = marian_tokenizer(tmp)
    config = TransformerConfig.tiny(
        src_vocab_size=tokenizer.source_vocab_size + 3,
        tgt_vocab_size=max(tokenizer.target_vocab.values()) + 1,
        d_model=32,
        activation="swish",
        layer_norm_eps=1e-5,
        positional="sinusoidal_concat",
        share_embeddings=False,
        output_bias=True,
        pad_id=tokenizer.pad_id,
        bos_id=tokenizer.pad_id,
        eos_id=tokenizer.eos_id,
    )
    return config, tokenizer


def _learned(tmp):
    """Learned positions (max_len rows, all used), gelu, an untied projection with its bias,
    unscaled embeddings; bos is made the likeliest output."""
    config = TransformerConfig.tiny(
        src_vocab_size=36,
        tgt_vocab_size=36,
        d_model=48,
        n_heads=4,
        activation="gelu",
        layer_norm_eps=1e-5,
        norm_first=True,
        positional="learned",
        max_len=MAX_LEN,
        scale_embeddings=False,
        tie_output=False,
    )
    return config, JointTokenizer(36)


CASES = {"pre_ln": _pre_ln, "marian_like": _marian_like, "learned": _learned}
# Output-bias changes: a special token made the likeliest (only its exclusion keeps it out of
# the output), and EOS made likelier, so that some outputs end early.
BIAS_ADD = {
    "marian_like": {"pad_id": 10.0, "eos_id": 2.0},
    "learned": {"bos_id": 10.0, "eos_id": 1.0},
}


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory) -> Case:
    tmp = tmp_path_factory.mktemp(request.param)
    config, tokenizer = CASES[request.param](tmp)
    params = distinct_params(config, seed=1)
    for token, add in BIAS_ADD.get(request.param, {}).items():
        token = getattr(config, token)
        if config.tie_output:
            params["output_bias"] = params["output_bias"].at[token].add(add)
        else:
            params["output"]["bias"] = params["output"]["bias"].at[token].add(add)
    folder = str(tmp / "ct2")
    save_ct2(config, params, tokenizer, folder)
    src = random_sources(config, tokenizer, seed=1)
    return Case(config, params, tokenizer, src, folder)


def _lengths(tokens: np.ndarray, eos: int) -> list[int]:
    """Tokens before EOS (all of a row without one)."""
    return [row.index(eos) if eos in row else len(row) for row in tokens.tolist()]


def _greedy(case: Case, src=None) -> np.ndarray:
    src = case.src if src is None else src
    return np.asarray(greedy_decode(case.model, case.params, jnp.asarray(src), max_len=MAX_LEN))


def test_greedy_equals_ours(case):
    ours = _greedy(case)
    theirs = ct2_translate(case.translator(), case.tokenizer, case.src, max_len=MAX_LEN)
    np.testing.assert_array_equal(theirs, ours)
    # A comparison that could fail: outputs differ between sentences, run several steps, and
    # some end with EOS (then pad) before max_len.
    assert len({tuple(row) for row in ours.tolist()}) >= 3, ours
    lengths = _lengths(ours, case.config.eos_id)
    assert max(lengths) > 3 and min(lengths) < MAX_LEN, ours


def test_beam_search_equals_ours(case):
    """Beam 4 with no length penalty: both rank by the summed log-probs (EOS included, pad and
    bos excluded from the softmax). The searches differ in one respect: ours keeps a finished
    hypothesis in its beam slot, ctranslate2 sets it aside and keeps W alive; they can end on
    different hypotheses, but on these models they agree, and the scores must then agree."""
    src = jnp.asarray(case.src)
    ours, our_scores = beam_search(
        case.model, case.params, src, beam_size=4, max_len=MAX_LEN, length_penalty=0.0
    )
    theirs, scores = ct2_translate(
        case.translator(),
        case.tokenizer,
        case.src,
        max_len=MAX_LEN,
        beam_size=4,
        length_penalty=0.0,
        return_scores=True,
    )
    np.testing.assert_array_equal(theirs, np.asarray(ours[:, 0]))
    np.testing.assert_allclose(scores, np.asarray(our_scores[:, 0]), rtol=1e-4, atol=1e-4)
    # The beam finds other outputs than greedy: the search itself is compared.
    assert (theirs != _greedy(case)).any(axis=1).sum() >= 3


def test_config_and_vocabularies(case):
    c, tokenizer = case.config, case.tokenizer
    with open(os.path.join(case.folder, "config.json")) as f:
        saved = json.load(f)
    assert saved["layer_norm_epsilon"] == pytest.approx(c.layer_norm_eps)
    assert saved["add_source_eos"] is True and saved["add_source_bos"] is False
    start = tokenizer.id_to_piece(c.bos_id)  # "<pad>" for the Marian-like model
    assert saved["decoder_start_token"] == saved["bos_token"] == start
    assert start == ("<pad>" if c.bos_id == c.pad_id else "<s>")
    assert (saved["eos_token"], saved["unk_token"]) == ("</s>", "<unk>")

    def vocabulary(name):
        with open(os.path.join(case.folder, f"{name}_vocabulary.json")) as f:
            return json.load(f)

    if isinstance(tokenizer, MarianTokenizer):
        source, target = vocabulary("source"), vocabulary("target")
        by_id = {i: p for p, i in tokenizer.source_vocab.items()}
        extra = range(tokenizer.source_vocab_size, c.src_vocab_size)
        assert source == [by_id[i] for i in range(tokenizer.source_vocab_size)] + [
            f"<unused_{i}>" for i in extra
        ]
        assert target == sorted(tokenizer.target_vocab, key=tokenizer.target_vocab.get)
    else:
        shared = vocabulary("shared")
        assert shared == [tokenizer.id_to_piece(i) for i in range(tokenizer.vocab_size)]


def test_int8(tmp_path):
    """An int8 export is smaller, translates into well-formed outputs, and gives the float32
    outputs log-probs close to float32's. (Its greedy tokens are not compared: these random
    models' margins between the best two tokens are often under the quantization error.)"""
    config, tokenizer = _pre_ln(tmp_path)
    params = distinct_params(config, seed=0)
    save_ct2(config, params, tokenizer, tmp_path / "f32")
    save_ct2(config, params, tokenizer, tmp_path / "int8", quantization="int8")
    size = os.path.getsize(tmp_path / "int8" / "model.bin")
    assert size < 0.7 * os.path.getsize(tmp_path / "f32" / "model.bin")

    src = random_sources(config, tokenizer, seed=1)
    f32 = ctranslate2.Translator(str(tmp_path / "f32"), device="cpu", compute_type="float32")
    int8 = ctranslate2.Translator(str(tmp_path / "int8"), device="cpu")
    out = ct2_translate(int8, tokenizer, src, max_len=MAX_LEN)
    assert out.shape == (BATCH, MAX_LEN)
    for row in out.tolist():  # tokens, then EOS and pad (or no EOS at all)
        n = row.index(config.eos_id) if config.eos_id in row else MAX_LEN
        assert all(4 <= i < config.tgt_vocab_size for i in row[:n]), row
        assert all(i == config.pad_id for i in row[n + 1 :]), row

    reference = ct2_translate(f32, tokenizer, src, max_len=MAX_LEN)
    pieces = ct2_tokens(tokenizer, src)
    targets = [[tokenizer.id_to_piece(i) for i in row if i > config.eos_id] for row in reference]
    want = np.concatenate([r.log_probs for r in f32.score_batch(pieces, targets)])
    got = np.concatenate([r.log_probs for r in int8.score_batch(pieces, targets)])
    # The quantization error here is about 0.1 per token (a wrong export: O(1)).
    assert np.abs(got - want).mean() < 0.4, (got, want)


def test_plain_text_pieces(tmp_path):
    """With our joint SentencePiece tokenizer, translate_batch on a text's pieces as the
    export's own SentencePiece model gives them (no EOS) is our greedy decoding of its ids
    plus EOS."""
    import sentencepiece

    from train.data.tokenizers import SentencePieceTokenizer, write_model

    sentences, _ = made_up_corpus(200, seed=0)
    write_model(tmp_path / "spm.model", sentences, vocab_size=300)
    tokenizer = SentencePieceTokenizer(tmp_path / "spm.model")
    config = TransformerConfig.tiny(
        src_vocab_size=304, tgt_vocab_size=304, d_model=32, norm_first=True
    )
    params = distinct_params(config, seed=3)
    save_ct2(config, params, tokenizer, tmp_path / "ct2")

    texts = sentences[:8]
    rows = [ids + [config.eos_id] for ids in tokenizer.encode_batch(texts)]
    src = np.full((len(rows), max(map(len, rows))), config.pad_id, np.int32)
    for b, row in enumerate(rows):
        src[b, : len(row)] = row
    ours = np.asarray(greedy_decode(Transformer(config), params, jnp.asarray(src), max_len=MAX_LEN))

    translator = ctranslate2.Translator(str(tmp_path / "ct2"), device="cpu")
    # The export carries its SentencePiece model, for both sides: the folder is all it needs.
    model_bytes = (tmp_path / "spm.model").read_bytes()
    for name in ("source.spm", "target.spm"):
        assert (tmp_path / "ct2" / name).read_bytes() == model_bytes
    spm = sentencepiece.SentencePieceProcessor(model_file=str(tmp_path / "ct2" / "source.spm"))
    pieces = [spm.encode(text, out_type=str) for text in texts]
    results = translator.translate_batch(
        pieces, beam_size=1, max_decoding_length=MAX_LEN, min_decoding_length=0
    )
    for b, result in enumerate(results):
        n = _lengths(ours[b : b + 1], config.eos_id)[0]
        want = [tokenizer.id_to_piece(i) for i in ours[b, :n]]
        assert result.hypotheses[0] == want
    assert len({tuple(r.hypotheses[0]) for r in results}) >= 3


class MarianVocabs:
    """The vocabulary calls save_ct2 makes of a MarianTokenizer, over given vocab.json dicts."""

    eos_id, unk_id, pad_id = 0, 1, 2

    def __init__(self, source: dict, target: dict):
        self.source_vocab, self.target_vocab = source, target


def test_marian_vocabulary_gaps_and_duplicates(tmp_path):
    base = {"</s>": 0, "<unk>": 1, "<pad>": 2}
    config = TransformerConfig.tiny(
        src_vocab_size=8,
        tgt_vocab_size=6,
        d_model=32,
        share_embeddings=False,
        bos_id=2,
        pad_id=2,
        eos_id=0,
    )
    params = distinct_params(config, seed=0)
    source = {**base, "▁a": 3, "▁c": 6}  # no ids 4, 5 or 7
    target = {**base, "▁x": 3, "▁y": 4, "▁z": 5}
    save_ct2(config, params, MarianVocabs(source, target), tmp_path / "ct2")
    with open(tmp_path / "ct2" / "source_vocabulary.json") as f:
        assert json.load(f) == [
            "</s>",
            "<unk>",
            "<pad>",
            "▁a",
            "<unused_4>",
            "<unused_5>",
            "▁c",
            "<unused_7>",
        ]
    # Translating maps pieces back to ids, placeholders included.
    src = np.array([[3, 4, 6, 0], [7, 0, 2, 2]], np.int32)
    translator = ctranslate2.Translator(str(tmp_path / "ct2"), device="cpu")
    ours = np.asarray(greedy_decode(Transformer(config), params, jnp.asarray(src), max_len=5))
    theirs = ct2_translate(translator, MarianVocabs(source, target), src, max_len=5)
    np.testing.assert_array_equal(theirs, ours)

    # A gap's placeholder may not name a real piece: ctranslate2 finds ids by piece.
    clash = {**base, "▁x": 3, "<unused_4>": 5}
    with pytest.raises(ValueError, match="several ids with one piece"):
        save_ct2(config, params, MarianVocabs(source, clash), tmp_path / "bad")
    assert not (tmp_path / "bad").exists()


def _listing(folder) -> dict[str, bytes]:
    return {name: (folder / name).read_bytes() for name in sorted(os.listdir(folder))}


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """A small model's (config, params, tokenizer)."""
    config, tokenizer = _pre_ln(tmp_path_factory.mktemp("small"))
    return config, distinct_params(config, seed=0), tokenizer


def test_position_table_length(small, tmp_path):
    """Sinusoids: 1024 rows whatever max_len, so a source longer than max_len translates as
    ours; learned positions: the table's max_len rows, and ctranslate2 refuses more."""
    config, params, tokenizer = small
    assert positions_rows(config) == 1024 and config.max_len == 64
    assert positions_rows(config.replace(max_len=2000)) == 2000
    save_ct2(config, params, tokenizer, tmp_path / "sinusoid")
    src = np.random.default_rng(0).integers(4, 40, (2, 80)).astype(np.int32)
    src[:, -1] = config.eos_id
    translator = ctranslate2.Translator(str(tmp_path / "sinusoid"), device="cpu")
    ours = greedy_decode(Transformer(config), params, jnp.asarray(src), max_len=MAX_LEN)
    theirs = ct2_translate(translator, tokenizer, src, max_len=MAX_LEN)
    np.testing.assert_array_equal(theirs, np.asarray(ours))

    learned = config.replace(positional="learned", max_len=16)
    assert positions_rows(learned) == 16
    params = distinct_params(learned, seed=0)
    save_ct2(learned, params, tokenizer, tmp_path / "learned")
    translator = ctranslate2.Translator(str(tmp_path / "learned"), device="cpu")
    with pytest.raises(RuntimeError, match="No position encodings"):
        ct2_translate(translator, tokenizer, src[:, -17:], max_len=4)


def test_what_ctranslate2_cannot_express_writes_nothing(small, tmp_path):
    config, params, tokenizer = small
    folder = tmp_path / "ct2"
    with pytest.raises(ValueError, match="RNNSeq2SeqConfig"):
        save_ct2(RNNSeq2SeqConfig(src_vocab_size=40, tgt_vocab_size=40), params, tokenizer, folder)
    with pytest.raises(ValueError, match=r"has 50 ids, more than the model's source .*\(40\)"):
        save_ct2(config, params, JointTokenizer(50), folder)
    with pytest.raises(ValueError, match="missing.*output_bias"):
        save_ct2(config.replace(output_bias=True), params, tokenizer, folder)
    with pytest.raises(ValueError, match="quantization"):
        save_ct2(config, params, tokenizer, folder, quantization="int4")
    assert os.listdir(tmp_path) == []


def test_an_existing_export_is_kept_unless_overwrite(small, tmp_path):
    config, params, tokenizer = small
    folder = tmp_path / "ct2"
    save_ct2(config, params, tokenizer, folder)
    before = _listing(folder)
    with pytest.raises(FileExistsError, match=str(folder)):
        save_ct2(config, params, tokenizer, folder, quantization="int8")
    assert _listing(folder) == before

    save_ct2(config, params, tokenizer, folder, quantization="int8", overwrite=True)
    after = _listing(folder)
    assert after.keys() == before.keys() and after["model.bin"] != before["model.bin"]
    assert os.listdir(tmp_path) == ["ct2"]  # no temporary folder left beside it

    # A folder that is not an export is never replaced.
    other = tmp_path / "notes"
    other.mkdir()
    (other / "todo.txt").write_text("keep me")
    with pytest.raises(ValueError, match="not a CTranslate2 export"):
        save_ct2(config, params, tokenizer, other, overwrite=True)
    assert (other / "todo.txt").read_text() == "keep me"


def test_a_failed_export_leaves_what_was_there(small, tmp_path, monkeypatch):
    config, params, tokenizer = small
    folder = tmp_path / "ct2"
    save_ct2(config, params, tokenizer, folder)
    before = _listing(folder)

    def save_half(self, output_dir):
        (Path(output_dir) / "model.bin").write_bytes(b"half")
        raise OSError("disk full")

    monkeypatch.setattr(ctranslate2.specs.TransformerSpec, "save", save_half)
    for target in (folder, tmp_path / "new"):
        with pytest.raises(OSError, match="disk full"):
            save_ct2(config, params, tokenizer, target, overwrite=True)
    assert _listing(folder) == before
    assert os.listdir(tmp_path) == ["ct2"]


def test_without_ctranslate2_the_error_says_what_to_install(small, tmp_path, monkeypatch):
    config, params, tokenizer = small
    monkeypatch.setitem(sys.modules, "ctranslate2", None)
    with pytest.raises(ImportError, match=re.escape('pip install "attention-jax[serve]"')):
        save_ct2(config, params, tokenizer, tmp_path / "ct2")
    assert os.listdir(tmp_path) == []
