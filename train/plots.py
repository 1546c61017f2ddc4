"""Plots written to W/plots/ (matplotlib, Agg backend: no display needed).

  loss.png                 training loss and validation loss (and perplexity) against step
  attention_<kind>.png     the attention of one translated sentence, a grid of layer x head
                           for each kind: encoder self-, decoder self- and cross-attention
  positional_encoding.png  the position vectors the Transformer adds to its embeddings

and the Annotated Transformer's figures (`make_annotated_transformer_plots`):

  masks.png                the subsequent (causal) mask; for one batch the source padding mask
                           and the combined (causal & padding) decoder mask of one sentence
  lr_schedule.png          learning rate against step for one or more schedules
  label_smoothing.png      the label-smoothed target distribution of a few targets

Those three return a `Drawn`: the file, the arrays drawn and where each value landed in the PNG
(row, column), so a test can read the image back and check what it shows.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from train.core.metrics import read_metrics
from transformer_jax.attention import combine_masks, make_causal_mask, make_padding_mask
from transformer_jax.losses import smoothed_target_distribution
from transformer_jax.positional import PositionalEncoding

PLOTS_DIR = "plots"


def _pyplot():
    # Lazy: matplotlib is slow to import, and only the end of a run draws.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: str) -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    _pyplot().close(fig)
    return path


def plot_losses(records: Sequence[Mapping[str, Any]], path: str, *, metric: str = "ppl") -> str:
    """Train and evaluation loss against step; a second panel with `metric` (ppl or bpc)."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    splits = sorted({r["split"] for r in records}, key=lambda s: (s != "train", s))
    for split in splits:
        rows = [r for r in records if r["split"] == split and isinstance(r.get("loss"), float)]
        if not rows:
            continue
        steps = [r["step"] for r in rows]
        style = "-" if split == "train" else "o-"
        axes[0].plot(steps, [r["loss"] for r in rows], style, label=split, markersize=3)
        if all(isinstance(r.get(metric), float) for r in rows):
            axes[1].plot(steps, [r[metric] for r in rows], style, label=split, markersize=3)
    axes[0].set(xlabel="step", ylabel="loss (nats / token)", title="loss")
    axes[1].set(xlabel="step", ylabel=metric, title=metric, yscale="log")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend()
    return _save(fig, path)


def plot_attention_grid(
    weights: np.ndarray,
    path: str,
    *,
    title: str,
    query_labels: Sequence[str],
    key_labels: Sequence[str],
) -> str:
    """weights [layers, heads, T, S] -> one heat map per (layer, head), query rows."""
    plt = _pyplot()
    n_layers, n_heads, t, s = weights.shape
    cell = max(2.0, 0.22 * max(t, s))
    fig, axes = plt.subplots(
        n_layers,
        n_heads,
        figsize=(cell * n_heads, cell * n_layers),
        squeeze=False,
        constrained_layout=True,
    )
    for layer in range(n_layers):
        for head in range(n_heads):
            ax = axes[layer, head]
            ax.imshow(weights[layer, head], vmin=0.0, vmax=1.0, cmap="viridis")
            ax.set_title(f"layer {layer} head {head}", fontsize=8)
            ax.set_xticks(range(s))
            ax.set_yticks(range(t))
            ax.set_xticklabels(key_labels, rotation=90, fontsize=6)
            ax.set_yticklabels(query_labels if head == 0 else [], fontsize=6)
    fig.suptitle(title)
    return _save(fig, path)


