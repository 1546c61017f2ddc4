"""Tokenizers: SentencePiece for translation, fixed word / character vocabularies for PTB.

SentencePieceTokenizer: one joint German+English model (a shared vocabulary lets a model tie
its source, target and output embeddings). Ids: pad=0, bos=1, eos=2, unk=3. It is trained on
the raw training sentences with the identity normalization, extra whitespace kept and byte
fallback, so `decode(encode(s)) == s` for every sentence, even one with a character never seen
in training: what the model reads is exactly the data, and decoded output is cased,
detokenized text ready for sacreBLEU. Trained models are cached in a work directory under a
name that encodes the options and a hash of the training text, so a run retrains only when
the model is missing (and resumed runs reuse the very same vocabulary).

WordVocab / CharVocab: the standard closed PTB vocabularies built from the train split. A
stream token is each whitespace-separated symbol of a line (a word, or a character or `_` of
the char files), and `<eos>` ends every line.
"""

from __future__ import annotations

import functools
import hashlib
import io
import os
import re
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import ClassVar

import numpy as np
import sentencepiece as spm

from train.data.vocab import ClosedVocab

PAD_ID = 0
BOS_ID = 1
EOS_ID = 2
UNK_ID = 3


def model_file_name(name: str, vocab_size: int, key: str, *, model_type: str = "bpe") -> str:
    """`<name>_<model_type><vocab_size>_<key>.model`: the file a trained SentencePiece model is
    kept in, key naming the text and options it was trained on ('*': a glob of every one)."""
    return f"{name}_{model_type}{vocab_size}_{key}.model"


class SentencePieceTokenizer:
    """A SentencePiece model with the project's special ids (pad 0, bos 1, eos 2, unk 3)."""

    pad_id: ClassVar[int] = PAD_ID
    bos_id: ClassVar[int] = BOS_ID
    eos_id: ClassVar[int] = EOS_ID
    unk_id: ClassVar[int] = UNK_ID

    def __init__(self, model_path: str | os.PathLike):
        self.model_path = Path(model_path)
        self._sp = spm.SentencePieceProcessor(model_file=os.fspath(self.model_path))
        ids = (self._sp.pad_id(), self._sp.bos_id(), self._sp.eos_id(), self._sp.unk_id())
        if ids != (PAD_ID, BOS_ID, EOS_ID, UNK_ID):
            raise ValueError(
                f"{self.model_path}: special ids (pad, bos, eos, unk) are {ids}, "
                f"expected {(PAD_ID, BOS_ID, EOS_ID, UNK_ID)}"
            )

    @classmethod
    def train_or_load(
        cls,
        sentences: Sequence[str],
        workdir: str | os.PathLike,
        *,
        vocab_size: int = 8000,
        model_type: str = "bpe",
        name: str = "spm",
    ) -> SentencePieceTokenizer:
        """Loads the cached model for these sentences and options, training it if missing.

        Args:
          sentences: the training text, one sentence per item (for Multi30k: the de and en
            sides of the train split together).
          workdir: directory for the cached `<name>_<model_type><vocab_size>_<hash>.model`.
          vocab_size: number of pieces, including the 4 special ids and 256 byte pieces.
          model_type: 'bpe' (default: trains in about a second on Multi30k) or 'unigram'.
          name: file name prefix.
        """
        if model_type not in ("bpe", "unigram"):
            raise ValueError(f"model_type must be 'bpe' or 'unigram', got {model_type!r}")
        if vocab_size <= 4 + 256:
            raise ValueError(
                f"vocab_size must exceed the 4 special and 256 byte pieces, got {vocab_size}"
            )
        # The hash covers the text and the options, so a changed corpus never reuses a stale model.
        digest = hashlib.sha256()
        digest.update(f"{model_type}|{vocab_size}|{len(sentences)}\n".encode())
        for s in sentences:
            digest.update(s.encode("utf-8") + b"\n")
        workdir = Path(workdir)
        path = workdir / model_file_name(
            name, vocab_size, digest.hexdigest()[:12], model_type=model_type
        )
        if not path.exists():
            write_model(path, sentences, vocab_size=vocab_size, model_type=model_type)
        return cls(path)

    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size()

    def encode(self, text: str) -> list[int]:
        """Piece ids of `text`, without bos/eos."""
        return self._sp.encode(text)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """`encode` over many texts at once (faster: one call into SentencePiece)."""
        return self._sp.encode(list(texts))

    def encode_targets(self, texts: Sequence[str]) -> list[list[int]]:
        """The target side's ids: a joint model encodes both sides alike (`encode_batch`)."""
        return self.encode_batch(texts)

    def sha256(self) -> str:
        """A hash of the model file's bytes: what a cache of its ids keys on."""
        return hashlib.sha256(self.model_path.read_bytes()).hexdigest()

    def decode(self, ids: Iterable[int]) -> str:
        """Detokenized text of `ids`: stops at the first eos, skips pad and bos.

        Accepts model output as is (a list or a [T] array with bos/eos/padding).
        """
        out = []
        for i in np.asarray(ids, dtype=np.int64).reshape(-1).tolist():
            if i == EOS_ID:
                break
            if i not in (PAD_ID, BOS_ID):
                out.append(i)
        return self._sp.decode(out)

    def decode_batch(self, ids_batch: Iterable[Iterable[int]]) -> list[str]:
        """`decode` of each row of a [B, T] array or list of id lists."""
        return [self.decode(ids) for ids in ids_batch]

    def id_to_piece(self, i: int) -> str:
        return self._sp.id_to_piece(int(i))


