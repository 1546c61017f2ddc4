"""A Transformer trained here (or a pretrained folder) to the formats people serve with:

    python -m train.translate --workdir W --export_marian DIR    # transformers' MarianMTModel
    python -m train.translate --workdir W --export_ct2 DIR --ct2_quantization int8
    python -m train.translate --pretrained opus-mt-de-en --export_ct2 DIR   # OPUS-MT too

The Hugging Face folder (`transformer_jax.save_marian`) holds what Marian can express:
post-LN, the sin-then-cos sinusoid, LayerNorm epsilon 1e-5; any other config is an error
naming the field, raised before the checkpoint is read. CTranslate2 (`transformer_jax.save_ct2`)
takes every Transformer of ours. A work directory exports the parameters it decodes with
(`train.core.inference.params_for_inference`: the best checkpoint's, its EMA, or the average of the
last N), with its own tokenizer; the search it ships is the run's beam size and output length.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from train.core.inference import params_for_inference, saved_config
from train.translate.pretrained import read_decoding, run_decoding, write_decoding
from train.translate.task import TASK
from train.translate.tokenizer import trained_tokenizer
from transformer_jax.config import TransformerConfig
from transformer_jax.interchange.marian import (
    GenerationDefaults,
    load_marian,
    marian_generation_defaults,
)
from transformer_jax.interchange.marian_export import marian_fields, save_marian


@dataclasses.dataclass(frozen=True)
class Exportable:
    """What an export writes: the model's config, its float32 parameters on the host, the
    tokenizer, and the search to ship (beam size, output positions)."""

    config: TransformerConfig
    params: Any
    tokenizer: Any
    generation: GenerationDefaults
    decoding: dict[str, Any] | None = None  # the run's decoding settings (DECODING_FILE)


def check_exportable(model_config: Any, *, marian: bool) -> None:
    """Before any checkpoint is read: a Transformer, and (marian) one Marian can express."""
    if not isinstance(model_config, TransformerConfig):
        raise ValueError(
            f"model: only the Transformer exports; this run's model is a "
            f"{type(model_config).__name__}"
        )
    if marian:
        marian_fields(model_config)  # a ValueError naming the field Marian cannot express


def load_exportable(
    *, workdir: str | None = None, pretrained: str | None = None, marian: bool = False
) -> Exportable:
    """The model of a trained work directory (its decoding parameters) or of a pretrained
    Marian folder, checked to be exportable (to Marian too when `marian`) first."""
    if pretrained is not None:
        model, params, tokenizer = load_marian(pretrained)
        check_exportable(model.config, marian=marian)
        if tokenizer is None:
            raise FileNotFoundError(f"{pretrained} has no tokenizer: an export needs one")
        return Exportable(
            model.config,
            params,
            tokenizer,
            marian_generation_defaults(pretrained),
            read_decoding(pretrained),  # a folder exported here passes its run's on
        )
    config = saved_config(TASK, workdir)
    check_exportable(config.model_config, marian=marian)
    config, _, params, _ = params_for_inference(TASK, workdir)
    params = jax.tree.map(lambda x: np.asarray(x, np.float32), jax.device_get(params))
    mc = config.model_config
    generation = GenerationDefaults(
        beam_size=config.beam_size,
        # The longest output the run's own evaluation allows (the largest bucket and its
        # margin), within the model's position table.
        max_len=min(max(config.buckets) + config.decode_margin, mc.max_len),
    )
    return Exportable(
        mc.replace(dtype="float32"),
        params,
        trained_tokenizer(config, workdir),
        generation,
        run_decoding(config),
    )


def export_marian(exportable: Exportable, folder: str) -> None:
    """The Hugging Face Marian folder (config.json, model.safetensors, generation_config.json,
    the tokenizer's files), and the run's decoding settings (DECODING_FILE): `--pretrained
    FOLDER` then decodes as `--workdir W` did."""
    save_marian(
        exportable.config,
        exportable.params,
        exportable.tokenizer,
        folder,
        generation=exportable.generation,
    )
    if exportable.decoding is not None:
        write_decoding(folder, exportable.decoding)


def export_ct2(exportable: Exportable, folder: str, *, quantization: str | None = None) -> None:
    """The CTranslate2 model folder, its weights quantized as asked (None: float32)."""
    from transformer_jax.interchange.ct2 import save_ct2

    save_ct2(
        exportable.config,
        exportable.params,
        exportable.tokenizer,
        folder,
        quantization=quantization,
    )