def plot_positional(table: np.ndarray, path: str) -> str:
    """table [T, D]: one row per position."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(10, 4))
    im = ax.imshow(table, aspect="auto", cmap="RdBu", vmin=-1.0, vmax=1.0)
    ax.set(xlabel="dimension", ylabel="position", title="positional encoding")
    fig.colorbar(im, ax=ax)
    return _save(fig, path)


# ------------------------------------------------------------------------ attention maps
def attention_maps(model, params, src: jax.Array, tgt: jax.Array) -> dict[str, np.ndarray]:
    """Teacher-forced attention of one sentence pair through the attention-map protocol:
    {kind: [layers, heads, T, S]} float32, kind in encoder_self / decoder_self / cross.

    src [1, S], tgt [1, T] decoder input. Every translation model answers
    `attention_maps(src, tgt) -> {kind: [B, layers, H, T, S]}`; empty for a model without
    attention (GRUSeq2Seq).
    """
    run = jax.jit(lambda p, s, t: model.apply({"params": p}, s, t, method="attention_maps"))
    return {
        kind: np.asarray(w[0], np.float32)
        for kind, w in jax.device_get(run(params, src, tgt)).items()
    }


def make_translation_plots(
    workdir: str, model, params, tokenizer, *, source: str, hypothesis: str
) -> list[str]:
    """Loss curves, the attention maps of `source` -> `hypothesis`, positional encodings."""
    out_dir = os.path.join(workdir, PLOTS_DIR)
    made = [plot_losses(read_metrics(workdir), os.path.join(out_dir, "loss.png"))]
    src_ids = tokenizer.encode_batch([source])[0] + [tokenizer.eos_id]
    tgt_ids = [model.config.bos_id] + tokenizer.encode_targets([hypothesis])[0]
    src_labels = [tokenizer.id_to_piece(i) for i in src_ids]
    tgt_labels = [tokenizer.id_to_piece(i) for i in tgt_ids]
    maps = attention_maps(
        model, params, jnp.asarray([src_ids], jnp.int32), jnp.asarray([tgt_ids], jnp.int32)
    )
    titles = {
        "encoder_self": "encoder self-attention",
        "decoder_self": "decoder self-attention",
        "cross": "decoder-encoder (cross) attention",
    }
    labels = {
        "encoder_self": (src_labels, src_labels),
        "decoder_self": (tgt_labels, tgt_labels),
        "cross": (tgt_labels, src_labels),
    }
    for kind, weights in maps.items():
        q, k = labels[kind]
        made.append(
            plot_attention_grid(
                weights,
                os.path.join(out_dir, f"attention_{kind}.png"),
                title=f"{titles[kind]}: {source!r} -> {hypothesis!r}",
                query_labels=q,
                key_labels=k,
            )
        )
    table = positional_table(model, params, length=max(len(src_ids), len(tgt_ids), 64))
    if table is not None:
        made.append(plot_positional(table, os.path.join(out_dir, "positional_encoding.png")))
    return made


def positional_table(model, params, *, length: int) -> np.ndarray | None:
    """[length, D] position vectors of a Transformer (sinusoids or its learned table)."""
    config = model.config
    if not hasattr(config, "positional"):
        return None
    if config.positional == "learned":
        length = min(length, config.max_len)
    table = PositionalEncoding(config).apply(
        {"params": params.get("positions", {})}, jnp.arange(length)
    )
    return np.asarray(table)


# ------------------------------------------------------------- the Annotated Transformer's
class Drawn(NamedTuple):
    """A saved figure: its path; the arrays drawn, by name; and for each the PNG pixel
    (row, column) where each value was drawn: [..., 2] int, the array's shape then 2 (an image:
    the centre of each cell; a curve: each point)."""

    path: str
    data: dict[str, np.ndarray]
    pixels: dict[str, np.ndarray]


def _to_pixels(fig, ax, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Data coordinates -> PNG (row, column) in the file `_save_drawn` writes."""
    points = ax.transData.transform(np.stack([np.ravel(x), np.ravel(y)], axis=-1))
    height = int(round(fig.get_size_inches()[1] * fig.dpi))
    rows = np.floor(height - points[:, 1]).astype(int)
    cols = np.floor(points[:, 0]).astype(int)
    return np.stack([rows, cols], axis=-1).reshape(*np.shape(x), 2)


def _image_pixels(fig, ax, shape: tuple[int, int]) -> np.ndarray:
    """[rows, cols, 2] PNG pixel of the centre of each cell of an `imshow` (cell (i, j) is at
    data x = j, y = i)."""
    i, j = np.meshgrid(np.arange(shape[0]), np.arange(shape[1]), indexing="ij")
    return _to_pixels(fig, ax, j, i)


def _save_drawn(
    fig, path: str, data: dict[str, np.ndarray], locate: Callable[[], dict[str, np.ndarray]]
) -> Drawn:
    """Lays the figure out, finds the pixels, saves at the figure's own dpi and size (no
    tight bounding box, which would move them)."""
    fig.canvas.draw()
    pixels = locate()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=fig.dpi)
    _pyplot().close(fig)
    return Drawn(path, data, pixels)


def decoder_masks(src: np.ndarray, tgt_in: np.ndarray, *, pad_id: int) -> dict[str, np.ndarray]:
    """The masks of one batch as the models build them (True = attend):
    'subsequent' [T, T], 'padding' [B, S] (the source keys), 'decoder' [T, T] (causal & target
    padding) of the sentence with the most padding."""
    t = tgt_in.shape[1]
    row = int(np.argmax((tgt_in == pad_id).sum(-1)))
    combined = combine_masks(make_causal_mask(t), make_padding_mask(tgt_in, pad_id))
    return {
        "subsequent": np.asarray(make_causal_mask(t)[0, 0]),
        "padding": np.asarray(make_padding_mask(src, pad_id)[:, 0, 0]),
        "decoder": np.asarray(combined[row, 0]),
    }


