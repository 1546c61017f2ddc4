"""FLOP counts: analytic formulas for the Transformer and Transformer-XL, and two checks of them.

Shape glossary: B batch, S source length (Transformer) or keys M + T (XL), T target / segment
length, M memory length, D model width, H heads, K head width, F feed-forward width, V vocabulary,
N layers.

Conventions (those of the MFU literature, e.g. PaLM appendix B):
  * Only matrix products count: a [m, k] x [k, n] product is 2 m k n FLOPs. Softmax, LayerNorm,
    dropout, the optimizer update and embedding gathers are left out (a few percent).
  * Attention is counted over the whole score rectangle it computes ([T, S]; the causal half is
    masked, not skipped).
  * Training = forward + backward. The backward of a product needs the gradients of both operands,
    twice the forward, except where one operand is a constant (Transformer-XL's relative position
    embeddings R): then only the weight gradient, once the forward.

Each formula is itemized (`FlopTerm`), so the output shows where the FLOPs are. `executed` counts
every product the implementation runs; `model` leaves out the work it discards (Transformer-XL
projects queries for the memory rows too and throws them away) and the forward products its backward
pass recomputes (remat), and is what MFU divides by. Two independent checks: `jaxpr_matmul_flops`
walks the traced program and adds up its `dot_general`s (the tests require it to equal `executed`
exactly), and `xla_flops` reads XLA's own count (`compiled.cost_analysis()['flops']`), which also
counts elementwise work, so its ratio to the formula is a little above 1.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

try:  # the public home since jax 0.9; jax.core's copy is deprecated
    from jax.extend.core import jaxprs_in_params
except ImportError:  # pragma: no cover - older jax
    from jax.core import jaxprs_in_params

TRANSFORMER_FORMULA = (
    "training FLOPs = 3 x forward; forward = 2 x multiply-adds of: encoder N x [B S (4 D^2 + 2 D F)"
    " + 2 B S^2 D], decoder N x [B T (4 D^2 + 2 D^2 + 2 D F) + 2 B S D^2 + 2 B T^2 D"
    " + 2 B T S D], output B T D V"
)
XL_FORMULA = (
    "training FLOPs = forward + backward (2 x forward; 1 x for R's projection, a constant input);"
    " forward = 2 x multiply-adds of N x [B S 3 D H K (q/k/v over memory + segment; the memory"
    " rows' q discarded) + S D H K (R) + 3 B T S H K ((q+u)k, (q+v)R, weights x v) + B T H K D"
    " + 2 B T D F] + softmax B T (D V + clusters) (+ adaptive projections), S = M + T;"
    " remat adds the recomputed products (the 3 attention ones, or whole layers) to the"
    " executed count, not to the model FLOPs"
)


@dataclasses.dataclass(frozen=True)
class FlopTerm:
    """One family of matrix products.

    forward: FLOPs of the forward pass for the whole step (all layers, the whole batch).
    backward_factor: backward FLOPs / forward FLOPs: 2 (both operands need gradients), 1 (only
      the weight: the other operand is a constant), 0 (nothing trainable).
    needed: False for work the implementation does on top of the model's (products it
      discards, recomputation): left out of model FLOPs, so MFU does not credit it.
    training_only: the products run only in a training step (a rematerialised forward
      recomputed during the backward pass), `forward` FLOPs of them.
    """

    name: str
    forward: float
    backward_factor: float = 2.0
    needed: bool = True
    training_only: bool = False  # recomputation for the backward pass (remat): no forward part

    @property
    def training(self) -> float:
        return self.forward * (1.0 + self.backward_factor)


@dataclasses.dataclass(frozen=True)
class FlopCount:
    """The itemized FLOPs of one step; `tokens` is the number of positions predicted."""

    terms: tuple[FlopTerm, ...]
    tokens: int
    formula: str

    def forward(self, *, executed: bool = False) -> float:
        return float(
            sum(t.forward for t in self.terms if (executed or t.needed) and not t.training_only)
        )

    def training(self, *, executed: bool = False) -> float:
        return float(sum(t.training for t in self.terms if executed or t.needed))

    def per_token(self, *, training: bool = True) -> float:
        return (self.training() if training else self.forward()) / self.tokens

    def as_dict(self) -> dict[str, Any]:
        return {
            "formula": self.formula,
            "tokens": self.tokens,
            "model_forward": self.forward(),
            "model_training": self.training(),
            "executed_forward": self.forward(executed=True),
            "executed_training": self.training(executed=True),
            "model_training_per_token": self.per_token(),
            "terms": {
                t.name: {
                    "forward": 0.0 if t.training_only else t.forward,
                    "training": t.training,
                    "needed": t.needed,
                }
                for t in self.terms
            },
        }


def transformer_flops(config, *, batch: int, src_len: int, tgt_len: int) -> FlopCount:
    """The encoder-decoder Transformer (`transformer_jax.TransformerConfig`) on [B, S] sources
    and [B, T] targets, teacher forced: FLOPs of one step."""
    b, s, t = batch, src_len, tgt_len
    d, f, v = config.d_model, config.d_ff, config.tgt_vocab_size
    ne, nd = config.n_encoder_layers, config.n_decoder_layers
    mm = lambda rows, k, n: 2.0 * rows * k * n  # noqa: E731 - [rows, k] x [k, n]
    terms = (
        FlopTerm("encoder q/k/v/out projections", ne * mm(b * s, d, 4 * d)),
        FlopTerm("encoder attention (scores + mix)", ne * 2 * mm(b * s, d, s)),
        FlopTerm("encoder feed-forward", ne * 2 * mm(b * s, d, f)),
        FlopTerm("decoder self q/k/v/out projections", nd * mm(b * t, d, 4 * d)),
        FlopTerm("decoder self attention (scores + mix)", nd * 2 * mm(b * t, d, t)),
        FlopTerm("decoder cross q/out projections", nd * mm(b * t, d, 2 * d)),
        FlopTerm("decoder cross k/v projections", nd * mm(b * s, d, 2 * d)),
        FlopTerm("decoder cross attention (scores + mix)", nd * 2 * mm(b * t, d, s)),
        FlopTerm("decoder feed-forward", nd * 2 * mm(b * t, d, f)),
        FlopTerm("output projection", mm(b * t, d, v)),
    )
    return FlopCount(terms=terms, tokens=b * t, formula=TRANSFORMER_FORMULA)


def xl_flops(config, *, batch: int, tgt_len: int, mem_len: int) -> FlopCount:
    """Transformer-XL (`xl_jax.TransformerXLConfig`) on a [B, T] segment with M memory slots,
    as `xl_jax.TransformerXL` computes it (q/k/v projected over all S = M + T rows, the softmax
    computed densely over every cluster, the backward pass recomputing what `config.remat`
    does not keep): FLOPs of one step."""
    b, t, m = batch, tgt_len, mem_len
    s = m + t
    d, f, n = config.d_model, config.d_inner, config.n_layers
    hk = config.n_heads * config.d_head
    mm = lambda rows, k, cols: 2.0 * rows * k * cols  # noqa: E731
    attention = FlopTerm("attention: (q+u)k, (q+v)R, weights x v", n * 3 * mm(b * t, hk, s))
    layers = [
        FlopTerm("k/v projections over memory + segment", n * mm(b * s, d, 2 * hk)),
        FlopTerm("q projection over the segment", n * mm(b * t, d, hk)),
        # The projection runs over concat(memory, segment); the memory rows' q is sliced off.
        FlopTerm("q projection over the memory (discarded)", n * mm(b * m, d, hk), needed=False),
        # R does not depend on the parameters: its projection only needs the weight gradient.
        FlopTerm("position projection W_kR R", n * mm(s, d, hk), backward_factor=1.0),
        attention,
        FlopTerm("output projection o_net", n * mm(b * t, hk, d)),
        FlopTerm("feed-forward", n * 2 * mm(b * t, d, f)),
    ]
    # What the backward pass recomputes (configs without the field keep everything).
    remat = getattr(config, "remat", "none")
    recomputed = {"none": [], "attention": [attention], "full": layers}[remat]
    terms = list(layers)
    if recomputed:
        terms.append(
            FlopTerm(
                f"recomputed in the backward (remat '{remat}')",
                sum(x.forward for x in recomputed),
                backward_factor=0.0,
                needed=False,
                training_only=True,
            )
        )
    terms += _adaptive_terms(config, rows=b * t)
    return FlopCount(terms=tuple(terms), tokens=b * t, formula=XL_FORMULA)


def _adaptive_terms(config, *, rows: int) -> list[FlopTerm]:
    """The adaptive embedding's projections and the (projected adaptive) softmax, every
    cluster for every token: `xl_jax.adaptive`'s dense path (softmax_tails='dense'). The
    grouped tails (the default) compute each tail only for its tokens, so they execute at
    most this; the model FLOPs reported stay those of the dense softmax."""
    d, bounds = config.d_model, config.cluster_bounds
    n_clusters = len(config.cutoffs)
    projected = config.div_val > 1 or config.d_embed != d
    n_tables = 1 if config.div_val == 1 else n_clusters + 1
    mm = lambda k, cols: 2.0 * rows * k * cols  # noqa: E731
    terms = []
    if projected:
        widths = [
            config.cluster_width(c) if config.div_val > 1 else config.d_embed
            for c in range(n_tables)
        ]
        terms.append(FlopTerm("adaptive embedding projections", sum(mm(e, d) for e in widths)))
    out = 0.0
    for k in range(n_clusters + 1):
        rows_k = bounds[k + 1] - bounds[k] + (n_clusters if k == 0 else 0)
        width = config.d_embed if config.div_val == 1 else config.cluster_width(k)
        if projected:
            out += mm(d, width)
        out += mm(width, rows_k)
    terms.append(FlopTerm("softmax (all clusters)", out))
    return terms


# ----------------------------------------------------------------------------- checks
def jaxpr_matmul_flops(fn: Callable, *args, **kwargs) -> float:
    """2 x multiply-adds of every `dot_general` in the traced program of fn(*args, **kwargs),
    entering nested programs (jit, remat, custom derivatives; a scan's body times its length).

    Raises ValueError on a `while` loop (its trip count is not in the program) and takes the
    most expensive branch of a `cond`.
    """
    closed = jax.make_jaxpr(fn)(*args, **kwargs)
    return _jaxpr_flops(closed.jaxpr)


def _jaxpr_flops(jaxpr) -> float:
    total = 0.0
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "dot_general":
            total += _dot_general_flops(eqn)
        elif name == "while":
            raise ValueError("jaxpr_matmul_flops: a while loop has no static trip count")
        elif name == "cond":
            total += max(_jaxpr_flops(br.jaxpr) for br in eqn.params["branches"])
        else:
            inner = sum(_jaxpr_flops(getattr(j, "jaxpr", j)) for j in jaxprs_in_params(eqn.params))
            total += inner * (eqn.params["length"] if name == "scan" else 1)
    return total


def _dot_general_flops(eqn) -> float:
    (lhs_contract, _), _ = eqn.params["dimension_numbers"]
    lhs_shape = eqn.invars[0].aval.shape
    out_shape = eqn.outvars[0].aval.shape
    contracted = math.prod(lhs_shape[i] for i in lhs_contract)
    return 2.0 * math.prod(out_shape) * contracted


def xla_flops(compiled) -> float | None:
    """XLA's FLOP count of a compiled program (`jax.stages.Compiled`), None where the backend
    gives none. (Older jax returns a list with one dict per program.)"""
    try:
        cost = compiled.cost_analysis()
    except Exception:  # noqa: BLE001 - some backends raise instead of returning nothing
        return None
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else None
    if not cost or "flops" not in cost:
        return None
    flops = float(cost["flops"])
    return flops if np.isfinite(flops) and flops > 0 else None
