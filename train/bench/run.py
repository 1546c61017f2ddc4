"""`run_benchmarks`: the sections in order, each recorded (or its error) and saved as it ends;
`run_and_report`, what `python -m train.bench` does with its parsed options."""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import flax
import jax
import jaxlib

from train.bench import cpu_vs_torch, data, decode, deviceless, train_steps, xl_eval
from train.bench.config import (
    DEFAULT_SECTIONS,
    SECTIONS,
    TARGET_SECTIONS,
    XL_SECTIONS,
    BenchConfig,
)
from train.bench.options import BenchOptions, config_from_options, parse_options
from train.bench.presets import preset_bench
from train.bench.report import merge_results, to_markdown, write_results
from train.bench.targets import compile_only_devices, get_target
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
    with _trace_dir(profile, profile_dir) as profile_dir:
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
                    name: measure_matmul_rate(
                        config.matmul_size, name, repeats=config.matmul_repeats
                    )
                    for name in ("bfloat16", "float32")
                },
            )
            results["matmul"] = matmul
        rates = {name: m["rate"] for name, m in (matmul or {}).items()}
        save()
        measures = _measures(
            config,
            rates=rates,
            nominal_peak=results["meta"]["nominal_bf16_peak"],
            cache_dir=cache_dir,
            profile_dir=profile_dir,
            log=log,
        )
        for section, measure in measures.items():
            if section not in sections:
                continue
            value = attempt(section, measure)
            if section in TRAIN_SECTIONS:
                if value:
                    results["train"].append(value)
            else:
                results[section] = value
            save()
        return results if earlier is None else merge_results(earlier, results)


@contextlib.contextmanager
def _trace_dir(profile: bool, profile_dir: str | None) -> Iterator[str | None]:
    """Where the training benches write their traces: `profile_dir`, or a scratch folder
    deleted at the end when it is None; None when not profiling."""
    if not profile:
        yield None
    elif profile_dir is not None:
        yield profile_dir
    else:
        with tempfile.TemporaryDirectory(prefix="bench-trace-", ignore_cleanup_errors=True) as d:
            yield d


# The training sections: each result is appended to the results' 'train' list; every other
# section's result is stored under its own name.
TRAIN_SECTIONS = ("train_transformer", *XL_SECTIONS)


def _measures(
    config: BenchConfig,
    *,
    rates: dict[str, float],
    nominal_peak: float | None,
    cache_dir: str,
    profile_dir: str | None,
    log: Callable[[str], None],
) -> dict[str, Callable[[], Any]]:
    """Every section after matmul -> the call that measures it, in the order of SECTIONS. An
    XL training section the config has no model for is left out (not run, nothing recorded).
    rates: the matmul section's matrix rates; profile_dir: where the training benches trace
    (None: no profile)."""
    train_kw = dict(
        nominal_peak=nominal_peak,
        profile_dir=profile_dir,
        steps=config.steps,
        warmup=config.warmup,
        rates=rates,
    )
    measures: dict[str, Callable[[], Any]] = {
        "train_transformer": lambda: train_steps.bench_train_step(
            train_steps.transformer_train_setup(config), **train_kw
        ),
    }
    for section, key in XL_SECTIONS.items():
        entry = next((x for x in config.xl if x[0].startswith(key)), None)
        if entry is not None:
            name, xl_cfg, b = entry
            measures[section] = lambda name=name, xl_cfg=xl_cfg, b=b: train_steps.bench_train_step(
                train_steps.xl_train_setup(name, xl_cfg, b, config), **train_kw
            )
    measures["decode"] = lambda: decode.decode_section(config, cache_dir=cache_dir, log=log)
    measures["xl_eval"] = lambda: xl_eval.xl_eval_bench(
        config.xl_eval,
        attn_lengths=config.attn_lengths,
        tgt_len=config.xl_eval_tgt_len,
        batch=config.xl_eval_batch,
        vanilla_batch=config.vanilla_batch,
        repeats=config.eval_repeats,
    )
    measures["cpu_vs_torch"] = lambda: cpu_vs_torch.cpu_vs_torch_bench(
        config, profile_dir=profile_dir, log=log
    )
    measures["data"] = lambda: data.data_bench(
        cache_dir=cache_dir,
        pairs=config.data_pairs,
        lm_tokens=config.data_lm_tokens,
        loader_seconds=config.data_loader_seconds,
        log=log,
    )
    return measures


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
    -> the exit status (1 if a section failed). With `options.target`, compiles the training
    sections for that device instead (`run_target_and_report`)."""
    if options.target:
        return run_target_and_report(options, command=command, log=log)
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


def target_benches(config: BenchConfig, sections: Sequence[str]) -> dict[str, Callable]:
    """The chosen training sections -> their TrainBench builders (an XL section the config
    has no model for is left out, as in `run_benchmarks`)."""
    benches: dict[str, Callable] = {}
    if "train_transformer" in sections:
        benches["train_transformer"] = lambda: train_steps.transformer_train_setup(config)
    for section, key in XL_SECTIONS.items():
        entry = next((x for x in config.xl if x[0].startswith(key)), None)
        if section in sections and entry is not None:
            name, xl_cfg, b = entry
            benches[section] = lambda name=name, xl_cfg=xl_cfg, b=b: train_steps.xl_train_setup(
                name, xl_cfg, b, config
            )
    return benches


def run_target_and_report(
    options: BenchOptions,
    *,
    command: str,
    log: Callable[[str], None] = print,
) -> int:
    """`--target`: the training sections compiled for the target, nothing run; prints each
    report and writes OUT/target_NAME.{json,md} (-> 1 if a section failed)."""
    target = get_target(options.target)
    if options.preset:  # the run preset's own step, its batch split over the target's devices
        count = len(compile_only_devices(target.name, options.target_devices))
        benches = {
            options.preset: lambda: preset_bench(
                options.preset, devices=count, batch_size=options.preset_batch_size
            )
        }
    else:
        sections = [s for s in options.only if s in TARGET_SECTIONS]
        benches = target_benches(config_from_options(options), sections)
    results = deviceless.run_target(
        benches,
        target,
        devices=options.target_devices,
        sharding=options.sharding,
        log=log,
    )
    meta = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": command,
        "quick": options.quick,
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "host": "compiled on this host for the target; nothing ran on a device",
    }
    results = {"meta": meta, **results}
    slug = "".join(c if c.isalnum() else "_" for c in target.name)
    stem = os.path.join(options.out, f"target_{slug}")
    os.makedirs(options.out, exist_ok=True)
    with open(stem + ".json", "w") as f:
        json.dump(results, f, indent=1)
    with open(stem + ".md", "w") as f:
        f.write(f"`{command}`, {meta['date']}\n\n")
        f.write("\n\n".join(deviceless.format_report(r) for r in results["train"]) + "\n")
    log(f"results: {stem}.json, {stem}.md")
    return 1 if results["errors"] else 0


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: parse the flags, run, report (-> exit code)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    keep_host_memory()  # as the training commands do: their step is the one measured
    return run_and_report(parse_options(argv), command=" ".join(["python -m train.bench", *argv]))
