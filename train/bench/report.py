"""The results as files: OUT/bench.json (every raw figure) and OUT/bench.md (tables), and
`merge_results`, which lays a later run over an earlier one."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any


def merge_results(earlier: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
    """`new` laid over `earlier` (same device): training entries replace those of the same
    name, the other sections and their errors those of the sections `new` ran; the meta is
    new's, listing the earlier runs (date, command)."""
    ran = set(new["meta"]["sections"])
    names = {r["name"] for r in new["train"]}
    merged = dict(earlier)
    merged["meta"] = dict(
        new["meta"],
        earlier_runs=[
            *earlier["meta"].get("earlier_runs", []),
            {"date": earlier["meta"]["date"], "command": earlier["meta"]["command"]},
        ],
    )
    merged["train"] = [r for r in earlier.get("train", []) if r["name"] not in names]
    merged["train"] += new["train"]
    for key in ("matmul", "decode", "xl_eval", "cpu_vs_torch", "data"):
        if new.get(key) is not None:
            merged[key] = new[key]
    merged["errors"] = [e for e in earlier.get("errors", []) if e["section"] not in ran]
    merged["errors"] += new["errors"]
    return merged


def write_results(results: Mapping[str, Any], out: str) -> tuple[str, str]:
    """OUT/bench.json and OUT/bench.md; returns their paths."""
    os.makedirs(out, exist_ok=True)
    json_path, md_path = os.path.join(out, "bench.json"), os.path.join(out, "bench.md")
    with open(json_path, "w") as f:
        json.dump(results, f, indent=1, default=_plain)
    with open(md_path, "w") as f:
        f.write(to_markdown(results))
    return json_path, md_path


def _xl_eval_lines(xl_eval: list[dict[str, Any]] | None) -> list[str]:
    """The XL evaluation table: with memory against the vanilla sliding window."""
    if not xl_eval:
        return []
    lines = [
        "| attention length | XL with memory (ms/token) | vanilla window (ms/token) | "
        "speed-up | FLOP ratio |",
        "|---|---|---|---|---|",
    ]
    for r in xl_eval:
        lines.append(
            f"| {r['attn_len']} | {r['xl_s_per_token'] * 1e3:.4f} | "
            f"{r['vanilla_s_per_token'] * 1e3:.3f} | {r['speedup']:,.0f}x | "
            f"{r['flop_ratio']:,.0f}x |"
        )
    return [*lines, ""]


