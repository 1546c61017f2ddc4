"""The one closed vocabulary of the project's language-model data: PTB's words and
characters (`train.data.tokenizers.WordVocab`, `CharVocab`) and a text run's own words or
characters (`train.lm.text.TextVocab`) are this class, counted from the training lines.

Ids (deterministic, whatever order the lines come in): `<eos>` is 0; then `<unk>` is 1 when
the vocabulary reads unknown symbols as it; then the symbols by decreasing count, ties in code
point order. Frequency order is the Transformer-XL reference's, and suits adaptive softmax
cut-offs. Without `<unk>` (PTB, whose out-of-vocabulary words are already `<unk>` in the data,
where it is counted as any word) an unknown symbol is an error naming it and its line.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import ClassVar

import numpy as np

from train.data.text_files import DataError

EOS, UNK = "<eos>", "<unk>"
SPLITS = ("words", "chars")  # a line's symbols: whitespace-separated, or every character


def line_symbols(line: str, split: str) -> list[str]:
    """The symbols of one line: its whitespace-separated words, or its characters."""
    return line.split() if split == "words" else list(line)


class ClosedVocab:
    """A closed vocabulary over the symbols of lines, `<eos>` ending each line.

    Args:
      symbols: the vocabulary in id order: `<eos>` first, then `<unk>` when `unknown`.
      split: 'words' or 'chars' (SPLITS), how a line is cut into symbols.
      unknown: True: a symbol outside the vocabulary reads as `<unk>` (id 1); False: it is an
        error.
    """

    EOS: ClassVar[str] = EOS
    UNK: ClassVar[str] = UNK

    def __init__(self, symbols: Sequence[str], *, split: str = "words", unknown: bool = False):
        if split not in SPLITS:
            raise ValueError(f"split: expected one of {SPLITS}, got {split!r}")
        head = [EOS, UNK] if unknown else [EOS]
        if list(symbols[: len(head)]) != head:
            raise ValueError(f"symbols must start with {', '.join(map(repr, head))}")
        if len(set(symbols)) != len(symbols):
            raise ValueError("symbols must be distinct")
        self.symbols, self.split, self.unknown = tuple(symbols), split, unknown
        self._ids = {s: i for i, s in enumerate(self.symbols)}

    @staticmethod
    def counted_symbols(
        lines: Iterable[str],
        *,
        split: str = "words",
        unknown: bool = False,
        min_count: int = 1,
        max_vocab: int = 0,
    ) -> list[str]:
        """The symbols in id order of the vocabulary counted from `lines` (a stream: never
        held whole): the special symbols, then those seen at least `min_count` times, most
        frequent first, at most `max_vocab` in all (0: no limit)."""
        counts: Counter = Counter()
        for line in lines:
            counts.update(line_symbols(line, split))
        head = [EOS, UNK] if unknown else [EOS]
        for special in head:  # never data symbols' ids, whatever the text holds
            counts.pop(special, None)
        kept = sorted(
            (s for s, c in counts.items() if c >= min_count), key=lambda s: (-counts[s], s)
        )
        if max_vocab:
            kept = kept[: max_vocab - len(head)]
        if not kept:
            raise DataError(
                f"min_count {min_count}: no {split[:-1]} of the training text is "
                "frequent enough to enter the vocabulary"
            )
        return [*head, *kept]

    @property
    def vocab_size(self) -> int:
        return len(self.symbols)

    @property
    def eos_id(self) -> int:
        return 0

    def __len__(self) -> int:
        return len(self.symbols)

    def token_to_id(self, symbol: str) -> int:
        """The symbol's id; an unknown one is `<unk>`'s, or a KeyError without `<unk>`."""
        if self.unknown:
            return self._ids.get(symbol, 1)
        return self._ids[symbol]

    def encode_lines(self, lines: Iterable[str]) -> np.ndarray:
        """int32 [N]: each line's symbol ids, then `<eos>`.

        Raises:
          ValueError: without `<unk>`, a symbol not in the vocabulary; the message gives the
            symbol and the line number.
        """
        ids, stream = self._ids, []
        for n, line in enumerate(lines):
            symbols = line_symbols(line, self.split)
            if self.unknown:
                stream.extend(map(ids.get, symbols, itertools.repeat(1)))
            else:
                try:
                    stream.extend([ids[s] for s in symbols])
                except KeyError as e:
                    raise ValueError(
                        f"line {n}: symbol {e.args[0]!r} is not in the "
                        f"{self.vocab_size}-symbol vocabulary"
                    ) from None
            stream.append(0)
        return np.asarray(stream, np.int32)
