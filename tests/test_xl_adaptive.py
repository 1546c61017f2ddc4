"""Adaptive input embedding and projected adaptive log-softmax against slow NumPy."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from xl_jax import AdaptiveEmbedding, ProjectedAdaptiveLogSoftmax, TransformerXLConfig

CASES = [
    dict(),  # full softmax, no projection
    dict(d_embed=24),  # full softmax, projected
    dict(cutoffs=(10, 30), div_val=1),  # clusters, one table
    dict(cutoffs=(10, 30), div_val=1, d_embed=24, tie_projs=(False, True, True)),
    dict(cutoffs=(10, 30), div_val=2, d_embed=32),
    dict(cutoffs=(10, 30), div_val=2, d_embed=32, tie_projs=(True, False, True)),
    dict(cutoffs=(10, 30), div_val=2, d_embed=32, tie_weights=False),
    dict(cutoffs=(10, 20, 40), div_val=2, d_embed=32),  # three tails
]


def _bounds(cfg):
    return (0, *cfg.cutoffs, cfg.vocab_size)


def _np(tree):
    return jax.tree.map(lambda x: np.asarray(x, np.float64), tree)


def _slow_embedding(p, cfg, tokens):
    out = np.zeros(tokens.shape + (cfg.d_model,))
    for idx in np.ndindex(tokens.shape):
        w = tokens[idx]
        if cfg.div_val == 1:
            c, lo = 0, 0
        else:
            c = sum(w >= x for x in cfg.cutoffs)
            lo = _bounds(cfg)[c]
        e = p[f"emb_{c}"][w - lo]
        if f"proj_{c}" in p:
            e = e @ p[f"proj_{c}"]
        out[idx] = e * np.sqrt(cfg.d_model)
    return out


def _log_softmax(x):
    x = x - x.max()
    return x - np.log(np.exp(x).sum())


def _slow_log_probs(crit, emb, cfg, h):
    """Row by row: the head over shortlist + cluster logits, tail c read at head column -c."""
    n = len(cfg.cutoffs)
    bounds = _bounds(cfg)

    def table(c):
        src = emb if cfg.tie_weights else crit
        key = "emb_" if cfg.tie_weights else "out_"
        if cfg.div_val == 1:
            lo, hi = bounds[c], bounds[c + 1]
            return src[key + "0"][lo:hi], crit["bias_0"][lo:hi]
        return src[key + str(c)], crit[f"bias_{c}"]

    def proj(c):
        if cfg.tie_projs and cfg.tie_projs[c] and (cfg.div_val > 1 or cfg.d_embed != cfg.d_model):
            return emb["proj_0" if cfg.div_val == 1 else f"proj_{c}"]
        return crit.get(f"proj_{c}")

    def logits(x, w, b, pr):
        return (x if pr is None else x @ pr.T) @ w.T + b

    out = np.zeros(h.shape[:-1] + (cfg.vocab_size,))
    for idx in np.ndindex(h.shape[:-1]):
        x = h[idx]
        w0, b0 = table(0)
        if n == 0:
            out[idx] = _log_softmax(logits(x, w0, b0, proj(0)))
            continue
        head = _log_softmax(
            logits(
                x,
                np.concatenate([w0, crit["cluster_weight"]]),
                np.concatenate([b0, crit["cluster_bias"]]),
                proj(0),
            )
        )
        out[idx][: bounds[1]] = head[: bounds[1]]
        for c in range(1, n + 1):
            w, b = table(c)
            tail = _log_softmax(logits(x, w, b, proj(c)))
            out[idx][bounds[c] : bounds[c + 1]] = head[len(head) - c] + tail
    return out


def _initial_parameters(cfg):
    """(embedding, softmax) parameters as initialized, the softmax with its own tables."""
    tokens = jnp.zeros((1, 3), jnp.int32)
    emb = AdaptiveEmbedding(cfg).init(jax.random.key(0), tokens)["params"]
    hidden = jnp.zeros((1, 3, cfg.d_model))
    return emb, ProjectedAdaptiveLogSoftmax(cfg).init(jax.random.key(1), hidden)["params"]


def test_parameters_start_as_the_reference_s():
    """Tables and cluster logits N(0, 0.02), projections N(0, 0.01), biases zero (the
    reference's init_std and proj_init_std), at each cluster's width."""
    cfg = TransformerXLConfig.tiny(
        vocab_size=2000,
        d_model=64,
        cutoffs=(500, 1000),
        div_val=2,
        d_embed=128,
        tie_weights=False,
    )
    emb, crit = _initial_parameters(cfg)
    widths = (128, 64, 32)
    for c, (rows, width) in enumerate(zip((500, 500, 1000), widths)):
        for params, table in ((emb, f"emb_{c}"), (crit, f"out_{c}")):
            chex.assert_shape(params[table], (rows, width))
            assert np.std(np.asarray(params[table], np.float32)) == pytest.approx(0.02, rel=0.1)
        for params in (emb, crit):
            chex.assert_shape(params[f"proj_{c}"], (width, cfg.d_model))
            std = np.std(np.asarray(params[f"proj_{c}"], np.float32))
            assert std == pytest.approx(0.01, rel=0.1)
        assert not np.asarray(crit[f"bias_{c}"], np.float32).any()
        chex.assert_shape(crit[f"bias_{c}"], (rows,))
    assert np.std(np.asarray(crit["cluster_weight"], np.float32)) == pytest.approx(0.02, rel=0.2)
    assert not np.asarray(crit["cluster_bias"], np.float32).any()
    # One table at the model's width: no projection at all, on either side.
    cfg = TransformerXLConfig.tiny(cutoffs=(10, 30), div_val=1, tie_weights=False)
    emb, crit = _initial_parameters(cfg)
    assert sorted(emb) == ["emb_0"]
    assert sorted(crit) == ["bias_0", "cluster_bias", "cluster_weight", "out_0"]
    # A table wider than the model is projected down, as a narrower one is projected up.
    for d_embed in (cfg.d_model // 2, cfg.d_model * 2):
        emb, _ = _initial_parameters(cfg.replace(d_embed=d_embed))
        chex.assert_shape(emb["proj_0"], (d_embed, cfg.d_model))


@pytest.mark.parametrize("overrides", CASES)
def test_adaptive_embedding_and_softmax_match_numpy(overrides):
    cfg = TransformerXLConfig.tiny(**overrides)
    # Every id once, in a random order: each cluster's first and last ids included.
    tokens = jnp.asarray(np.random.default_rng(0).permutation(cfg.vocab_size).reshape(2, -1))
    t = tokens.shape[1]
    emb_mod = AdaptiveEmbedding(cfg)
    emb_params = emb_mod.init(jax.random.key(0), tokens)["params"]
    # Random biases and cluster logits so the test sees them.
    rng = np.random.default_rng(1)
    h = jnp.asarray(rng.normal(size=(2, t, cfg.d_model)), jnp.float32)
    crit = ProjectedAdaptiveLogSoftmax(cfg)
    tied = emb_mod.apply({"params": emb_params}, method=AdaptiveEmbedding.tied_parameters)
    kw = dict(tied_tables=tied[0], tied_projs=tied[1])
    crit_params = crit.init(jax.random.key(2), h, **kw)["params"]
    crit_params = jax.tree.map(
        lambda x: jnp.asarray(rng.normal(size=x.shape) * 0.5, jnp.float32), crit_params
    )

    got_emb = emb_mod.apply({"params": emb_params}, tokens)
    chex.assert_trees_all_close(
        np.asarray(got_emb, np.float64),
        _slow_embedding(_np(emb_params), cfg, np.asarray(tokens)),
        rtol=1e-5,
        atol=1e-6,
    )
    # Each table is read only at its own ids: no row past its end enters the gradients.
    grads = jax.grad(lambda p: jnp.sum(emb_mod.apply({"params": p}, tokens) ** 2))(emb_params)
    chex.assert_tree_all_finite(grads)

    logp = crit.apply({"params": crit_params}, h, **kw)
    want = _slow_log_probs(_np(crit_params), _np(emb_params), cfg, np.asarray(h, np.float64))
    chex.assert_shape(logp, (2, t, cfg.vocab_size))
    chex.assert_trees_all_close(np.asarray(logp, np.float64), want, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.exp(np.asarray(logp, np.float64)).sum(-1), 1.0, atol=1e-5)

    nll = crit.apply({"params": crit_params}, h, tokens, **kw)
    want_nll = -np.take_along_axis(want, np.asarray(tokens)[..., None], axis=-1)[..., 0]
    chex.assert_trees_all_close(np.asarray(nll, np.float64), want_nll, rtol=1e-4, atol=1e-5)


def test_tied_softmax_has_no_own_tables():
    cfg = TransformerXLConfig.tiny(
        cutoffs=(10, 30), div_val=2, d_embed=32, tie_projs=(False, True, True)
    )
    emb_mod = AdaptiveEmbedding(cfg)
    tokens = jnp.zeros((1, 3), jnp.int32)
    emb_params = emb_mod.init(jax.random.key(0), tokens)["params"]
    tied = emb_mod.apply({"params": emb_params}, method=AdaptiveEmbedding.tied_parameters)
    params = ProjectedAdaptiveLogSoftmax(cfg).init(
        jax.random.key(1), jnp.zeros((1, 3, cfg.d_model)), tied_tables=tied[0], tied_projs=tied[1]
    )["params"]
    assert sorted(params) == [
        "bias_0",
        "bias_1",
        "bias_2",
        "cluster_bias",
        "cluster_weight",
        "proj_0",
    ]
    chex.assert_shape(params["cluster_weight"], (2, 32))


def _crit_nll_and_grads(cfg, hidden, targets, params, tied):
    """Mean NLL and its gradients (params, tied tables and projections, hidden)."""
    crit = ProjectedAdaptiveLogSoftmax(cfg)

    def loss(params, tied, hidden, targets):
        nll = crit.apply(
            {"params": params}, hidden, targets, tied_tables=tied[0], tied_projs=tied[1]
        )
        return nll.mean(), nll

    # The targets are an argument, not a constant of the program: every target distribution
    # of a config then runs one compiled program (the persistent cache's hit).
    grad_fn = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)
    return jax.jit(grad_fn)(params, tied, hidden, targets)


@pytest.mark.parametrize("overrides", [c for c in CASES if c.get("cutoffs")])
@pytest.mark.parametrize(
    "targets_in", ["spread", "head_only", "one_tail", "last_tail", "one_token_in_a_tail"]
)
def test_grouped_tails_equal_the_dense_path_nll_and_gradients(overrides, targets_in):
    cfg = TransformerXLConfig.tiny(**overrides)
    rng = np.random.default_rng(3)
    low, high = {
        "spread": (0, 64),
        "head_only": (0, 10),
        "one_tail": (10, 30),
        "last_tail": (30, 64),
        "one_token_in_a_tail": (0, 10),
    }[targets_in]
    targets = jnp.asarray(rng.integers(low, high, (3, 11)))
    if targets_in == "spread":  # most tokens in the head, as with a Zipfian vocabulary
        targets = jnp.where(jnp.asarray(rng.random((3, 11)) < 0.6), targets % 10, targets)
    if targets_in == "one_token_in_a_tail":  # the ladder's smallest capacity above 0
        targets = (targets % 10).at[1, 4].set(cfg.cutoffs[-1] + 3)
    hidden = jnp.asarray(rng.normal(size=(3, 11, cfg.d_model)), jnp.float32)
    emb_mod = AdaptiveEmbedding(cfg)
    emb_params = emb_mod.init(jax.random.key(0), targets)["params"]
    tied = emb_mod.apply({"params": emb_params}, method=AdaptiveEmbedding.tied_parameters)
    params = ProjectedAdaptiveLogSoftmax(cfg).init(
        jax.random.key(2), hidden, tied_tables=tied[0], tied_projs=tied[1]
    )["params"]
    params = jax.tree.map(
        lambda x: jnp.asarray(rng.normal(size=x.shape) * 0.5, jnp.float32), params
    )

    # The tails' mode spelled at run time, as a flag's value is.
    cfg = cfg.replace(softmax_tails="".join(["grou", "ped"]))
    (_, grouped), grouped_grads = _crit_nll_and_grads(cfg, hidden, targets, params, tied)
    dense_cfg = cfg.replace(softmax_tails="dense")
    assert cfg.softmax_tails == "grouped"
    (_, dense), dense_grads = _crit_nll_and_grads(dense_cfg, hidden, targets, params, tied)
    chex.assert_trees_all_close(grouped, dense, rtol=1e-6, atol=1e-6)
    chex.assert_trees_all_close(grouped_grads, dense_grads, rtol=1e-5, atol=1e-7)


def test_capacity_ladder_always_holds_every_token():
    from xl_jax.adaptive import capacity_ladder

    assert capacity_ladder(300) == (0, 2, 3, 5, 10, 19, 38, 75, 150, 300)
    assert capacity_ladder(1) == (0, 1)
    with pytest.raises(TypeError):  # the rungs by keyword
        capacity_ladder(300, 2)
    assert capacity_ladder(300, rungs=3) == (0, 38, 75, 150, 300)  # 0, then N / 2^3 to N
    with pytest.raises(ValueError, match="softmax_tails"):
        TransformerXLConfig.tiny(softmax_tails="sparse")
