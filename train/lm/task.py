"""Language modelling as a `train.core.task.Task`: Transformer-XL on Penn Treebank, a TFDS
text dataset or the user's text.

The training memory is part of the TrainState (checkpointed, so a resumed run continues the
same stream with the same memory); evaluation runs the validation and test streams in order
with a fresh memory of its own length (eval_mem_len, longer than in training as the reference
evaluates) and segments of eval_tgt_len. Word level reports perplexity, character level bits
per character (nats / ln 2, over every symbol including the `<eos>` that ends each line).
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from train import plots
from train.core.metrics import add_sums, read_metrics, summarize
from train.core.parallel import DataParallel
from train.core.task import EvalContext
from train.data.token_cache import CACHE_DIR
from train.lm.config import DATASETS, PRESETS, LMConfig
from train.lm.sources import config_for_data, lm_source
from xl_jax.config import TransformerXLConfig
from xl_jax.data import lm_batches
from xl_jax.memory import init_memory, reset_rows
from xl_jax.model import TransformerXL


def load_vocab(config: LMConfig):
    """The run's vocabulary: PTB's closed one, or the one of a text run's training file or a
    TFDS run's train split at its level."""
    return lm_source(config).vocab()


def load_stream(
    config: LMConfig, split: str, *, cache_dir: str | None = None, log=None
) -> np.ndarray | None:
    """The token stream of a split ('train', 'valid', 'test'): PTB's, the text run's or the
    TFDS run's, `<eos>` after every line (bytes as they are at the byte level, a newline
    after each TFDS example); None for a text or TFDS run without that split. With
    `cache_dir` a text or TFDS run's stream is encoded once into the token cache there and
    read memory-mapped (train.data.token_cache); else int32 in memory. An evaluation split is
    cut to its first eval_tokens when that is set."""
    stream = lm_source(config).stream(split, cache_dir, log)
    if stream is None:
        return None
    return stream[: config.eval_tokens] if config.eval_tokens and split != "train" else stream


def make_loss_fn(model: TransformerXL):
    """train.core.step's loss protocol on {'inputs', 'targets'} [B, T]; `extra` is the
    memory."""

    def loss_fn(params, batch, *, rng, extra, deterministic):
        rngs = None if deterministic else {"dropout": rng}
        if "reset" in batch:  # the first batch of an epoch: the stream starts again
            extra = reset_rows(extra, batch["reset"])
        nll, memory = model.apply(
            {"params": params},
            batch["inputs"],
            extra,
            targets=batch["targets"],
            deterministic=deterministic,
            rngs=rngs,
        )
        n_tokens = jnp.float32(nll.shape[0] * nll.shape[1])
        return nll.astype(jnp.float32).sum(), {"n_tokens": n_tokens}, memory

    return loss_fn


def as_batch(pair) -> dict[str, np.ndarray]:
    inputs, targets = pair
    return {"inputs": inputs, "targets": targets}


def train_batches(stream: np.ndarray, config: LMConfig):
    """-> (the epoch's batches, start step -> the endless batch stream from there): step k
    reads batch k mod (batches per epoch), so a resumed run reads exactly what an
    uninterrupted one would; `rows` (N -> a slice, `DataParallel.local_rows`) keeps this
    process's rows of each batch. With reset_memory_each_epoch each batch carries 'reset' [B],
    True on the first batch of every epoch after the first."""
    batches = lm_batches(
        stream, batch_size=config.batch_size, tgt_len=config.model_config.tgt_len, drop_last=True
    )

    def from_step(start: int, rows: Callable[[int], slice] | None = None):
        # This process's rows of every batch (rows of the stream: each is a contiguous part,
        # and only those are read).
        mine = slice(None) if rows is None else rows(config.batch_size)
        step = start
        while True:
            inputs, targets = batches.batch(step % len(batches), rows=mine)
            batch = {"inputs": inputs, "targets": targets}
            if config.reset_memory_each_epoch:
                batch["reset"] = np.full(
                    (config.batch_size,), step > 0 and step % len(batches) == 0
                )[mine]
            yield batch
            step += 1

    return batches, from_step


def evaluate_stream(
    dp: DataParallel, eval_step, params, stream: np.ndarray, config: LMConfig
) -> dict[str, float]:
    """Per-token nll over a whole stream, in order, memory carried from segment to segment."""
    rows = dp.round_rows(config.eval_batch_size)
    memory = dp.put_global(
        jax.device_get(init_memory(config.model_config, rows, mem_len=config.eval_mem_len))
    )
    total = None
    for pair in lm_batches(stream, batch_size=rows, tgt_len=config.eval_tgt_len):
        sums, memory = eval_step(params, dp.put_global(as_batch(pair)), memory)
        total = add_sums(total, sums)
    return with_bpc(summarize({k: float(v) for k, v in jax.device_get(total).items()}), config)


def with_bpc(values: dict[str, float], config: LMConfig) -> dict[str, float]:
    if config.data_level() in ("char", "byte"):
        values["bpc"] = values["nll"] / math.log(2.0)
    return values


