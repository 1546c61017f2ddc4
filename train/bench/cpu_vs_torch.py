"""The project's CPU training step against PyTorch's, side by side in one process.

The translation Transformer of the `cpu` preset at each of `config.torch_shapes` (sentences x
length, sources and targets alike), and the Transformer-XL of train.lm's `cpu` preset (batch
`torch_xl_batch`, memory carried from step to step) against `xl_torch_reference`'s
MemTransformerLM (the official model's maths). Per model:

  project        `train.core.step.make_train_step` with the preset's loss and optimizer,
                 jitted by `train.core.parallel.DataParallel` on the CPU device (state donated);
  torch_eager    `torch_reference`'s (for XL `xl_torch_reference`'s) model of the same shape
                 and parameter count (asserted), the same loss and optimizer chain;
  torch_compile  the same, forward and loss under `torch.compile` (its failure is reported,
                 not raised);
  jax_floor,     the step's matrix products alone, in jax and in torch (`products_floor`):
  torch_floor    eager PyTorch's step over the jax floor bounds what the project's step can
                 reach on the machine.

All float32, dropout off, identical random batches (step i reads batch i in every arm), the
arms taking turns step by step; medians of `torch_steps` steps after `torch_warmup` untimed
ones (the first call, which compiles, is timed apart). torch gets as many threads as XLA's CPU
pool has: the CPUs this process may run on.
"""

from __future__ import annotations

import copy
import os
import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from train import lm, translate
from train.bench.config import BenchConfig
from train.bench.products_floor import Floor, hlo_products, transformer_floor, xl_floor
from train.bench.profile import profile_summary
from train.bench.timing import time_interleaved
from train.bench.train_steps import PROFILED_STEPS
from train.core.parallel import DataParallel, batch_signature
from train.core.state import TrainState, count_params
from transformer_jax.model import Transformer
from transformer_jax.optim import make_optimizer
from xl_jax.memory import init_memory
from xl_jax.model import TransformerXL


def import_torch_reference():
    """train.bench.torch_reference, with a sentence if torch is missing."""
    try:
        from train.bench import torch_reference
    except ModuleNotFoundError as e:
        if e.name != "torch":
            raise
        raise ImportError(
            "cpu_vs_torch needs PyTorch, a test-only dependency of this project: "
            "pip install torch (the CPU wheel is enough)"
        ) from e
    return torch_reference


def xla_cpu_threads() -> int:
    """The size of XLA's CPU thread pool: the CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def cpu_vs_torch_bench(
    config: BenchConfig,
    *,
    profile_dir: str | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """The comparison rows (see the module docstring), with the setting they were taken in;
    with profile_dir, each row also says where the project's step spent its time (PROFILED_STEPS
    more steps traced there, ops categorised by the program's HLO)."""
    tr = import_torch_reference()
    import torch  # optional, a test-only dependency: imported where the comparison runs

    threads = xla_cpu_threads()
    torch.set_num_threads(threads)
    cpu = jax.devices("cpu")[0]
    rows = []

    def compare(setup: Mapping[str, Any], slug: str) -> None:
        row = _compare(setup, config)
        if profile_dir is not None:
            row["profile"] = setup["profile"](os.path.join(profile_dir, f"cpu_vs_torch_{slug}"))
        rows.append(row)

    for b, t in config.torch_shapes:
        log(f"[bench] cpu_vs_torch: Transformer {b} x {t}")
        compare(_transformer_arms(config, b, t, cpu, tr), f"transformer_{b}x{t}")
    log("[bench] cpu_vs_torch: Transformer-XL")
    compare(_xl_arms(config, cpu, tr), "xl")
    return {
        "torch": torch.__version__,
        "threads": threads,
        "cpu": cpu.device_kind,
        "steps": config.torch_steps,
        "warmup": config.torch_warmup,
        "rows": rows,
    }


