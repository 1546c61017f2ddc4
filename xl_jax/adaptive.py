"""Adaptive input embedding and projected adaptive log-softmax (Baevski & Auli; Grave et al.).

Shapes (transformer_jax/shapes.py): B batch, T length, D model width, V vocabulary; cluster c holds
the ids `[bounds[c], bounds[c + 1])` with `bounds = (0, *cutoffs, V)`, and has width
`E_c = d_embed // div_val**c`.

With `div_val == 1` there is a single table [V, d_embed] (clusters then only split the softmax);
otherwise one table [V_c, E_c] per cluster. A projection [E_c, D] maps cluster c's width to D:
always when `div_val > 1`, only when d_embed != D otherwise. The reference stores projections
as [D, E_c] (`emb_projs`, `out_projs`); ours are their transposes.

Softmax with clusters (the reference's `ProjectedAdaptiveLogSoftmax`): a head over the
`cutoffs[0]` shortlist ids plus one logit per tail cluster (`cluster_weight`, `cluster_bias`
appended after the shortlist); log p(id in tail cluster c) = head[-c] + tail_c[id - bounds[c]].
Note the order: tail cluster c uses head column -c, so the last `cluster_weight` row belongs to
the first tail cluster.

Cost. Full log-probabilities [B, T, V] compute every tail for every token. With targets, and
`softmax_tails='grouped'` (the default), tail c is computed only for the tokens whose targets
fall in it: the N = B * T tokens are sorted by cluster, so tail c's tokens are one contiguous run
of `order`, and a `lax.switch` picks the smallest of a fixed ladder of capacities (0, N/2^J,
..., N/2, N) that holds the run; each branch has static shapes and only the chosen one runs. No
token is ever dropped (capacity N is always on the ladder), so the NLL is the dense path's, at
most twice the tail's real work (the head is still computed for every token). On wt103_base
(cutoffs 20k/40k/200k of 267,735 ids) the tails are ~92% of the dense softmax's rows.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from transformer_jax.layers import tied_logits
from transformer_jax.losses import token_cross_entropy
from xl_jax.config import TransformerXLConfig

Array = jax.Array


def _n_tables(cfg: TransformerXLConfig) -> int:
    return 1 if cfg.div_val == 1 else len(cfg.cutoffs) + 1


def _needs_proj(cfg: TransformerXLConfig) -> bool:
    return cfg.div_val > 1 or cfg.d_embed != cfg.d_model


def _table_shape(cfg: TransformerXLConfig, c: int) -> tuple[int, int]:
    if cfg.div_val == 1:
        return cfg.vocab_size, cfg.d_embed
    lo, hi = cfg.cluster_bounds[c], cfg.cluster_bounds[c + 1]
    return hi - lo, cfg.cluster_width(c)


class AdaptiveEmbedding(nn.Module):
    """tokens [B, T] -> [B, T, D] embeddings scaled by sqrt(D).

    Parameters: `emb_{c}` [V_c, E_c] (reference `emb_layers.{c}.weight`) and, where a
    projection is needed, `proj_{c}` [E_c, D] (`emb_projs.{c}`, transposed).
    `tied_parameters()` hands tables and projections to the softmax for weight tying.
    """

    config: TransformerXLConfig

    def setup(self):
        cfg = self.config
        n = _n_tables(cfg)
        self.tables = [
            self.param(
                f"emb_{c}", nn.initializers.normal(0.02), _table_shape(cfg, c), cfg.param_dtype
            )
            for c in range(n)
        ]
        if _needs_proj(cfg):
            self.projs = [
                self.param(
                    f"proj_{c}",
                    nn.initializers.normal(0.01),
                    (_table_shape(cfg, c)[1], cfg.d_model),
                    cfg.param_dtype,
                )
                for c in range(n)
            ]
        else:
            self.projs = [None] * n

    def __call__(self, tokens: Array) -> Array:
        cfg = self.config
        scale = cfg.d_model**0.5
        bounds = cfg.cluster_bounds if cfg.div_val > 1 else (0, cfg.vocab_size)
        out = jnp.zeros(tokens.shape + (cfg.d_model,), cfg.dtype)
        for c, (table, proj) in enumerate(zip(self.tables, self.projs)):
            lo, hi = bounds[c], bounds[c + 1]
            inside = (tokens >= lo) & (tokens < hi)
            emb = jnp.take(
                table.astype(cfg.dtype), jnp.clip(tokens - lo, 0, hi - lo - 1), axis=0
            )  # [B, T, E_c]
            if proj is not None:
                emb = emb @ proj.astype(cfg.dtype)  # [B, T, D]
            out = out + jnp.where(inside[..., None], emb, 0)
        return out * scale

    def tied_parameters(self) -> tuple[list[Array], list[Array | None]]:
        """(tables, projections) per table, for the softmax's weight tying."""
        return list(self.tables), list(self.projs)