def write_model(
    path: str | os.PathLike, sentences: Sequence[str], *, vocab_size: int, model_type: str = "bpe"
) -> None:
    """Trains a model on `sentences` (all of them, in order) and writes it to `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    proto = _train_model(sentences, vocab_size=vocab_size, model_type=model_type)
    # Write-then-rename: a concurrent reader (another host) never sees half a model.
    with tempfile.NamedTemporaryFile(dir=path.parent, suffix=".tmp", delete=False) as f:
        f.write(proto)
    os.replace(f.name, path)


def _train_model(sentences: Sequence[str], *, vocab_size: int, model_type: str) -> bytes:
    """The serialized model; a vocabulary size the text cannot give is a ValueError naming
    the sizes it can."""
    try:
        return _spm_train(sentences, vocab_size=vocab_size, model_type=model_type)
    except RuntimeError as e:
        low, high = _size_range(str(e), sentences, model_type=model_type)
        if low is not None and high is not None:
            raise VocabularySizeError(vocab_size, low, high, len(sentences)) from None
        raise ValueError(
            f"SentencePiece training failed (vocab_size={vocab_size}, "
            f"{len(sentences)} sentences): {e}"
        ) from e


class VocabularySizeError(ValueError):
    """A SentencePiece vocabulary size the training text cannot give: `asked`, and the range
    [`low`, `high`] it can, over `sentences` training sentences."""

    def __init__(self, asked: int, low: int, high: int, sentences: int):
        self.asked, self.low, self.high, self.sentences = asked, low, high, sentences
        super().__init__(f"vocab_size={asked}: {self.reason}")

    @property
    def reason(self) -> str:
        return (
            f"SentencePiece can make between {self.low:,} and {self.high:,} pieces of these "
            f"{self.sentences:,} training sentences, not {self.asked:,}"
        )


def _size_range(
    message: str, sentences: Sequence[str], *, model_type: str
) -> tuple[int | None, int | None]:
    """(fewest, most) pieces SentencePiece can make of `sentences`, from its error about a
    size outside them: the fewest are every character (coverage 1.0), the 256 byte pieces and
    the 4 special ones; the most it names when asked for too many (asked once more, with a
    size no text can give, when the error was about too few). (None, None) for any other
    error."""
    too_many = re.search(
        r"Vocabulary size too high \(\d+\)\. Please set it to a value <= (\d+)", message
    )
    too_few = re.search(r"smaller than required_chars\. \d+ vs (\d+)", message)
    if too_many:
        characters = {c for s in sentences for c in s}
        return len(characters) + 256 + 4, int(too_many.group(1))
    if too_few:
        try:
            _spm_train(sentences, vocab_size=1 << 24, model_type=model_type)
        except RuntimeError as e:
            high = re.search(r"Please set it to a value <= (\d+)", str(e))
            return int(too_few.group(1)), int(high.group(1)) if high else None
    return None, None


def _spm_train(sentences: Sequence[str], *, vocab_size: int, model_type: str) -> bytes:
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(sentences),
        model_writer=model,
        vocab_size=vocab_size,
        model_type=model_type,
        pad_id=PAD_ID,
        bos_id=BOS_ID,
        eos_id=EOS_ID,
        unk_id=UNK_ID,
        # Exact round trip: no NFKC, keep doubled/leading/trailing spaces as pieces, every
        # training character in the vocabulary, unseen characters as UTF-8 byte pieces.
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        character_coverage=1.0,
        byte_fallback=True,
        # Sentencepiece samples 1M sentences by default; use all, in order (deterministic).
        input_sentence_size=0,
        shuffle_input_sentence=False,
        max_sentence_length=1 << 16,
        num_threads=1,
        minloglevel=2,
    )
    return model.getvalue()


def multi30k_tokenizer(
    workdir: str | os.PathLike,
    *,
    vocab_size: int = 8000,
    model_type: str = "bpe",
    data_dir: str | os.PathLike | None = None,
) -> SentencePieceTokenizer:
    """The joint de+en tokenizer of the Multi30k train split, cached in `workdir`."""
    from train.data.datasets import load_multi30k  # local: importing TFDS is not free

    pairs = load_multi30k("train", data_dir=data_dir)
    sentences = [s for de, en in pairs for s in (de, en)]
    return SentencePieceTokenizer.train_or_load(
        sentences, workdir, vocab_size=vocab_size, model_type=model_type, name="multi30k_spm"
    )


class StreamVocab(ClosedVocab):
    """PTB's closed vocabulary (`train.data.vocab.ClosedVocab`): whitespace-separated symbols
    (words, or the character level's spaced characters), `<eos>` ending each line, no `<unk>`
    of its own (PTB's is a data symbol, counted as any): an unknown symbol is an error."""

    LEVEL: ClassVar[str] = ""  # the PTB config this vocabulary is for
    PTB_SIZE: ClassVar[int] = 0  # the size from_ptb must find

    def __init__(self, symbols: Sequence[str]):
        """Args: symbols: the vocabulary in id order, `<eos>` first."""
        super().__init__(symbols, split="words", unknown=False)

    @classmethod
    def from_lines(cls, lines: Iterable[str]) -> StreamVocab:
        return cls(cls.counted_symbols(lines, split="words"))

    @classmethod
    def from_ptb(cls, *, data_dir: str | os.PathLike | None = None) -> StreamVocab:
        """The standard vocabulary of the PTB train split at this class's level."""
        from train.data.datasets import load_ptb  # local: importing TFDS is not free

        vocab = _counted(cls, tuple(load_ptb(cls.LEVEL, "train", data_dir=data_dir)))
        if vocab.vocab_size != cls.PTB_SIZE:
            raise ValueError(
                f"PTB {cls.LEVEL} train gives {vocab.vocab_size} symbols with "
                f"<eos>, expected {cls.PTB_SIZE}: the prepared data is not PTB"
            )
        return vocab

    def decode(self, ids: Iterable[int]) -> str:
        """Space-joined symbols of `ids` (`<eos>` included), for inspection."""
        return " ".join(self.symbols[i] for i in np.asarray(ids).reshape(-1).tolist())


@functools.lru_cache(maxsize=4)
def _counted(cls: type[StreamVocab], lines: tuple[str, ...]) -> StreamVocab:
    """`cls.from_lines(lines)`, counted once per process for the same lines: a PTB run's
    config, its vocabulary and each split's stream all ask (5M symbols at the char level)."""
    return cls.from_lines(lines)


class WordVocab(StreamVocab):
    """PTB word vocabulary: the 9,999 train word types (with `<unk>`) + `<eos>` = 10,000."""

    LEVEL = "word"
    PTB_SIZE = 10_000


class CharVocab(StreamVocab):
    """PTB character vocabulary: the 49 train symbols (a-z, 0-9, N, `_`, punctuation) + `<eos>`."""

    LEVEL = "char"
    PTB_SIZE = 50
