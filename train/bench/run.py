"""`run_benchmarks`: the sections in order, each recorded (or its error) and saved as it ends;
`run_and_report`, what `python -m train.bench` does with its parsed options."""

from __future__ import annotations

import datetime
import json
import os
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import flax
import jax
import jaxlib

from train.bench import cpu_vs_torch, data, decode, train_steps, xl_eval
from train.bench.config import DEFAULT_SECTIONS, SECTIONS, XL_SECTIONS, BenchConfig
from train.bench.options import BenchOptions, config_from_options, parse_options
from train.bench.report import merge_results, to_markdown, write_results
from train.bench.timing import measure_matmul_rate, nominal_bf16_peak
from train.core.host_memory import keep_host_memory

# Sections that do not use the matrix rate: a run of only these skips the matmul section (on
# a CPU the full size, 8192^3, would take minutes).
WITHOUT_MATMUL = ("cpu_vs_torch", "data")


def run_benchmarks(
    config: BenchConfig,
    *,
    sections: Sequence[str] = DEFAULT_SECTIONS,
    out: str | None,
    cache_dir: str = os.path.join("runs", "bench-cache"),
    profile: bool = True,
    profile_dir: str | None = None,
    command: str = "",
    quick: bool = False,
    append: bool = False,
    raise_errors: bool = False,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Runs `sections` (matmul first, unless all are WITHOUT_MATMUL) and returns the results;
    with `out`, writes OUT/bench.json and OUT/bench.md after every section (a run cut short
    keeps what it has).
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
            return run_benchmarks(
                config,
                sections=sections,
                out=out,
                cache_dir=cache_dir,
                profile=True,
                profile_dir=scratch,
                command=command,
                quick=quick,
                append=append,
                raise_errors=raise_errors,
                log=log,
            )
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    device = jax.local_devices()[0]
    meta = _meta(config, device, command=command, quick=quick)
    with_matmul = "matmul" in sections or not set(sections) <= set(WITHOUT_MATMUL)
    meta["sections"] = [s for s in SECTIONS if s in sections or (s == "matmul" and with_matmul)]
    earlier = None
    if append and out and os.path.exists(os.path.join(out, "bench.json")):
        with open(os.path.join(out, "bench.json")) as f:
            earlier = json.load(f)
        if earlier["meta"]["device_kind"] != meta["device_kind"]:
            raise ValueError(
                f"--append: {out}/bench.json holds results of "
                f"{earlier['meta']['device_kind']}, this is {meta['device_kind']}"
            )
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
            results["errors"].append(
                {
                    "section": section,
                    "error": f"{type(e).__name__}: {e}",
                    "traceback": traceback.format_exc()[-4000:],
                }
            )
            value = None
        log(f"[bench] {section} done in {time.perf_counter() - start:.1f}s")
        return value

    matmul = None
    if with_matmul:
        matmul = attempt(
            "matmul",
            lambda: {
                name: measure_matmul_rate(config.matmul_size, name, repeats=config.matmul_repeats)
                for name in ("bfloat16", "float32")
            },
        )
        results["matmul"] = matmul
    rates = {name: m["rate"] for name, m in (matmul or {}).items()}
    train_kw = dict(
        nominal_peak=results["meta"]["nominal_bf16_peak"],
        profile_dir=profile_dir if profile else None,
        steps=config.steps,
        warmup=config.warmup,
        rates=rates,
    )
    save()

    if "train_transformer" in sections:
        r = attempt(
            "train_transformer",
            lambda: train_steps.bench_train_step(
                train_steps.transformer_train_setup(config), **train_kw
            ),
        )
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
        r = attempt(
            section,
            lambda name=name, xl_cfg=xl_cfg, b=b: train_steps.bench_train_step(
                train_steps.xl_train_setup(name, xl_cfg, b, config), **train_kw
            ),
        )
        if r:
            results["train"].append(r)
        save()
    if "decode" in sections:
        results["decode"] = attempt(
            "decode", lambda: decode.decode_section(config, cache_dir=cache_dir, log=log)
        )
        save()
    if "xl_eval" in sections:
        results["xl_eval"] = attempt(
            "xl_eval",
            lambda: xl_eval.xl_eval_bench(
                config.xl_eval,
                attn_lengths=config.attn_lengths,
                tgt_len=config.xl_eval_tgt_len,
                batch=config.xl_eval_batch,
                vanilla_batch=config.vanilla_batch,
                repeats=config.eval_repeats,
            ),
        )
        save()
    if "cpu_vs_torch" in sections:
        results["cpu_vs_torch"] = attempt(
            "cpu_vs_torch",
            lambda: cpu_vs_torch.cpu_vs_torch_bench(
                config, profile_dir=profile_dir if profile else None, log=log
            ),
        )
        save()
    if "data" in sections:
        results["data"] = attempt(
            "data",
            lambda: data.data_bench(
                cache_dir=cache_dir,
                pairs=config.data_pairs,
                lm_tokens=config.data_lm_tokens,
                loader_seconds=config.data_loader_seconds,
                log=log,
            ),
        )
        save()
    return results if earlier is None else merge_results(earlier, results)


def _meta(config: BenchConfig, device: jax.Device, *, command: str, quick: bool) -> dict[str, Any]:

    kind = device.device_kind
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
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


def run_and_report(
    options: BenchOptions,
    *,
    command: str,
    log: Callable[[str], None] = lambda m: print(m, flush=True),
) -> int:
    """Runs the benchmarks `options` choose, writes OUT/bench.{json,md}, prints the tables;
    -> the exit status (1 if a section failed)."""
    results = run_benchmarks(
        config_from_options(options),
        sections=options.only,
        out=options.out,
        cache_dir=options.cache_dir,
        profile=options.profile,
        profile_dir=options.profile_dir,
        command=command,
        quick=options.quick,
        append=options.append,
        log=log,
    )
    log(to_markdown(results))
    log(
        f"results: {os.path.join(options.out, 'bench.json')}, "
        f"{os.path.join(options.out, 'bench.md')}"
    )
    return 1 if results["errors"] else 0


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: parse the flags, run, report (-> exit code)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    keep_host_memory()  # as the training commands do: their step is the one measured
    return run_and_report(parse_options(argv), command=" ".join(["python -m train.bench", *argv]))
