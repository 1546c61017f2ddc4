"""TransformerXL: memory semantics, causality, masks, recompilation, config validation."""

from __future__ import annotations

import functools

import chex
import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import matmul_sites, needs_gpu

from train.core.state import TrainState
from train.core.step import make_train_step
from train.lm.task import make_loss_fn
from xl_jax import TransformerXL, TransformerXLConfig, init_memory, update_memory


@functools.partial(jax.jit, static_argnums=0)
def _apply(cfg, params, tokens, memory, targets=None):
    """TransformerXL(cfg).apply under jit: eager Flax is slow on the shared CPU."""
    return TransformerXL(cfg).apply({"params": params}, tokens, memory, targets=targets)


def _setup(cfg, batch=2, length=12, seed=0):
    model = TransformerXL(cfg)
    tokens = jax.random.randint(jax.random.key(seed + 1), (batch, length), 0, cfg.vocab_size)
    params = model.init(jax.random.key(seed), tokens[:, :4], init_memory(cfg, batch))["params"]
    return model, params, tokens


def _run_segments(model, params, tokens, memory, seg_len, targets=None):
    outs = []
    for s in range(0, tokens.shape[1], seg_len):
        tgt = None if targets is None else targets[:, s : s + seg_len]
        out, memory = _apply(model.config, params, tokens[:, s : s + seg_len], memory, tgt)
        outs.append(out)
    return jnp.concatenate(outs, axis=1), memory


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides",
    [
        dict(),
        dict(norm_first=True),
        dict(cutoffs=(20, 40), div_val=2, d_embed=32),
        dict(untie_r=True, tie_weights=False, d_embed=24),
    ],
)
def test_segments_with_memory_equal_one_pass(overrides):
    # M = 10 >= the 8 tokens before the last segment, so every key of every position fits in
    # the memory; segment 2 also sees 6 unfilled slots (valid = 4 of 10), which must be masked.
    cfg = TransformerXLConfig.tiny(mem_len=10, **overrides)
    model, params, tokens = _setup(cfg)
    targets = jnp.roll(tokens, -1, axis=1)
    seg, _ = _run_segments(model, params, tokens, init_memory(cfg, 2), 4)
    full, _ = _apply(cfg, params, tokens, init_memory(cfg, 2, mem_len=0))
    chex.assert_shape(seg, (2, 12, cfg.vocab_size))
    chex.assert_trees_all_close(seg, full, rtol=1e-5, atol=1e-5)
    seg_nll, _ = _run_segments(model, params, tokens, init_memory(cfg, 2), 4, targets)
    want_nll = -jnp.take_along_axis(full, targets[..., None], axis=-1)[..., 0]
    chex.assert_trees_all_close(seg_nll, want_nll, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_evaluation_memory_and_segment_length_differ_from_training():
    cfg = TransformerXLConfig.tiny(tgt_len=4, mem_len=4)
    model, params, tokens = _setup(cfg)
    seg, mem = _run_segments(model, params, tokens, init_memory(cfg, 2, mem_len=9), 3)
    full, _ = _apply(cfg, params, tokens, init_memory(cfg, 2, mem_len=0))
    chex.assert_trees_all_close(seg, full, rtol=1e-5, atol=1e-5)
    chex.assert_shape(mem.hidden, [(2, 9, cfg.d_model)] * cfg.n_layers)
    np.testing.assert_array_equal(mem.valid, [9, 9])


def test_memory_keeps_exactly_the_last_mem_len_positions():
    # One layer: the memory is the embedded tokens, so segment 2 (queries T..2T-1 with keys
    # from T-M on) must equal a fresh pass over the window [T-M, 2T) at its last T positions.
    cfg = TransformerXLConfig.tiny(n_layers=1, mem_len=3)
    model, params, tokens = _setup(cfg, length=12)
    T, M = 6, 3
    _, mem = _apply(cfg, params, tokens[:, :T], init_memory(cfg, 2))
    seg2, _ = _apply(cfg, params, tokens[:, T:], mem)
    window, _ = _apply(cfg, params, tokens[:, T - M :], init_memory(cfg, 2, 0))
    chex.assert_trees_all_close(seg2, window[:, M:], rtol=1e-5, atol=1e-5)


def test_update_memory_slides_and_counts():
    cfg = TransformerXLConfig.tiny(n_layers=1, d_model=2, mem_len=3)
    mem = init_memory(cfg, 1)
    seen = []
    for step in range(3):
        h = jnp.arange(2 * step, 2 * step + 2, dtype=jnp.float32)[None, :, None] * jnp.ones(2)
        seen.extend(range(2 * step, 2 * step + 2))
        mem = update_memory(mem, [h])
        n = min(len(seen), 3)
        np.testing.assert_array_equal(mem.valid, [n])
        np.testing.assert_array_equal(mem.hidden[0][0, 3 - n :, 0], seen[-n:])


def test_update_memory_takes_one_position_at_a_time_and_an_empty_segment():
    """Generation adds one position a step (T = 1 < M); an empty segment (T = 0) keeps the
    memory as it is. Both keep M slots."""
    cfg = TransformerXLConfig.tiny(n_layers=2, d_model=2, mem_len=3)
    mem = init_memory(cfg, 1)
    for step in range(5):
        h = jnp.full((1, 1, 2), step, jnp.float32)
        mem = update_memory(mem, [h, h + 10])
        n = min(step + 1, 3)
        np.testing.assert_array_equal(mem.valid, [n])
        np.testing.assert_array_equal(mem.hidden[0][0, 3 - n :, 0], np.arange(step + 1)[-n:])
        np.testing.assert_array_equal(mem.hidden[1][0, 3 - n :, 0], np.arange(step + 1)[-n:] + 10)
    empty = jnp.zeros((1, 0, 2), jnp.float32)
    same = update_memory(mem, [empty, empty])
    chex.assert_trees_all_equal(same, mem)


def test_update_memory_takes_exactly_one_segment_per_layer():
    cfg = TransformerXLConfig.tiny(n_layers=2, d_model=2, mem_len=3)
    h = jnp.ones((1, 2, 2), jnp.float32)
    with pytest.raises(ValueError, match="zip"):
        update_memory(init_memory(cfg, 1), [h])
    with pytest.raises(ValueError, match="zip"):
        update_memory(init_memory(cfg, 1), [h, h, h])


def test_the_mask_s_lengths_are_keyword_only():
    """q_len and mem_len are both ints; taken by position, a swap would go unnoticed."""
    from xl_jax.memory import attention_mask

    valid = jnp.array([2])
    with pytest.raises(TypeError):
        attention_mask(valid, 3, 2, False)
    assert attention_mask(valid, q_len=3, mem_len=2, same_length=False).shape == (1, 1, 3, 5)


def test_reset_rows_empties_the_rows_asked_and_keeps_the_others():
    from xl_jax.memory import reset_rows

    cfg = TransformerXLConfig.tiny(n_layers=2, d_model=2, mem_len=3)
    mem = init_memory(cfg, 2)
    mem = update_memory(mem, [jnp.ones((2, 3, 2)), 2 * jnp.ones((2, 3, 2))])
    out = reset_rows(mem, jnp.array([True, False]))
    np.testing.assert_array_equal(out.valid, [0, 3])
    for before, after in zip(mem.hidden, out.hidden, strict=True):
        np.testing.assert_array_equal(after[0], np.zeros((3, 2)))
        np.testing.assert_array_equal(after[1], before[1])
    chex.assert_trees_all_equal(reset_rows(mem, jnp.array([True, True])), init_memory(cfg, 2))


@pytest.mark.parametrize("same_length", [False, True])
def test_the_attention_mask_follows_its_three_rules(same_length):
    """Key j is visible to query i when d = M + i - j >= 0, the slot is filled
    (j >= M - valid), and with same_length d < M; a bool mask [B, 1, T, S]."""
    from xl_jax.memory import attention_mask

    m, t, valid = 3, 4, [3, 1]
    mask = attention_mask(jnp.array(valid), q_len=t, mem_len=m, same_length=same_length)
    assert mask.dtype == jnp.bool_ and mask.shape == (2, 1, t, m + t)
    want = np.zeros((2, 1, t, m + t), bool)
    for b in range(2):
        for i in range(t):
            for j in range(m + t):
                d = m + i - j
                want[b, 0, i, j] = d >= 0 and j >= m - valid[b] and (d < m or not same_length)
    np.testing.assert_array_equal(mask, want)


def test_a_negative_memory_length_is_an_error_that_says_so():
    cfg = TransformerXLConfig.tiny()
    with pytest.raises(ValueError, match="mem_len must be >= 0, got -1"):
        init_memory(cfg, 2, mem_len=-1)
    assert init_memory(cfg, 2, mem_len=0).length == 0


@pytest.mark.slow
def test_no_gradient_through_memory_into_previous_segment():
    cfg = TransformerXLConfig.tiny()
    model, params, tokens = _setup(cfg, length=8)
    targets = jnp.roll(tokens, -1, axis=1)

    def two_segment_loss(p):
        _, mem = model.apply({"params": p}, tokens[:, :4], init_memory(cfg, 2))
        nll, _ = model.apply({"params": p}, tokens[:, 4:], mem, targets=targets[:, 4:])
        return nll.sum()

    _, fixed_mem = _apply(cfg, params, tokens[:, :4], init_memory(cfg, 2))

    def second_segment_loss(p):
        nll, _ = model.apply({"params": p}, tokens[:, 4:], fixed_mem, targets=targets[:, 4:])
        return nll.sum()

    g_through = jax.jit(jax.grad(two_segment_loss))(params)
    g_const = jax.jit(jax.grad(second_segment_loss))(params)
    chex.assert_trees_all_close(g_through, g_const, rtol=1e-6, atol=1e-7)
    # And the memory does carry information: the loss depends on it.
    other_mem = jax.tree.map(lambda x: x, fixed_mem).replace(
        hidden=tuple(h + 1.0 for h in fixed_mem.hidden)
    )
    nll_a, _ = _apply(cfg, params, tokens[:, 4:], fixed_mem, targets[:, 4:])
    nll_b, _ = _apply(cfg, params, tokens[:, 4:], other_mem, targets[:, 4:])
    assert np.abs(np.asarray(nll_a - nll_b)).max() > 1e-4


@pytest.mark.parametrize("p", [1, 5, 6])
def test_causal_across_segments(p):
    cfg = TransformerXLConfig.tiny(mem_len=4)
    model, params, tokens = _setup(cfg, length=8)
    changed = tokens.at[:, p].set((tokens[:, p] + 1) % cfg.vocab_size)
    a, _ = _run_segments(model, params, tokens, init_memory(cfg, 2), 4)
    b, _ = _run_segments(model, params, changed, init_memory(cfg, 2), 4)
    chex.assert_trees_all_close(a[:, :p], b[:, :p], rtol=0, atol=0)
    assert np.abs(np.asarray(a[:, p] - b[:, p])).max() > 1e-4


@pytest.mark.slow
def test_same_length_changes_only_queries_with_more_than_mem_len_keys():
    # Empty memory of M = 4 slots: query i has i + 1 causal keys, all at distance < M for
    # i < M, so same_length must leave exactly those positions unchanged (in every layer).
    cfg = TransformerXLConfig.tiny(mem_len=4)
    model, params, tokens = _setup(cfg, length=8)
    a, _ = _apply(cfg, params, tokens, init_memory(cfg, 2))
    b, _ = _apply(cfg.replace(same_length=True), params, tokens, init_memory(cfg, 2))
    chex.assert_trees_all_close(a[:, :4], b[:, :4], rtol=1e-6, atol=1e-6)
    assert np.abs(np.asarray(a[:, 4:] - b[:, 4:])).max(axis=(0, 2)).min() > 1e-4


@pytest.mark.slow
def test_clamp_len_changes_only_positions_that_see_longer_distances():
    cfg = TransformerXLConfig.tiny()
    model, params, tokens = _setup(cfg, length=8)
    # At init (std 0.02) the position terms are tiny; make them matter.
    params = flax.traverse_util.path_aware_map(
        lambda path, x: x * 50 if "r_net" in path or "r_r_bias" in path else x, params
    )
    empty = init_memory(cfg, 2, mem_len=0)
    a, _ = _apply(cfg, params, tokens, empty)
    b, _ = _apply(cfg.replace(clamp_len=2), params, tokens, empty)
    chex.assert_trees_all_close(a[:, :3], b[:, :3], rtol=1e-6, atol=1e-6)
    assert np.abs(np.asarray(a[:, 3:] - b[:, 3:])).max(axis=(0, 2)).min() > 1e-4
    # clamp_len <= 0 means "no clamping", as in the reference.
    c, _ = _apply(cfg.replace(clamp_len=0), params, tokens, empty)
    chex.assert_trees_all_close(a, c, rtol=0, atol=0)


@pytest.mark.slow
def test_jitted_step_traces_once_across_segments():
    cfg = TransformerXLConfig.tiny()
    model, params, tokens = _setup(cfg, length=16)
    chex.clear_trace_counter()

    # Two traces in all: one for the training memory, one for the longer evaluation memory.
    # A memory whose shape or dtype changed from segment to segment would trace a third time.
    @jax.jit
    @chex.assert_max_traces(n=2)
    def step(params, tokens, memory):
        return model.apply({"params": params}, tokens, memory)

    for mem_len in (cfg.mem_len, 12):
        mem = init_memory(cfg, 2, mem_len=mem_len)
        for s in range(0, 16, 4):
            _, mem = step(params, tokens[:, s : s + 4], mem)


@pytest.mark.slow
def test_dropout_needs_rng_and_is_reproducible():
    cfg = TransformerXLConfig.tiny(dropout=0.3, dropatt=0.3)
    model, params, tokens = _setup(cfg, length=4)
    mem = init_memory(cfg, 2)

    def run(key):
        return model.apply(
            {"params": params}, tokens, mem, deterministic=False, rngs={"dropout": key}
        )[0]

    with pytest.raises(flax.errors.InvalidRngError, match="dropout"):
        model.apply({"params": params}, tokens, mem, deterministic=False)
    # The masks are a function of the key alone: the compiled program draws the eager ones.
    noisy = jax.jit(run)(jax.random.key(3))
    chex.assert_trees_all_close(noisy, run(jax.random.key(3)), atol=1e-6)
    assert np.abs(np.asarray(noisy - jax.jit(run)(jax.random.key(4)))).max() > 1e-4
    # Deterministic: no dropout at all, the output of the same model built without it.
    det, _ = _apply(cfg, params, tokens, mem)
    plain, _ = _apply(cfg.replace(dropout=0.0, dropatt=0.0), params, tokens, mem)
    chex.assert_trees_all_close(det, plain, atol=1e-6)
    assert np.abs(np.asarray(noisy - det)).max() > 1e-4


@pytest.mark.slow
def test_float64_under_x64():
    cfg32 = TransformerXLConfig.tiny()
    model32, params, tokens = _setup(cfg32, length=8)
    out32, _ = _run_segments(model32, params, tokens, init_memory(cfg32, 2), 4)
    with jax.enable_x64(True):
        cfg64 = cfg32.replace(dtype=jnp.float64)
        p64 = jax.tree.map(lambda x: jnp.asarray(x, jnp.float64), params)
        model64 = TransformerXL(cfg64)
        out64, mem = _run_segments(model64, p64, tokens, init_memory(cfg64, 2), 4)
        assert out64.dtype == jnp.float64 and mem.hidden[0].dtype == jnp.float64
        chex.assert_trees_all_close(
            np.asarray(out64), np.asarray(out32, np.float64), rtol=1e-4, atol=1e-4
        )
        # The float64 probabilities are normalised to float64 precision.
        np.testing.assert_allclose(np.exp(np.asarray(out64)).sum(-1), 1.0, atol=1e-12)


# The float32 products of the bf16 policy, by name (the last part of a product's name stack):
# the attention scores, (a)+(c) in the shared core and (b)+(d) here, and the output logits
# with their two gradient products accumulate in float32 from bf16 operands; in the backward
# pass the scores' float32 cotangent is the one float32 operand of their gradient products.
XL_SCORES = ("bthk,bshk->bhts", "bthk,shk->bhts")
XL_LOGITS = ("...d,vd->...v", "...v,vd->...d", "...d,...v->dv")
BF16, F32 = "bfloat16", "float32"


def _xl_allowed_dtypes(where: str) -> set[tuple[str, str, str]]:
    """(lhs, rhs, result) dtypes the bf16 policy allows the product named `where`."""
    name = where.rsplit("/", 1)[-1]
    if name in XL_SCORES:
        return {(BF16, BF16, F32), (F32, BF16, F32)}
    if name in XL_LOGITS:
        return {(BF16, BF16, F32)}
    return {(BF16, BF16, BF16)}


@pytest.mark.slow
def test_bfloat16_multiplies_every_product_in_bf16_but_the_float32_scores_and_logits():
    # As the Transformer's test: closeness to float32 would also pass a model that computed a
    # product (one feed-forward layer, say) in float32. Every product of the bf16 forward pass
    # and of its whole training step (the LM's loss, gradients, optimizer) takes bf16
    # operands, apart from the named ones above, and there are as many as in float32.
    cfg32 = TransformerXLConfig.tiny()
    _, params, tokens = _setup(cfg32, length=9)
    batch = {"inputs": tokens[:, :8], "targets": tokens[:, 1:]}

    def programs(cfg):
        model = TransformerXL(cfg)
        memory = init_memory(cfg, 2)

        def forward(p):
            return model.apply({"params": p}, batch["inputs"], memory, targets=batch["targets"])

        state = TrainState.create(
            params=params, tx=optax.adam(1e-3), rng=jax.random.key(0), extra=memory
        )
        step = make_train_step(make_loss_fn(model))
        return matmul_sites(forward, params), matmul_sites(step, state, batch)

    full, half = programs(cfg32), programs(cfg32.replace(dtype="bfloat16"))
    for full_sites, half_sites in zip(full, half):
        assert {s[1:3] for s in full_sites} == {(F32, F32)}
        assert len(half_sites) == len(full_sites)
        assert [s for s in half_sites if tuple(s[1:]) not in _xl_allowed_dtypes(s[0])] == []
    # The exceptions name real products (a renamed one would silently allow nothing).
    names = {s[0].rsplit("/", 1)[-1] for s in half[1]}
    assert set(XL_SCORES) | set(XL_LOGITS) <= names


@pytest.mark.parametrize(
    "field,value",
    [
        ("d_model", 0),
        ("n_layers", 0),
        ("mem_len", -1),
        ("dropout", 1.0),
        ("d_model", 31),
        ("cutoffs", (40, 20)),
        ("cutoffs", (10, 64)),
        ("tie_projs", (True,)),
        ("same_length", True),
        ("remat", "sometimes"),
        ("attention_impl", "flash"),
    ],
)
def test_config_validation_names_the_field(field, value):
    kw = {field: value}
    if field == "tie_projs":
        kw["cutoffs"] = (10, 20)
    if field == "same_length":
        kw["mem_len"] = 0
    with pytest.raises(ValueError, match=field):
        TransformerXLConfig.tiny(**kw)


def test_presets_build():
    small = TransformerXLConfig.seed_small()
    assert (
        small.n_layers,
        small.n_heads,
        small.d_model,
        small.d_head,
        small.d_inner,
        small.tgt_len,
        small.mem_len,
    ) == (4, 3, 32, 17, 71, 33, 41)
    wt = TransformerXLConfig.wt103_base()
    assert wt.cutoffs and wt.d_embed == 410
    e8 = TransformerXLConfig.enwik8_base()
    assert (e8.n_layers, e8.d_model, e8.n_heads, e8.d_head, e8.d_inner) == (12, 512, 8, 64, 2048)
    TransformerXLConfig.ptb()
    hash(wt)  # static jit argument


@needs_gpu
def test_cudnn_attention_matches_xla_in_bf16_loss_and_gradients():
    # The position term reaches cuDNN as a [B, H, T, S] bias; its gradient (through q and
    # r_net) must flow as on the XLA path.
    cfg = TransformerXLConfig.tiny(dtype="bfloat16", d_head=16, tgt_len=16, mem_len=16)
    model, params, tokens = _setup(cfg, length=17)
    memory = init_memory(cfg, 2)

    def loss(impl):
        m = TransformerXL(cfg.replace(attention_impl=impl))

        def f(p):
            nll, _ = m.apply({"params": p}, tokens[:, :16], memory, targets=tokens[:, 1:])
            return jnp.mean(nll)

        return jax.jit(jax.value_and_grad(f))(params)

    (l_fused, g_fused), (l_xla, g_xla) = loss("cudnn"), loss("xla")
    np.testing.assert_allclose(float(l_fused), float(l_xla), rtol=2e-2)
    chex.assert_trees_all_close(g_fused, g_xla, atol=2e-2, rtol=1e-1)


def test_a_memory_of_another_batch_or_bad_tokens_are_errors_that_say_so():
    config = TransformerXLConfig.tiny(vocab_size=50)
    model = TransformerXL(config)
    tokens = jnp.zeros((2, config.tgt_len), jnp.int32)
    params = model.init(jax.random.PRNGKey(0), tokens, init_memory(config, 2))["params"]
    apply = functools.partial(model.apply, {"params": params})
    with pytest.raises(ValueError, match=r"memory: \[3\] rows for tokens of batch 2"):
        apply(tokens, init_memory(config, 3))
    with pytest.raises(ValueError, match=r"tokens: expected \[B, L\]"):
        apply(tokens[0], init_memory(config, 2))
    with pytest.raises(ValueError, match=r"targets: token ids must be in \[0, 50\)"):
        apply(tokens, init_memory(config, 2), targets=tokens + 50)