class ProjectedAdaptiveLogSoftmax(nn.Module):
    """hidden [B, T, D] -> log-probabilities [B, T, V], or with targets the NLL [B, T].

    Parameters (reference names `crit.*` in brackets): `out_{c}` [V_c, E_c]
    (`out_layers.{c}.weight`; absent with `tie_weights`), `bias_{c}` [V_c]
    (`out_layers.{c}.bias`), `proj_{k}` [E_k, D] for each of the len(cutoffs) + 1 clusters k
    where needed and not tied (`out_projs.{k}`, transposed), `cluster_weight`
    [len(cutoffs), d_embed] and `cluster_bias` [len(cutoffs)].
    Logits and log-softmax are computed in (at least) float32.
    """

    config: TransformerXLConfig

    @nn.compact
    def __call__(
        self,
        hidden: Array,  # [B, T, D]
        targets: Array | None = None,  # [B, T] int
        *,
        tied_tables: Sequence[Array] | None = None,  # the embedding's tables
        tied_projs: Sequence[Array | None] | None = None,  # the embedding's projections
    ) -> Array:
        cfg = self.config
        n_tables, n_clusters = _n_tables(cfg), len(cfg.cutoffs)
        f = jnp.promote_types(cfg.dtype, jnp.float32)
        init = nn.initializers.normal(0.02)

        tables, biases = [], []
        for c in range(n_tables):
            shape = _table_shape(cfg, c)
            if cfg.tie_weights:
                tables.append(tied_tables[c])
            else:
                tables.append(self.param(f"out_{c}", init, shape, cfg.param_dtype))
            biases.append(
                self.param(f"bias_{c}", nn.initializers.zeros, shape[:1], cfg.param_dtype)
            )

        def proj(k: int) -> Array | None:
            if not _needs_proj(cfg):
                return None
            if cfg.tie_projs and cfg.tie_projs[k]:
                # div_val == 1 has one embedding projection; it serves every cluster.
                return tied_projs[0 if cfg.div_val == 1 else k]
            width = cfg.d_embed if cfg.div_val == 1 else cfg.cluster_width(k)
            return self.param(
                f"proj_{k}", nn.initializers.normal(0.01), (width, cfg.d_model), cfg.param_dtype
            )

        def cluster(k: int) -> tuple[Array, Array]:
            """Output rows and biases of cluster k."""
            if cfg.div_val > 1:
                return tables[k], biases[k]
            lo, hi = cfg.cluster_bounds[k], cfg.cluster_bounds[k + 1]
            return tables[0][lo:hi], biases[0][lo:hi]

        def logits_of(weight, bias, p, x=hidden) -> Array:  # [..., D] -> [..., rows]
            h = x if p is None else jnp.einsum("...d,ed->...e", x, p.astype(cfg.dtype))
            # tied_logits: float32 products and a weight gradient without a transposed copy
            # of the logits' gradient.
            return tied_logits(h, weight.astype(h.dtype)).astype(f) + bias.astype(f)

        def log_softmax(weight, bias, p, x=hidden) -> Array:  # [..., D] -> [..., rows]
            return jax.nn.log_softmax(logits_of(weight, bias, p, x), axis=-1)

        if n_clusters == 0:
            weight, bias = cluster(0)
            if targets is None:
                return log_softmax(weight, bias, proj(0))
            # The NLL with its closed-form gradient (no scatter into a [B, T, V] zero array).
            return token_cross_entropy(logits_of(weight, bias, proj(0)), targets)

        cluster_weight = self.param(
            "cluster_weight", init, (n_clusters, cfg.d_embed), cfg.param_dtype
        )
        cluster_bias = self.param(
            "cluster_bias", nn.initializers.zeros, (n_clusters,), cfg.param_dtype
        )
        weight, bias = cluster(0)
        shortlist = cfg.cutoffs[0]
        head = log_softmax(
            jnp.concatenate([weight, cluster_weight.astype(weight.dtype)]),
            jnp.concatenate([bias, cluster_bias.astype(bias.dtype)]),
            proj(0),
        )  # [B, T, shortlist + clusters]
        head_size = shortlist + n_clusters

        if targets is None:
            parts = [head[..., :shortlist]]
            for k in range(1, n_clusters + 1):
                weight, bias = cluster(k)
                parts.append(head[..., head_size - k, None] + log_softmax(weight, bias, proj(k)))
            return jnp.concatenate(parts, axis=-1)

        # Per-token NLL without concatenating the whole vocabulary: pick each token's cluster.
        logprob = jnp.take_along_axis(
            head, jnp.clip(targets, 0, shortlist - 1)[..., None], axis=-1
        )[..., 0]
        if cfg.softmax_tails == "grouped":
            tail_lps = _grouped_tail_log_probs(
                hidden,
                targets,
                cfg.cluster_bounds,
                [
                    functools.partial(log_softmax, *cluster(k), proj(k))
                    for k in range(1, n_clusters + 1)
                ],
            )
        for k in range(1, n_clusters + 1):
            lo, hi = cfg.cluster_bounds[k], cfg.cluster_bounds[k + 1]
            if cfg.softmax_tails == "grouped":
                tail_lp = tail_lps[k - 1]
            else:
                tail = log_softmax(*cluster(k), proj(k))
                tail_lp = jnp.take_along_axis(
                    tail, jnp.clip(targets - lo, 0, hi - lo - 1)[..., None], axis=-1
                )[..., 0]
            inside = (targets >= lo) & (targets < hi)
            logprob = jnp.where(inside, head[..., head_size - k] + tail_lp, logprob)
        return -logprob


