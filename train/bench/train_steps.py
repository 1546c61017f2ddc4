"""Training-step benchmarks: the project's own train step (`train.core.step.make_train_step`,
jitted by `train.core.parallel.DataParallel`: state donated, metrics left on device) on one
device, timed, with its FLOPs (formula, XLA, jaxpr), memory, MFU and a profile."""

from __future__ import annotations

import dataclasses
import os
import re
import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from train.bench import program
from train.bench.config import BenchConfig
from train.bench.flops import FlopCount, jaxpr_matmul_flops, transformer_flops, xl_flops, xla_flops
from train.bench.profile import profile_summary
from train.bench.targets import target_for_device_kind
from train.bench.timing import compiled_memory, device_peak_bytes, time_calls, utilisation
from train.core.parallel import DataParallel
from train.core.state import TrainState, count_params
from train.core.step import make_train_step
from train.lm import make_loss_fn as lm_loss_fn
from train.translate import make_loss_fn as translate_loss_fn
from transformer_jax.model import Transformer
from transformer_jax.optim import OptimizerConfig, make_optimizer
from xl_jax.config import TransformerXLConfig
from xl_jax.memory import init_memory
from xl_jax.model import TransformerXL

PROFILED_STEPS = 3


@dataclasses.dataclass(frozen=True)
class TrainBench:
    """One training benchmark, before anything is allocated.

    init_state: () -> the fresh TrainState (jitted straight onto the device by the bench;
      `jax.eval_shape`-able, so a test can trace the paper sizes without allocating them).
    batch: host arrays of the one batch every timed step reads.
    real_tokens: the positions of that batch the loss counts (not padding); `flops.tokens`
      counts them all.
    """

    name: str
    loss_fn: Callable
    init_state: Callable[[], TrainState]
    batch: Mapping[str, np.ndarray]
    flops: FlopCount
    info: Mapping[str, Any]
    real_tokens: int


def transformer_train_setup(config: BenchConfig) -> TrainBench:
    """The Transformer training step on random [B, L] sources and targets, Adam on the Noam
    schedule, label smoothing 0.1: `train.translate`'s loss. Rows are full unless
    `config.transformer_min_len` draws shorter ones (padded at the end)."""

    cfg, b, length = config.transformer, config.transformer_batch, config.transformer_len
    model = Transformer(cfg)
    rng = np.random.default_rng(0)

    def tokens(lengths=None):
        ids = rng.integers(3, cfg.tgt_vocab_size, (b, length), dtype=np.int32)
        if lengths is None:
            return ids
        return np.where(np.arange(length) < lengths[:, None], ids, cfg.pad_id).astype(np.int32)

    src_len = tgt_len = None
    if config.transformer_min_len:
        src_len = rng.integers(config.transformer_min_len, length + 1, b)
        tgt_len = rng.integers(config.transformer_min_len, length + 1, b)
    batch = {"src": tokens(src_len), "tgt_in": tokens(tgt_len), "tgt_out": tokens(tgt_len)}

    def init_state() -> TrainState:
        dummy = jnp.ones((1, 8), jnp.int32)
        params = model.init({"params": jax.random.PRNGKey(0)}, dummy, dummy)["params"]
        tx, _ = make_optimizer(
            OptimizerConfig(schedule="noam", d_model=cfg.d_model, warmup_steps=4000)
        )
        return TrainState.create(params=params, tx=tx, rng=jax.random.PRNGKey(1))

    return TrainBench(
        name="transformer_base" if cfg.d_model == 512 else "transformer (quick)",
        loss_fn=translate_loss_fn(model, smoothing=0.1, pad_id=cfg.pad_id),
        init_state=init_state,
        batch=batch,
        flops=transformer_flops(cfg, batch=b, src_len=length, tgt_len=length),
        info=dict(
            batch=b,
            src_len=length,
            tgt_len=length,
            dtype=config.dtype,
            attention_impl=cfg.attention_impl,
        ),
        real_tokens=int(np.sum(batch["tgt_out"] != cfg.pad_id)),
    )


def xl_train_setup(
    name: str, xl_config: TransformerXLConfig, batch_size: int, config: BenchConfig
) -> TrainBench:
    """The Transformer-XL training step on random [B, tgt_len] segments, the mem_len memory
    carried from step to step (the state's `extra`), Adam: `train.lm`'s loss."""

    cfg, b = xl_config, batch_size
    model = TransformerXL(cfg)
    rng = np.random.default_rng(0)
    tokens = lambda: rng.integers(0, cfg.vocab_size, (b, cfg.tgt_len), dtype=np.int32)  # noqa

    def init_state() -> TrainState:
        dummy = jnp.ones((1, 8), jnp.int32)
        params = model.init({"params": jax.random.PRNGKey(0)}, dummy, init_memory(cfg, 1))["params"]
        # Adam as the paper (its cosine schedule does not change the cost of a step).
        return TrainState.create(
            params=params,
            tx=optax.adam(2.5e-4),
            rng=jax.random.PRNGKey(1),
            extra=init_memory(cfg, b),
        )

    return TrainBench(
        name=name,
        loss_fn=lm_loss_fn(model),
        init_state=init_state,
        batch={"inputs": tokens(), "targets": tokens()},
        flops=xl_flops(cfg, batch=b, tgt_len=cfg.tgt_len, mem_len=cfg.mem_len),
        info=dict(
            batch=b,
            tgt_len=cfg.tgt_len,
            mem_len=cfg.mem_len,
            dtype=config.dtype,
            remat=cfg.remat,
            attention_impl=cfg.attention_impl,
        ),
        real_tokens=b * cfg.tgt_len,  # a stream: every position is a token
    )


