"""`python -m train.bench --target h200`: the bench's training steps compiled for a device this
host does not have, and what their programs hold.

The step is the one the bench times (`train.bench.train_steps`: the project's train step,
jitted by `train.core.parallel.DataParallel` with its shardings and donation), over abstract
arguments placed on the target's compile-only devices (`train.bench.targets`). Nothing runs:
the report is the program's memory against the chip's, its kernels by category, the largest
kernels, and an estimated step time (`train.bench.program`), each labelled as what it is.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import jax

from train.bench import program
from train.bench.flops import xla_flops
from train.bench.targets import GpuTarget, TpuTarget, compile_only_devices, compiling_for
from train.bench.timing import compiled_memory, utilisation
from train.bench.train_steps import TrainBench
from train.core.parallel import DataParallel


def abstract_arguments(bench: TrainBench, dp: DataParallel) -> tuple[Any, Any]:
    """(state, batch) as ShapeDtypeStructs with the run's shardings over `dp`'s mesh: the
    state's shapes from `jax.eval_shape` of its initialiser, nothing allocated."""
    state = jax.eval_shape(bench.init_state)
    shardings = dp.state_shardings(state)
    state = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shardings
    )
    batch = {
        k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=dp.batch_sharding)
        for k, v in bench.batch.items()
    }
    return state, batch


def compile_for_target(
    bench: TrainBench,
    target: GpuTarget | TpuTarget,
    *,
    devices: int | None = None,
    sharding: str = "replicated",
) -> tuple[jax.stages.Compiled, float, str | None]:
    """The bench's train step compiled for `target` (-> the compiled program, seconds, a note
    on how it was compiled when it differs from the device's own compile, else None).

    Without the device nothing is autotuned, and XLA's untuned Triton GEMM tiling can find no
    tile for some products (wt103_base's 410-wide ones); such a step is compiled again with
    its GEMMs on cuBLAS, as the note says."""
    dp = DataParallel("jit", devices=compile_only_devices(target.name, devices), sharding=sharding)
    state, batch = abstract_arguments(bench, dp)
    step = dp.compile_train_step(bench.loss_fn, state)
    start = time.perf_counter()
    note = None
    with compiling_for(target):
        lowered = step.lower(state, batch)
        try:
            compiled = lowered.compile()
        except jax.errors.JaxRuntimeError as e:
            if "find output tile sizes" not in str(e):
                raise
            note = (
                "XLA's untuned Triton GEMM tiling found no tile for a product "
                "(xla_gpu_enable_triton_gemm=False: every GEMM on cuBLAS)"
            )
            compiled = lowered.compile(compiler_options={"xla_gpu_enable_triton_gemm": False})
    return compiled, time.perf_counter() - start, note


def target_train_report(
    bench: TrainBench,
    target: GpuTarget | TpuTarget,
    *,
    devices: int | None = None,
    sharding: str = "replicated",
) -> dict[str, Any]:
    """One training bench on `target`: memory per device against the chip's, the kernels by
    category with their bytes and FLOPs, the ten largest, and the estimated step time and
    MFU (labelled estimates)."""
    compiled, compile_s, note = compile_for_target(
        bench, target, devices=devices, sharding=sharding
    )
    memory = compiled_memory(compiled)
    kernels = program.program_kernels(compiled.as_text())
    summary = program.summarize(kernels, program.pricing_for(target))
    model_flops = bench.flops.training()
    step_s = summary["estimate"]["step_s"]
    n_devices = len(compile_only_devices(target.name, devices))
    return {
        "name": bench.name,
        **bench.info,
        "target": target.name,
        "device_kind": target.device_name,
        "devices": n_devices,
        "sharding": sharding,
        "compile_s": compile_s,
        "compile_note": note,
        "tokens_per_step": bench.flops.tokens,
        "memory": memory,
        "chip_memory_bytes": target.memory_bytes,
        "fits": bool(memory and memory["footprint"] <= target.memory_bytes),
        "xla_flops": xla_flops(compiled),
        "bytes_per_token": summary["bytes"] / bench.flops.tokens,
        **summary,
        "estimated_mfu_vs_nominal_bf16": utilisation(
            model_flops / n_devices, step_s, target.bf16_peak
        ),
    }


