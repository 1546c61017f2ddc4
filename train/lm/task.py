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
import functools
import math
import os
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from train import plots
from train.core.metrics import add_sums, read_metrics, summarize
from train.core.parallel import DataParallel
from train.core.task import EvalContext
from train.data.text_files import DataError, check_fingerprint, files_sha256
from train.data.tfds_source import is_tfds, open_dataset
from train.data.token_cache import CACHE_DIR, ids_dtype, stream_cache
from train.data.tokenizers import CharVocab, WordVocab
from train.lm.config import DATASETS, PRESETS, LMConfig, make_config
from train.lm.text import (
    byte_chunks,
    byte_length,
    encoded_chunks,
    encoded_lines,
    tfds_split,
    training_vocab,
)
from xl_jax.config import TransformerXLConfig
from xl_jax.data import lm_batches
from xl_jax.memory import init_memory, reset_rows
from xl_jax.model import TransformerXL


def load_vocab(config: LMConfig):
    """PTB's closed vocabulary, or the one of a text run's training file or a TFDS run's train
    split at its level."""
    if config.dataset == "text" or is_tfds(config.dataset):
        vocab = training_vocab(
            config.dataset,
            config.level,
            train_text=config.train_text,
            text_feature=config.text_feature,
            min_count=config.min_count,
            max_vocab=config.max_vocab,
            data_dir=config.data_dir,
        )
        if vocab.vocab_size != config.model_config.vocab_size:
            source, what = (
                (f"dataset: {config.dataset}", "data")
                if is_tfds(config.dataset)
                else (f"train_text: {config.train_text}", "text")
            )
            raise DataError(
                f"{source} gives {vocab.vocab_size:,} symbols, the run's model "
                f"{config.model_config.vocab_size:,}: not the {what} this run was made from"
            )
        return vocab
    level = DATASETS[config.dataset]
    return (WordVocab if level == "word" else CharVocab).from_ptb(data_dir=config.data_dir)


def load_stream(
    config: LMConfig, split: str, *, cache_dir: str | None = None, log=None
) -> np.ndarray | None:
    """The token stream of a split ('train', 'valid', 'test'): PTB's, the text run's or the
    TFDS run's, `<eos>` after every line (bytes as they are at the byte level, a newline
    after each TFDS example); None for a text or TFDS run without that split. With
    `cache_dir` a text or TFDS run's stream is encoded once into the token cache there and
    read memory-mapped (train.data.token_cache); else int32 in memory."""
    if is_tfds(config.dataset):
        stream = _tfds_stream(config, split, cache_dir, log)
    elif config.dataset == "text":
        stream = _text_stream(config, split, cache_dir, log)
    else:
        from train.data.datasets import load_ptb  # lazy: importing TFDS is not free

        stream = load_vocab(config).encode_lines(
            load_ptb(DATASETS[config.dataset], split, data_dir=config.data_dir)
        )
    if stream is None:
        return None
    return stream[: config.eval_tokens] if config.eval_tokens and split != "train" else stream


def _text_stream(config: LMConfig, split: str, cache_dir: str | None, log) -> np.ndarray | None:
    """A text run's split: its ids as `chunks` yields them, cached when `cache_dir` is set."""
    if config.split_bytes:
        path = config.train_text
        a, b, c = config.split_bytes
        total = byte_length(path)
        if a + b >= total:
            raise DataError(
                f"split_bytes {tuple(config.split_bytes)}: {path} has only {total:,} "
                "bytes, too few for a train and a validation part and a test part"
            )
        start, stop = {"train": (0, a), "valid": (a, a + b), "test": (a + b, a + b + c)}[split]
    else:
        path = {"train": config.train_text, "valid": config.valid_text, "test": config.test_text}[
            split
        ]
        if path is None:
            return None
        start, stop = 0, None
    vocab = load_vocab(config)
    if config.level == "byte":
        dtype = np.uint8

        def chunks():
            empty = True
            for chunk in byte_chunks(path, start, stop):
                empty = False
                yield np.frombuffer(chunk, np.uint8)
            if empty and not config.split_bytes:
                raise DataError(f"{path}: the file is empty")
    else:
        dtype = ids_dtype(vocab.vocab_size)

        def chunks():
            yield from encoded_lines(vocab, path)

    return _stream(
        chunks,
        dtype=dtype,
        cache_dir=cache_dir,
        log=log,
        what=f"{split} text",
        text_sha256=_sha256(path),
        byte_range=[start, stop],
        train_sha256=_sha256(config.train_text),  # the vocabulary's source
        level=config.level,
        min_count=config.min_count,
        max_vocab=config.max_vocab,
    )


