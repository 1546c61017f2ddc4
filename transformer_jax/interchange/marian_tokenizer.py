"""The tokenizer of OPUS-MT (Marian) folders, without `transformers`.

    tokenizer = MarianTokenizer.from_folder("opus-mt-de-en")
    ids = tokenizer.encode(["Ein Mann fährt Fahrrad."])   # [B, S] int32, pad-padded, EOS-ended
    text = tokenizer.decode(tokens)                       # [B, T] -> list[str]; [T] -> str

Marian keeps two SentencePiece models, `source.spm` and `target.spm`, whose own piece ids are
not the model's: `vocab.json` maps pieces to model ids (one joint vocabulary), or, in folders
with `target_vocab.json`, the source side only. Encoding and decoding follow transformers'
`MarianTokenizer` (`tokenizer(texts, padding=True)` and `decode(ids,
skip_special_tokens=True)` with the target SentencePiece model); the tests compare the two.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from transformer_jax.files import write_bytes

SOURCE_SPM, TARGET_SPM, VOCAB, TARGET_VOCAB = (
    "source.spm",
    "target.spm",
    "vocab.json",
    "target_vocab.json",
)
TOKENIZER_FILES = (SOURCE_SPM, TARGET_SPM, VOCAB)
TOKENIZER_CONFIG = "tokenizer_config.json"
# SentencePiece's word-boundary mark, which decoding turns back into a space.
_SPACE = "\u2581"


def read_json(path: Path):
    """The parsed JSON file at `path`; a missing or malformed file is an error naming it."""
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None


def _load_spm(path: Path) -> Any:
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found")
    try:
        import sentencepiece  # optional: the 'pretrained' extra; the model loads without it
    except ImportError as e:
        raise ImportError(
            f"reading {path} needs the sentencepiece package: "
            'pip install "attention-jax[pretrained]"'
        ) from e
    spm = sentencepiece.SentencePieceProcessor()
    try:
        spm.Load(str(path))
    except (OSError, RuntimeError) as e:
        raise ValueError(f"{path} is not a SentencePiece model: {e}") from None
    return spm


def _read_vocab(path: Path, specials: Sequence[str]) -> dict[str, int]:
    vocab = read_json(path)
    if not isinstance(vocab, dict) or not all(isinstance(i, int) for i in vocab.values()):
        raise ValueError(f"{path} must map each piece to an integer id")
    for token in specials:
        if token not in vocab:
            raise ValueError(f"{path} has no {token!r}, which Marian needs")
    return vocab


class MarianTokenizer:
    """Text <-> Marian token ids, through SentencePiece and `vocab.json`.

    Attributes:
      pad_id, eos_id, unk_id: the ids of `<pad>`, `</s>` and `<unk>` in the source vocabulary
        (the target vocabulary, where separate, must agree on pad and eos).
      files: the files it was read from, by their names in a Marian folder (`save` copies
        them).

    Besides transformers' calls (`encode`, `decode`), it has the ones the training library
    reads of a tokenizer (`encode_batch`, `encode_targets`, `vocab_size`, `id_to_piece`,
    `sha256`), so a Marian model fine-tunes on its own pieces. It has no `bos_id`: where
    decoding starts is the model's (config.json's decoder_start_token_id; pad in OPUS-MT).
    """

    def __init__(
        self,
        source_spm: str | Path,
        target_spm: str | Path,
        vocab: str | Path,
        target_vocab: str | Path | None = None,
        *,
        unk_token: str = "<unk>",
        eos_token: str = "</s>",
        pad_token: str = "<pad>",
    ):
        specials = (unk_token, eos_token, pad_token)
        self.files = {
            SOURCE_SPM: Path(source_spm),
            TARGET_SPM: Path(target_spm),
            VOCAB: Path(vocab),
        }
        if target_vocab is not None:
            self.files[TARGET_VOCAB] = Path(target_vocab)
        self.special_tokens = {
            "unk_token": unk_token,
            "eos_token": eos_token,
            "pad_token": pad_token,
        }
        self.spm_source = _load_spm(Path(source_spm))
        self.spm_target = _load_spm(Path(target_spm))
        self.source_vocab = _read_vocab(Path(vocab), specials)
        target = (
            self.source_vocab if target_vocab is None else _read_vocab(Path(target_vocab), specials)
        )
        self.unk_id, self.eos_id, self.pad_id = (self.source_vocab[t] for t in specials)
        if (target[eos_token], target[pad_token]) != (self.eos_id, self.pad_id):
            raise ValueError(
                f"{target_vocab} gives {eos_token} and {pad_token} other ids than {vocab}"
            )
        self.target_vocab = target
        self._target_pieces = {i: piece for piece, i in target.items()}
        self._source_pieces = {i: piece for piece, i in self.source_vocab.items()}
        # Text naming a special token stands for that token, as in transformers.
        self._specials = {t: self.source_vocab[t] for t in specials}
        self._special_re = re.compile("(" + "|".join(map(re.escape, specials)) + ")")
        # Decoding drops every special token, <unk> included (skip_special_tokens=True).
        self._skipped_on_decode = {target[t] for t in specials}

    @classmethod
    def from_folder(cls, folder: str | Path) -> MarianTokenizer:
        """Reads source.spm, target.spm, vocab.json (and target_vocab.json where present)."""
        folder = Path(folder)
        config_path = folder / TOKENIZER_CONFIG
        options = read_json(config_path) if config_path.is_file() else {}
        target_vocab = folder / TARGET_VOCAB
        separate = options.get("separate_vocabs", target_vocab.is_file())
        tokens = {
            k: options[k]
            for k in ("unk_token", "eos_token", "pad_token")
            if isinstance(options.get(k), str)
        }
        return cls(
            folder / SOURCE_SPM,
            folder / TARGET_SPM,
            folder / VOCAB,
            target_vocab if separate else None,
            **tokens,
        )

    @property
    def source_vocab_size(self) -> int:
        """One more than the largest source id (the embedding rows the model needs)."""
        return max(self.source_vocab.values()) + 1

    @property
    def vocab_size(self) -> int:
        """One more than the largest id of either vocabulary."""
        return max(self.source_vocab_size, max(self.target_vocab.values()) + 1)

    def _pieces(self, text: str, spm: Any) -> list[str]:
        """One text (no special tokens in it) -> its SentencePiece pieces; a leading language
        code such as `>>fra<<` (multilingual targets) stays one piece."""
        code = []
        if text.startswith(">>") and (end := text.find("<<")) != -1:
            code, text = [text[: end + 2]], text[end + 2 :]
        return code + spm.encode(text, out_type=str)

    def _ids(self, text: str, *, target: bool = False) -> list[int]:
        """One text -> its ids in the source (or target) vocabulary, without EOS: a special
        token's text is that token, an unknown piece is <unk>."""
        spm, vocab = (
            (self.spm_target, self.target_vocab) if target else (self.spm_source, self.source_vocab)
        )
        ids = []
        for chunk in self._special_re.split(text):
            if chunk in self._specials:
                ids.append(vocab[chunk])
            elif chunk:
                ids.extend(vocab.get(p, self.unk_id) for p in self._pieces(chunk, spm))
        return ids

    def encode_one(self, text: str, *, max_len: int | None = None) -> list[int]:
        """One source text -> its ids, ending with EOS (at most `max_len` ids)."""
        ids = self._ids(text)
        if max_len is not None:
            ids = ids[: max_len - 1]
        return ids + [self.eos_id]

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Source texts -> their ids without EOS (the training library appends it)."""
        return [self._ids(t) for t in texts]

    def encode_targets(self, texts: Sequence[str]) -> list[list[int]]:
        """Target texts -> their ids in the target vocabulary, through the target SentencePiece
        model, without EOS: the labels, as transformers' `tokenizer(text_target=...)` makes
        them (less the EOS, which the training batches append)."""
        return [self._ids(t, target=True) for t in texts]

    def encode(self, texts: Sequence[str], *, max_len: int | None = None) -> np.ndarray:
        """Source texts -> [B, S] int32 ids, each row ending with EOS, right-padded with pad_id
        to the longest (S <= max_len where given: longer texts are cut, keeping the EOS)."""
        if isinstance(texts, str) or not texts:
            raise ValueError("encode takes a non-empty list of strings")
        if max_len is not None and max_len < 1:
            raise ValueError(f"max_len must be at least 1 (room for EOS), got {max_len}")
        rows = [self.encode_one(t, max_len=max_len) for t in texts]
        out = np.full((len(rows), max(map(len, rows))), self.pad_id, np.int32)
        for i, row in enumerate(rows):
            out[i, : len(row)] = row
        return out

    def decode_one(self, ids: Sequence[int]) -> str:
        """Target ids [T] -> text: stops at the first EOS, drops pad, <unk> and ids outside
        the target vocabulary, and joins the pieces with the target SentencePiece model."""
        pieces = []
        for i in map(int, ids):
            if i == self.eos_id:
                break
            if i in self._skipped_on_decode or i not in self._target_pieces:
                continue
            pieces.append(self._target_pieces[i])
        return self.spm_target.decode_pieces(pieces).replace(_SPACE, " ").strip()

    def decode(self, ids) -> str | list[str]:
        """ids [T] -> str, or [B, T] -> list of B str (see `decode_one`)."""
        ids = np.asarray(ids)
        if ids.ndim == 1:
            return self.decode_one(ids)
        if ids.ndim == 2:
            return [self.decode_one(row) for row in ids]
        raise ValueError(f"decode takes ids of shape [T] or [B, T], got {ids.shape}")

    def id_to_piece(self, i: int) -> str:
        """The target piece of id `i` (the source piece where the target has none)."""
        i = int(i)
        return self._target_pieces.get(i, self._source_pieces.get(i, f"<{i}>"))

    def sha256(self) -> str:
        """A hash of its files' bytes and its special tokens: what a cache of its ids keys on."""
        digest = hashlib.sha256(json.dumps(self.special_tokens, sort_keys=True).encode())
        for name in sorted(self.files):
            digest.update(f"{name}\n".encode())
            digest.update(self.files[name].read_bytes())
        return digest.hexdigest()

    def save(self, folder: str | Path) -> None:
        """Writes its files (source.spm, target.spm, vocab.json, target_vocab.json where
        separate) and tokenizer_config.json to `folder`, each written whole then renamed, so
        `MarianTokenizer.from_folder(folder)` and transformers' `MarianTokenizer` read it."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        options = {
            **self.special_tokens,
            "separate_vocabs": TARGET_VOCAB in self.files,
            "tokenizer_class": "MarianTokenizer",
        }
        contents = {name: path.read_bytes() for name, path in self.files.items()}
        contents[TOKENIZER_CONFIG] = (json.dumps(options, indent=2) + "\n").encode()
        for name, data in contents.items():
            write_bytes(folder / name, data)


def has_tokenizer_files(folder: str | Path) -> bool:
    """Whether `folder` holds a tokenizer. Some but not all of its files is an error naming
    the missing ones."""
    folder = Path(folder)
    missing = [name for name in TOKENIZER_FILES if not (folder / name).is_file()]
    if missing and len(missing) < len(TOKENIZER_FILES):
        raise FileNotFoundError(
            f"{folder} has part of a Marian tokenizer; missing: {', '.join(missing)}"
        )
    return not missing
