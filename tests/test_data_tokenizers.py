"""Tokenizers: SentencePiece round trip, special ids and caching; PTB word/char vocabularies.

SentencePiece training is kept small (2,000 sentences, 500 pieces). The PTB references are
the shipped .gz files read with plain `gzip` and counted the slow, obvious way.
"""

from __future__ import annotations

import gzip
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from train.data import datasets, tokenizers
from train.data.tokenizers import CharVocab, SentencePieceTokenizer, StreamVocab, WordVocab

DATA = Path(datasets.__file__).parent / "data"


def gz_lines(path: Path) -> list[str]:
    with gzip.open(path, "rt", encoding="utf-8", newline="") as f:
        text = f.read()
    return text[: text.rfind("\n")].split("\n")


@pytest.fixture(scope="module")
def sentences() -> list[str]:
    """1,000 train pairs (de and en): 2,000 sentences, with every odd line the data has."""
    de, en = (
        gz_lines(DATA / "multi30k" / "train.de.gz"),
        gz_lines(DATA / "multi30k" / "train.en.gz"),
    )
    picked = list(range(1000))
    # Make sure the sample holds the irregular lines: leading/trailing or doubled spaces, a tab.
    odd = [i for i, s in enumerate(de) if s != s.strip() or "  " in s][:20]
    odd += [i for i, s in enumerate(de) if "\t" in s]
    picked = sorted(set(picked[: 1000 - len(odd)]) | set(odd))
    return [s for i in picked for s in (de[i], en[i])]


@pytest.fixture(scope="module")
def tokenizer(sentences, tmp_path_factory) -> SentencePieceTokenizer:
    return SentencePieceTokenizer.train_or_load(
        sentences, tmp_path_factory.mktemp("work"), vocab_size=500
    )


def test_special_ids_and_size(tokenizer):
    assert tokenizer.vocab_size == 500
    assert [tokenizer.id_to_piece(i) for i in range(4)] == ["<pad>", "<s>", "</s>", "<unk>"]
    assert (tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id, tokenizer.unk_id) == (0, 1, 2, 3)


def test_round_trip_is_exact(tokenizer, sentences):
    assert any(s != s.strip() for s in sentences) and any("\t" in s for s in sentences)
    for s in sentences:
        ids = tokenizer.encode(s)
        assert min(ids) > 3  # no specials (bos/eos/unk) inside a sentence
        assert tokenizer.decode(ids) == s
    # Unseen text, including characters outside the training alphabet (byte fallback).
    held_out = gz_lines(DATA / "multi30k" / "test_2018_flickr.de.gz")[:200] + ["Straße 東京 ☃ —"]
    encoded = tokenizer.encode_batch(held_out)
    assert [tokenizer.decode(ids) for ids in encoded] == held_out
    assert encoded == [tokenizer.encode(s) for s in held_out]


def test_decode_stops_at_eos_and_skips_pad_and_bos(tokenizer):
    ids = tokenizer.encode("Ein Mann fährt Fahrrad.")
    row = np.array([1, *ids, 2, *tokenizer.encode(" noch mehr"), 0, 0], dtype=np.int32)
    assert tokenizer.decode(row) == "Ein Mann fährt Fahrrad."
    assert tokenizer.decode_batch(np.stack([row, row])) == ["Ein Mann fährt Fahrrad."] * 2


def test_training_is_cached_and_deterministic(sentences, tokenizer, tmp_path, monkeypatch):
    # Same text and options in the same directory: loaded, never retrained.
    workdir = tokenizer.model_path.parent
    monkeypatch.setattr(tokenizers, "_train_model", lambda *a, **k: pytest.fail("retrained"))
    again = SentencePieceTokenizer.train_or_load(sentences, workdir, vocab_size=500)
    assert again.model_path == tokenizer.model_path
    monkeypatch.undo()
    # Trained again elsewhere: the very same model bytes.
    fresh = SentencePieceTokenizer.train_or_load(sentences, tmp_path, vocab_size=500)
    assert fresh.model_path.read_bytes() == tokenizer.model_path.read_bytes()
    # Other text: another cache file, not the stale model.
    other = SentencePieceTokenizer.train_or_load(sentences[:-2], tmp_path, vocab_size=500)
    assert other.model_path != fresh.model_path
    assert len(list(tmp_path.glob("*.model"))) == 2 and not list(tmp_path.glob("*.tmp"))


def test_bad_tokenizer_options(sentences, tmp_path):
    with pytest.raises(ValueError, match="model_type"):
        SentencePieceTokenizer.train_or_load(sentences, tmp_path, model_type="word")
    with pytest.raises(ValueError, match="vocab_size"):
        SentencePieceTokenizer.train_or_load(sentences, tmp_path, vocab_size=100)
    with pytest.raises(ValueError, match="vocab_size=50000"):
        SentencePieceTokenizer.train_or_load(sentences[:50], tmp_path, vocab_size=50000)


# --- PTB vocabularies --------------------------------------------------------------------------


def reference_vocab(lines: list[str]) -> list[str]:
    counts = Counter()
    for line in lines:
        for token in line.split():
            counts[token] += 1
    return ["<eos>"] + sorted(counts, key=lambda t: (-counts[t], t))


def reference_stream(lines: list[str], symbols: list[str]) -> np.ndarray:
    out = []
    for line in lines:
        for token in line.split():
            out.append(symbols.index(token))  # slow and obvious; used on small inputs
        out.append(0)
    return np.array(out)