def to_markdown(results: Mapping[str, Any]) -> str:
    """The results as markdown tables (the README's performance section takes them as is)."""
    meta = results["meta"]
    lines = [
        f"Device: {meta['device_kind']} ({meta['platform']}), jax {meta['jax']}, "
        f"compute dtype {meta['dtype']}, {meta['date']}.",
        f"Command: `{meta['command']}`",
    ]
    lines += [
        f"Earlier, merged: `{run['command']}` ({run['date']})"
        for run in meta.get("earlier_runs", [])
    ]
    lines.append("")
    matmul = results.get("matmul") or {}
    if matmul:
        rates = ", ".join(
            f"{name} {m['rate'] / 1e12:.3g} TFLOP/s ({m['n']}^3)" for name, m in matmul.items()
        )
        peak = meta.get("nominal_bf16_peak")
        lines += [
            f"Measured matrix rate: {rates}"
            + (f"; datasheet bf16 peak {peak / 1e12:.4g} TFLOP/s." if peak else "."),
            "",
        ]
    train = results.get("train") or []
    if train:
        # A float32 run (a CPU) is also compared with the float32 rate it actually uses.
        f32 = meta["dtype"] == "float32"
        lines += [
            "| training step | tokens/step | step (ms) | tokens/s | compile (s) | "
            "memory (GiB) | model TFLOP/step | XLA / formula | MFU (measured bf16) | "
            + ("MFU (measured float32) | " if f32 else "")
            + "MFU (datasheet bf16) |",
            "|---" * (11 if f32 else 10) + "|",
        ]
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
                + f"{_pct(r.get('mfu_vs_nominal_bf16'))} |"
            )
        padded = [
            r
            for r in train
            if r.get("real_tokens_per_step", r["tokens_per_step"]) < r["tokens_per_step"]
        ]
        if padded:
            lines += ["", "Real (non-pad) tokens, where the batch has padding:", ""]
            lines += [
                f"- {r['name']}: {r['real_tokens_per_step']:,} of {r['tokens_per_step']:,} "
                f"positions a step, {r['real_tokens_per_s']:,.0f} real tokens/s, MFU on them "
                f"{_pct(r.get('real_mfu_vs_measured_bf16'))} (measured bf16), "
                f"{_pct(r.get('real_mfu_vs_nominal_bf16'))} (datasheet bf16)"
                for r in padded
            ]
        lines += [
            "",
            "FLOP formulas (matrix products only; MFU divides the model FLOPs, the XLA "
            "ratio compares with every product executed; * the program loops (the XL "
            "layers run in a scan) and XLA's cost analysis counts a loop body once, so "
            "its count falls short):",
        ]
        for formula in dict.fromkeys(r["flops"]["formula"] for r in train):
            lines.append(f"- {formula}")
        estimated = [r for r in train if r.get("program")]
        if estimated:
            lines += ["", "Measured beside the estimate from the compiled program "
                      "(`train.bench.program`; the same figure `--target` gives without the "
                      "device):", ""]  # fmt: skip
            lines += [
                f"- {r['name']}: measured {r['step_s_median'] * 1e3:.1f} ms a step, estimated "
                f"{r['program']['estimate']['step_s'] * 1e3:.1f} ms "
                f"({r['program']['kernels']:,} kernels)"
                for r in estimated
            ]
        lines.append("")
        for r in train:
            lines += _profile_lines(r["name"], r.get("profile"), r["step_s_median"])
    lines += _decode_lines(results.get("decode"))
    lines += _xl_eval_lines(results.get("xl_eval"))
    lines += _cpu_vs_torch_lines(results.get("cpu_vs_torch"))
    lines += _data_lines(results.get("data"))
    for err in results.get("errors") or []:
        lines.append(f"- {err['section']} failed: {err['error']}")
    return "\n".join(lines) + "\n"


