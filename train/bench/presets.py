"""A run preset's real training step as a bench, for `--target` to compile: whether the run
fits a device this host lacks (`python -m train.bench --target v5e:2x2 --preset wmt14_base`).

The step is the run's own: its model, loss, optimizer (with its moving average, clipping and
schedule) and carried state, built from the preset's config with abstract shapes only. The
batch is the preset's largest: the Transformer's largest bucket at its token budget (its
attention's memory grows with the length), the language model's [batch_size, tgt_len] with its
memory. No data is read: a paper's recipe is made for its data by name (WMT14's TFDS dataset;
WikiText-103's 267,735 words, enwik8's bytes), whose vocabulary sizes the model.
"""

from __future__ import annotations

import numpy as np

from train.bench.flops import transformer_flops, xl_flops
from train.bench.train_steps import TrainBench
from train.core.task import state_maker
from train.data.batching import rows_for
from transformer_jax.optim import make_optimizer

# The data each recipe is for, named only (nothing is read): what its config needs to be made.
WT103_VOCAB = 267_735  # WikiText-103's words with <eos> and <unk> (Merity et al. 2016)
_RECIPE_DATA = {
    ("translate", "wmt14_base"): dict(dataset="tfds:wmt14_translate/de-en"),
    ("translate", "wmt14_big"): dict(dataset="tfds:wmt14_translate/de-en"),
    ("lm", "wt103_base"): dict(
        dataset="text",
        train_text="wiki.train.tokens",
        valid_text="wiki.valid.tokens",
        level="word",
        vocab_size=WT103_VOCAB,
    ),
    ("lm", "enwik8_base"): dict(
        dataset="text",
        train_text="enwik8",
        split_bytes=(90_000_000, 5_000_000, 5_000_000),
        level="byte",
    ),
}


def task_presets() -> dict[str, list[str]]:
    """Each task's run presets: {'translate': [...], 'lm': [...]}."""
    from train import lm, translate

    return {"translate": sorted(translate.PRESETS), "lm": sorted(lm.PRESETS)}


def resolve_preset(name: str) -> tuple[str, str]:
    """'wmt14_base' or 'lm:base' -> (task, preset); a name both tasks have needs its task
    ('translate:base', 'lm:base'). A ValueError names the preset."""
    presets = task_presets()
    task, sep, preset = name.rpartition(":")
    if sep:
        if task not in presets or preset not in presets[task]:
            raise ValueError(
                f"preset: {name!r} is not a preset of {task or 'a task'} "
                f"(translate: {', '.join(presets['translate'])}; lm: {', '.join(presets['lm'])})"
            )
        return task, preset
    owners = [t for t, names in presets.items() if name in names]
    if len(owners) == 1:
        return owners[0], name
    if owners:
        raise ValueError(f"preset: both tasks have {name!r}: give translate:{name} or lm:{name}")
    raise ValueError(
        f"preset: {name!r} is no preset (translate: {', '.join(presets['translate'])}; "
        f"lm: {', '.join(presets['lm'])})"
    )


def preset_bench(name: str, *, devices: int = 1, batch_size: int | None = None) -> TrainBench:
    """The training step of run preset `name` (`resolve_preset`) as a TrainBench whose batch is
    the preset's largest, split over `devices` data-parallel devices; `batch_size`: a language
    model's rows in place of the preset's. A batch that does not split over the devices is
    refused as the run refuses it (ValueError naming batch_size)."""
    task_name, preset = resolve_preset(name)
    fields = dict(_RECIPE_DATA.get((task_name, preset), {}))
    if task_name == "translate":
        from train.translate import TASK, make_config

        config = make_config("transformer", preset, **fields)
        length = max(config.buckets)
        rows = rows_for(length, tokens_per_batch=config.tokens_per_batch, num_devices=devices)
        shape = (rows, length)
        batch = {k: np.zeros(shape, np.int32) for k in ("src", "tgt_in", "tgt_out")}
        flops = transformer_flops(config.model_config, batch=rows, src_len=length, tgt_len=length)
    else:
        from train.lm import TASK
        from train.lm.config import make_config

        dataset = fields.pop("dataset", "ptb")
        vocab_size = fields.pop("vocab_size", None)
        if batch_size is not None:
            fields["batch_size"] = batch_size
        config = make_config(dataset, preset, vocab_size=vocab_size, **fields)
        if config.batch_size % devices:
            fit = (config.batch_size // devices or 1) * devices
            raise ValueError(
                f"batch_size: the {preset} preset's {config.batch_size} rows do not split over "
                f"{devices} devices; give --preset_batch_size a multiple of {devices} "
                f"(e.g. {fit} or {fit + devices})"
            )
        mc = config.model_config
        shape = (config.batch_size, mc.tgt_len)
        batch = {k: np.zeros(shape, np.int32) for k in ("inputs", "targets")}
        flops = xl_flops(mc, batch=config.batch_size, tgt_len=mc.tgt_len, mem_len=mc.mem_len)
    model = TASK.build_model(config)
    tx, _ = make_optimizer(TASK.optimizer_config(config))
    create = state_maker(TASK, config, model, tx)
    return TrainBench(
        name=f"{task_name}:{preset}",
        loss_fn=TASK.loss_fn(config, model),
        init_state=lambda: create(config.seed),
        batch=batch,
        flops=flops,
        info=dict(batch=shape[0], length=shape[1], dtype=str(np.dtype(config.model_config.dtype))),
        real_tokens=int(np.prod(shape)),
    )
