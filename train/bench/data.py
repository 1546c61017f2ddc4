"""The data section: preparing a WMT-sized parallel corpus and a WikiText-103-sized text, and
the loaders that feed training from their token caches.

A synthetic corpus is written once (under the bench's cache_dir, reused by later runs):
`pairs` sentence pairs of a made-up language pair (words drawn from a Zipfian vocabulary of
random letter strings, so SentencePiece has real structure to learn; each target word is its
source word's fixed translation, in reverse order) and a word-level text of about `lm_tokens`
tokens drawn the same way. Then, for translation and for the LM:

  prepare   the `cpu` preset's `Task.prepare` on the files, in a fresh process with an empty
            work directory (tokenizer training on the spm_sample, streaming encode, the token
            cache, the batcher): wall time, and that process's peak RSS (`os.wait4`'s
            ru_maxrss), against the goals (the pairs under 3 minutes and 2 GiB);
  reuse     the same in a second fresh process: the cache is found, nothing is encoded;
  loader    the training batches of the prepared data (memory-mapped), drawn for
            `loader_seconds`: batches/s, tokens/s (every position of a batch's arrays, and the
            real tokens alone), against the goal of 2M tokens/s;
  step      the `cpu` preset's training step on those batches (median of `step_steps` after
            one compiling call): the loader must draw a batch at least 20x faster.

`python -m train.bench --only data` runs it at full size; the sizes are flags.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np

# The goals of issue 24: preparation of 1M pairs under 3 minutes and 2 GiB, a loader 20x faster
# than the CPU step and at least 2M tokens/s.
PEAK = "peak_rss_bytes: "  # the child's last line
CHILD = "import sys; from train.bench.data import main; sys.exit(main(sys.argv[1:]))"
GOALS = {"prepare_s": 180.0, "peak_rss_bytes": 2 << 30, "loader_over_step": 20.0, "tokens_s": 2e6}


def write_corpus(
    directory: str, *, pairs: int, lm_tokens: int, seed: int = 0, log: Callable = print
) -> dict[str, str]:
    """The synthetic files (see the module docstring), written unless already there ->
    {name: path}: train/valid source and target, LM train and valid text."""
    paths = {
        name: os.path.join(directory, name)
        for name in ("train.xx", "train.yy", "valid.xx", "valid.yy", "lm.train", "lm.valid")
    }
    done = os.path.join(directory, "done")
    if os.path.exists(done):
        return paths
    os.makedirs(directory, exist_ok=True)
    start = time.monotonic()
    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))

    def vocabulary(n: int) -> np.ndarray:
        return np.array(["".join(rng.choice(letters, k)) for k in rng.integers(2, 10, n)], object)

    def zipf(n: int) -> np.ndarray:
        p = 1.0 / np.arange(1, n + 1) ** 1.1
        return np.cumsum(p / p.sum())

    # Translation: 30k word types a side, 10..22 words a sentence (about 25 pieces of the
    # cpu preset's 4k SentencePiece vocabulary; 12..28 words gave 32).
    src_words, tgt_words, cdf = vocabulary(30_000), vocabulary(30_000), zipf(30_000)
    with (
        open(paths["train.xx"], "w") as fx,
        open(paths["train.yy"], "w") as fy,
        open(paths["valid.xx"], "w") as vx,
        open(paths["valid.yy"], "w") as vy,
    ):
        for first in range(0, pairs + 1000, 100_000):
            n = min(100_000, pairs + 1000 - first)
            lengths = rng.integers(10, 23, n)
            ids = np.minimum(np.searchsorted(cdf, rng.random(int(lengths.sum()))), len(cdf) - 1)
            src, tgt = src_words[ids].tolist(), tgt_words[ids].tolist()
            ends = np.cumsum(lengths).tolist()
            for i, (a, b) in enumerate(zip([0, *ends[:-1]], ends)):
                to_valid = first + i >= pairs
                (vx if to_valid else fx).write(" ".join(src[a:b]) + "\n")
                (vy if to_valid else fy).write(" ".join(reversed(tgt[a:b])) + "\n")
    # LM: 200k word types (WikiText-103 has 267k), 5..40 words a line.
    words, cdf = vocabulary(200_000), zipf(200_000)
    for name, total in (("lm.train", lm_tokens), ("lm.valid", max(lm_tokens // 500, 1000))):
        with open(paths[name], "w") as f:
            written = 0
            while written < total:
                lengths = rng.integers(5, 41, 50_000)
                ids = np.minimum(np.searchsorted(cdf, rng.random(int(lengths.sum()))), len(cdf) - 1)
                chosen, ends = words[ids].tolist(), np.cumsum(lengths).tolist()
                for a, b in zip([0, *ends[:-1]], ends):
                    f.write(" ".join(chosen[a:b]) + "\n")
                    written += b - a
                    if written >= total:
                        break
    open(done, "w").close()
    log(f"[bench] data: wrote the synthetic corpus in {time.monotonic() - start:.0f}s: {directory}")
    return paths


def make_config(task: str, paths: dict[str, str], work: str):
    """The `cpu` preset's config of `task` on the synthetic files, caching under `work`."""
    if task == "translate":
        from train import translate

        return translate.make_config(
            "transformer",
            "cpu",
            train_src=paths["train.xx"],
            train_tgt=paths["train.yy"],
            valid_src=paths["valid.xx"],
            valid_tgt=paths["valid.yy"],
            src_lang="xx",
            tgt_lang="yy",
            cache_dir=os.path.join(work, "cache"),
            tokenizer_dir=os.path.join(work, "tokenizer"),
        )
    from train import lm

    return lm.config_for_data(
        "text",
        "cpu",
        train_text=paths["lm.train"],
        valid_text=paths["lm.valid"],
        cache_dir=os.path.join(work, "cache"),
    )