def _decode_lines(decode: Mapping[str, Any] | None) -> list[str]:
    """The decode section: one row per model x batch x search x engine, a note per model."""
    if not decode:
        return []
    if "sizes" not in decode:  # a bench.json from before the engines were compared
        return [
            f"Beam search of {decode['model']} ({decode['weights']}), {decode['split']}: "
            f"{decode['sentences_per_s']:.1f} sentences/s, "
            f"{decode['output_tokens_per_s']:,.0f} output tokens/s.",
            "",
        ]
    low, high = decode["source_lengths"]
    versions = ", ".join(f"{k} {v}" for k, v in decode["versions"].items())
    lines = [
        f"Decoding, our search against the serving engines on the same random weights "
        f"(sharpened so that outputs are decisive and of varied lengths): random sources of "
        f"{low}-{high} tokens (EOS counted), padded to the buckets {decode['buckets']}, "
        f"outputs of up to bucket + {decode['margin']} tokens; greedy and beam "
        f"{decode['beam_size']} (length penalty {decode['length_penalty']}: GNMT's in ours, "
        f"length ** alpha in the engines). CTranslate2 and transformers on "
        f"{decode['engine_device']} with {decode['threads']} threads, ours on JAX's "
        f"{decode['backend']}; medians of {decode['rounds']} interleaved rounds. "
        f"{decode['cpu']}; {versions}. tokens/s counts every output token up to and with "
        "EOS; x ours is the ratio of tokens/s; first calls: the first call of each source "
        "shape less a steady one (ours: compiling).",
        "",
        "| model | batch | search | engine | output tokens/s | ms/sentence | x ours | "
        "same tokens as ours | first calls (s) | load (s) |",
        "|---|---:|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    notes = []
    for size in decode["sizes"]:
        engines = size["engines"]
        for r in size["rows"]:
            lines.append(
                f"| {size['name']} | {r['batch']} | {r['search']} | {r['engine']} | "
                f"{r['tokens_per_s']:,.0f} | {r['ms_per_sentence']:,.1f} | "
                f"{r['x_ours']:.2f} | {_pct(r['same_as_ours'])} | "
                f"{r['first_calls_extra_s']:.1f} | {engines[r['engine']]['load_s']:.1f} |"
            )
        exports = ", ".join(
            f"{name} {e['export_s']:.1f} s" for name, e in engines.items() if e["export_s"]
        )
        lengths = size.get("greedy_lengths") or {}
        eos = size["eos_calibration"]
        notes.append(
            f"{size['name']}: {size['model']}, {size['params']:,} parameters; EOS logit "
            f"+{eos['eos_bias']:.1f}: our greedy outputs {lengths.get('mean', 0):.1f} tokens "
            f"on average ({lengths.get('min')} to {lengths.get('max')}, "
            f"{_pct(lengths.get('at_limit'))} at the limit); exports: {exports or 'none'}."
        )
        notes += [
            f"{size['name']}: {name} unavailable: {why}"
            for name, why in size["unavailable"].items()
        ]
    return lines + [""] + [f"- {note}" for note in notes] + [""]


def _profile_lines(
    name: str, profile: Mapping[str, Any] | None, step_s: float, top: int = 5
) -> list[str]:
    """Where a training step's time went: category shares and the top ops."""
    if not profile:
        return []
    busy_ms = profile["busy_us_per_step"] / 1e3
    op_ms = profile.get("op_events_us_per_step", profile["busy_us_per_step"]) / 1e3
    in_ops = f" ({op_ms:.1f} in op events)" if op_ms < busy_ms else ""
    shares = ", ".join(f"{c} {100 * x:.0f}%" for c, x in profile["categories"].items())
    wall = f"{step_s * 1e3:.1f} ms"
    if "wall_us_per_step" in profile:
        wall = f"{profile['wall_us_per_step'] / 1e3:.1f} ms traced ({wall} untraced)"
    lines = [
        f"Profile of {name} ({profile['source']}): {busy_ms:.1f} ms busy per step{in_ops} of "
        f"{wall}; {shares}.",
        "",
        "| op | ms/step | share | category |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| `{op['name'][:60]}` | {op['us_per_step'] / 1e3:.2f} | "
        f"{100 * op['share']:.1f}% | {op['category']} |"
        for op in profile["top"][:top]
    ]
    return lines + [""]


def _cpu_vs_torch_lines(cmp: Mapping[str, Any] | None) -> list[str]:
    """The CPU training steps against PyTorch: medians and the project's speed ratios."""
    if not cmp:
        return []
    lines = [
        f"CPU training step against PyTorch {cmp['torch']} ({cmp['cpu']}): float32, "
        f"{cmp['threads']} threads for both (XLA's CPU pool uses the {cmp['threads']} "
        f"CPUs this process may run on; torch.set_num_threads({cmp['threads']})), dropout "
        f"off, the same parameter count, identical batches, steps interleaved, medians of "
        f"{cmp['steps']} steps after {cmp['warmup']} untimed. Ratio: PyTorch's step time "
        "over the project's (above 1: the project trains more tokens per second).",
        "",
        "| step | params | project (ms) | torch eager (ms) | torch.compile (ms) | "
        "project / eager | project / compile |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in cmp["rows"]:
        arms = r["arms"]

        def ms(name, arms=arms):
            return "n/a" if arms.get(name) is None else f"{arms[name]['median_s'] * 1e3:.1f}"

        lines.append(
            f"| {r['name']} | {r['n_params']:,} | {ms('project')} | "
            f"{ms('torch_eager')} | {ms('torch_compile')} | "
            f"{_num(r['project_over_eager'], '.2f')} | "
            f"{_num(r.get('project_over_compile'), '.2f')} |"
        )
    lines += _floor_lines(cmp["rows"])
    notes = [
        f"{r['name']}: torch.compile failed: {r['compile_error']}"
        for r in cmp["rows"]
        if r.get("compile_error")
    ]
    notes += [
        f"{r['name']}: no products floor: {r['floor_error']}"
        for r in cmp["rows"]
        if r.get("floor_error")
    ]
    # Results of older runs may carry notes (such as an XL row skipped) in a bench.json.
    notes += cmp.get("notes", [])
    lines += [""] + [f"- {note}" for note in notes] + ([""] if notes else [])
    for r in cmp["rows"]:
        lines += _profile_lines(r["name"], r.get("profile"), r["arms"]["project"]["median_s"])
    return lines


def _floor_lines(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """The products floor of each row (`train.bench.products_floor`), if it was timed."""
    rows = [r for r in rows if "eager_over_floor" in r]
    if not rows:
        return []
    lines = [
        "",
        "Products floor: each step's matrix products alone (no softmax, LayerNorm, loss, "
        "transposes or optimizer), in jax and in torch, timed in the same turns. Eager "
        "PyTorch's step over the jax floor is the most the project's step could reach against "
        "it on this machine.",
        "",
        "| products of | count, GFLOP (step; floor) | jax floor (ms) | torch floor (ms) | "
        "eager / jax floor | project above its floor (ms) | eager above its floor (ms) |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    differ = []
    for r in rows:
        (n_step, gf_step), (n_floor, gf_floor) = r["products"]["step"], r["products"]["floor"]
        if n_step != n_floor or abs(gf_step - gf_floor) > 1e-6 * gf_step:
            differ.append(r["name"])
        arms = r["arms"]
        lines.append(
            f"| {r['name']} | {n_step}, {gf_step:.4g}; {n_floor}, {gf_floor:.4g} | "
            f"{arms['jax_floor']['median_s'] * 1e3:.1f} | "
            f"{arms['torch_floor']['median_s'] * 1e3:.1f} | {r['eager_over_floor']:.2f} | "
            f"{r['project_above_floor_ms']:.1f} | {r['eager_above_floor_ms']:.1f} |"
        )
    if differ:
        lines += [""] + [
            f"- {name}: the floor's products differ from the step's (a remat policy's "
            "recomputation, or a floor that no longer mirrors the model: "
            "train/bench/products_floor.py)"
            for name in differ
        ]
    return lines


def _data_lines(data: Mapping[str, Any] | None) -> list[str]:
    """The data section: preparation (fresh and reused), loader and the CPU step, per task."""
    if not data:
        return []
    goals = data["goals"]
    lines = [
        f"Data: a synthetic corpus of {data['pairs']:,} sentence pairs and a "
        f"{data['lm_tokens']:,}-token LM text, the `cpu` presets. Goals: preparing the pairs "
        f"under {goals['prepare_s']:.0f} s and {_gib(goals['peak_rss_bytes'])} GiB; a loader "
        f"{goals['loader_over_step']:.0f}x faster than the CPU step and at least "
        f"{goals['tokens_s'] / 1e6:.0f}M tokens/s.",
        "",
        "| task | prepare (s) | peak RSS (GiB) | reuse (s) | batches/s | positions/s | "
        "tokens/s | CPU step (ms) | loader / step |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for task in ("translate", "lm"):
        r = data.get(task)
        if not r:
            continue
        loader = r["loader"]
        lines.append(
            f"| {task} | {r['prepare']['seconds']:.1f} | "
            f"{_gib(r['prepare']['peak_rss_bytes'])} | {r['reuse']['seconds']:.1f} | "
            f"{loader['batches_per_s']:,.0f} | {loader['positions_per_s'] / 1e6:.1f}M | "
            f"{loader['tokens_per_s'] / 1e6:.1f}M | {r['step_s'] * 1e3:.0f} | "
            f"{r['loader_over_step']:,.0f}x |"
        )
    return lines + [""]


def _gib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 2**30:.2f}"


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def _num(x: float | None, fmt: str) -> str:
    return "n/a" if x is None else format(x, fmt)


def _plain(x: Any) -> Any:
    if hasattr(x, "item"):
        return x.item()
    return str(x)