# ------------------------------------------------------------------------------ one comparison
def _compare(setup: Mapping[str, Any], config: BenchConfig) -> dict[str, Any]:
    """Times the arms of `setup` (first calls apart, then interleaved) -> one row."""
    arms = dict(setup["arms"])
    first_call_s, compile_error = {}, None
    for name in list(arms):
        start = time.perf_counter()
        try:
            arms[name](0)
        except Exception as e:  # noqa: BLE001 - torch.compile's many failure modes
            if name != "torch_compile":
                raise
            compile_error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            del arms[name]
            continue
        first_call_s[name] = time.perf_counter() - start
    times = time_interleaved(arms, warmup=config.torch_warmup, steps=config.torch_steps)
    losses = setup["losses"]()
    tokens = setup["tokens_per_step"]
    out_arms: dict[str, Any] = {"torch_compile": None}
    for name, ts in times.items():
        median = statistics.median(ts)
        out_arms[name] = {
            "median_s": median,
            "min_s": min(ts),
            "times_s": ts,
            "first_call_s": first_call_s[name],
            "tokens_per_s": tokens / median,
            "final_loss": losses.get(name),  # None for the floors: no loss
        }
    project = out_arms["project"]["median_s"]

    def ratio(name):
        arm = out_arms.get(name)
        return None if arm is None else arm["median_s"] / project

    return {
        "name": setup["name"],
        "model": setup["model"],
        **setup["shape"],
        "tokens_per_step": tokens,
        "n_params": setup["n_params"],
        "arms": out_arms,
        "project_over_eager": ratio("torch_eager"),
        "project_over_compile": ratio("torch_compile"),
        "compile_error": compile_error,
        **_floor_fields(out_arms, setup),
    }


def _floor_fields(arms: Mapping[str, Any], setup: Mapping[str, Any]) -> dict[str, Any]:
    """The products floor's figures of one row: eager PyTorch's step over the jax floor (the
    most the project's step can reach against it here), each step's time above its own floor,
    and the products (count, GFLOP) of the step and of the floor, which should be equal."""
    if "jax_floor" not in arms:  # not mirrored: setup["floor_error"] says why
        return {"floor_error": setup["floor_error"]}
    ms = {
        name: arms[name]["median_s"] * 1e3
        for name in ("project", "torch_eager", "jax_floor", "torch_floor")
    }
    return {
        "floor_error": setup["floor_error"],  # None: the floor was built
        "eager_over_floor": ms["torch_eager"] / ms["jax_floor"],
        "torch_floor_over_jax_floor": ms["torch_floor"] / ms["jax_floor"],
        "project_above_floor_ms": ms["project"] - ms["jax_floor"],
        "eager_above_floor_ms": ms["torch_eager"] - ms["torch_floor"],
        "products": {
            "step": setup["step_products"](),
            "floor": list(hlo_products(setup["floor"].hlo)),
        },
    }


def _project_arm(loss_fn, init_state: Callable[[], TrainState], batches, cpu):
    """The project's jitted train step on the CPU device -> (arm, n_params, last loss,
    profile, products), profile(trace_dir): where PROFILED_STEPS more steps spent their time;
    products(): [count, GFLOP] of the step's matrix products."""
    dp = DataParallel("jit", devices=[cpu])
    state = dp.put_state(dp.init_state(init_state))
    placed = [dp.put_batch(b) for b in batches]
    step = dp.compile_train_step(loss_fn, state)
    box = {"state": state, "metrics": None}

    def arm(i: int) -> None:
        box["state"], box["metrics"] = step(box["state"], placed[i % len(placed)])
        jax.block_until_ready(box)

    def last_loss() -> float:
        m = box["metrics"]
        return float(m["loss_sum"] / m["n_tokens"])

    def program_hlo() -> str:
        """The optimized HLO of the executable the arm runs."""
        return step.executables[batch_signature(placed[0])].as_text()

    def profile(trace_dir: str) -> dict[str, Any] | None:
        with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
            start = time.perf_counter()
            for i in range(PROFILED_STEPS):
                arm(i)
            traced_s = time.perf_counter() - start
        # The executable's HLO says what each op of the trace runs.
        summary = profile_summary(trace_dir, steps=PROFILED_STEPS, hlo_text=program_hlo())
        if summary:
            # The traced steps take their own time, so the busy time is read against it:
            # against the median it read more than two threads can be busy
            # (benchmarks/cpu_vs_torch_2026-11-28c_amd25/).
            summary["wall_us_per_step"] = traced_s / PROFILED_STEPS * 1e6
        return summary

    def products() -> list:
        """[count, GFLOP] of the step's matrix products, from its optimized HLO."""
        return list(hlo_products(program_hlo()))

    return arm, count_params(state.params), last_loss, profile, products


