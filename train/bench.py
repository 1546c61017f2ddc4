"""Speed benchmarks: training throughput and MFU, beam-4 decoding, Transformer-XL evaluation.

    python -m train.bench                        # full sizes, for one GPU
    python -m train.bench --quick                # CPU sizes: a couple of minutes on 2 cores
    python -m train.bench --only train_xl_enwik8 xl_eval --out DIR

Sections (`--only` picks some; `matmul` always runs, the other sections divide by its rate):
  matmul             the device's achievable matrix rate: median time of a large square
                     product (8192^3 on a GPU) in bf16, and in float32.
  train_transformer  Transformer base (512 wide, 6+6 layers), ~25k source and ~25k target
                     tokens a batch ([768, 32] each, no padding), the paper's vocabulary 37000.
  train_xl_enwik8    Transformer-XL enwik8_base: 12 x 512, segment 512, memory 512, batch 22.
  train_xl_wt103     Transformer-XL wt103_base: 16 x 410, segment/memory 150, adaptive softmax
                     over 267,735 words, batch 60.
  decode             beam-4 search over Multi30k test_2016_flickr (1,000 sentences) with a
                     random-init Transformer base on the joint 8k SentencePiece vocabulary:
                     sentences per second. An untrained model rarely emits EOS, so every
                     sentence runs to its length limit (source bucket + 16): a worst case.
  xl_eval            per-token evaluation time of Transformer-XL with memory (segments of 128,
                     memory = the attention length) against a vanilla Transformer that
                     recomputes a sliding window of the whole attention length for every token
                     (the same network with no memory; only the window's last position is new),
                     at attention lengths 800 ... 3800 (the XL paper's Table 9).

Every training figure is the project's own train step (`train.step.make_train_step` jitted by
`train.parallel.DataParallel`: state donated, metrics left on device) on one device, in the
compute dtype (bf16 on an accelerator: parameters, softmax and loss stay float32). Timing:
`.lower(...).compile()` is the compile time; then warm-up steps, then the median of N steps each
ended by `block_until_ready`. FLOPs: the itemized formulas of `train.flops` (stated in the
output), beside XLA's `compiled.cost_analysis()['flops']` and their ratio. MFU = model FLOPs per
second / the bf16 matrix rate measured in the same run (and / the datasheet peak when the device
is known). Peak memory: `compiled.memory_analysis()` (arguments + outputs + temporaries -
aliased). Results go to OUT/bench.json (every raw figure, the device, versions, date, command
line) and OUT/bench.md (tables), and are printed.

`main` only parses flags; `run_benchmarks(config, ...)` does the work, and each section is an
importable function that the tests run at tiny sizes.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import glob
import gzip
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from train.flops import FlopCount, jaxpr_matmul_flops, transformer_flops, xl_flops, xla_flops
from train.parallel import DataParallel
from train.state import TrainState, count_params
from train.step import make_train_step
from transformer_jax.config import TransformerConfig
from transformer_jax.attention import IMPLEMENTATIONS
from xl_jax.config import REMAT_MODES, TransformerXLConfig

PROFILED_STEPS = 3
SECTIONS = ("matmul", "train_transformer", "train_xl_enwik8", "train_xl_wt103", "decode",
            "xl_eval")
XL_SECTIONS = {"train_xl_enwik8": "enwik8", "train_xl_wt103": "wt103"}

# Datasheet dense bf16 peaks (FLOP/s), matched in order against `device_kind`.
NOMINAL_BF16_PEAK = (
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989.4e12),   # SXM ("NVIDIA H100 80GB HBM3")
    ("H200", 989.4e12),
    ("A100", 312e12),
    ("L4", 121e12),
)


# ----------------------------------------------------------------------------- configuration
@dataclasses.dataclass(frozen=True)
class BenchConfig:
    """The sizes of one benchmark run (`full` for an accelerator, `quick` for a CPU).

    Attributes:
      dtype: compute dtype of every model ('float32' | 'bfloat16').
      steps, warmup: timed and untimed training steps of each training benchmark.
      matmul_size, matmul_repeats: the square product that measures the matrix rate.
      transformer, transformer_batch, transformer_len: the Transformer training step, on
        [batch, len] sources and targets.
      xl: (name, config, batch) per Transformer-XL training benchmark; segment and memory
        lengths are the config's tgt_len and mem_len.
      decode_model: the Transformer that decodes (its vocabulary is set to the tokenizer's).
      decode_vocab_size: the joint SentencePiece vocabulary size.
      decode_sentences: the first N sentences of test_2016_flickr (0 = all).
      decode_batch, beam_size, decode_margin, decode_repeats: beam search batch rows, beams,
        extra output positions beyond the source bucket, timed passes over the sentences.
      xl_eval: the Transformer-XL of the evaluation comparison.
      attn_lengths: attention lengths A compared (XL memory M = A; vanilla window = A).
      xl_eval_tgt_len, xl_eval_batch: XL's evaluation segment length and batch.
      vanilla_batch: sliding windows evaluated at once by the vanilla model.
      eval_repeats: timed calls per length and model.
    """

    dtype: str
    steps: int
    warmup: int
    matmul_size: int
    matmul_repeats: int
    transformer: TransformerConfig
    transformer_batch: int
    transformer_len: int
    xl: tuple[tuple[str, TransformerXLConfig, int], ...]
    decode_model: TransformerConfig
    decode_vocab_size: int
    decode_sentences: int
    decode_batch: int
    beam_size: int
    decode_margin: int
    decode_repeats: int
    xl_eval: TransformerXLConfig
    attn_lengths: tuple[int, ...]
    xl_eval_tgt_len: int
    xl_eval_batch: int
    vanilla_batch: int
    eval_repeats: int

    def __post_init__(self):
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype: expected 'float32' or 'bfloat16', got {self.dtype!r}")
        for name in ("steps", "matmul_size", "matmul_repeats", "transformer_batch",
                     "transformer_len", "decode_batch", "beam_size", "decode_repeats",
                     "xl_eval_tgt_len", "xl_eval_batch", "vanilla_batch", "eval_repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        for name in ("warmup", "decode_sentences", "decode_margin"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)}")
        if not self.attn_lengths or min(self.attn_lengths) < 1:
            raise ValueError(f"attn_lengths: must be positive lengths, got {self.attn_lengths}")

    def replace(self, **changes) -> BenchConfig:
        return dataclasses.replace(self, **changes)

    @classmethod
    def full(cls, dtype: str = "bfloat16") -> BenchConfig:
        """The paper-sized models, for one GPU (about 8 minutes on an H100)."""
        dt = jnp.dtype(dtype)
        return cls(
            dtype=dtype, steps=20, warmup=3, matmul_size=8192, matmul_repeats=10,
            # 768 x 32 = 24,576 tokens on each side: the paper's "~25k source and target tokens".
            transformer=TransformerConfig.base(dtype=dt), transformer_batch=768,
            transformer_len=32,
            xl=(("enwik8_base", TransformerXLConfig.enwik8_base(dtype=dt), 22),
                ("wt103_base", TransformerXLConfig.wt103_base(dtype=dt), 60)),
            decode_model=TransformerConfig.base(src_vocab_size=8000, tgt_vocab_size=8000,
                                                dtype=dt),
            decode_vocab_size=8000, decode_sentences=0, decode_batch=128, beam_size=4,
            decode_margin=16, decode_repeats=3,
            xl_eval=TransformerXLConfig.enwik8_base(dtype=dt, dropout=0.0),
            attn_lengths=(800, 1800, 2800, 3800), xl_eval_tgt_len=128, xl_eval_batch=16,
            vanilla_batch=4, eval_repeats=5)

    @classmethod
    def quick(cls, dtype: str = "float32") -> BenchConfig:
        """Shrunk models of the same families: every section runs on a 2-core CPU in minutes."""
        dt = jnp.dtype(dtype)
        small_xl = dict(n_layers=2, n_heads=4, d_model=128, d_head=32, d_inner=512, dtype=dt)
        return cls(
            dtype=dtype, steps=5, warmup=2, matmul_size=512, matmul_repeats=5,
            transformer=TransformerConfig.base(
                src_vocab_size=1000, tgt_vocab_size=1000, d_model=128, n_heads=4, d_ff=512,
                n_encoder_layers=2, n_decoder_layers=2, dtype=dt),
            transformer_batch=16, transformer_len=32,
            xl=(("enwik8_base (quick: 2 x 128, 64 + 64)",
                 TransformerXLConfig.enwik8_base(tgt_len=64, mem_len=64, **small_xl), 4),
                ("wt103_base (quick: 2 x 128, V 4000, 32 + 32)",
                 TransformerXLConfig.wt103_base(vocab_size=4000, cutoffs=(1000, 2000, 3000),
                                                tgt_len=32, mem_len=32, **small_xl), 4)),
            decode_model=TransformerConfig.base(
                src_vocab_size=8000, tgt_vocab_size=8000, d_model=128, n_heads=4, d_ff=512,
                n_encoder_layers=2, n_decoder_layers=2, dtype=dt),
            decode_vocab_size=8000, decode_sentences=64, decode_batch=32, beam_size=4,
            decode_margin=16, decode_repeats=1,
            xl_eval=TransformerXLConfig.enwik8_base(dropout=0.0, **small_xl),
            attn_lengths=(64, 128, 256), xl_eval_tgt_len=16, xl_eval_batch=2, vanilla_batch=2,
            eval_repeats=3)


# ----------------------------------------------------------------------------- measuring
def time_calls(call: Callable[[], Any], *, warmup: int, repeats: int) -> list[float]:
    """Seconds of each of `repeats` calls of `call` (after `warmup` untimed ones), each timed
    to `block_until_ready` of what it returns."""
    for _ in range(warmup):
        jax.block_until_ready(call())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(call())
        times.append(time.perf_counter() - start)
    return times


def measure_matmul_rate(n: int, dtype: Any, *, repeats: int, warmup: int = 2) -> dict[str, Any]:
    """The achievable matrix rate: the median time of an [n, n] x [n, n] product in `dtype`
    (random inputs, output in `dtype`, accumulation left to the backend) -> 2 n^3 / median."""
    dtype = jnp.dtype(dtype)
    ka, kb = jax.random.split(jax.random.PRNGKey(0))
    a = jax.random.normal(ka, (n, n), jnp.float32).astype(dtype)
    b = jax.random.normal(kb, (n, n), jnp.float32).astype(dtype)
    product = jax.jit(lambda x, y: jnp.matmul(x, y, preferred_element_type=dtype))
    times = time_calls(lambda: product(a, b), warmup=warmup, repeats=repeats)
    median = statistics.median(times)
    flops = 2.0 * n ** 3
    return {"n": n, "dtype": dtype.name, "flops": flops, "median_s": median, "times_s": times,
            "rate": flops / median}


def nominal_bf16_peak(device_kind: str) -> float | None:
    """The datasheet dense bf16 rate of a known device, else None."""
    for name, peak in NOMINAL_BF16_PEAK:
        if name.lower() in device_kind.lower():
            return peak
    return None


def compiled_memory(compiled) -> dict[str, int] | None:
    """Byte counts of a compiled program from XLA's buffer assignment, None where the backend
    gives none. footprint = arguments + outputs + temporaries - aliased (donated inputs reuse
    their buffers for outputs, so they count once)."""
    try:
        stats = compiled.memory_analysis()
    except Exception:  # noqa: BLE001 - some backends raise instead of returning None
        return None
    if stats is None:
        return None
    names = ("argument", "output", "temp", "alias", "generated_code")
    out = {name: int(getattr(stats, f"{name}_size_in_bytes", 0) or 0) for name in names}
    out["footprint"] = out["argument"] + out["output"] + out["temp"] - out["alias"]
    peak = getattr(stats, "peak_memory_in_bytes", None)
    if peak:
        out["peak_reported"] = int(peak)
    return out


def device_peak_bytes(device: jax.Device) -> int | None:
    """The allocator's peak since the process started (GPU/TPU), None where unknown (CPU)."""
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001
        return None
    return int(stats["peak_bytes_in_use"]) if stats and "peak_bytes_in_use" in stats else None


def utilisation(flops: float, seconds: float, rate: float | None) -> float | None:
    """Model FLOPs utilisation: flops / seconds / rate (None without a rate)."""
    return flops / seconds / rate if rate else None


# Op categories of a profile, first match wins; matched against `_op_text`: the event's name
# and, from the HLO instruction XLA puts in its args, the opcode, a custom call's target and a
# fusion's called computation (not the operands: a fusion reading a %dot is no matmul).
OP_CATEGORIES = (
    ("attention (fused)", re.compile(r"fmha|flash|cudnn", re.IGNORECASE)),
    # nvjet_*: cuBLAS's newer GEMM kernels (seen with jax 0.11 on an H100).
    ("matmul", re.compile(r"gemm|cublas|nvjet|^dot|\bdot\b|matmul|xmma|gmma|convolution",
                          re.IGNORECASE)),
    ("collective", re.compile(r"all-reduce|all-gather|reduce-scatter|nccl", re.IGNORECASE)),
    ("copy", re.compile(r"copy|memcpy|memset|transpose", re.IGNORECASE)),
)


def summarize_trace_events(events: Sequence[Mapping[str, Any]], *, steps: int, top: int = 12
                           ) -> dict[str, Any] | None:
    """Where the time of `steps` profiled steps went, from Chrome/Perfetto trace events.

    Device time only: on a GPU the device process's "XLA Ops" line (one event per HLO op) if
    present, else its stream lines (one per kernel); on a CPU the ops on the host threads that
    execute the program (not the Python thread, not the runtime's enclosing scopes). Returns the busy time per step, the `top` ops by time
    (name, microseconds per step, share, category, calls per step) and the share of each
    category; None if the trace has no such events.
    """
    procs, threads = {}, {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            procs[e["pid"]] = e["args"]["name"]
        elif e.get("ph") == "M" and e.get("name") == "thread_name":
            threads[(e["pid"], e["tid"])] = e["args"]["name"]
    timed = [e for e in events if "dur" in e and e.get("ph", "X") == "X"]
    devices = {pid for pid, name in procs.items() if "/device:" in name}
    if devices:
        lines = {key: name for key, name in threads.items() if key[0] in devices}
        chosen = {key for key, name in lines.items() if name == "XLA Ops"} or {
            key for key, name in lines.items() if name.lower().startswith("stream")}
        where = "device: " + ("XLA Ops" if any(lines[k] == "XLA Ops" for k in chosen)
                              else "streams")
    else:
        chosen = {key for key, name in threads.items() if name != "python"}
        where = "host threads, summed over threads"
    # Left out: Python frames ('$file:line name') and the CPU runtime's C++ scopes
    # ('ThunkExecutor::Execute'), which enclose the ops rather than being ones.
    picked = [e for e in timed if (e.get("pid"), e.get("tid")) in chosen
              and not str(e.get("name", "")).startswith("$")
              and (devices or "::" not in str(e.get("name", "")))]
    if not picked:
        return None
    per_op: dict[str, list] = {}
    for e in picked:
        entry = per_op.setdefault(e["name"], [0.0, 0, _op_text(e)])
        entry[0] += float(e["dur"])
        entry[1] += 1
    total = sum(v[0] for v in per_op.values())
    categories: dict[str, float] = {}
    ops = []
    for name, (dur, calls, text) in sorted(per_op.items(), key=lambda kv: -kv[1][0]):
        category = next((c for c, pattern in OP_CATEGORIES if pattern.search(text)),
                        "other (elementwise, reductions)")
        categories[category] = categories.get(category, 0.0) + dur / total
        ops.append({"name": name, "us_per_step": dur / steps, "share": dur / total,
                    "category": category, "calls_per_step": calls / steps})
    return {"source": where, "busy_us_per_step": total / steps, "top": ops[:top],
            "categories": dict(sorted(categories.items(), key=lambda kv: -kv[1]))}


def _op_text(event: Mapping[str, Any]) -> str:
    """An event's name, plus the opcode, custom-call target and called computation of the HLO
    instruction in its args (e.g. 'long_name': '%f = bf16[8] fusion(%a), calls=%gemm_1')."""
    parts = [str(event.get("name", ""))]
    for value in (event.get("args") or {}).values():
        text = str(value)
        opcode = re.search(r"=\s*\S+\s+([\w-]+)\(", text)
        if opcode:
            parts.append(opcode.group(1))
        parts += re.findall(r'custom_call_target="([^"]*)"', text)
        parts += re.findall(r"calls=%?([\w.-]+)", text)
    return " ".join(parts)


def profile_summary(trace_dir: str, *, steps: int) -> dict[str, Any] | None:
    """`summarize_trace_events` of the newest perfetto trace `jax.profiler.trace` wrote
    under `trace_dir` (None if there is none)."""
    paths = glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True)
    if not paths:
        return None
    with gzip.open(max(paths, key=os.path.getmtime), "rt") as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    return summarize_trace_events(events, steps=steps)


# ----------------------------------------------------------------------------- training
@dataclasses.dataclass(frozen=True)
class TrainBench:
    """One training benchmark, before anything is allocated.

    init_state: () -> the fresh TrainState (jitted straight onto the device by the bench;
      `jax.eval_shape`-able, so a test can trace the paper sizes without allocating them).
    batch: host arrays of the one batch every timed step reads.
    """

    name: str
    loss_fn: Callable
    init_state: Callable[[], TrainState]
    batch: Mapping[str, np.ndarray]
    flops: FlopCount
    info: Mapping[str, Any]


def transformer_train_setup(config: BenchConfig) -> TrainBench:
    """The Transformer training step on random [B, L] sources and targets (no padding), Adam on
    the Noam schedule, label smoothing 0.1: `train.translate`'s loss."""
    from train.translate import make_loss_fn
    from transformer_jax.model import Transformer
    from transformer_jax.optim import make_optimizer

    cfg, b, length = config.transformer, config.transformer_batch, config.transformer_len
    model = Transformer(cfg)
    rng = np.random.default_rng(0)
    tokens = lambda: rng.integers(3, cfg.tgt_vocab_size, (b, length), dtype=np.int32)  # noqa

    def init_state() -> TrainState:
        dummy = jnp.ones((1, 8), jnp.int32)
        params = model.init({"params": jax.random.PRNGKey(0)}, dummy, dummy)["params"]
        return TrainState.create(params=params, tx=make_optimizer(cfg.d_model, 4000),
                                 rng=jax.random.PRNGKey(1))

    return TrainBench(
        name="transformer_base" if cfg.d_model == 512 else "transformer (quick)",
        loss_fn=make_loss_fn(model, smoothing=0.1, pad_id=cfg.pad_id), init_state=init_state,
        batch={"src": tokens(), "tgt_in": tokens(), "tgt_out": tokens()},
        flops=transformer_flops(cfg, batch=b, src_len=length, tgt_len=length),
        info=dict(batch=b, src_len=length, tgt_len=length, dtype=config.dtype,
                  attention_impl=cfg.attention_impl))


def xl_train_setup(name: str, xl_config: TransformerXLConfig, batch_size: int,
                   config: BenchConfig) -> TrainBench:
    """The Transformer-XL training step on random [B, tgt_len] segments, the mem_len memory
    carried from step to step (the state's `extra`), Adam: `train.lm`'s loss."""
    from train.lm import make_loss_fn
    from xl_jax.memory import init_memory
    from xl_jax.model import TransformerXL

    cfg, b = xl_config, batch_size
    model = TransformerXL(cfg)
    rng = np.random.default_rng(0)
    tokens = lambda: rng.integers(0, cfg.vocab_size, (b, cfg.tgt_len), dtype=np.int32)  # noqa

    def init_state() -> TrainState:
        dummy = jnp.ones((1, 8), jnp.int32)
        params = model.init({"params": jax.random.PRNGKey(0)}, dummy,
                            init_memory(cfg, 1))["params"]
        # Adam as the paper (its cosine schedule does not change the cost of a step).
        return TrainState.create(params=params, tx=optax.adam(2.5e-4),
                                 rng=jax.random.PRNGKey(1), extra=init_memory(cfg, b))

    return TrainBench(
        name=name, loss_fn=make_loss_fn(model), init_state=init_state,
        batch={"inputs": tokens(), "targets": tokens()},
        flops=xl_flops(cfg, batch=b, tgt_len=cfg.tgt_len, mem_len=cfg.mem_len),
        info=dict(batch=b, tgt_len=cfg.tgt_len, mem_len=cfg.mem_len, dtype=config.dtype,
                  remat=cfg.remat, attention_impl=cfg.attention_impl))


def bench_train_step(bench: TrainBench, *, steps: int, warmup: int,
                     rates: Mapping[str, float], nominal_peak: float | None = None,
                     profile_dir: str | None = None) -> dict[str, Any]:
    """Compiles the project's train step for `bench` on one device and times it.

    rates: measured matrix rates by dtype name ('bfloat16', 'float32'), for the MFU figures.
    Returns every raw figure: compile_s, step times, tokens_per_s, memory, the analytic FLOPs
    next to XLA's and the jaxpr's, MFU, the last step's loss (to show it is finite) and, with
    `profile_dir`, where the time of 3 more (traced) steps went.
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
        profile = profile_summary(trace_dir, steps=PROFILED_STEPS)
    loss = float(metrics["loss_sum"] / metrics["n_tokens"])
    median = statistics.median(times)
    flops = bench.flops
    model_flops = flops.training()
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
        "memory": compiled_memory(compiled),
        "device_peak_bytes": device_peak_bytes(device),
        "flops": flops.as_dict(),
        "xla_flops": xla,
        "xla_over_executed": xla / flops.training(executed=True) if xla else None,
        # XLA's cost analysis counts the body of a while loop (a scan) once, not per trip:
        # flagged where that is why its count falls short of the products executed.
        "xla_counts_loops_once": bool(xla and xla < flops.training(executed=True) and re.search(
            r"\bwhile\(", compiled.as_text() or "")),
        "jaxpr_matmul_flops": traced,
        "model_tflops_per_s": model_flops / median / 1e12,
        "mfu_vs_measured_bf16": utilisation(model_flops, median, rates.get("bfloat16")),
        "mfu_vs_measured_float32": utilisation(model_flops, median, rates.get("float32")),
        "mfu_vs_nominal_bf16": utilisation(model_flops, median, nominal_peak),
        "final_loss": loss,
        "profile": profile,
    }


# ----------------------------------------------------------------------------- decoding
def decode_bench(model, params, sources: Sequence[Sequence[int]], *, beam_size: int,
                 batch_size: int, margin: int, repeats: int,
                 buckets: Sequence[int] | None = None) -> dict[str, Any]:
    """Beam search over every source (token ids ending in EOS), in the evaluation batches of
    `train.batching.eval_batches` (one compiled shape per bucket in use), output length
    bucket + margin as `train.translate`. A first pass compiles every shape; then `repeats`
    timed passes (each blocked at its end) -> sentences per second of the median pass."""
    from train.batching import DEFAULT_BUCKETS, eval_batches
    from transformer_jax.decode import beam_search

    batches = eval_batches([(list(s), []) for s in sources], batch_size=batch_size,
                           buckets=buckets or DEFAULT_BUCKETS)
    device = jax.local_devices()[0]
    srcs = [jax.device_put(batch["src"], device) for batch in batches]

    def decode_all():
        return [beam_search(model, params, src, beam_size=beam_size,
                            max_len=src.shape[1] + margin)[0] for src in srcs]

    start = time.perf_counter()
    outputs = jax.block_until_ready(decode_all())
    first_pass_s = time.perf_counter() - start
    times = time_calls(decode_all, warmup=0, repeats=repeats)
    median = statistics.median(times)
    pad = model.config.pad_id
    real = [batch["index"] >= 0 for batch in batches]
    generated = sum(int(np.sum(np.asarray(out)[:, 0][keep] != pad))
                    for out, keep in zip(outputs, real))
    return {
        "sentences": len(sources), "beam_size": beam_size, "batch": batch_size,
        "shapes": sorted({tuple(int(n) for n in s.shape) for s in srcs}),
        "first_pass_s": first_pass_s,  # compiling every shape + one pass
        "pass_s_median": median, "pass_times_s": times,
        "sentences_per_s": len(sources) / median,
        "output_tokens": generated, "output_tokens_per_s": generated / median,
    }


def multi30k_decode_bench(config: BenchConfig, *, cache_dir: str) -> dict[str, Any]:
    """`decode_bench` on Multi30k test_2016_flickr with a random-init `config.decode_model`."""
    from train.datasets import load_multi30k
    from train.tokenizers import multi30k_tokenizer
    from train.translate import encode_source
    from transformer_jax.model import Transformer

    tokenizer = multi30k_tokenizer(os.path.join(cache_dir, "tokenizer"),
                                   vocab_size=config.decode_vocab_size)
    pairs = load_multi30k("test_2016_flickr")
    if config.decode_sentences:
        pairs = pairs[:config.decode_sentences]
    sources = encode_source(tokenizer, [de for de, _ in pairs])
    cfg = config.decode_model.replace(src_vocab_size=tokenizer.vocab_size,
                                      tgt_vocab_size=tokenizer.vocab_size)
    model = Transformer(cfg)
    dummy = jnp.ones((1, 8), jnp.int32)
    params = jax.jit(lambda r: model.init({"params": r}, dummy, dummy)["params"])(
        jax.random.PRNGKey(0))
    result = decode_bench(model, params, sources, beam_size=config.beam_size,
                          batch_size=config.decode_batch, margin=config.decode_margin,
                          repeats=config.decode_repeats)
    result.update(split="test_2016_flickr", model=_transformer_name(cfg), dtype=config.dtype,
                  weights="random init")
    return result


# ----------------------------------------------------------------------------- XL evaluation
def xl_eval_bench(xl_config: TransformerXLConfig, *, attn_lengths: Sequence[int], tgt_len: int,
                  batch: int, vanilla_batch: int, repeats: int, warmup: int = 1
                  ) -> list[dict[str, Any]]:
    """Per-token evaluation time, Transformer-XL with memory against a vanilla sliding window.

    For each attention length A:
      XL: segments [batch, tgt_len] with a full memory of M = A slots, the memory fed back
        (donated) from call to call: per token = median call / (batch * tgt_len).
      vanilla: the same network with no memory on windows [vanilla_batch, A]; each window
        yields one new prediction (its last position), as a model without memory that slides
        its window by one token: per token = median call / vanilla_batch.
    Also the analytic forward FLOPs per token of each (`train.flops.xl_flops`).
    """
    from xl_jax.memory import init_memory
    from xl_jax.model import TransformerXL

    model = TransformerXL(xl_config)
    dummy = jnp.ones((1, 8), jnp.int32)
    params = jax.jit(lambda r: model.init({"params": r}, dummy, init_memory(xl_config, 1))
                     ["params"])(jax.random.PRNGKey(0))
    rng = np.random.default_rng(0)
    tokens = lambda b, t: jnp.asarray(  # noqa: E731
        rng.integers(0, xl_config.vocab_size, (b, t), dtype=np.int32))

    # The memory is donated: each call writes the next memory in place of the last.
    @functools.partial(jax.jit, donate_argnums=(2,))
    def xl_step(params, segment, memory):
        nll, memory = model.apply({"params": params}, segment, memory, segment)
        return jnp.sum(nll), memory

    @jax.jit
    def vanilla_step(params, window):
        empty = init_memory(xl_config, window.shape[0], mem_len=0)
        nll, _ = model.apply({"params": params}, window, empty, window)
        return nll[:, -1]

    results = []
    for a in attn_lengths:
        segment = tokens(batch, tgt_len)
        memory = init_memory(xl_config, batch, mem_len=a)
        # A filled memory, one buffer per layer (init_memory shares one zeros array between
        # the layers, and a buffer cannot be donated twice in one call).
        memory = memory.replace(hidden=tuple(jnp.array(h, copy=True) for h in memory.hidden),
                                valid=jnp.full_like(memory.valid, a))

        def xl_call():
            nonlocal memory
            loss, memory = xl_step(params, segment, memory)
            return loss

        window = tokens(vanilla_batch, a)
        start = time.perf_counter()
        jax.block_until_ready(xl_call())
        xl_first = time.perf_counter() - start
        xl_times = time_calls(xl_call, warmup=warmup, repeats=repeats)
        start = time.perf_counter()
        jax.block_until_ready(vanilla_step(params, window))
        vanilla_first = time.perf_counter() - start
        vanilla_times = time_calls(lambda: vanilla_step(params, window), warmup=warmup,
                                   repeats=repeats)
        xl_token = statistics.median(xl_times) / (batch * tgt_len)
        vanilla_token = statistics.median(vanilla_times) / vanilla_batch
        xl_f = xl_flops(xl_config, batch=batch, tgt_len=tgt_len, mem_len=a)
        vanilla_f = xl_flops(xl_config, batch=vanilla_batch, tgt_len=a, mem_len=0)
        results.append({
            "attn_len": a, "xl_tgt_len": tgt_len, "xl_batch": batch,
            "vanilla_batch": vanilla_batch,
            "xl_s_per_token": xl_token, "vanilla_s_per_token": vanilla_token,
            "speedup": vanilla_token / xl_token,
            "xl_flops_per_token": xl_f.forward(executed=True) / (batch * tgt_len),
            "vanilla_flops_per_token": vanilla_f.forward(executed=True) / vanilla_batch,
            "xl_first_call_s": xl_first, "vanilla_first_call_s": vanilla_first,
            "xl_times_s": xl_times, "vanilla_times_s": vanilla_times,
        })
        results[-1]["flop_ratio"] = (results[-1]["vanilla_flops_per_token"]
                                     / results[-1]["xl_flops_per_token"])
    return results


# ----------------------------------------------------------------------------- the run
def run_benchmarks(config: BenchConfig, *, sections: Sequence[str] = SECTIONS, out: str | None,
                   cache_dir: str = os.path.join("runs", "bench-cache"),
                   profile: bool = True, profile_dir: str | None = None, command: str = "",
                   quick: bool = False, append: bool = False, raise_errors: bool = False,
                   log: Callable[[str], None] = print) -> dict[str, Any]:
    """Runs `sections` (matmul always first) and returns the results; with `out`, writes
    OUT/bench.json and OUT/bench.md after every section (a run cut short keeps what it has).
    A section that fails is recorded under 'errors' and the run goes on, unless
    `raise_errors`. profile: trace 3 more steps of each training bench and summarize where
    their time went; the traces are kept in `profile_dir` if given, else deleted.
    append: merge into the results already in OUT/bench.json (`merge_results`), so the
    sections of one device can be measured in several commands."""
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        raise ValueError(f"sections: unknown {sorted(unknown)}; choose from {SECTIONS}")
    if profile and profile_dir is None:
        scratch = tempfile.mkdtemp(prefix="bench-trace-")
        try:
            return run_benchmarks(config, sections=sections, out=out, cache_dir=cache_dir,
                                  profile=True, profile_dir=scratch, command=command,
                                  quick=quick, append=append, raise_errors=raise_errors,
                                  log=log)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    device = jax.local_devices()[0]
    meta = _meta(config, device, command=command, quick=quick)
    meta["sections"] = ["matmul", *(s for s in SECTIONS if s in sections and s != "matmul")]
    earlier = None
    if append and out and os.path.exists(os.path.join(out, "bench.json")):
        with open(os.path.join(out, "bench.json")) as f:
            earlier = json.load(f)
        if earlier["meta"]["device_kind"] != meta["device_kind"]:
            raise ValueError(f"--append: {out}/bench.json holds results of "
                             f"{earlier['meta']['device_kind']}, this is {meta['device_kind']}")
    results: dict[str, Any] = {"meta": meta, "train": [], "errors": []}

    def save():
        if out:
            write_results(results if earlier is None else merge_results(earlier, results), out)

    def attempt(section: str, fn: Callable[[], Any]) -> Any:
        log(f"[bench] {section} ...")
        start = time.perf_counter()
        try:
            value = fn()
        except Exception as e:  # noqa: BLE001 - one failed section must not lose the others
            if raise_errors:
                raise
            log(f"[bench] {section} FAILED: {type(e).__name__}: {e}")
            results["errors"].append({"section": section, "error": f"{type(e).__name__}: {e}",
                                      "traceback": traceback.format_exc()[-4000:]})
            value = None
        log(f"[bench] {section} done in {time.perf_counter() - start:.1f}s")
        return value

    matmul = attempt("matmul", lambda: {
        name: measure_matmul_rate(config.matmul_size, name, repeats=config.matmul_repeats)
        for name in ("bfloat16", "float32")})
    results["matmul"] = matmul
    rates = {name: m["rate"] for name, m in (matmul or {}).items()}
    train_kw = dict(nominal_peak=results["meta"]["nominal_bf16_peak"],
                    profile_dir=profile_dir if profile else None)
    save()

    train_kw = dict(train_kw, steps=config.steps, warmup=config.warmup, rates=rates)
    if "train_transformer" in sections:
        r = attempt("train_transformer",
                    lambda: bench_train_step(transformer_train_setup(config), **train_kw))
        if r:
            results["train"].append(r)
        save()
    for section, key in XL_SECTIONS.items():
        if section not in sections:
            continue
        entry = next((x for x in config.xl if x[0].startswith(key)), None)
        if entry is None:
            continue
        name, xl_cfg, b = entry
        r = attempt(section, lambda: bench_train_step(
            xl_train_setup(name, xl_cfg, b, config), **train_kw))
        if r:
            results["train"].append(r)
        save()
    if "decode" in sections:
        results["decode"] = attempt(
            "decode", lambda: multi30k_decode_bench(config, cache_dir=cache_dir))
        save()
    if "xl_eval" in sections:
        results["xl_eval"] = attempt("xl_eval", lambda: xl_eval_bench(
            config.xl_eval, attn_lengths=config.attn_lengths, tgt_len=config.xl_eval_tgt_len,
            batch=config.xl_eval_batch, vanilla_batch=config.vanilla_batch,
            repeats=config.eval_repeats))
        save()
    return results if earlier is None else merge_results(earlier, results)


def merge_results(earlier: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
    """`new` laid over `earlier` (same device): training entries replace those of the same
    name, the other sections and their errors those of the sections `new` ran; the meta is
    new's, listing the earlier runs (date, command)."""
    ran = set(new["meta"].get("sections", SECTIONS))
    names = {r["name"] for r in new["train"]}
    merged = dict(earlier)
    merged["meta"] = dict(new["meta"], earlier_runs=[
        *earlier["meta"].get("earlier_runs", []),
        {"date": earlier["meta"]["date"], "command": earlier["meta"]["command"]}])
    merged["train"] = [r for r in earlier.get("train", []) if r["name"] not in names]
    merged["train"] += new["train"]
    for key in ("matmul", "decode", "xl_eval"):
        if new.get(key) is not None:
            merged[key] = new[key]
    merged["errors"] = [e for e in earlier.get("errors", []) if e["section"] not in ran]
    merged["errors"] += new["errors"]
    return merged


def _meta(config: BenchConfig, device: jax.Device, *, command: str, quick: bool
          ) -> dict[str, Any]:
    import flax
    import jaxlib

    kind = device.device_kind
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": command,
        "quick": quick,
        "platform": device.platform,
        "device_kind": kind,
        "n_local_devices": jax.local_device_count(),
        "devices_used": 1,
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "flax": flax.__version__,
        "dtype": config.dtype,
        "nominal_bf16_peak": nominal_bf16_peak(kind) if device.platform == "gpu" else None,
    }


