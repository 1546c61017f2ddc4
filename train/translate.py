"""Train and evaluate a translation model on Multi30k German -> English.

    python -m train.translate                          # Transformer: preset cpu, or gpu on a GPU
    python -m train.translate --preset base --workdir runs/base --dtype bfloat16
    python -m train.translate --model bahdanau --preset cpu
    python -m train.translate --workdir W              # resume W with its saved config
    python -m train.translate --workdir W --translate "Ein Mann fährt Fahrrad."

`main` only parses flags; `train_and_evaluate(config, workdir)` does the work and returns the
final metrics, so tests call it with tiny configs. Evaluation: teacher-forced loss and
perplexity on validation and test, then sacreBLEU (cased, 13a tokenization, on detokenized
text) of beam-search output on the test split, written to W/translations/.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from train import cli, registry
from train.checkpoint import Checkpoints, check_run_config, config_to_dict, load_run_config
from train.loop import LoopConfig, fit, printer
from train.metrics import MetricsWriter, add_sums, summarize
from train.parallel import DataParallel, maybe_initialize_distributed
from train.state import TrainState, count_params

SPLITS = ("validation", "test_2016_flickr", "test_2017_flickr", "test_2017_mscoco",
          "test_2018_flickr")


@dataclasses.dataclass(frozen=True)
class TranslateConfig:
    """One translation run. `model_config` is the chosen model's own config (resolved from the
    preset); everything else is how to train and evaluate it.

    Attributes:
      model: a name of `train.registry` ('transformer', 'gru', 'bahdanau', ...).
      preset: 'tiny' | 'cpu' | 'base' (see PRESETS).
      vocab_size: joint German+English SentencePiece pieces.
      tokens_per_batch: token budget N * L of each padded batch array (src or tgt).
      buckets: the allowed padded lengths L (one compiled shape per bucket in use).
      steps: stop after this many optimizer steps (a resumed run counts from 0).
      minutes: also stop when this many minutes of wall time have passed since the start,
        data preparation included (0 = no limit); evaluation follows.
      optimizer: 'noam' (Adam 0.9/0.98/1e-9 on lr_factor * D^-0.5 * min(s^-0.5,
        s * warmup^-1.5)) or 'adam' (constant learning_rate).
      clip_norm: clip the gradient to this global norm (None: no clipping).
      label_smoothing: of the training loss (validation perplexity is unsmoothed).
      ema_decay: evaluate (validation, test, beam search, --translate) with an exponential
        moving average of the parameters at this decay (0 = off: the raw parameters). It is
        kept in the optimizer state (`transformer_jax.optim.params_ema`), so it is
        checkpointed and resumes exactly; training itself is unchanged.
      parallel: 'jit' (Mesh + NamedSharding) or 'pmap'. distributed: call
        jax.distributed.initialize() first (several hosts).
      log_every, eval_every, checkpoint_every: in steps; eval_every 0 = at the end only (a
        checkpoint is saved at each evaluation, and at checkpoint_every).
      beam_size, length_penalty, decode_margin: beam search on the test split; outputs are at
        most (source bucket length + decode_margin) pieces.
      eval_sentences: evaluate on the first N sentences of each split (0 = all).
      data_dir: TFDS data directory (None: TFDS's default).
      tokenizer_dir: where the trained SentencePiece model is cached (None: W/tokenizer); the
        file name encodes the options and a hash of the text, so runs can share a directory.
    """

    model: str = "transformer"
    preset: str = "cpu"
    model_config: Any = None
    vocab_size: int = 8000
    tokens_per_batch: int = 4096
    buckets: tuple[int, ...] = (12, 16, 20, 24, 32, 48, 64, 96)
    steps: int = 100_000
    minutes: float = 0.0
    optimizer: str = "noam"
    warmup_steps: int = 4000
    lr_factor: float = 1.0
    learning_rate: float = 1e-3
    clip_norm: float | None = None
    label_smoothing: float = 0.1
    ema_decay: float = 0.0
    seed: int = 0
    parallel: str = "jit"
    distributed: bool = False
    log_every: int = 100
    eval_every: int = 0
    checkpoint_every: int = 1000
    keep_checkpoints: int = 3
    beam_size: int = 4
    length_penalty: float = 0.6
    decode_margin: int = 16
    eval_batch_size: int = 128
    eval_sentences: int = 0
    test_split: str = "test_2016_flickr"
    data_dir: str | None = None
    tokenizer_dir: str | None = None
    progress: bool = True
    plots: bool = True

    def __post_init__(self):
        if self.model_config is None:
            raise ValueError("model_config: build configs with make_config(...)")
        if self.optimizer not in ("noam", "adam"):
            raise ValueError(f"optimizer: expected 'noam' or 'adam', got {self.optimizer!r}")
        if self.optimizer == "noam" and not hasattr(self.model_config, "d_model"):
            raise ValueError(f"optimizer: 'noam' needs a model with d_model; {self.model} has "
                             "none (use 'adam')")
        if self.parallel not in ("jit", "pmap"):
            raise ValueError(f"parallel: expected 'jit' or 'pmap', got {self.parallel!r}")
        if self.test_split not in SPLITS:
            raise ValueError(f"test_split: expected one of {SPLITS}, got {self.test_split!r}")
        for name in ("vocab_size", "tokens_per_batch", "warmup_steps", "beam_size",
                     "eval_batch_size", "log_every", "keep_checkpoints"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        for name in ("steps", "minutes", "eval_every", "checkpoint_every", "eval_sentences",
                     "decode_margin"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)}")
        if not 0.0 <= self.label_smoothing < 1.0:
            raise ValueError(f"label_smoothing: must be in [0, 1), got {self.label_smoothing}")
        if not 0.0 <= self.ema_decay < 1.0:
            raise ValueError(f"ema_decay: must be in [0, 1) (0 = off), got {self.ema_decay}")
        if self.clip_norm is not None and self.clip_norm <= 0:
            raise ValueError(f"clip_norm: must be > 0 or None, got {self.clip_norm}")


# Run presets: TranslateConfig fields per preset (the model's own sizes are in registry.py).
PRESETS: dict[str, dict[str, Any]] = {
    # Tests and smoke runs: seconds.
    # One bucket: one compiled shape for training, one for evaluation, one for decoding.
    "tiny": dict(vocab_size=1000, tokens_per_batch=1024, buckets=(64,), steps=20,
                 warmup_steps=10,
                 lr_factor=2.0, log_every=5, checkpoint_every=10, eval_sentences=64,
                 eval_batch_size=32, decode_margin=8),
    # The CPU default: under ten minutes on 2 cores, data preparation and evaluation
    # included (training stops at `minutes`; beam search over the 1000 test sentences
    # follows). Chosen by short runs on the idle 2-core machine (equal wall time, validation
    # ppl and greedy BLEU; README, "Tuning the CPU default"): in a run this short the number
    # of updates matters most, so small 512-token batches (4x the updates of 2048 for the
    # same time), Adam at a constant 1e-3 from step 0 with clipping (a Noam warm-up spends
    # most of such a run below its peak; 2e-3 and linear decay were both worse), pre-LN,
    # and a 4k vocabulary (a step 18% faster than at 8k).
    # Evaluated with an EMA of the parameters (decay 0.99), chosen in runs of a fixed 1850
    # steps (their outcome does not depend on the machine's load): with dropout 0.1 the EMA
    # took validation ppl from 13.36 to 11.89 and test BLEU from 24.62 to 25.85 (decays
    # 0.98, 0.995, 0.997: validation ppl 12.11, 11.98, 12.42; 0.99 had the lowest).
    # No bucket of 96: one training pair of 29000 needs more than 64 positions, so the
    # shape was compiled for a single batch an epoch. With no dropout (registry.py) as well,
    # the measured run (idle machine) trained 2208 steps in its 8 minutes and ended at
    # 9 min 14 s in all, evaluation (61 s) included: test BLEU 28.79, validation ppl 9.49
    # (again after merging with the GPU work: 2124 steps, 9 min 6 s, BLEU 28.35).
    "cpu": dict(vocab_size=4000, tokens_per_batch=512, buckets=(12, 16, 20, 24, 32, 48, 64),
                steps=100_000, minutes=8.0, optimizer="adam", learning_rate=1e-3,
                clip_norm=1.0, ema_decay=0.99, log_every=100, checkpoint_every=1000),
    # One GPU, one ten-minute command: 7 minutes of training, then evaluation. Few buckets
    # (each shape compiles in tens of seconds; padding costs a GPU little), 8k-token batches,
    # the family's optimizer (the Transformer's Noam: a 2,000-step warm-up, peak 1e-3 for
    # D 512), bf16 (the model preset). Measured on one H100 shared with two other training
    # runs: 6,462 steps, test_2016_flickr BLEU 40.10 (beam 4), 7 min 43 s in all.
    "gpu": dict(vocab_size=8000, tokens_per_batch=8192, buckets=(16, 32, 64), steps=100_000,
                minutes=7.0, warmup_steps=2000, lr_factor=1.0,
                clip_norm=1.0, log_every=200, checkpoint_every=5000),
    # The paper's base recipe (~25k target tokens a batch, Noam factor 1, warm-up 4000).
    "base": dict(vocab_size=8000, tokens_per_batch=25_000, steps=100_000, warmup_steps=4000,
                 lr_factor=1.0, log_every=100, eval_every=1000, checkpoint_every=1000),
}

# Fields a resumed run may change: they do not alter the training trajectory.
MAY_CHANGE = ("steps", "minutes", "parallel", "distributed", "log_every", "eval_every",
              "checkpoint_every", "keep_checkpoints", "beam_size", "length_penalty",
              "decode_margin", "eval_batch_size", "eval_sentences", "test_split", "data_dir",
              "tokenizer_dir", "progress", "plots")


def make_config(model: str = "transformer", preset: str = "cpu", *,
                model_overrides: Mapping[str, Any] = (), **run_overrides) -> TranslateConfig:
    """The config of `preset` for `model`, with field overrides (validated)."""
    if preset not in PRESETS:
        raise ValueError(f"preset: expected one of {sorted(PRESETS)}, got {preset!r}")
    spec = registry.get(model)
    fields = {**spec.run_defaults, **PRESETS[preset], **run_overrides}
    bad = {"model", "preset", "model_config"} & set(run_overrides)
    if bad:
        raise ValueError(f"{sorted(bad)}: pass model/preset as arguments and model fields as "
                         "model_overrides")
    model_config = registry.build_model_config(
        model, preset, vocab_size=fields.get("vocab_size", TranslateConfig.vocab_size),
        overrides=model_overrides)
    return TranslateConfig(model=model, preset=preset, model_config=model_config, **fields)


def config_from_dict(values: Mapping[str, Any]) -> TranslateConfig:
    values = dict(values)
    spec = registry.get(values["model"])
    values["model_config"] = cli.from_dict(spec.config_cls, values["model_config"])
    return cli.from_dict(TranslateConfig, values)


def replace(config: TranslateConfig, *, model_overrides: Mapping[str, Any] = (),
            **run_overrides) -> TranslateConfig:
    """`config` with some run and model fields changed (validated again)."""
    model_config = config.model_config
    if model_overrides:
        model_config = dataclasses.replace(model_config, **dict(model_overrides))
    return dataclasses.replace(config, model_config=model_config, **run_overrides)


# ------------------------------------------------------------------------------ data
@dataclasses.dataclass
class Split:
    """One evaluation split: raw sentences and their encoded pairs (src ids end with eos)."""

    name: str
    sources: list[str]
    references: list[str]
    pairs: list[tuple[list[int], list[int]]]


def load_tokenizer(config: TranslateConfig, workdir: str):
    from train.tokenizers import multi30k_tokenizer
    return multi30k_tokenizer(config.tokenizer_dir or os.path.join(workdir, "tokenizer"),
                              vocab_size=config.vocab_size, data_dir=config.data_dir)


def encode_source(tokenizer, sentences: Sequence[str]) -> list[list[int]]:
    # The source ends with eos, so the encoder sees where the sentence stops (as fairseq does).
    return [ids + [tokenizer.eos_id] for ids in tokenizer.encode_batch(list(sentences))]


def load_split(config: TranslateConfig, tokenizer, name: str) -> Split:
    from train.datasets import load_multi30k
    pairs = load_multi30k(name, data_dir=config.data_dir)
    if config.eval_sentences:
        pairs = pairs[:config.eval_sentences]
    de, en = [p[0] for p in pairs], [p[1] for p in pairs]
    encoded = list(zip(encode_source(tokenizer, de), tokenizer.encode_batch(en)))
    return Split(name, de, en, encoded)


# ------------------------------------------------------------------------------ model
def build_model(config: TranslateConfig):
    return registry.get(config.model).module_cls(config.model_config)


def make_optimizer(config: TranslateConfig) -> tuple[optax.GradientTransformation,
                                                     optax.Schedule]:
    """-> (tx, lr schedule): Noam (the paper) or constant-rate Adam (the baselines), after
    optional clipping, followed by the parameter average when ema_decay > 0."""
    from transformer_jax.optim import noam_schedule, params_ema
    if config.optimizer == "noam":
        schedule = noam_schedule(config.model_config.d_model, config.warmup_steps,
                                 config.lr_factor)
        adam = optax.adam(schedule, b1=0.9, b2=0.98, eps=1e-9)
    else:
        schedule = optax.constant_schedule(config.learning_rate)
        adam = optax.adam(schedule)
    parts = [adam]
    if config.clip_norm is not None:
        parts.insert(0, optax.clip_by_global_norm(config.clip_norm))
    if config.ema_decay:
        parts.append(params_ema(config.ema_decay))  # last: it averages the updated params
    return (parts[0] if len(parts) == 1 else optax.chain(*parts)), schedule


def eval_params(config: TranslateConfig, state: TrainState):
    """The parameters to evaluate and decode with: the moving average when ema_decay > 0,
    else the trained parameters themselves."""
    if not config.ema_decay:
        return state.params
    from transformer_jax.optim import find_params_ema
    return find_params_ema(state.opt_state)


def make_loss_fn(model, *, smoothing: float, pad_id: int):
    """The train.step loss protocol for a translation model on {'src','tgt_in','tgt_out'}:
    label-smoothed cross-entropy summed over real target tokens, plus the unsmoothed nll."""
    from transformer_jax.losses import label_smoothed_cross_entropy

    def loss_fn(params, batch, *, rng, extra, deterministic):
        rngs = None if deterministic else {"dropout": rng}
        logits = model.apply({"params": params}, batch["src"], batch["tgt_in"],
                             deterministic=deterministic, rngs=rngs)
        loss_sum, n_tokens = label_smoothed_cross_entropy(
            logits, batch["tgt_out"], smoothing=smoothing, pad_id=pad_id)
        if smoothing:
            nll_sum, _ = label_smoothed_cross_entropy(logits, batch["tgt_out"], smoothing=0.0,
                                                      pad_id=pad_id)
        else:
            nll_sum = loss_sum
        return loss_sum, {"n_tokens": n_tokens.astype(jnp.float32), "nll_sum": nll_sum}, extra

    return loss_fn


def init_state(config: TranslateConfig, model, tx, dp: DataParallel) -> TrainState:
    """Fresh float32 params and optimizer state from the seed, in the global layout."""

    def create(seed):
        init_rng, train_rng = jax.random.split(jax.random.PRNGKey(seed))
        dummy = jnp.ones((1, 8), jnp.int32)
        params = model.init({"params": init_rng}, dummy, dummy)["params"]
        return TrainState.create(params=params, tx=tx, rng=train_rng)

    return dp.init_state(create, config.seed)


# ------------------------------------------------------------------------------ evaluation
def _model_batch(batch: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k: v for k, v in batch.items() if k in ("src", "tgt_in", "tgt_out")}


def teacher_forced(dp: DataParallel, eval_step, params, batches) -> dict[str, float]:
    """Summed loss / nll over `batches` (summed on device, fetched once) -> loss, nll, ppl."""
    total = None
    for batch in batches:
        sums, _ = eval_step(params, dp.put_global(_model_batch(batch)), None)
        total = add_sums(total, sums)
    return summarize({k: float(v) for k, v in jax.device_get(total).items()})


def translate_pairs(model, params, dp: DataParallel, config: TranslateConfig, tokenizer,
                    pairs, *, greedy: bool = False) -> list[str]:
    """Beam search (or greedy decoding) over `pairs` (their sources), in order ->
    detokenized hypotheses."""
    from train.batching import eval_batches
    from transformer_jax.decode import beam_search, greedy_decode

    out: list[str] = [""] * len(pairs)
    # Decoded shortest source first, so no batch runs as long as its longest sentence. Only
    # the sources are batched: the reference's length has no say in the output budget.
    batches = eval_batches([(src, []) for src, _ in pairs],
                           batch_size=dp.round_rows(config.eval_batch_size),
                           buckets=config.buckets, num_devices=dp.n_devices,
                           sort_by_length=True)
    for batch in batches:
        src = batch["src"]
        max_len = src.shape[1] + config.decode_margin
        if greedy:
            best = np.asarray(jax.device_get(
                greedy_decode(model, params, dp.put_global(src), max_len=max_len)))  # [N, L]
        else:
            tokens, _ = beam_search(model, params, dp.put_global(src),
                                    beam_size=config.beam_size, max_len=max_len,
                                    length_penalty=config.length_penalty)
            best = np.asarray(jax.device_get(tokens))[:, 0]  # [N, L], best beam first
        for row, i in enumerate(batch["index"]):
            if i >= 0:
                out[i] = tokenizer.decode(best[row])
    return out


def bleu(hypotheses: Sequence[str], references: Sequence[str]) -> float:
    """Corpus sacreBLEU: cased, 13a tokenization, detokenized input (sacrebleu's defaults)."""
    import sacrebleu
    return float(sacrebleu.corpus_bleu(list(hypotheses), [list(references)]).score)


# ------------------------------------------------------------------------------ the run
def train_and_evaluate(config: TranslateConfig, workdir: str) -> dict[str, Any]:
    """Trains (or resumes) in `workdir`, then evaluates; returns the final metrics:
    step, stop reason, params (count), train_seconds (summed over resumed runs), val/test loss
    and ppl, test BLEU, and the hypotheses path."""
    t0 = time.monotonic()
    maybe_initialize_distributed(config.distributed)
    run_config = config_to_dict(config)
    check_run_config(workdir, run_config, may_change=MAY_CHANGE)
    log = printer()
    dp = DataParallel(config.parallel)
    eval_dp = dp if dp.mode == "jit" else DataParallel("jit")
    eval_rows = dp.round_rows(config.eval_batch_size)

    from train.batching import TokenBatcher, eval_batches
    from train.datasets import load_multi30k
    tokenizer = load_tokenizer(config, workdir)
    train_pairs = load_multi30k("train", data_dir=config.data_dir)
    train_encoded = list(zip(encode_source(tokenizer, [p[0] for p in train_pairs]),
                             tokenizer.encode_batch([p[1] for p in train_pairs])))
    batcher = TokenBatcher(train_encoded, tokens_per_batch=config.tokens_per_batch,
                           buckets=config.buckets, num_devices=dp.n_devices, seed=config.seed)
    validation = load_split(config, tokenizer, "validation")
    test = load_split(config, tokenizer, config.test_split)
    log(f"data: {batcher.num_examples} training pairs ({batcher.num_dropped} too long), "
        f"{batcher.num_batches} batches an epoch; vocabulary {tokenizer.vocab_size}; "
        f"{len(batcher.shape_set())} batch shapes to compile: {batcher.shape_set()}; "
        f"{dp.n_devices} device(s), {config.parallel}; prepared in {time.monotonic() - t0:.1f}s")

    model = build_model(config)
    tx, schedule = make_optimizer(config)
    state = init_state(config, model, tx, eval_dp)
    log(f"model: {config.model} ({config.preset}), {count_params(state.params):,} parameters")
    loss_fn = make_loss_fn(model, smoothing=config.label_smoothing,
                           pad_id=config.model_config.pad_id)
    eval_step = eval_dp.compile_eval_step(loss_fn, state)
    val_batches = eval_batches(validation.pairs, batch_size=eval_rows, buckets=config.buckets,
                               num_devices=dp.n_devices)

    def evaluate(global_state: TrainState) -> dict[str, float]:
        return teacher_forced(eval_dp, eval_step, eval_params(config, global_state),
                              val_batches)

    fitted = fit(
        state, workdir=workdir, run_config=run_config, dp=dp, loss_fn=loss_fn,
        lr_schedule=schedule, batches=batcher.iterate, keep_checkpoints=config.keep_checkpoints,
        config=LoopConfig.from_run(config, start=t0), evaluate=evaluate, log=log)
    state, step, final = fitted.state, fitted.step, fitted.summary()
    final.update(params=count_params(state.params), train_seconds=fitted.elapsed)
    if fitted.reason == "sigterm":
        return final

    val = fitted.last_eval or evaluate(state)
    final.update({f"val_{k}": v for k, v in val.items() if k in ("loss", "nll", "ppl")})
    t_eval = time.monotonic()
    params = eval_params(config, state)
    test_tf = teacher_forced(eval_dp, eval_step, params, eval_batches(
        test.pairs, batch_size=eval_rows, buckets=config.buckets, num_devices=dp.n_devices))
    hypotheses = translate_pairs(model, params, eval_dp, config, tokenizer, test.pairs)
    score = bleu(hypotheses, test.references)
    path = write_translations(workdir, config.test_split, step, test, hypotheses)
    record = {"loss": test_tf["loss"], "nll": test_tf["nll"], "ppl": test_tf["ppl"],
              "bleu": score, "sentences": len(hypotheses), "beam_size": config.beam_size,
              "eval_seconds": time.monotonic() - t_eval,
              "total_seconds": time.monotonic() - t0}
    MetricsWriter(workdir).write(step, config.test_split, record)
    final.update({f"test_{k}": v for k, v in record.items()})
    final["hypotheses"] = path
    log(f"{config.test_split}: BLEU {score:.2f} (sacreBLEU, cased, 13a, beam "
        f"{config.beam_size}), ppl {test_tf['ppl']:.2f}; validation ppl {val['ppl']:.2f}; "
        f"translations in {path}")
    if config.plots and jax.process_index() == 0:
        from train import plots
        made = plots.make_translation_plots(workdir, model, params, tokenizer,
                                            source=test.sources[0], hypothesis=hypotheses[0])
        log(f"plots: {', '.join(os.path.basename(p) for p in made)} in "
            f"{os.path.join(workdir, 'plots')}")
    return final


def write_translations(workdir: str, split: str, step: int, data: Split,
                       hypotheses: Sequence[str]) -> str:
    """W/translations/<split>.step<N>.en (one hypothesis a line, in test order); also the
    source and reference next to it once."""
    directory = os.path.join(workdir, "translations")
    path = os.path.join(directory, f"{split}.step{step}.en")
    if jax.process_index() == 0:
        os.makedirs(directory, exist_ok=True)
        for name, lines in ((path, hypotheses),
                            (os.path.join(directory, f"{split}.source.de"), data.sources),
                            (os.path.join(directory, f"{split}.reference.en"), data.references)):
            with open(name, "w", encoding="utf-8") as f:
                f.writelines(line.replace("\n", " ") + "\n" for line in lines)
    return path


def translate_text(workdir: str, sentences: Sequence[str], *, step: int | None = None,
                   greedy: bool = False) -> list[str]:
    """Translates German `sentences` with the checkpoint of `workdir` (default: the best by
    validation loss, else the latest), by beam search or greedy decoding."""
    saved = load_run_config(workdir)
    if saved is None:
        raise FileNotFoundError(f"{workdir} has no {os.path.basename('config.json')}: "
                                "not a train.translate work directory")
    config = config_from_dict(saved)
    checkpoints = Checkpoints(workdir, keep=config.keep_checkpoints)
    if checkpoints.latest_step() is None:
        raise FileNotFoundError(f"no checkpoint in {checkpoints.directory}: train first")
    step = checkpoints.best_step() if step is None else step
    dp = DataParallel("jit")
    model = build_model(config)
    tx, _ = make_optimizer(config)
    template = init_state(config, model, tx, dp)  # shapes, dtypes and shardings to restore into
    state, _ = checkpoints.restore(template, step)
    checkpoints.close()
    tokenizer = load_tokenizer(config, workdir)
    pairs = [(src, []) for src in encode_source(tokenizer, sentences)]
    return translate_pairs(model, eval_params(config, state), dp, config, tokenizer, pairs,
                           greedy=greedy)


# ------------------------------------------------------------------------------ CLI
def config_from_args(argv: Sequence[str] | None) -> tuple[TranslateConfig | None, str,
                                                          argparse.Namespace]:
    """-> (config, or None for --translate; workdir; the parsed args)."""
    known = cli.pre_parse(argv, "model")
    saved = load_run_config(known.workdir) if known.workdir else None
    model_name = known.model or (saved or {}).get("model", "transformer")
    if model_name not in registry.names():
        model_name = "transformer"  # the full parser reports the bad choice
    model_cls = registry.get(model_name).config_cls
    parser = cli.base_parser(
        "python -m train.translate", __doc__, choice_flag="model", choices=registry.names(),
        presets=list(PRESETS), run_cls=TranslateConfig, model_cls=model_cls,
        model_title=f"model ({model_name})")
    parser.add_argument("--translate", nargs="+", metavar="SENTENCE",
                        help="translate with the checkpoint in --workdir and exit")
    args = parser.parse_args(argv)
    if args.translate:
        if not args.workdir:
            parser.error("--translate needs --workdir (a trained run)")
        return None, args.workdir, args
    config = cli.resolve_config(
        parser, args, saved=saved, choice_flag="model", default_choice="transformer",
        run_cls=TranslateConfig, model_cls=model_cls, make_config=make_config,
        config_from_dict=config_from_dict, replace=replace)
    workdir = args.workdir or os.path.join(
        "runs", f"translate-{config.model}-{config.preset}-{time.strftime('%Y%m%d-%H%M%S')}")
    return config, workdir, args


def main(argv: Sequence[str] | None = None) -> int:
    config, workdir, args = config_from_args(argv)
    if config is None:
        for line in translate_text(workdir, args.translate):
            print(line)
        return 0
    print(f"workdir: {workdir}", flush=True)
    final = train_and_evaluate(config, workdir)
    if final["reason"] != "sigterm":
        print(f"final: step {final['step']}, test BLEU {final['test_bleu']:.2f}, "
              f"test ppl {final['test_ppl']:.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