def _tfds_stream(config: LMConfig, split: str, cache_dir: str | None, log) -> np.ndarray | None:
    """A TFDS run's split, its examples read and encoded in chunks, cached when `cache_dir` is
    set; keyed by the prepared copy's dataset_info.json (which fixes every split, the train
    split the vocabulary is counted on included)."""
    feature = config.text_feature
    data, name = tfds_split(config.dataset, split, feature=feature, data_dir=config.data_dir)
    if name is None:
        return None
    vocab = load_vocab(config)

    def chunks():
        lines = (line for (line,) in data.iter_read(name, (feature,)))
        yield from encoded_chunks(vocab, lines)

    return _stream(
        chunks,
        dtype=np.uint8 if config.level == "byte" else ids_dtype(vocab.vocab_size),
        cache_dir=cache_dir,
        log=log,
        what=f"{config.dataset} {name}",
        dataset_sha256=_sha256(data.info_path),
        dataset=data.builder.info.full_name,  # name/config/version
        split=name,
        feature=feature,
        level=config.level,
        min_count=config.min_count,
        max_vocab=config.max_vocab,
    )


def _stream(
    chunks: Callable[[], Iterable[np.ndarray]],
    *,
    dtype: np.dtype,
    cache_dir: str | None,
    log,
    what: str,
    **key_parts: Any,
) -> np.ndarray:
    """The ids `chunks()` yields, concatenated: from the token cache of `key_parts` in
    `cache_dir` (memory-mapped), or with no cache_dir in memory (int32)."""
    if cache_dir is None:
        parts = list(chunks())
        return np.concatenate(parts).astype(np.int32) if parts else np.zeros(0, np.int32)
    return stream_cache(cache_dir, chunks, dtype=dtype, log=log, what=what, **key_parts)


def _sha256(path: str) -> str:
    """`files_sha256(path)`, computed once per process for each file version (size, time):
    the three splits' caches all name the training file."""
    info = os.stat(path)
    return _sha256_of(path, (info.st_size, info.st_mtime_ns))


@functools.lru_cache(maxsize=8)
def _sha256_of(path: str, stamp: tuple[int, int]) -> str:
    return files_sha256(path)


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

    def choices(self) -> list[str]:
        return [*sorted(DATASETS), "tfds:"]  # 'tfds:' takes any name after it (tfds:lm1b)

    def model_config_cls(self, choice: str) -> type:
        return TransformerXLConfig  # one model for every dataset

    def make_config(
        self, choice: str, preset: str, *, model_overrides: Mapping[str, Any] = (), **run_overrides
    ) -> LMConfig:
        return make_config(choice, preset, model_overrides=model_overrides, **run_overrides)

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
        cached = {}
        if config.dataset == "text":
            check_fingerprint(workdir, {"train_text": config.train_text})
            cached = dict(cache_dir=config.cache_dir or os.path.join(workdir, CACHE_DIR), log=log)
        elif is_tfds(config.dataset):  # its version and splits: dataset_info.json
            data = open_dataset(config.dataset, config.data_dir)
            check_fingerprint(workdir, {"dataset": data.info_path})
            if data.splits().note:
                log(f"data: {config.dataset}: {data.splits().note}")
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