# ----------------------------------------------------------------------------- output
def write_results(results: Mapping[str, Any], out: str) -> tuple[str, str]:
    """OUT/bench.json and OUT/bench.md; returns their paths."""
    os.makedirs(out, exist_ok=True)
    json_path, md_path = os.path.join(out, "bench.json"), os.path.join(out, "bench.md")
    with open(json_path, "w") as f:
        json.dump(results, f, indent=1, default=_plain)
    with open(md_path, "w") as f:
        f.write(to_markdown(results))
    return json_path, md_path


def to_markdown(results: Mapping[str, Any]) -> str:
    """The results as markdown tables (the README's performance section takes them as is)."""
    meta = results["meta"]
    lines = [f"Device: {meta['device_kind']} ({meta['platform']}), jax {meta['jax']}, "
             f"compute dtype {meta['dtype']}, {meta['date']}.",
             f"Command: `{meta['command']}`"]
    lines += [f"Earlier, merged: `{run['command']}` ({run['date']})"
              for run in meta.get("earlier_runs", [])]
    lines.append("")
    matmul = results.get("matmul") or {}
    if matmul:
        rates = ", ".join(f"{name} {m['rate'] / 1e12:.3g} TFLOP/s ({m['n']}^3)"
                          for name, m in matmul.items())
        peak = meta.get("nominal_bf16_peak")
        lines += [f"Measured matrix rate: {rates}"
                  + (f"; datasheet bf16 peak {peak / 1e12:.4g} TFLOP/s." if peak else "."), ""]
    train = results.get("train") or []
    if train:
        # A float32 run (a CPU) is also compared with the float32 rate it actually uses.
        f32 = meta["dtype"] == "float32"
        lines += ["| training step | tokens/step | step (ms) | tokens/s | compile (s) | "
                  "memory (GiB) | model TFLOP/step | XLA / formula | MFU (measured bf16) | "
                  + ("MFU (measured float32) | " if f32 else "") + "MFU (datasheet bf16) |",
                  "|---" * (11 if f32 else 10) + "|"]
        for r in train:
            mem = r.get("memory") or {}
            lines.append(
                f"| {r['name']} | {r['tokens_per_step']:,} | {r['step_s_median'] * 1e3:.1f} | "
                f"{r['tokens_per_s']:,.0f} | {r['compile_s']:.1f} | "
                f"{_gib(mem.get('footprint'))} | {r['flops']['model_training'] / 1e12:.3g} | "
                f"{_num(r.get('xla_over_executed'), '.3f')}"
                f"{'*' if r.get('xla_counts_loops_once') else ''} | "
                f"{_pct(r.get('mfu_vs_measured_bf16'))} | "
                + (f"{_pct(r.get('mfu_vs_measured_float32'))} | " if f32 else "")
                + f"{_pct(r.get('mfu_vs_nominal_bf16'))} |")
        lines += ["", "FLOP formulas (matrix products only; MFU divides the model FLOPs, the XLA "
                  "ratio compares with every product executed; * the program loops (the XL "
                  "layers run in a scan) and XLA's cost analysis counts a loop body once, so "
                  "its count falls short):"]
        for formula in dict.fromkeys(r["flops"]["formula"] for r in train):
            lines.append(f"- {formula}")
        lines.append("")
        for r in train:
            lines += _profile_lines(r["name"], r.get("profile"), r["step_s_median"])
    decode = results.get("decode")
    if decode:
        lines += ["| beam search | sentences | beam | batch | sentences/s | output tokens/s | "
                  "first pass incl. compile (s) |", "|---|---|---|---|---|---|---|",
                  f"| {decode['model']}, {decode['weights']}, {decode['split']} | "
                  f"{decode['sentences']} | {decode['beam_size']} | {decode['batch']} | "
                  f"{decode['sentences_per_s']:.1f} | {decode['output_tokens_per_s']:,.0f} | "
                  f"{decode['first_pass_s']:.1f} |", ""]
    xl_eval = results.get("xl_eval")
    if xl_eval:
        lines += ["| attention length | XL with memory (ms/token) | vanilla window (ms/token) | "
                  "speed-up | FLOP ratio |", "|---|---|---|---|---|"]
        for r in xl_eval:
            lines.append(f"| {r['attn_len']} | {r['xl_s_per_token'] * 1e3:.4f} | "
                         f"{r['vanilla_s_per_token'] * 1e3:.3f} | {r['speedup']:,.0f}x | "
                         f"{r['flop_ratio']:,.0f}x |")
        lines.append("")
    for err in results.get("errors") or []:
        lines.append(f"- {err['section']} failed: {err['error']}")
    return "\n".join(lines) + "\n"


