"""Translating with a trained work directory's checkpoint."""

from __future__ import annotations

from collections.abc import Sequence

from train.core.inference import params_for_inference
from train.translate.evaluate import DecodeOptions, translate_pairs
from train.translate.sources import encode_source
from train.translate.task import TASK
from train.translate.tokenizer import trained_tokenizer
from transformer_jax.model import quantized


def translate_text(
    workdir: str,
    sentences: Sequence[str],
    *,
    step: int | None = None,
    quantize: str | None = None,
    progress=None,
    **options,
) -> list[str]:
    """Translates German `sentences` with the checkpoint of `workdir` (default: the best by
    validation loss, else the latest; a run with average_checkpoints N: the mean of its last
    N), by beam search or greedy decoding, in input order; with quantize="int8", by the int8
    form of the model (`transformer_jax.int8`). `options` are `DecodeOptions` fields
    (beam_size, length_penalty, greedy, decode_margin, max_output_len, eval_batch_size): each
    given one replaces the run's own setting. progress: called with each batch's number of
    sentences."""
    options = DecodeOptions(**options)  # a bad option fails before the checkpoint is read
    config, model, params, dp = params_for_inference(TASK, workdir, step=step)
    if quantize:
        # Replicated first: each process quantizes the whole weights (fsdp shards them).
        model, params = quantized(model, dp.replicate(params), quantize)
    tokenizer = trained_tokenizer(config, workdir)
    pairs = [(src, []) for src in encode_source(tokenizer, sentences)]
    return translate_pairs(
        model,
        params,
        dp,
        options.over(config),
        tokenizer,
        pairs,
        greedy=options.greedy,
        max_output_len=options.max_output_len,
        progress=progress,
    )