def capacity_ladder(n_tokens: int, *, rungs: int = 8) -> tuple[int, ...]:
    """The static capacities a tail may be computed at: 0, then ceil(N / 2^j) up to N."""
    sizes = {math.ceil(n_tokens / 2**j) for j in range(rungs + 1)}
    return (0, *sorted(sizes))


def _grouped_tail_log_probs(
    hidden: Array,  # [B, T, D]
    targets: Array,  # [B, T] int
    bounds: Sequence[int],  # (0, *cutoffs, V)
    tail_log_softmax: Sequence[Callable[[Array], Array]],  # per tail: [C, D] -> [C, V_c]
) -> list[Array]:
    """Per tail cluster c, log p(target | cluster c) [B, T] for the tokens whose target is in
    c (0 elsewhere), computing tail c only for those tokens (at a capacity of the ladder).

    Exact: the rows computed are the dense path's rows for those tokens.
    """
    shape = targets.shape
    n = math.prod(shape)
    flat_h = hidden.reshape(n, hidden.shape[-1])  # [N, D]
    flat_t = targets.reshape(n)  # [N]
    cluster = jnp.searchsorted(jnp.asarray(bounds[1:-1]), flat_t, side="right")  # [N] 0 = head
    order = jnp.argsort(cluster, stable=True)  # tokens grouped by cluster, [N]
    counts = jnp.bincount(cluster, length=len(bounds) - 1)
    starts = jnp.cumsum(counts) - counts
    # Padded by N so a window of any capacity <= N starting at any start <= N fits, and
    # dynamic_slice never shifts it (it clamps windows that run past the end).
    order = jnp.concatenate([order, jnp.zeros_like(order)])
    ladder = capacity_ladder(n)

    out = []
    for c, tail_fn in enumerate(tail_log_softmax, start=1):
        lo, hi = bounds[c], bounds[c + 1]

        def branch(cap, c=c, lo=lo, hi=hi, tail_fn=tail_fn):
            def run(start, count):
                zeros = jnp.zeros((n,), jnp.promote_types(hidden.dtype, jnp.float32))
                if cap == 0:
                    return zeros
                rows = lax.dynamic_slice(order, (start,), (cap,))  # [C]
                tail = tail_fn(flat_h[rows])  # [C, V_c]
                picked = jnp.take_along_axis(
                    tail, jnp.clip(flat_t[rows] - lo, 0, hi - lo - 1)[:, None], axis=1
                )[:, 0]
                # Rows past the run belong to later clusters: they add nothing.
                return zeros.at[rows].add(jnp.where(jnp.arange(cap) < count, picked, 0.0))

            return run

        rung = jnp.searchsorted(jnp.asarray(ladder), counts[c])  # smallest capacity >= count
        out.append(
            lax.switch(rung, [branch(cap) for cap in ladder], starts[c], counts[c]).reshape(shape)
        )
    return out
