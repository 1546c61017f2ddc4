"""Plots written to W/plots/ (matplotlib, Agg backend: no display needed).

  loss.png                 training loss and validation loss (and perplexity) against step
  attention_<kind>.png     the attention of one translated sentence, a grid of layer x head
                           for each kind: encoder self-, decoder self- and cross-attention
  positional_encoding.png  the position vectors the Transformer adds to its embeddings
"""
from __future__ import annotations

import os
import re
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from train.core.metrics import read_metrics

PLOTS_DIR = "plots"


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _save(fig, path: str) -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    _pyplot().close(fig)
    return path


def plot_losses(records: Sequence[Mapping[str, Any]], path: str, *,
                metric: str = "ppl") -> str:
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


def plot_attention_grid(weights: np.ndarray, path: str, *, title: str,
                        query_labels: Sequence[str], key_labels: Sequence[str]) -> str:
    """weights [layers, heads, T, S] -> one heat map per (layer, head), query rows."""
    plt = _pyplot()
    n_layers, n_heads, t, s = weights.shape
    cell = max(2.0, 0.22 * max(t, s))
    fig, axes = plt.subplots(n_layers, n_heads, figsize=(cell * n_heads, cell * n_layers),
                             squeeze=False, constrained_layout=True)
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
def _path_name(path) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))))
                    for k in path)


def _kind(name: str) -> str:
    low = name.lower()
    if "encoder" in low and "cross" not in low:
        return "encoder_self"
    if "decoder" in low and "self" in low:
        return "decoder_self"
    # cross-attention, and a baseline's only attention (its 'weights'): over the source
    return "cross"


def _layer_index(name: str) -> int:
    found = re.findall(r"layers?_(\d+)", name)
    return int(found[-1]) if found else 0


def _as_layers_heads(w: np.ndarray, *, sown: bool) -> np.ndarray | None:
    """One sentence's weights -> [layers, heads, T, S]. Sown per attention layer:
    [B, H, T, S]. From an `attention_maps` method: [B, T, S] (one map), [B, L, T, S] (one
    single-head map per layer, ConvS2S) or [B, L, H, T, S]."""
    if w.ndim == 3:
        return w[0][None, None]
    if w.ndim == 4:
        return w[0][None] if sown else w[0][:, None]
    if w.ndim == 5:
        return w[0]
    return None


def attention_maps(model, params, src: jax.Array, tgt: jax.Array) -> dict[str, np.ndarray]:
    """Teacher-forced attention of one sentence pair, {kind: [rows, heads, T, S]} with kind in
    encoder_self / decoder_self / cross.

    Reads the model's `attention_maps(src, tgt)` method when it has one (the RNN and ConvS2S
    baselines), else the 'attention_weights' a model sows into 'intermediates' (the
    Transformer's attention layers do when that collection is mutable). src [1, S], tgt [1, T]
    decoder input. Empty if the model exposes none.
    """
    sown = not hasattr(model, "attention_maps")
    if not sown:
        run = lambda p, s, t: model.apply({"params": p}, s, t,  # noqa: E731
                                          method="attention_maps")
    else:
        run = lambda p, s, t: model.apply({"params": p}, s, t,  # noqa: E731
                                          mutable=["intermediates"])[1].get("intermediates", {})
    tree = jax.device_get(jax.jit(run)(params, src, tgt))
    found: dict[str, list[tuple[int, np.ndarray]]] = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        name = _path_name(path)
        if not re.search(r"attention|weights|attn", name.lower()):
            continue
        w = _as_layers_heads(np.asarray(leaf, np.float32), sown=sown)
        if w is not None:
            found.setdefault(_kind(name), []).append((_layer_index(name), w))
    return {kind: np.concatenate([w for _, w in sorted(ws, key=lambda p: p[0])])
            for kind, ws in found.items()}


def make_translation_plots(workdir: str, model, params, tokenizer, *, source: str,
                           hypothesis: str) -> list[str]:
    """Loss curves, the attention maps of `source` -> `hypothesis`, positional encodings."""
    out_dir = os.path.join(workdir, PLOTS_DIR)
    made = [plot_losses(read_metrics(workdir), os.path.join(out_dir, "loss.png"))]
    src_ids = tokenizer.encode(source) + [tokenizer.eos_id]
    tgt_ids = [tokenizer.bos_id] + tokenizer.encode(hypothesis)
    src_labels = [tokenizer.id_to_piece(i) for i in src_ids]
    tgt_labels = [tokenizer.id_to_piece(i) for i in tgt_ids]
    maps = attention_maps(model, params, jnp.asarray([src_ids], jnp.int32),
                          jnp.asarray([tgt_ids], jnp.int32))
    titles = {"encoder_self": "encoder self-attention", "decoder_self":
              "decoder self-attention", "cross": "decoder-encoder (cross) attention"}
    labels = {"encoder_self": (src_labels, src_labels), "decoder_self": (tgt_labels, tgt_labels),
              "cross": (tgt_labels, src_labels)}
    for kind, weights in maps.items():
        q, k = labels[kind]
        made.append(plot_attention_grid(
            weights, os.path.join(out_dir, f"attention_{kind}.png"),
            title=f"{titles[kind]}: {source!r} -> {hypothesis!r}", query_labels=q,
            key_labels=k))
    table = positional_table(model, params, length=max(len(src_ids), len(tgt_ids), 64))
    if table is not None:
        made.append(plot_positional(table, os.path.join(out_dir, "positional_encoding.png")))
    return made


def positional_table(model, params, *, length: int) -> np.ndarray | None:
    """[length, D] position vectors of a Transformer (sinusoids or its learned table)."""
    config = model.config
    if not hasattr(config, "positional"):
        return None
    from transformer_jax.positional import PositionalEncoding
    if config.positional == "learned":
        length = min(length, config.max_len)
    table = PositionalEncoding(config).apply({"params": params.get("positions", {})},
                                             jnp.arange(length))
    return np.asarray(table)