def prepare(task: str, paths: dict[str, str], work: str, log: Callable = print):
    """-> (config, the task's data): `Task.prepare` of the cpu preset on one CPU device."""
    import jax

    from train.core.parallel import DataParallel

    config = make_config(task, paths, work)
    module = __import__(f"train.{task}.task", fromlist=["TASK"])
    dp = DataParallel("jit", devices=jax.devices("cpu")[:1])
    os.makedirs(os.path.join(work, "run"), exist_ok=True)
    return config, module.TASK.prepare(config, os.path.join(work, "run"), dp, log)


def prepare_in_subprocess(task: str, paths: dict[str, str], work: str) -> dict[str, Any]:
    """`prepare` in a fresh Python process -> wall seconds, its peak RSS in bytes (Linux
    reports ru_maxrss in KiB), and the lines it logged."""
    spec = json.dumps({"task": task, "paths": paths, "work": work})
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    with tempfile.TemporaryFile("w+") as out:
        start = time.monotonic()
        proc = subprocess.Popen(
            # Not `-m train.bench.data`: the package imports this module before running it.
            [sys.executable, "-c", CHILD, spec],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )
        _, status, usage = os.wait4(proc.pid, 0)
        seconds = time.monotonic() - start
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        lines = out.read().splitlines()
    if proc.returncode != 0:
        raise RuntimeError(
            f"preparing {task} failed ({proc.returncode}):\n" + "\n".join(lines[-30:])
        )
    reported = [json.loads(line[len(PEAK) :]) for line in lines if line.startswith(PEAK)]
    peak = reported[-1] if reported and reported[-1] else usage.ru_maxrss * 1024  # KiB
    return {
        "seconds": seconds,
        "peak_rss_bytes": peak,
        "log": [line for line in lines if not line.startswith(PEAK)],
    }


def own_peak_rss() -> int | None:
    """This process's peak resident set (VmHWM) in bytes; None without /proc."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def loader_rate(batches, seconds: float) -> dict[str, float]:
    """Batches drawn from the iterator `batches` for about `seconds` -> batches/s, positions
    per second (every array element of a batch: src or inputs, with padding) and real
    tokens/s (source plus target tokens that are not padding, or inputs for the LM)."""
    count = positions = real = 0
    start = time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds or count == 0:
        batch = next(batches)
        count += 1
        if "src" in batch:
            positions += batch["src"].size + batch["tgt_out"].size
            real += int(np.count_nonzero(batch["src"]) + np.count_nonzero(batch["tgt_out"]))
        else:
            positions += batch["inputs"].size
            real += batch["inputs"].size
    return {
        "batches": count,
        "seconds": elapsed,
        "batches_per_s": count / elapsed,
        "positions_per_s": positions / elapsed,
        "tokens_per_s": real / elapsed,
    }


def step_seconds(task: str, config, batch, steps: int) -> float:
    """The median seconds of the `cpu` preset's train step of `task` on `batch` (after one
    compiling call), on one CPU device."""
    import jax

    from train.core.parallel import DataParallel
    from train.core.state import TrainState
    from transformer_jax.optim import make_optimizer

    module = __import__(f"train.{task}.task", fromlist=["TASK"])
    t = module.TASK
    model = t.build_model(config)
    tx, _ = make_optimizer(t.optimizer_config(config))

    def create(seed):
        params, extra = t.init_params(config, model, jax.random.PRNGKey(seed))
        return TrainState.create(params=params, tx=tx, rng=jax.random.PRNGKey(1), extra=extra)

    dp = DataParallel("jit", devices=jax.devices("cpu")[:1])
    state = dp.init_state(create, 0)
    step = dp.compile_train_step(t.loss_fn(config, model), state)
    placed = dp.put_batch(batch)
    times = []
    for i in range(steps + 1):
        start = time.perf_counter()
        state, metrics = step(state, placed)
        jax.block_until_ready(metrics)
        if i:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def data_bench(
    *,
    cache_dir: str,
    pairs: int,
    lm_tokens: int,
    loader_seconds: float = 5.0,
    step_steps: int = 5,
    log: Callable = print,
) -> dict[str, Any]:
    """The section's figures (see the module docstring) for translation and the LM."""
    paths = write_corpus(
        os.path.join(cache_dir, f"data-{pairs}-pairs-{lm_tokens}-tokens"),
        pairs=pairs,
        lm_tokens=lm_tokens,
        log=log,
    )
    out: dict[str, Any] = {"pairs": pairs, "lm_tokens": lm_tokens, "goals": GOALS}
    os.makedirs(cache_dir, exist_ok=True)
    for task in ("translate", "lm"):
        work = tempfile.mkdtemp(prefix=f"bench-data-{task}-", dir=cache_dir)
        try:
            log(f"[bench] data: preparing {task} in a fresh process")
            first = prepare_in_subprocess(task, paths, work)
            again = prepare_in_subprocess(task, paths, work)
            config, data = prepare(task, paths, work, log=lambda _: None)
            loader = loader_rate(data.batches(0), loader_seconds)
            batch = next(data.batches(0))
            step = step_seconds(task, config, batch, step_steps)
            out[task] = {
                "prepare": first,
                "reuse": again,
                "loader": loader,
                "step_s": step,
                "loader_over_step": step * loader["batches_per_s"],
                "batch_shape": list(batch["src" if task == "translate" else "inputs"].shape),
            }
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return out


def main(argv: list[str]) -> int:
    """The child process of `prepare_in_subprocess`: argv[0] is its JSON spec."""
    spec = json.loads(argv[0])
    prepare(spec["task"], spec["paths"], spec["work"], log=lambda m: print(m, flush=True))
    print(PEAK + json.dumps(own_peak_rss()), flush=True)
    return 0
