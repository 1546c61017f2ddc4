"""The floor of a CPU training step: its matrix products alone, in jax and in torch.

`cpu_vs_torch` times, beside each training step, a program made of the products that step
runs and nothing else: the same projections, attention products, feed-forward products and
output layer, forward and backward (the input and weight gradients autodiff asks for), chained
as the model chains them, with a random gradient for the logits. Softmax, LayerNorm, the
activation, residual adds, the rel-shift, the loss, the head transposes (the floor reshapes
[N, H K] to [B, T, H, K]: wrong maths, no copy), the embedding lookups and the optimizer are
left out.

What the floor answers: how fast the step could be if everything around its products cost
nothing. Eager PyTorch's whole step over the jax floor bounds the speed ratio the project can
reach on a machine (`benchmarks/cpu_vs_torch_2026-11-28f_amd25/`). Each floor's products are
counted from its
optimized HLO beside the step's (`hlo_products`), so a floor that no longer mirrors its model
shows in the report.

A random logits gradient, not the gradient of a sum: with a constant one XLA turns the output
table's gradient into a row sum, one product fewer. The logits are returned: unread, XLA drops
their product.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax.config import TransformerConfig
from transformer_jax.layers import dense_product, tied_logits
from xl_jax.config import TransformerXLConfig

_SEED = 0


@dataclasses.dataclass(frozen=True)
class Floor:
    """One model's floor at one shape.

    jax_step, torch_step: run one floor step to its end (forward and backward products).
    hlo: the jax floor's optimized HLO (for `hlo_products`).
    """

    jax_step: Callable[[], None]
    torch_step: Callable[[], None]
    hlo: str


_DEF = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*\w+\[([\d,]*)\]")
_DOT = re.compile(r"\bdot\(%([\w.\-]+),\s*%([\w.\-]+)\)")
_LHS_CONTRACTING = re.compile(r"lhs_contracting_dims=\{([\d,]*)\}")


def hlo_products(hlo_text: str) -> tuple[int, float]:
    """The `dot` instructions of an HLO module (fused computations included) -> (how many,
    GFLOP): 2 x the output's elements x the contracted size each."""
    shapes: dict[str, tuple[int, ...]] = {}
    dots = []
    for line in hlo_text.splitlines():
        m = _DEF.match(line)
        if not m:
            continue
        shapes[m.group(1)] = tuple(int(d) for d in m.group(2).split(",") if d)
        dot = _DOT.search(line)
        if dot:
            dots.append((shapes[m.group(1)], dot.group(1), _LHS_CONTRACTING.search(line)))
    gflop = 0.0
    for out, lhs, contracting in dots:
        dims = [int(d) for d in contracting.group(1).split(",") if d] if contracting else []
        gflop += 2 * math.prod(out) * math.prod(shapes[lhs][d] for d in dims) / 1e9
    return len(dots), gflop


