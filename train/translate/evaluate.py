"""Evaluating a translation model: teacher-forced loss and perplexity, decoding a set of
sentences in length order (beam search or greedy), corpus sacreBLEU, and the files a run
writes to W/translations/."""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from train.core.metrics import add_sums, summarize
from train.core.parallel import DataParallel
from train.data.batching import eval_batches
from transformer_jax.decoding import decode

MODEL_INPUTS = ("src", "tgt_in", "tgt_out")


def model_batch(batch: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The arrays the loss reads (batchers add bookkeeping such as 'index')."""
    return {k: v for k, v in batch.items() if k in MODEL_INPUTS}


def special_ids(model_config) -> dict[str, int]:
    """The pad, bos (decoding's start) and eos ids batches are built with: the model's (a
    Marian model pads with its last id and starts from pad)."""
    return dict(pad_id=model_config.pad_id, bos_id=model_config.bos_id, eos_id=model_config.eos_id)


def teacher_forced(dp: DataParallel, eval_step: Callable, params: Any, batches) -> dict[str, float]:
    """Summed loss / nll over `batches` (summed on device, fetched once) -> loss, nll, ppl."""
    total = None
    for batch in batches:
        sums, _ = eval_step(params, dp.put_global(model_batch(batch)), None)
        total = add_sums(total, sums)
    return summarize({k: float(v) for k, v in jax.device_get(total).items()})


@dataclasses.dataclass(frozen=True)
class DecodeOptions:
    """What a command asks of the search, in place of the settings it decodes with otherwise
    (a trained run's saved config, or a pretrained folder's defaults); None keeps theirs.

    One rule bounds the output on both paths: at most the source's padded length (its
    bucket) + decode_margin pieces, or max_output_len pieces for every sentence when given.

    Attributes:
      beam_size, length_penalty: of the beam search (GNMT's penalty alpha).
      greedy: greedy decoding, which equals the beam search of one beam.
      decode_margin: outputs are at most the source's bucket + this many pieces.
      max_output_len: outputs are at most this many pieces, whatever the source's length.
      eval_batch_size: sentences decoded together.
    """

    beam_size: int | None = None
    length_penalty: float | None = None
    greedy: bool = False
    decode_margin: int | None = None
    max_output_len: int | None = None
    eval_batch_size: int | None = None

    def __post_init__(self):
        for name, least in (
            ("beam_size", 1),
            ("max_output_len", 1),
            ("eval_batch_size", 1),
            ("decode_margin", 0),
        ):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < least):
                raise ValueError(f"{name}: expected an integer >= {least}, got {value!r}")
        if self.length_penalty is not None and not math.isfinite(self.length_penalty):
            raise ValueError(f"length_penalty: expected a finite number, got {self.length_penalty}")
        # Each pair below would have one of its two settings ignored: refused instead.
        if self.greedy and self.beam_size is not None:
            raise ValueError(
                "beam_size, greedy: greedy decoding is the search of one beam; give one"
            )
        if self.greedy and self.length_penalty is not None:
            raise ValueError("length_penalty, greedy: greedy decoding ranks no beams by length")
        if self.decode_margin is not None and self.max_output_len is not None:
            raise ValueError(
                "decode_margin, max_output_len: the output's bound is one or the other; give one"
            )

    def over(self, settings):
        """`settings` (a TranslateConfig or `train.translate.pretrained.DecodeSettings`) with
        the options given in place of its own (validated again)."""
        fields = ("beam_size", "length_penalty", "decode_margin", "eval_batch_size")
        given = {name: getattr(self, name) for name in fields if getattr(self, name) is not None}
        return dataclasses.replace(settings, **given)


def translate_pairs(
    model,
    params,
    dp: DataParallel,
    config,
    tokenizer,
    pairs,
    *,
    greedy: bool = False,
    max_output_len: int | None = None,
    progress: Callable[[int], None] | None = None,
) -> list[str]:
    """Beam search (or greedy decoding) over `pairs` (their sources), in order ->
    detokenized hypotheses. `config` supplies eval_batch_size, buckets, decode_margin,
    beam_size, length_penalty and model_config's special ids (a TranslateConfig, or
    `train.translate.pretrained.DecodeSettings`). Outputs are at most max_output_len pieces
    when given, else the batch's padded source length + decode_margin. progress: called with
    the number of sentences each batch translated."""
    out: list[str] = [""] * len(pairs)
    params = dp.replicate(params)  # fsdp-split weights: gathered once, not in every step
    # Decoded shortest source first, so no batch runs as long as its longest sentence. Only
    # the sources are batched: the reference's length has no say in the output budget.
    batches = eval_batches(
        [(src, []) for src, _ in pairs],
        batch_size=dp.round_rows(config.eval_batch_size),
        buckets=config.buckets,
        num_devices=dp.n_devices,
        sort_by_length=True,
        **special_ids(config.model_config),
    )
    for batch in batches:
        src = batch["src"]
        max_len = max_output_len or src.shape[1] + config.decode_margin
        if greedy:
            best = decode.greedy_decode(
                model, params, dp.put_global(src), max_len=max_len
            )  # [N, L]
        else:
            # Only the best beam is kept, so a sentence may leave the search once its best is
            # final: the same output as the full search, in fewer steps.
            tokens, _ = decode.beam_search(
                model,
                params,
                dp.put_global(src),
                beam_size=config.beam_size,
                max_len=max_len,
                length_penalty=config.length_penalty,
                best_only=True,
                return_beams=1,
            )
            best = tokens[:, 0]  # [N, L], best beam first
        best = dp.fetch_rows(best)
        done = 0
        for row, i in enumerate(batch["index"]):
            if i >= 0:
                out[i] = tokenizer.decode(best[row])
                done += 1
        if progress is not None:
            progress(done)
    return out


def bleu(hypotheses: Sequence[str], references: Sequence[str]) -> float:
    """Corpus sacreBLEU: cased, 13a tokenization, detokenized input (sacrebleu's defaults)."""
    import sacrebleu  # lazy: slow to import, and only evaluation needs it

    return float(sacrebleu.corpus_bleu(list(hypotheses), [list(references)]).score)


def chrf(hypotheses: Sequence[str], references: Sequence[str]) -> float:
    """Corpus chrF (sacrebleu's defaults: character 6-grams, beta 2) on detokenized text."""
    import sacrebleu  # lazy: slow to import, and only evaluation needs it

    return float(sacrebleu.corpus_chrf(list(hypotheses), [list(references)]).score)


def write_translations(
    workdir: str,
    split: str,
    step: int,
    *,
    sources: Sequence[str],
    references: Sequence[str],
    hypotheses: Sequence[str],
    src_lang: str,
    tgt_lang: str,
) -> str:
    """W/translations/<split>.step<N>.<tgt_lang> (one hypothesis a line, in test order); also
    the source and reference next to it once, <split>.source.<src_lang> and
    <split>.reference.<tgt_lang> (the languages: `TranslateConfig.output_languages`).
    Process 0 writes; every process returns the path."""
    directory = os.path.join(workdir, "translations")
    path = os.path.join(directory, f"{split}.step{step}.{tgt_lang}")
    if jax.process_index() == 0:
        os.makedirs(directory, exist_ok=True)
        for name, lines in (
            (path, hypotheses),
            (os.path.join(directory, f"{split}.source.{src_lang}"), sources),
            (os.path.join(directory, f"{split}.reference.{tgt_lang}"), references),
        ):
            write_lines(name, lines)
    return path


def write_lines(path: str, lines: Sequence[str]) -> None:
    """One line each (newlines inside a line become spaces), written atomically."""
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(line.replace("\n", " ") + "\n" for line in lines)
    os.replace(tmp, path)
