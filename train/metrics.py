"""Metrics: summing per-step device metrics into log lines, and W/metrics.jsonl.

Each line of metrics.jsonl is one JSON object: {"step", "split", ...}. split 'train' lines carry
loss (the training objective per token, label-smoothed for translation), nll and ppl (the
unsmoothed per-token negative log-likelihood and its exp), lr, grad_norm, tokens_per_sec
(real, non-pad target tokens), elapsed (training seconds, summed over resumed runs); 'validation' / test-split lines carry the
evaluation figures (loss, ppl or bpc, bleu).
"""
from __future__ import annotations

import json
import math
import os
from typing import Any, Iterable, Mapping

import jax

METRICS_FILE = "metrics.jsonl"


def summarize(sums: Mapping[str, float]) -> dict[str, float]:
    """Summed quantities (loss_sum, n_tokens, optional nll_sum) -> per-token loss, nll (nats)
    and ppl = exp(nll). Without nll_sum the loss is the nll (an unsmoothed objective)."""
    n = max(sums["n_tokens"], 1.0)
    out = {"loss": sums["loss_sum"] / n, "n_tokens": sums["n_tokens"]}
    nll = sums.get("nll_sum", sums["loss_sum"]) / n
    out["nll"] = nll
    out["ppl"] = math.exp(nll) if nll < 700 else math.inf
    return out


def summarize_interval(steps: Iterable[Mapping[str, float]]) -> dict[str, float]:
    """Per-step host metrics of one logging interval -> one line: token-weighted loss / nll /
    ppl over the interval, the lr and grad_norm of its last step."""
    steps = list(steps)
    keys = ("loss_sum", "nll_sum", "n_tokens")
    sums = {k: sum(m[k] for m in steps) for k in keys if k in steps[0]}
    out = summarize(sums)
    for k in ("lr", "grad_norm"):
        if k in steps[-1]:
            out[k] = steps[-1][k]
    return out


def add_sums(a: Mapping[str, Any] | None, b: Mapping[str, Any]) -> dict[str, Any]:
    """Adds two dicts of (device) scalars; a None accumulator starts the sum."""
    return dict(b) if a is None else {k: a[k] + b[k] for k in b}


class MetricsWriter:
    """Appends one JSON object per line to W/metrics.jsonl (process 0 only)."""

    def __init__(self, workdir: str):
        self.path = os.path.join(workdir, METRICS_FILE)
        self.enabled = jax.process_index() == 0
        if self.enabled:
            os.makedirs(workdir, exist_ok=True)

    def write(self, step: int, split: str, values: Mapping[str, Any]) -> dict[str, Any]:
        record = {"step": int(step), "split": split}
        record.update({k: _plain(v) for k, v in values.items()})
        if self.enabled:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")
        return record

    def rewind(self, step: int) -> int:
        """Drops the lines logged after `step` (a run that died past its last checkpoint
        and now resumes from `step` re-logs them). They move to metrics.rewound.jsonl.
        Returns how many moved."""
        if not self.enabled or not os.path.exists(self.path):
            return 0
        records = read_metrics(self.path)
        keep = [r for r in records if r["step"] <= step]
        late = [r for r in records if r["step"] > step]
        if late:
            with open(self.path.replace(".jsonl", ".rewound.jsonl"), "a") as f:
                f.writelines(json.dumps(r) + "\n" for r in late)
            tmp = self.path + ".tmp"
            with open(tmp, "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in keep)
            os.replace(tmp, self.path)
        return len(late)


def read_metrics(path: str) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl (a file path or a workdir)."""
    if os.path.isdir(path):
        path = os.path.join(path, METRICS_FILE)
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _plain(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)  # JSON has no NaN/inf; keep the file strict JSON
    if hasattr(v, "item"):
        return _plain(v.item())
    return v
