"""Translating and scoring with a released checkpoint: an OPUS-MT / Marian folder on disk
(`transformer_jax.load_marian`), decoded with this project's beam search in the same
length-sorted batches as the evaluation of a trained run.

    python -m train.translate --pretrained DIR --translate "Ein Mann fährt Fahrrad."
    python -m train.translate --pretrained DIR --translate_file de.txt --output en.txt
    python -m train.translate --pretrained DIR --eval      # sacreBLEU on Multi30k's test set
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from collections.abc import Sequence
from typing import Any

from train.core.parallel import DataParallel
from train.translate.config import SPLITS
from train.translate.evaluate import DecodeOptions, bleu, translate_pairs
from transformer_jax.interchange.marian import load_marian, marian_generation_defaults
from transformer_jax.model import quantized

# A folder exported from a run here (`--export_marian`) keeps the run's decoding settings in
# this file, beside transformers' generation_config.json (which has no place for a margin over
# the source's length, or for our buckets), so that it decodes as its run did.
DECODING_FILE = "decoding.json"
DECODING_FIELDS = ("beam_size", "length_penalty", "decode_margin", "eval_batch_size", "buckets")


@dataclasses.dataclass(frozen=True)
class DecodeSettings:
    """What `translate_pairs` reads of a run config, for a model that was not trained here.

    Outputs are at most (source bucket length + decode_margin) pieces, as a trained run's;
    sources are cut to the checkpoint's max_length."""

    model_config: Any
    beam_size: int = 4
    length_penalty: float = 0.6
    decode_margin: int = 64
    eval_batch_size: int = 64
    buckets: tuple[int, ...] = (16, 32, 64, 128, 256, 512)


def run_decoding(config) -> dict[str, Any]:
    """A run config's decoding settings (DECODING_FIELDS), as DECODING_FILE holds them."""
    out = {name: getattr(config, name) for name in DECODING_FIELDS}
    out["buckets"] = list(out["buckets"])
    return out


def write_decoding(folder: str, decoding: dict[str, Any]) -> None:
    with open(os.path.join(folder, DECODING_FILE), "w", encoding="utf-8") as f:
        json.dump(decoding, f, indent=2)
        f.write("\n")


def read_decoding(folder: str) -> dict[str, Any] | None:
    """The folder's DECODING_FILE, checked (ValueError naming the file and the field), else
    None when it has none (a folder not exported from here)."""
    path = os.path.join(folder, DECODING_FILE)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            fields = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a readable JSON file of decoding settings ({e})") from e
    if not isinstance(fields, dict):
        raise ValueError(f"{path}: expected an object of {', '.join(DECODING_FIELDS)}")
    unknown = sorted(set(fields) - set(DECODING_FIELDS))
    if unknown:
        raise ValueError(f"{path}: {unknown[0]} is not a decoding setting")
    for name, least in (("beam_size", 1), ("decode_margin", 0), ("eval_batch_size", 1)):
        value = fields.get(name, least)
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise ValueError(f"{path}: {name} must be an integer >= {least}, got {value!r}")
    penalty = fields.get("length_penalty", 0.0)
    if not isinstance(penalty, (int, float)) or not math.isfinite(penalty):
        raise ValueError(f"{path}: length_penalty must be a number, got {penalty!r}")
    buckets = fields.get("buckets", [1])
    if (
        not isinstance(buckets, list)
        or not buckets
        or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in buckets)
        or buckets != sorted(set(buckets))
    ):
        raise ValueError(f"{path}: buckets must be increasing positive integers, got {buckets!r}")
    if "buckets" in fields:
        fields["buckets"] = tuple(buckets)
    return fields


class Pretrained:
    """A loaded folder: model, params, tokenizer and its decoding settings.

    `options` are `DecodeOptions` fields; those not given are, for a folder exported from a run
    here, that run's (DECODING_FILE); else the folder's generation defaults
    (`marian_generation_defaults`: beam_size its num_beams, decode_margin half its
    max_length, at most 64) and DecodeSettings' (length_penalty 0.6, eval_batch_size 64)."""

    def __init__(self, folder: str, *, quantize: str | None = None, **options):
        self.options = DecodeOptions(**options)  # a bad option fails before the folder is read
        self.model, self.params, self.tokenizer = load_marian(folder)
        if quantize:  # the int8 form decodes in its place (transformer_jax.int8)
            self.model, self.params = quantized(self.model, self.params, quantize)
        if self.tokenizer is None:
            raise FileNotFoundError(
                f"{folder} has no tokenizer (source.spm, target.spm, "
                "vocab.json): it can be loaded as a model, not translate"
            )
        run = read_decoding(folder)
        if run is not None:  # exported from a run here: its own settings
            own = DecodeSettings(model_config=self.model.config, **run)
            # Its sources whole, as the run's: only the position table bounds them.
            self.max_source_len = self.model.config.max_len
        else:
            shipped = marian_generation_defaults(folder)
            limit = min(shipped.max_len, self.model.config.max_len)
            own = DecodeSettings(
                model_config=self.model.config,
                beam_size=shipped.beam_size,
                decode_margin=max(1, min(64, limit // 2)),
                buckets=tuple(b for b in DecodeSettings.buckets if b < limit) + (limit,),
            )
            self.max_source_len = limit  # the folder's max_length, within its positions
        self.settings = self.options.over(own)
        self.dp = DataParallel("jit")

    def translate(self, sentences: Sequence[str], *, progress=None) -> list[str]:
        """Source sentences -> translations, in input order (`progress`: called with each
        batch's number of sentences)."""
        pairs = [(self.tokenizer.encode_one(s, max_len=self.max_source_len), []) for s in sentences]
        return translate_pairs(
            self.model,
            self.params,
            self.dp,
            self.settings,
            self.tokenizer,
            pairs,
            greedy=self.options.greedy,
            max_output_len=self.options.max_output_len,
            progress=progress,
        )


def evaluate_pretrained(
    folder: str,
    *,
    split: str = "test_2016_flickr",
    data_dir: str | None = None,
    sentences: int = 0,
    **options,
) -> dict[str, Any]:
    """Corpus sacreBLEU (cased, 13a) of the folder's model on a shipped Multi30k split, German
    to English -> {'bleu', 'sentences', 'split', 'seconds', 'hypotheses'}."""
    from train.data.datasets import load_multi30k  # lazy: importing TFDS is not free

    if split not in SPLITS:
        raise ValueError(f"split: expected one of {SPLITS}, got {split!r}")
    pairs = load_multi30k(split, data_dir=data_dir)
    if sentences:
        pairs = pairs[:sentences]
    start = time.monotonic()
    model = Pretrained(folder, **options)
    hypotheses = model.translate([de for de, _ in pairs])
    return {
        "bleu": bleu(hypotheses, [en for _, en in pairs]),
        "sentences": len(pairs),
        "split": split,
        "seconds": time.monotonic() - start,
        "hypotheses": hypotheses,
    }