def format_report(report: dict[str, Any]) -> str:
    """A training bench's target report as text: memory, categories, top kernels, estimate."""
    gb = 1e9
    mem = report["memory"] or {}
    lines = [
        f"## {report['name']} on {report['target']} ({report['device_kind']}, "
        f"{report['devices']} device(s), {report['sharding']}): compiled in "
        f"{report['compile_s']:.1f} s, nothing run",
        *([f"note: {report['compile_note']}"] if report.get("compile_note") else []),
        "",
        f"memory per device: {mem.get('footprint', 0) / gb:.3f} GB "
        f"(arguments {mem.get('argument', 0) / gb:.3f}, temporaries {mem.get('temp', 0) / gb:.3f}, "
        f"outputs {mem.get('output', 0) / gb:.3f}, aliased {mem.get('alias', 0) / gb:.3f}"
        + (f", peak {mem['peak_reported'] / gb:.3f}" if mem.get("peak_reported") else "")
        + ") of "
        f"{report['chip_memory_bytes'] / gb:.1f} GB: "
        + ("fits" if report["fits"] else "DOES NOT FIT"),
        "",
        "| category | kernels | GB | TFLOP | estimated ms |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, row in report["categories"].items():
        lines.append(
            f"| {name} | {row['kernels']:,} | {row['bytes'] / gb:.2f} | {row['flops'] / 1e12:.3f} "
            f"| {row['est_s'] * 1e3:.2f} |"
        )
    est = report["estimate"]
    lines += [
        f"| all | {report['kernels']:,} | {report['bytes'] / gb:.2f} | | "
        f"{est['busy_s'] * 1e3:.2f} |",
        "",
        f"bytes as read (a sliced operand: its slices); with every operand whole: "
        f"{report['listed_bytes'] / gb:.2f} GB, elementwise "
        f"{report['categories']['elementwise and reductions']['listed_bytes'] / gb:.2f}",
        f"bytes per token: {report['bytes_per_token']:,.0f}",
        f"estimated step: {est['step_s'] * 1e3:.2f} ms = kernels {est['busy_s'] * 1e3:.2f} ms + "
        f"gaps {est['gap_s'] * 1e3:.2f} ms ({report['kernels']:,} x "
        f"{est['pricing']['gap_s'] * 1e6:.1f} us); estimated MFU "
        f"{(report['estimated_mfu_vs_nominal_bf16'] or 0) * 100:.1f}% of the bf16 datasheet rate"
        " (AN ESTIMATE, not a measurement)",
    ]
    if est["attention_unpriced"]:
        lines.append(
            "attention kernels without a measured time (priced by roofline): "
            + ", ".join(est["attention_unpriced"])
        )
    lines += ["", "the ten largest kernels by bytes:", "", "| kernel | category | calls | GB |"]
    lines.append("|---|---|---:|---:|")
    for k in report["top"]:
        lines.append(f"| {k['name']} | {k['category']} | {k['count']} | {k['bytes'] / gb:.3f} |")
    return "\n".join(lines)


def run_target(
    benches: dict[str, Callable[[], TrainBench]],
    target: GpuTarget | TpuTarget,
    *,
    devices: int | None = None,
    sharding: str = "replicated",
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Every chosen training bench compiled for `target`: {'target': ..., 'train': [reports],
    'errors': [...]}. A bench that fails to compile is recorded and the others go on."""
    results: dict[str, Any] = {"target": target.name, "train": [], "errors": []}
    for section, setup in benches.items():
        log(f"[bench] {section} for {target.name} ...")
        try:
            report = target_train_report(setup(), target, devices=devices, sharding=sharding)
        except Exception as e:  # noqa: BLE001 - one failed section must not lose the others
            # XLA's messages carry the whole Python stack: its first lines say what failed.
            error = f"{type(e).__name__}: " + "\n".join(str(e).splitlines()[:3])
            entry = {"section": section, "error": error}
            if "RESOURCE_EXHAUSTED" in error:  # the compiler's own verdict: it does not fit
                entry["fits"] = False
                log(f"[bench] {section} DOES NOT FIT on {target.name}: {error}")
            else:
                log(f"[bench] {section} FAILED: {error}")
            results["errors"].append(entry)
            continue
        results["train"].append({"section": section, **report})
        log(format_report(report))
    return results
