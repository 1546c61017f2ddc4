"""Translating with a trained work directory's checkpoint."""

from __future__ import annotations

from collections.abc import Sequence

from train.core.task import params_for_inference
from train.translate.evaluate import translate_pairs
from train.translate.task import TASK, encode_source, trained_tokenizer
from transformer_jax.quantize import quantized


def translate_text(
    workdir: str,
    sentences: Sequence[str],
    *,
    step: int | None = None,
    greedy: bool = False,
    quantize: str | None = None,
) -> list[str]:
    """Translates German `sentences` with the checkpoint of `workdir` (default: the best by
    validation loss, else the latest; a run with average_checkpoints N: the mean of its last
    N), by beam search or greedy decoding, in input order; with quantize="int8", by the int8
    form of the model (`transformer_jax.quantize`)."""
    config, model, params, dp = params_for_inference(TASK, workdir, step=step)
    if quantize:
        # Replicated first: each process quantizes the whole weights (fsdp shards them).
        model, params = quantized(model, dp.replicate(params), quantize)
    tokenizer = trained_tokenizer(config, workdir)
    pairs = [(src, []) for src in encode_source(tokenizer, sentences)]
    return translate_pairs(model, params, dp, config, tokenizer, pairs, greedy=greedy)
