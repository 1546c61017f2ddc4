"""Evaluating a translation model: teacher-forced loss and perplexity, decoding a set of
sentences in length order (beam search or greedy), corpus sacreBLEU, and the files a run
writes to W/translations/."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from train.core.metrics import add_sums, summarize
from train.core.parallel import DataParallel
from train.data.batching import eval_batches
from transformer_jax import decode

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


def translate_pairs(
    model, params, dp: DataParallel, config, tokenizer, pairs, *, greedy: bool = False
) -> list[str]:
    """Beam search (or greedy decoding) over `pairs` (their sources), in order ->
    detokenized hypotheses. `config` supplies eval_batch_size, buckets, decode_margin,
    beam_size, length_penalty and model_config's special ids (a TranslateConfig, or
    `train.translate.pretrained.DecodeSettings`)."""
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
        max_len = src.shape[1] + config.decode_margin
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
        for row, i in enumerate(batch["index"]):
            if i >= 0:
                out[i] = tokenizer.decode(best[row])
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