def build_floor(build: Callable[..., Floor], *args) -> tuple[Floor | None, str | None]:
    """`build(*args)` -> (the floor, None), or (None, why) for a model it does not mirror:
    the comparison then runs without the floor and says so."""
    try:
        return build(*args), None
    except ValueError as e:
        return None, str(e)


def _floor_arms(floor: Floor | None) -> dict[str, Callable[[int], None]]:
    """The products floor's two arms (the batch index is not theirs: one fixed input)."""
    if floor is None:
        return {}
    return {"jax_floor": lambda i: floor.jax_step(), "torch_floor": lambda i: floor.torch_step()}


def _torch_arms(step_eager, step_compiled, batches) -> tuple[dict, Callable]:
    """The eager and (if wanted) compiled torch steps over the same batches."""
    losses = {}

    def arm(name, step):
        def run(i: int) -> None:
            losses[name] = step(*batches[i % len(batches)])

        return run

    arms = {"torch_eager": arm("torch_eager", step_eager)}
    if step_compiled is not None:
        arms["torch_compile"] = arm("torch_compile", step_compiled)
    return arms, lambda: {k: float(v) for k, v in losses.items()}


def _check_params(name: str, project: int, torch_model) -> int:
    from train.bench.torch_reference import count_params as torch_count  # needs torch

    theirs = torch_count(torch_model)
    if theirs != project:
        raise ValueError(
            f"{name}: the PyTorch model has {theirs:,} parameters, the project's "
            f"{project:,}: not the same model"
        )
    return project


def _n_batches(config: BenchConfig) -> int:
    return config.torch_warmup + config.torch_steps + 1  # + the first call


# ------------------------------------------------------------------------------ the models
def transformer_problem(config: BenchConfig, b: int, t: int, n_batches: int):
    """The project's side of the Transformer comparison -> (model config, run config, loss_fn,
    init_state, batches): `config.torch_transformer` in float32 with the cpu preset's loss and
    optimizer, and n_batches random [b, t] batches. What `benchmarks/` scripts build the
    bench's step from, too."""
    cfg = config.torch_transformer.replace(dtype=jnp.float32)
    # The cpu preset's run: Adam after clipping to 1, EMA 0.99, label smoothing 0.1, at its
    # peak rate from step 0 as the PyTorch side runs it (its warm-up changes no step's cost).
    run = translate.make_config("transformer", "cpu", adam_warmup_steps=0)
    tx, _ = make_optimizer(run.optimizer_config())
    model = Transformer(cfg)
    rng = np.random.default_rng(0)
    batches = [
        {
            k: rng.integers(3, cfg.tgt_vocab_size, (b, t), dtype=np.int32)
            for k in ("src", "tgt_in", "tgt_out")
        }
        for _ in range(n_batches)
    ]

    def init_state() -> TrainState:
        dummy = jnp.ones((1, 8), jnp.int32)
        params = model.init({"params": jax.random.PRNGKey(0)}, dummy, dummy)["params"]
        return TrainState.create(params=params, tx=tx, rng=jax.random.PRNGKey(1))

    loss_fn = translate.make_loss_fn(model, smoothing=run.label_smoothing, pad_id=cfg.pad_id)
    return cfg, run, loss_fn, init_state, batches


def _transformer_arms(config: BenchConfig, b: int, t: int, cpu, tr) -> dict[str, Any]:
    import torch  # optional, a test-only dependency: imported where the comparison runs

    cfg, run, loss_fn, init_state, batches = transformer_problem(config, b, t, _n_batches(config))
    project, n_project, project_loss, profile, products = _project_arm(
        loss_fn, init_state, batches, cpu
    )
    floor, floor_error = build_floor(transformer_floor, cfg, b, t)
    torch.manual_seed(0)
    eager = tr.TorchTransformer(cfg)
    compiled = copy.deepcopy(eager)
    opt = dict(learning_rate=run.learning_rate, clip_norm=run.clip_norm, ema_decay=run.ema_decay)
    loss = lambda m: tr.translation_loss_fn(m, smoothing=run.label_smoothing)  # noqa: E731
    torch_batches = [
        tuple(torch.from_numpy(x[k].astype(np.int64)) for k in ("src", "tgt_in", "tgt_out"))
        for x in batches
    ]
    arms, torch_losses = _torch_arms(
        tr.TorchTrainStep(eager, loss(eager), **opt),
        tr.TorchTrainStep(compiled, torch.compile(loss(compiled)), **opt)
        if config.torch_compile
        else None,
        torch_batches,
    )
    name = (
        f"Transformer {cfg.n_encoder_layers}+{cfg.n_decoder_layers} x {cfg.d_model}, "
        f"V {cfg.tgt_vocab_size}, {b} x {t}"
    )
    return {
        "name": name,
        "model": "transformer",
        "shape": {"batch": b, "length": t},
        "tokens_per_step": b * t,
        "n_params": _check_params(name, n_project, eager),
        "arms": {"project": project, **arms, **_floor_arms(floor)},
        "losses": lambda: {"project": project_loss(), **torch_losses()},
        "profile": profile,
        "step_products": products,
        "floor": floor,
        "floor_error": floor_error,
    }