def _profile_lines(name: str, profile: Mapping[str, Any] | None, step_s: float,
                   top: int = 5) -> list[str]:
    """Where a training step's time went: category shares and the top ops."""
    if not profile:
        return []
    busy_ms = profile["busy_us_per_step"] / 1e3
    shares = ", ".join(f"{c} {100 * x:.0f}%" for c, x in profile["categories"].items())
    lines = [f"Profile of {name} ({profile['source']}): {busy_ms:.1f} ms busy per step of "
             f"{step_s * 1e3:.1f} ms; {shares}.", "", "| op | ms/step | share | category |",
             "|---|---|---|---|"]
    lines += [f"| `{op['name'][:60]}` | {op['us_per_step'] / 1e3:.2f} | "
              f"{100 * op['share']:.1f}% | {op['category']} |" for op in profile["top"][:top]]
    return lines + [""]


def _gib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 2 ** 30:.2f}"


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def _num(x: float | None, fmt: str) -> str:
    return "n/a" if x is None else format(x, fmt)


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name).strip("_")


def _transformer_name(cfg: TransformerConfig) -> str:
    return (f"Transformer {cfg.n_encoder_layers}+{cfg.n_decoder_layers} x {cfg.d_model}, "
            f"V {cfg.tgt_vocab_size}")