@pytest.fixture(scope="module")
def ptb_word() -> dict[str, list[str]]:
    return {s: gz_lines(DATA / "ptb" / f"ptb.{s}.txt.gz") for s in ("train", "valid", "test")}


def test_word_vocab_is_the_standard_10k(ptb_word):
    vocab = WordVocab.from_lines(ptb_word["train"])
    expected = reference_vocab(ptb_word["train"])
    assert vocab.vocab_size == 10_000 == len(expected)
    assert list(vocab.symbols) == expected
    assert vocab.symbols[:4] == ("<eos>", "the", "<unk>", "N")
    train = vocab.encode_lines(ptb_word["train"])
    assert train.dtype == np.int32 and train.shape == (929_589,)
    # Independent check of the stream: map back with a plain dict built from the reference list.
    index = {t: i for i, t in enumerate(expected)}
    head = [index[t] for line in ptb_word["train"][:300] for t in [*line.split(), "<eos>"]]
    np.testing.assert_array_equal(train[: len(head)], head)
    assert vocab.decode(train[: len(head)]).split() == [
        t for line in ptb_word["train"][:300] for t in [*line.split(), "<eos>"]
    ]
    assert vocab.encode_lines(ptb_word["valid"]).shape == (73_760,)
    assert vocab.encode_lines(ptb_word["test"]).shape == (82_430,)


def test_unknown_symbol_is_a_clear_error(ptb_word):
    vocab = WordVocab.from_lines(ptb_word["train"][:50])
    with pytest.raises(ValueError, match=r"line 1: symbol 'zyzzyva' is not in the"):
        vocab.encode_lines([ptb_word["train"][0], "the zyzzyva"])
    with pytest.raises(ValueError, match="must start with"):
        StreamVocab(["the", "<eos>"])


def test_char_vocab_has_50_symbols():
    lines = {s: gz_lines(DATA / "ptb" / f"ptb.char.{s}.txt.gz") for s in ("train", "valid", "test")}
    vocab = CharVocab.from_lines(lines["train"])
    expected = reference_vocab(lines["train"])
    assert vocab.vocab_size == 50 and list(vocab.symbols) == expected
    assert "_" in vocab.symbols and all(len(s) == 1 for s in vocab.symbols[1:])
    sizes = {s: vocab.encode_lines(lines[s]).shape[0] for s in lines}
    assert sizes == {"train": 5_017_482, "valid": 393_042, "test": 442_423}
    np.testing.assert_array_equal(
        vocab.encode_lines(lines["valid"][:40]), reference_stream(lines["valid"][:40], expected)
    )


def test_from_ptb_builds_through_the_tfds_dataset(tmp_path, ptb_word):
    vocab = WordVocab.from_ptb(data_dir=tmp_path)
    assert vocab.symbols == WordVocab.from_lines(ptb_word["train"]).symbols
    # The check of the expected size: a class expecting another size refuses.

    class Wrong(WordVocab):
        PTB_SIZE = 9_999

    with pytest.raises(ValueError, match="expected 9999"):
        Wrong.from_ptb(data_dir=tmp_path)


def test_a_vocabulary_size_the_text_cannot_give_names_the_sizes_it_can(tmp_path):
    from train.data.tokenizers import VocabularySizeError, write_model

    sentences = ["ein mann fährt fahrrad", "a man rides a bike", "zwei hunde im schnee"] * 20
    ranges = set()
    for size in (4000, 64):
        with pytest.raises(VocabularySizeError) as e:
            write_model(tmp_path / "m.model", sentences, vocab_size=size)
        message = str(e.value)
        assert message.startswith(f"vocab_size={size}: SentencePiece can make between")
        assert f"{e.value.low:,} and {e.value.high:,} pieces of these 60 training" in message
        ranges.add((e.value.low, e.value.high))
    # Either side's error gives the same range, and both ends of it are sizes it can make.
    ((low, high),) = ranges
    assert low == len(set("".join(sentences))) + 256 + 4  # characters, bytes, specials
    for size in (low, high):
        write_model(tmp_path / f"{size}.model", sentences, vocab_size=size)


def test_one_closed_vocabulary_counts_ptb_and_text_runs_alike():
    """PTB's vocabularies and a text run's are one class (`train.data.vocab.ClosedVocab`):
    the same count order (most frequent first, ties in code point order), <eos> 0, and <unk>
    1 only where unknown symbols read as it; PTB's own <unk> is a counted word."""
    from train.data.vocab import ClosedVocab
    from train.lm.text import TextVocab

    lines = ["b a c a", "c a <unk> b", "d <eos>"]
    ptb = WordVocab.from_lines(lines)
    text = TextVocab.build(lines, "word")
    assert isinstance(ptb, ClosedVocab) and isinstance(text, ClosedVocab)
    assert ptb.symbols == ("<eos>", "a", "b", "c", "<unk>", "d")
    assert text.symbols == ("<eos>", "<unk>", "a", "b", "c", "d")
    np.testing.assert_array_equal(ptb.encode_lines(["a d", "b"]), [1, 5, 0, 2, 0])
    np.testing.assert_array_equal(text.encode_lines(["a zz", "d"]), [2, 1, 0, 5, 0])
    with pytest.raises(ValueError, match="line 1: symbol 'zz' is not in the 6-symbol"):
        ptb.encode_lines(["a", "zz"])
    chars = TextVocab.build(["abca", "b"], "char", max_vocab=4)
    assert chars.symbols == ("<eos>", "<unk>", "a", "b") and chars.token_to_id("c") == 1
    with pytest.raises(KeyError):
        ptb.token_to_id("zz")