def _xl_arms(config: BenchConfig, cpu, tr) -> dict[str, Any]:
    import torch  # optional, a test-only dependency: imported where the comparison runs

    from train.bench import xl_torch_reference  # needs torch

    cfg = config.torch_xl.replace(dtype=jnp.float32)
    if cfg.dropout or cfg.dropatt:
        raise ValueError("cpu_vs_torch: the Transformer-XL's dropout must be off")
    b, t = config.torch_xl_batch, cfg.tgt_len
    # The cpu preset's optimizer: clipping to 0.25, Adam on the warm-up + cosine schedule
    # (torch: the same peak rate, constant; a schedule costs nothing measurable).
    run = lm.make_config("ptb", "cpu")
    tx, _ = make_optimizer(run.optimizer_config())
    model = TransformerXL(cfg)
    rng = np.random.default_rng(0)
    batches = [
        {k: rng.integers(0, cfg.vocab_size, (b, t), dtype=np.int32) for k in ("inputs", "targets")}
        for _ in range(_n_batches(config))
    ]

    def init_state() -> TrainState:
        dummy = jnp.ones((1, 8), jnp.int32)
        params = model.init({"params": jax.random.PRNGKey(0)}, dummy, init_memory(cfg, 1))["params"]
        return TrainState.create(
            params=params, tx=tx, rng=jax.random.PRNGKey(1), extra=init_memory(cfg, b)
        )

    project, n_project, project_loss, profile, products = _project_arm(
        lm.make_loss_fn(model), init_state, batches, cpu
    )
    floor, floor_error = build_floor(xl_floor, cfg, b)
    torch.manual_seed(0)
    eager = xl_torch_reference.from_config(cfg).train()
    _official_init(eager)
    compiled = copy.deepcopy(eager)
    opt = dict(learning_rate=run.learning_rate, clip_norm=run.clip_norm)
    # Time-major, as the official code: [T, B].
    torch_batches = [
        tuple(
            torch.from_numpy(np.ascontiguousarray(x[k].T).astype(np.int64))
            for k in ("inputs", "targets")
        )
        for x in batches
    ]
    arms, torch_losses = _torch_arms(
        tr.TorchTrainStep(eager, tr.XLLossFn(eager), **opt),
        tr.TorchTrainStep(compiled, tr.XLLossFn(torch.compile(compiled)), **opt)
        if config.torch_compile
        else None,
        torch_batches,
    )
    name = (
        f"Transformer-XL {cfg.n_layers} x {cfg.d_model}, V {cfg.vocab_size}, {b} x {t}, "
        f"memory {cfg.mem_len}, remat {cfg.remat}"
    )
    return {
        "name": name,
        "model": "transformer_xl",
        "shape": {"batch": b, "length": t, "mem_len": cfg.mem_len},
        "tokens_per_step": b * t,
        "n_params": _check_params(name, n_project, eager),
        "arms": {"project": project, **arms, **_floor_arms(floor)},
        "losses": lambda: {"project": project_loss(), **torch_losses()},
        "profile": profile,
        "step_products": products,
        "floor": floor,
        "floor_error": floor_error,
    }


def _official_init(model) -> None:
    """The official train.py's `weights_init` (init_std 0.02; LayerNorm scales around 1):
    the port leaves biases and projections at zero and embeddings at N(0, 1), which after the
    sqrt(D) scaling starts the loss near 48 instead of log V."""
    import torch  # optional, a test-only dependency: imported where the comparison runs

    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("layer_norm.weight"):
                p.normal_(1.0, 0.02)
            elif name.endswith(".bias"):  # not r_w_bias, r_r_bias (u, v): normal
                p.zero_()
            else:
                p.normal_(0.0, 0.02)