def _target_estimate(device: jax.Device, compiled) -> dict[str, Any] | None:
    """On a device `--target` knows, the estimate it would give without the device (kernels,
    bytes, categories, the estimated step), to print beside what is measured; else None."""
    target = target_for_device_kind(device.device_kind)
    if target is None:
        return None
    summary = program.summarize(
        program.program_kernels(compiled.as_text()), program.pricing_for(target)
    )
    return {k: summary[k] for k in ("kernels", "bytes", "categories", "estimate")}


def bench_train_step(
    bench: TrainBench,
    *,
    steps: int,
    warmup: int,
    rates: Mapping[str, float],
    nominal_peak: float | None = None,
    profile_dir: str | None = None,
) -> dict[str, Any]:
    """Compiles the project's train step for `bench` on one device and times it.

    rates: measured matrix rates by dtype name ('bfloat16', 'float32'), for the MFU figures.
    Returns every raw figure: compile_s, step times, tokens_per_s, memory, the analytic FLOPs
    next to XLA's and the jaxpr's, MFU, the last step's loss (to show it is finite) and, with
    `profile_dir`, where the time of 3 more (traced) steps went. tokens_per_s and the MFU
    count every position of the batch; the real_* figures only its real (non-pad) tokens,
    with the model FLOPs scaled by the real share.
    """
    device = jax.local_devices()[0]
    dp = DataParallel("jit", devices=[device])
    state = dp.put_state(dp.init_state(bench.init_state))
    batch = dp.put_batch(bench.batch)
    step = dp.compile_train_step(bench.loss_fn, state)
    start = time.perf_counter()
    lowered = step.lower(state, batch)
    lower_s = time.perf_counter() - start
    compiled = lowered.compile()
    compile_s = time.perf_counter() - start - lower_s

    metrics = None

    def one_step():
        nonlocal state, metrics
        state, metrics = compiled(state, batch)
        return state.step

    # Any device-to-host transfer inside the timed steps raises on an accelerator (on a CPU,
    # device memory is host memory and the guard never fires; tests/test_efficiency.py checks
    # the compiled program there).
    with jax.transfer_guard_device_to_host("disallow_explicit"):
        times = time_calls(one_step, warmup=warmup, repeats=steps)
    profile = None
    if profile_dir is not None:
        trace_dir = os.path.join(profile_dir, _slug(bench.name))
        with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
            time_calls(one_step, warmup=0, repeats=PROFILED_STEPS)
        profile = profile_summary(trace_dir, steps=PROFILED_STEPS, hlo_text=compiled.as_text())
    loss = float(metrics["loss_sum"] / metrics["n_tokens"])
    estimate = _target_estimate(device, compiled)
    median = statistics.median(times)
    flops = bench.flops
    model_flops = flops.training()
    real_flops = model_flops * bench.real_tokens / flops.tokens
    xla = xla_flops(compiled)
    # Traced again without jit: the matmuls the program contains (a fused attention kernel, as
    # cuDNN's on a GPU, is a custom call: its products are missing from this count).
    try:
        traced = jaxpr_matmul_flops(make_train_step(bench.loss_fn), state, batch)
    except ValueError:  # a while loop: no static count
        traced = None
    return {
        "name": bench.name,
        **bench.info,
        "tokens_per_step": flops.tokens,
        "n_params": count_params(state.params),
        "lower_s": lower_s,
        "compile_s": compile_s,
        "step_s_median": median,
        "step_s_min": min(times),
        "step_times_s": times,
        "tokens_per_s": flops.tokens / median,
        "real_tokens_per_step": bench.real_tokens,
        "real_tokens_per_s": bench.real_tokens / median,
        "memory": compiled_memory(compiled),
        "device_peak_bytes": device_peak_bytes(device),
        "flops": flops.as_dict(),
        "xla_flops": xla,
        "xla_over_executed": xla / flops.training(executed=True) if xla else None,
        # XLA's cost analysis counts the body of a while loop (a scan) once, not per trip:
        # flagged where that is why its count falls short of the products executed.
        "xla_counts_loops_once": bool(
            xla
            and xla < flops.training(executed=True)
            and re.search(r"\bwhile\(", compiled.as_text() or "")
        ),
        "jaxpr_matmul_flops": traced,
        "model_tflops_per_s": model_flops / median / 1e12,
        "mfu_vs_measured_bf16": utilisation(model_flops, median, rates.get("bfloat16")),
        "mfu_vs_measured_float32": utilisation(model_flops, median, rates.get("float32")),
        "mfu_vs_nominal_bf16": utilisation(model_flops, median, nominal_peak),
        "real_mfu_vs_measured_bf16": utilisation(real_flops, median, rates.get("bfloat16")),
        "real_mfu_vs_nominal_bf16": utilisation(real_flops, median, nominal_peak),
        "final_loss": loss,
        "profile": profile,
        "program": estimate,
    }


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name).strip("_")