@dataclasses.dataclass
class LMData:
    """The token streams of one run (TaskData)."""

    config: LMConfig
    batches_per_epoch: int
    from_step: Callable
    valid: np.ndarray
    test: np.ndarray | None
    log: Callable[[str], None] = print

    def batches(self, start_step: int, rows=None):
        return self.from_step(start_step, rows)

    def example_batches(self, rows=None) -> list[dict[str, np.ndarray]]:
        """The stream's one shape: its first batch."""
        return [next(self.from_step(0, rows))]

    def evaluate(self, dp: DataParallel, eval_step: Callable, params) -> dict[str, float]:
        return evaluate_stream(dp, eval_step, params, self.valid, self.config)

    def start(self, ctx: EvalContext, params) -> None:
        """Nothing to measure before the first step: the model starts from random weights."""

    def finish(
        self, ctx: EvalContext, step: int, params, validation: Mapping[str, float]
    ) -> dict[str, Any]:
        config = self.config
        out = {f"val_{k}": v for k, v in validation.items()}
        figure = "bpc" if "bpc" in validation else "ppl"
        if self.test is None:  # a text run given no test file
            self.log(f"no test text; validation {figure} {validation[figure]:.3f}")
        else:
            test = evaluate_stream(ctx.dp, ctx.eval_step, params, self.test, config)
            test["total_seconds"] = time.monotonic() - ctx.started
            ctx.writer.write_final(step, "test", test)
            out.update({f"test_{k}": v for k, v in test.items()})
            self.log(
                f"test {figure} {test[figure]:.3f}, validation {figure} "
                f"{validation[figure]:.3f} (eval segments {config.eval_tgt_len}, memory "
                f"{config.eval_mem_len})"
            )
        if config.plots and jax.process_index() == 0:
            path = plots.plot_losses(
                read_metrics(ctx.workdir), os.path.join(ctx.workdir, plots.PLOTS_DIR, "loss.png")
            )
            self.log(f"plots: {path}")
        return out


class LMTask:
    """`train.core.task.Task` for Transformer-XL on PTB (word or character level), a TFDS
    dataset or text."""

    name = "lm"
    choice_flag = "dataset"
    default_choice = "ptb"
    config_cls = LMConfig
    presets = tuple(PRESETS)
    preset_fields = PRESETS

    def choices(self) -> list[str]:
        return [*sorted(DATASETS), "tfds:"]  # 'tfds:' takes any name after it (tfds:lm1b)

    def model_config_cls(self, choice: str) -> type:
        return TransformerXLConfig  # one model for every dataset

    def make_config(
        self, choice: str, preset: str, *, model_overrides: Mapping[str, Any] = (), **run_overrides
    ) -> LMConfig:
        """A new run's config; its vocabulary counted by its data's source where the data sets
        it (`config_for_data`)."""
        return config_for_data(choice, preset, model_overrides=model_overrides, **run_overrides)

    def build_model(self, config: LMConfig) -> TransformerXL:
        return TransformerXL(config.model_config)

    def optimizer_config(self, config: LMConfig):
        return config.optimizer_config()

    def initial_params(self, config: LMConfig) -> None:
        """From the seed: language models are trained from scratch here."""
        return None

    def init_params(self, config: LMConfig, model: TransformerXL, rng):
        mc = config.model_config
        memory = init_memory(mc, config.batch_size)
        tokens = jnp.zeros((config.batch_size, mc.tgt_len), jnp.int32)
        params = model.init({"params": rng}, tokens, memory, targets=tokens)["params"]
        return params, memory

    def loss_fn(self, config: LMConfig, model: TransformerXL):
        return make_loss_fn(model)

    def describe(self, config: LMConfig) -> str:
        return "Transformer-XL"

    def prepare(
        self, config: LMConfig, workdir: str, dp: DataParallel, log: Callable[[str], None]
    ) -> LMData:
        if config.batch_size % dp.n_devices:
            raise ValueError(
                f"batch_size: {config.batch_size} rows do not split over {dp.n_devices} devices"
            )
        source = lm_source(config)
        source.check(workdir, log)  # a resumed run reads the data it started on
        cached = {}
        if source.cached:
            cached = dict(cache_dir=config.cache_dir or os.path.join(workdir, CACHE_DIR), log=log)
        train_stream = load_stream(config, "train", **cached)
        batches, from_step = train_batches(train_stream, config)
        data = LMData(
            config=config,
            batches_per_epoch=len(batches),
            from_step=from_step,
            valid=load_stream(config, "valid", **cached),
            test=load_stream(config, "test", **cached),
            log=log,
        )
        log(
            f"data: {config.dataset} ({config.data_level()}), {len(train_stream):,} training "
            f"tokens, vocabulary {config.model_config.vocab_size:,}, {len(batches)} batches of "
            f"{config.batch_size} x {config.model_config.tgt_len} an epoch (1 compiled shape), "
            f"{len(data.valid):,} valid / "
            f"{'no' if data.test is None else format(len(data.test), ',')} test tokens; "
            f"{dp.n_devices} device(s), {config.parallel}"
        )
        return data


TASK = LMTask()