def _plain(x: Any) -> Any:
    if hasattr(x, "item"):
        return x.item()
    return str(x)


# ----------------------------------------------------------------------------- CLI
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m train.bench", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="shrunk sizes for a CPU (every section in a couple of minutes)")
    parser.add_argument("--only", nargs="+", choices=SECTIONS, default=list(SECTIONS),
                        metavar="SECTION", help=f"run only these sections: {', '.join(SECTIONS)}")
    parser.add_argument("--out", default="bench_results",
                        help="directory for bench.json and bench.md (default: bench_results)")
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                        help="compute dtype; auto: bfloat16 on an accelerator, float32 on a CPU")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per training bench")
    parser.add_argument("--batch", action="append", default=[], metavar="NAME=B",
                        help="batch size of one training bench: transformer, enwik8 or wt103")
    parser.add_argument("--attn-lengths", type=int, nargs="+", default=None,
                        help="attention lengths of the XL evaluation comparison")
    parser.add_argument("--xl-eval-tgt-len", type=int, default=None,
                        help="XL evaluation segment length")
    parser.add_argument("--decode-sentences", type=int, default=None,
                        help="decode the first N test sentences (0 = all)")
    parser.add_argument("--cache-dir", default=os.path.join("runs", "bench-cache"),
                        help="where the Multi30k tokenizer is cached")
    parser.add_argument("--profile", default=None, metavar="DIR",
                        help="keep the jax.profiler traces of the training benches in DIR "
                             "(default: summarized, then deleted)")
    parser.add_argument("--no-profile", action="store_true",
                        help="do not profile the training benches")
    parser.add_argument("--attention-impl", choices=IMPLEMENTATIONS, default=None,
                        help="attention_impl of every model (default: the configs' 'auto')")
    parser.add_argument("--xl-remat", choices=REMAT_MODES, default=None,
                        help="remat mode of the Transformer-XL training benches")
    parser.add_argument("--append", action="store_true",
                        help="merge into OUT/bench.json (same device): the sections run now "
                             "replace theirs, the others are kept")
    return parser


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    dtype = args.dtype
    if dtype == "auto":
        dtype = "float32" if jax.default_backend() == "cpu" else "bfloat16"
    config = BenchConfig.quick(dtype) if args.quick else BenchConfig.full(dtype)
    changes: dict[str, Any] = {}
    if args.steps is not None:
        changes["steps"] = args.steps
    if args.attn_lengths:
        changes["attn_lengths"] = tuple(args.attn_lengths)
    if args.xl_eval_tgt_len is not None:
        changes["xl_eval_tgt_len"] = args.xl_eval_tgt_len
    if args.decode_sentences is not None:
        changes["decode_sentences"] = args.decode_sentences
    xl = list(config.xl)
    for item in args.batch:
        name, _, value = item.partition("=")
        if not value.isdigit() or int(value) < 1:
            raise ValueError(f"--batch: expected NAME=B with B >= 1, got {item!r}")
        if name == "transformer":
            changes["transformer_batch"] = int(value)
            continue
        hits = [i for i, (n, _, _) in enumerate(xl) if n.startswith(name)]
        if not hits:
            raise ValueError(f"--batch: unknown bench {name!r}; use transformer, enwik8 or "
                             "wt103")
        for i in hits:
            xl[i] = (xl[i][0], xl[i][1], int(value))
    if args.xl_remat:
        xl = [(n, c.replace(remat=args.xl_remat), b) for n, c, b in xl]
    if args.attention_impl:
        impl = args.attention_impl
        xl = [(n, c.replace(attention_impl=impl), b) for n, c, b in xl]
        changes.update(transformer=config.transformer.replace(attention_impl=impl),
                       decode_model=config.decode_model.replace(attention_impl=impl),
                       xl_eval=config.xl_eval.replace(attention_impl=impl))
    changes["xl"] = tuple(xl)
    return config.replace(**changes)


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args)
    except ValueError as e:
        parser.error(str(e))
    command = " ".join(["python -m train.bench", *argv])
    results = run_benchmarks(config, sections=args.only, out=args.out, cache_dir=args.cache_dir,
                             profile=not args.no_profile, profile_dir=args.profile,
                             command=command, quick=args.quick, append=args.append,
                             log=lambda m: print(m, flush=True))
    print(to_markdown(results), flush=True)
    print(f"results: {os.path.join(args.out, 'bench.json')}, "
          f"{os.path.join(args.out, 'bench.md')}", flush=True)
    return 1 if results["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
