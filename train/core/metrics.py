"""Metrics: summing per-step device metrics into log lines, W/metrics.jsonl and TensorBoard.

Each line of metrics.jsonl is one JSON object: {"step", "split", ...}. split 'train' lines carry
loss (the training objective per token, label-smoothed for translation), nll and ppl (the unsmoothed
per-token negative log-likelihood and its exp), lr, grad_norm, tokens_per_sec (real, non-pad target
tokens), elapsed (training seconds, summed over resumed runs); 'validation' / test-split lines carry
the evaluation figures (loss, ppl or bpc, bleu).
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Iterable, Mapping
from typing import Any

import jax

from train.core.workdir import local_dir

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"


def _tensorboardx():
    """tensorboardX, imported when a run first writes to TensorBoard (only process 0 does),
    and without PyTorch: its writer imports torch whenever torch is installed, only to accept
    torch tensors, which no run logs. That import was more than a second of each run's
    start-up. A process that has imported torch already keeps it, and torch stays importable
    afterwards."""
    if "torch" in sys.modules:
        import tensorboardX.summary  # noqa: PLC0415

        return tensorboardX
    sys.modules["torch"] = None  # `import torch` raises ImportError, which tensorboardX takes
    try:
        import tensorboardX.summary  # noqa: PLC0415
    finally:
        del sys.modules["torch"]
    return tensorboardX


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
    """Appends one JSON object per line to W/metrics.jsonl and the same scalars to TensorBoard
    event files in W/tensorboard/ (process 0 only).

    Lines are written whole (one write call of a complete line, then flush), so a kill
    mid-write leaves at most one partial last line, which `read_metrics` skips and `rewind`
    removes. TensorBoard events cannot be deleted; a resumed run's writer starts with
    `purge_step`, which tells TensorBoard to drop the events at and after the resumed step
    from the earlier files, so the curves show each step once.
    """

    def __init__(self, workdir: str):
        workdir = local_dir(workdir)  # a remote W: its mirror, pushed with each checkpoint
        self.path = os.path.join(workdir, METRICS_FILE)
        self.tensorboard_dir = os.path.join(workdir, TENSORBOARD_DIR)
        self.enabled = jax.process_index() == 0
        self._board = None
        self._purge_step: int | None = None
        if self.enabled:
            os.makedirs(workdir, exist_ok=True)

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def write(self, step: int, split: str, values: Mapping[str, Any]) -> dict[str, Any]:
        record = {"step": int(step), "split": split}
        record.update({k: _plain(v) for k, v in values.items()})
        if self.enabled:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")
            self._scalars(record)
        return record

    def write_final(self, step: int, split: str, values: Mapping[str, Any]) -> dict[str, Any]:
        """`write`, replacing a line of the same step and split (evaluating a finished run
        again gives one line, not two)."""
        if self.enabled:
            records = read_metrics(self.path)
            others = [r for r in records if not (r["step"] == step and r["split"] == split)]
            if len(others) < len(records):
                self._rewrite(others)
        return self.write(step, split, values)

    def hparams(self, config: Mapping[str, Any]) -> None:
        """The run's config as TensorBoard hyperparameters (flattened, dotted names)."""
        if not self.enabled:
            return
        hparams = _tensorboardx().summary.hparams
        flat = {
            k: v if isinstance(v, (bool, int, float, str)) else str(v)
            for k, v in _flatten(config).items()
        }
        board = self._writer()
        for event in hparams(flat, {"validation/loss": 0.0}):
            board.file_writer.add_summary(event)
        board.flush()

    def rewind(self, step: int) -> int:
        """Drops the lines logged after `step` (a run that died past its last checkpoint
        and now resumes from `step` re-logs them), and a partial last line. They move to
        metrics.rewound.jsonl. Returns how many moved."""
        if not self.enabled:
            return 0
        self._purge_step = step + 1
        if not os.path.exists(self.path):
            return 0
        records = read_metrics(self.path)
        keep = [r for r in records if r["step"] <= step]
        late = [r for r in records if r["step"] > step]
        if late:
            with open(self.path.replace(".jsonl", ".rewound.jsonl"), "a") as f:
                f.writelines(json.dumps(r) + "\n" for r in late)
        if late or _has_partial_line(self.path):
            self._rewrite(keep)
        return len(late)

    def close(self) -> None:
        if self._board is not None:
            self._board.close()
            self._board = None

    def _rewrite(self, records: Iterable[Mapping[str, Any]]) -> None:
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
        os.replace(tmp, self.path)

    def _writer(self):
        if self._board is None:
            self._board = _tensorboardx().SummaryWriter(
                self.tensorboard_dir, purge_step=self._purge_step, flush_secs=30
            )
        return self._board

    def _scalars(self, record: Mapping[str, Any]) -> None:
        board = self._writer()
        for key, value in record.items():
            if (
                key not in ("step", "split")
                and isinstance(value, (int, float))
                and not isinstance(value, bool)
            ):
                board.add_scalar(f"{record['split']}/{key}", value, record["step"])
        board.flush()


def read_metrics(path: str) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl (a file path or a workdir)."""
    path = local_dir(path)
    if os.path.isdir(path):
        path = os.path.join(path, METRICS_FILE)
    if not os.path.exists(path):
        return []
    records = []
    with open(path) as f:
        lines = f.read().split("\n")
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as e:
            if number == len(lines):  # a partial last line: a kill mid-write; rewind drops it
                break
            raise ValueError(
                f"{path}, line {number}: not a JSON record ({e}); delete or fix that line"
            ) from e
    return records


def _has_partial_line(path: str) -> bool:
    with open(path, "rb") as f:
        data = f.read()
    return bool(data) and not data.endswith(b"\n")


def _flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in tree.items():
        if isinstance(v, Mapping):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _plain(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)  # JSON has no NaN/inf; keep the file strict JSON
    if hasattr(v, "item"):
        return _plain(v.item())
    return v