def _weights(shapes: dict[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(_SEED)
    return {k: rng.normal(0.0, 0.05, s).astype(np.float32) for k, s in shapes.items()}


def _build(shapes, inputs, n_grads, j_logits, t_logits, n_rows, vocab) -> Floor:
    """Floor from the products' weights, inputs, how many of the inputs get a gradient (they
    come from embeddings), and the two logits functions (params, *inputs) -> [n_rows, vocab]."""
    import torch  # optional, a test-only dependency: imported where the comparison runs

    weights = _weights(shapes)
    rng = np.random.default_rng(_SEED + 1)
    xs = [rng.normal(0.0, 1.0, s).astype(np.float32) for s in inputs]
    ct = rng.normal(0.0, 1e-3, (n_rows, vocab)).astype(np.float32)

    def backward(params, inputs, ct):
        logits, vjp = jax.vjp(j_logits, params, *inputs)
        return logits, vjp(ct)[: 1 + n_grads]

    program = jax.jit(backward)
    j_args = ({k: jnp.asarray(w) for k, w in weights.items()}, [jnp.asarray(x) for x in xs])
    j_ct = jnp.asarray(ct)
    hlo = program.lower(*j_args, j_ct).compile().as_text()

    t_params = {k: torch.tensor(w, requires_grad=True) for k, w in weights.items()}
    t_inputs = [torch.tensor(x, requires_grad=i < n_grads) for i, x in enumerate(xs)]
    t_ct = torch.from_numpy(ct)

    def jax_step() -> None:
        jax.block_until_ready(program(*j_args, j_ct))

    def torch_step() -> None:
        for w in (*t_params.values(), *t_inputs):
            w.grad = None
        t_logits(t_params, *t_inputs).backward(t_ct)

    return Floor(jax_step, torch_step, hlo)


def transformer_floor(cfg: TransformerConfig, b: int, t: int) -> Floor:
    """The translation Transformer's step at b sentences of t tokens (sources and targets)."""
    if cfg.quantize is not None:
        raise ValueError(f"products floor: an int8 model ({cfg.quantize!r}) is not mirrored")
    d, h, f, v, n = cfg.d_model, cfg.n_heads, cfg.d_ff, cfg.tgt_vocab_size, b * t
    k = d // h
    shapes = {"out": (v, d) if cfg.tie_output else (d, v)}
    for i in range(cfg.n_encoder_layers):
        shapes |= {f"e{i}s{p}": (d, d) for p in "qkvo"} | {f"e{i}f1": (d, f), f"e{i}f2": (f, d)}
    for i in range(cfg.n_decoder_layers):
        shapes |= {f"d{i}{a}{p}": (d, d) for a in "sc" for p in "qkvo"}
        shapes |= {f"d{i}f1": (d, f), f"d{i}f2": (f, d)}

    def j_attention(w, pre, xq, xkv):
        # dense_product: the model's projections, with its kernel-gradient form.
        q, kk, vv = (dense_product(x, w[pre + p]) for x, p in ((xq, "q"), (xkv, "k"), (xkv, "v")))
        q, kk, vv = (x.reshape(b, t, h, k) for x in (q, kk, vv))
        scores = jnp.einsum("bthk,bshk->bhts", q, kk)  # the attention core's einsums
        mixed = jnp.einsum("bhts,bshk->bthk", scores, vv).reshape(n, d)
        return dense_product(mixed, w[pre + "o"])

    def j_logits(w, x, y):  # [N, D] each
        for i in range(cfg.n_encoder_layers):
            x = j_attention(w, f"e{i}s", x, x)
            x = dense_product(dense_product(x, w[f"e{i}f1"]), w[f"e{i}f2"])
        for i in range(cfg.n_decoder_layers):
            y = j_attention(w, f"d{i}s", y, y)
            y = j_attention(w, f"d{i}c", y, x)
            y = dense_product(dense_product(y, w[f"d{i}f1"]), w[f"d{i}f2"])
        return tied_logits(y, w["out"]) if cfg.tie_output else dense_product(y, w["out"])

    def t_attention(w, pre, xq, xkv):
        q, kk, vv = (
            (x @ w[pre + p]).view(b, t, h, k) for x, p in ((xq, "q"), (xkv, "k"), (xkv, "v"))
        )
        q, kk, vv = (x.transpose(1, 2) for x in (q, kk, vv))  # views
        mixed = ((q @ kk.transpose(-1, -2)) @ vv).transpose(1, 2).reshape(n, d)
        return mixed @ w[pre + "o"]

    def t_logits(w, x, y):
        for i in range(cfg.n_encoder_layers):
            x = t_attention(w, f"e{i}s", x, x)
            x = (x @ w[f"e{i}f1"]) @ w[f"e{i}f2"]
        for i in range(cfg.n_decoder_layers):
            y = t_attention(w, f"d{i}s", y, y)
            y = t_attention(w, f"d{i}c", y, x)
            y = (y @ w[f"d{i}f1"]) @ w[f"d{i}f2"]
        return y @ (w["out"].T if cfg.tie_output else w["out"])

    # Both inputs get a gradient: they come from the embeddings, which train.
    return _build(shapes, [(n, d), (n, d)], 2, j_logits, t_logits, n, v)


def xl_floor(cfg: TransformerXLConfig, b: int) -> Floor:
    """The Transformer-XL's step at b sequences of a `tgt_len` segment, memory `mem_len`."""
    if cfg.cutoffs or cfg.d_embed != cfg.d_model:
        raise ValueError(
            "products floor: the adaptive softmax and embedding (cutoffs "
            f"{cfg.cutoffs}, d_embed {cfg.d_embed} against d_model {cfg.d_model}) are not mirrored"
        )
    d, h, k, v, t, m = (
        cfg.d_model,
        cfg.n_heads,
        cfg.d_head,
        cfg.vocab_size,
        cfg.tgt_len,
        cfg.mem_len,
    )
    s = t + m
    shapes = {"out": (v, d)}
    for i in range(cfg.n_layers):
        shapes |= {f"l{i}qkv": (d, 3 * h * k), f"l{i}r": (d, h * k), f"l{i}o": (h * k, d)}
        shapes |= {f"l{i}f1": (d, cfg.d_inner), f"l{i}f2": (cfg.d_inner, d)}
    # The positional embeddings are sinusoids in the model: a constant, no gradient.
    pos = np.random.default_rng(_SEED + 2).normal(0.0, 1.0, (s, d)).astype(np.float32)
    j_pos = jnp.asarray(pos)

    def j_logits(w, x, memory):  # [B, T, D], [L, B, M, D]
        for i in range(cfg.n_layers):
            cat = jnp.concatenate([memory[i], x], axis=1)  # [B, S, D], as the model's layer
            qkv = (cat @ w[f"l{i}qkv"]).reshape(b, s, 3, h, k)
            q, kk, vv = qkv[:, -t:, 0], qkv[:, :, 1], qkv[:, :, 2]
            r = (j_pos @ w[f"l{i}r"]).reshape(s, h, k)
            scores = jnp.einsum("bthk,bshk->bhts", q, kk) + jnp.einsum("bthk,shk->bhts", q, r)
            mixed = jnp.einsum("bhts,bshk->bthk", scores, vv).reshape(b, t, h * k)
            x = ((mixed @ w[f"l{i}o"]) @ w[f"l{i}f1"]) @ w[f"l{i}f2"]
        return tied_logits(x.reshape(b * t, d), w["out"])

    def t_logits(w, x, memory):
        import torch  # optional, a test-only dependency: imported where the comparison runs

        t_pos = torch.from_numpy(pos)
        for i in range(cfg.n_layers):
            cat = torch.cat([memory[i], x], dim=1)
            qkv = (cat @ w[f"l{i}qkv"]).view(b, s, 3, h, k)
            q, kk, vv = (qkv[:, :, j].transpose(1, 2) for j in range(3))  # [B, H, S, K]
            q = q[:, :, -t:]
            r = (t_pos @ w[f"l{i}r"]).view(s, h, k).permute(1, 2, 0)  # [H, K, S]
            scores = q @ kk.transpose(-1, -2) + q @ r
            mixed = (scores @ vv).transpose(1, 2).reshape(b, t, h * k)
            x = ((mixed @ w[f"l{i}o"]) @ w[f"l{i}f1"]) @ w[f"l{i}f2"]
        return x.reshape(b * t, d) @ w["out"].T

    # The segment's input gets a gradient (the embedding's); the memory is a constant.
    return _build(shapes, [(b, t, d), (cfg.n_layers, b, m, d)], 1, j_logits, t_logits, b * t, v)