def plot_masks(masks: Mapping[str, np.ndarray], path: str) -> Drawn:
    """One panel per 2-D boolean mask: white = attend (True), black = masked."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(masks), figsize=(4 * len(masks), 4), dpi=100, squeeze=False)
    data = {name: np.asarray(m, bool) for name, m in masks.items()}
    for ax, (name, mask) in zip(axes[0], data.items()):
        ax.imshow(mask.astype(np.float32), cmap="gray", vmin=0.0, vmax=1.0, interpolation="nearest")
        ax.set(
            title=f"{name} mask",
            xlabel="key position",
            ylabel="sentence" if mask.shape[0] != mask.shape[1] else "query position",
        )
    return _save_drawn(
        fig,
        path,
        data,
        lambda: {
            name: _image_pixels(fig, ax, mask.shape)
            for ax, (name, mask) in zip(axes[0], data.items())
        },
    )


def plot_lr_schedule(schedules: Mapping[str, Callable], steps: int, path: str) -> Drawn:
    """Learning rate against step 0..steps-1, one curve per schedule (a callable step -> rate,
    e.g. an optax schedule; called on the array of steps)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4), dpi=100)
    x = np.arange(steps)
    # A constant schedule (optax.constant_schedule) returns one scalar whatever the steps.
    data = {
        name: np.broadcast_to(np.asarray(fn(jnp.asarray(x)), np.float64), x.shape)
        for name, fn in schedules.items()
    }
    for name, rate in data.items():
        ax.plot(x, rate, label=name, linewidth=1.5)
    ax.set(xlabel="step", ylabel="learning rate", title="learning-rate schedule")
    ax.legend()
    ax.grid(alpha=0.3)
    return _save_drawn(
        fig, path, data, lambda: {name: _to_pixels(fig, ax, x, rate) for name, rate in data.items()}
    )


def plot_label_smoothing(
    path: str, *, smoothing: float, vocab_size: int, targets: Sequence[int], pad_id: int = 0
) -> Drawn:
    """The target distribution q of `label_smoothed_cross_entropy` for each target (a row
    each, gray: 0 black, 1 white), as the Annotated Transformer draws it."""
    plt = _pyplot()
    q = np.asarray(
        smoothed_target_distribution(
            jnp.asarray(targets), vocab_size, smoothing=smoothing, pad_id=pad_id
        )
    )
    fig, ax = plt.subplots(figsize=(max(4.0, 0.5 * vocab_size), max(3.0, 0.5 * len(q))), dpi=100)
    im = ax.imshow(q, cmap="gray", vmin=0.0, vmax=1.0, interpolation="nearest")
    ax.set(
        xlabel="token id",
        ylabel="target",
        title=f"label smoothing {smoothing}",
        yticks=range(len(q)),
        yticklabels=[str(t) for t in targets],
    )
    fig.colorbar(im, ax=ax)
    return _save_drawn(
        fig,
        path,
        {"target_distribution": q},
        lambda: {"target_distribution": _image_pixels(fig, ax, q.shape)},
    )


def make_annotated_transformer_plots(
    out_dir: str,
    *,
    src: np.ndarray,
    tgt_in: np.ndarray,
    pad_id: int,
    schedules: Mapping[str, Callable],
    steps: int,
    smoothing: float,
    vocab_size: int = 5,
    targets: Sequence[int] = (2, 1, 0, 3, 3),
) -> list[Drawn]:
    """masks.png (for the batch src [B, S], tgt_in [B, T]), lr_schedule.png and
    label_smoothing.png in out_dir. The default targets and vocabulary are the Annotated
    Transformer's example (pad 0 among them)."""
    return [
        plot_masks(
            decoder_masks(np.asarray(src), np.asarray(tgt_in), pad_id=pad_id),
            os.path.join(out_dir, "masks.png"),
        ),
        plot_lr_schedule(schedules, steps, os.path.join(out_dir, "lr_schedule.png")),
        plot_label_smoothing(
            os.path.join(out_dir, "label_smoothing.png"),
            smoothing=smoothing,
            vocab_size=vocab_size,
            targets=targets,
            pad_id=pad_id,
        ),
    ]
