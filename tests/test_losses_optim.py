"""Label-smoothed cross-entropy, the Noam schedule and the paper's Adam against their formulas;
the gradient clipping against optax's, and the train step's update (clipped mean gradient,
non-finite steps skipped) against optax's chain."""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from absl.testing import parameterized

from train.core.state import TrainState
from train.core.step import make_train_step
from transformer_jax import (
    OptimizerConfig,
    label_smoothed_cross_entropy,
    make_optimizer,
    noam_schedule,
    smoothed_target_distribution,
    token_cross_entropy,
)
from transformer_jax.optim import clip_by_global_norm, find_params_ema, params_ema


def _explicit_smoothed_ce(logits, targets, smoothing, pad_id):
    """Build the target distribution q token by token, then sum -q log p over real tokens."""
    logits = np.asarray(logits, np.float64)
    b_, t_, v_ = logits.shape
    total, count = 0.0, 0
    for b in range(b_):
        for t in range(t_):
            y = targets[b, t]
            if y == pad_id:
                continue
            q = np.zeros(v_)
            for v in range(v_):
                if v == y:
                    q[v] = 1.0 - smoothing
                elif v != pad_id:
                    q[v] = smoothing / (v_ - 2)
            assert abs(q.sum() - 1.0) < 1e-12
            log_p = logits[b, t] - np.log(np.sum(np.exp(logits[b, t])))
            total += -np.sum(q * log_p)
            count += 1
    return total, count


class LabelSmoothingTest(chex.TestCase):
    """The loss is a pure function: the same numbers eager and under jit (chex.variants)."""

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.parameters(0.0, 0.1, 0.4)
    def test_label_smoothing_equals_explicit_distribution(self, smoothing):
        rng = np.random.default_rng(0)
        logits = rng.normal(size=(3, 4, 7)).astype(np.float32) * 3
        targets = rng.integers(1, 7, size=(3, 4)).astype(np.int32)
        targets[0, 2:] = 0
        targets[2, 3] = 0
        loss = self.variant(
            functools.partial(label_smoothed_cross_entropy, smoothing=smoothing, pad_id=0)
        )
        loss_sum, n_tokens = loss(jnp.asarray(logits), jnp.asarray(targets))
        ref_sum, ref_count = _explicit_smoothed_ce(logits, targets, smoothing, 0)
        assert int(n_tokens) == ref_count == 9
        np.testing.assert_allclose(float(loss_sum), ref_sum, rtol=1e-5)

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.parameters(0.0, 0.1)
    def test_label_smoothing_gradient_is_autodiffs_of_the_explicit_distribution(self, smoothing):
        # The loss has a closed-form VJP ((softmax - q) per real position); it must be the
        # gradient autodiff takes through log_softmax against the written-out q, pad rows
        # zero.
        rng = np.random.default_rng(2)
        logits = jnp.asarray(rng.normal(size=(3, 4, 7)) * 3, jnp.float32)
        targets = np.asarray(rng.integers(1, 7, size=(3, 4)), np.int32)
        targets[0, 2:] = 0
        targets = jnp.asarray(targets)
        scale = jnp.float32(0.7)  # a cotangent other than 1

        def ours(x):
            return (
                scale * label_smoothed_cross_entropy(x, targets, smoothing=smoothing, pad_id=0)[0]
            )

        def explicit(x):
            q = smoothed_target_distribution(targets, 7, smoothing=smoothing, pad_id=0)
            return scale * -jnp.sum(q * jax.nn.log_softmax(x, axis=-1))

        chex.assert_trees_all_close(self.variant(ours)(logits), explicit(logits), rtol=1e-5)
        got, want = self.variant(jax.grad(ours))(logits), jax.grad(explicit)(logits)
        chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-6)
        assert float(jnp.abs(got[0, 2:]).max()) == 0.0  # pad targets: no gradient
        # The unsmoothed per-position form without an excluded id is the plain NLL.
        nll = self.variant(jax.grad(lambda x: jnp.sum(token_cross_entropy(x, targets))))(logits)
        want = jax.grad(
            lambda x: (
                -jnp.sum(jnp.take_along_axis(jax.nn.log_softmax(x), targets[..., None], axis=-1))
            )
        )(logits)
        chex.assert_trees_all_close(nll, want, rtol=1e-5, atol=1e-6)


def test_label_smoothing_differs_from_kl_by_the_entropy_of_q():
    # The Annotated Transformer minimises KL(q || p) = CE(q, p) - H(q); H(q) is a constant.
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(1, 5, 6)).astype(np.float32)
    targets = np.array([[3, 4, 5, 1, 2]], np.int32)
    s, v = 0.1, 6
    loss_sum, n = label_smoothed_cross_entropy(logits, targets, smoothing=s, pad_id=0)
    q_entropy = -(1 - s) * np.log(1 - s) - s * np.log(s / (v - 2))
    log_p = np.asarray(logits, np.float64) - np.log(np.exp(logits).sum(-1, keepdims=True))
    kl = 0.0
    for t, y in enumerate(targets[0]):
        q = np.full(v, s / (v - 2))
        q[0], q[y] = 0.0, 1 - s
        kl += np.sum(np.where(q > 0, q * (np.log(np.where(q > 0, q, 1)) - log_p[0, t]), 0))
    np.testing.assert_allclose(float(loss_sum) - int(n) * q_entropy, kl, rtol=1e-5)


@pytest.mark.parametrize("smoothing", [-0.1, 1.0, 1.5])
def test_bad_smoothing_raises(smoothing):
    with pytest.raises(ValueError, match=f"smoothing must be in \\[0, 1\\), got {smoothing}"):
        label_smoothed_cross_entropy(
            jnp.zeros((1, 1, 5)), jnp.ones((1, 1), jnp.int32), smoothing=smoothing, pad_id=0
        )


@pytest.mark.parametrize("platform", ["cpu", "gpu"])
@pytest.mark.parametrize("excluded", [None, 2])
@pytest.mark.parametrize("smoothing", [0.0, 0.3])
def test_token_cross_entropy_spreads_smoothing_over_every_id_but_the_target_and_excluded(
    monkeypatch, platform, excluded, smoothing
):
    """With nothing excluded (the XL's adaptive softmax) the mass goes to V - 1 ids; with an
    id excluded, to V - 2. The value and the closed-form gradient, on both paths."""
    from transformer_jax import losses

    monkeypatch.setattr(losses, "compile_platform", lambda *a: platform)
    v = 6
    logits = jnp.asarray(np.random.default_rng(3).normal(size=(2, 3, v)), jnp.float32)
    targets = jnp.array([[0, 1, 3], [5, 4, 1]])
    q = np.full((2, 3, v), smoothing / (v - 1 - (excluded is not None)))
    if excluded is not None:
        q[..., excluded] = 0.0
    np.put_along_axis(q, np.asarray(targets)[..., None], 1.0 - smoothing, axis=-1)
    x = np.asarray(logits, np.float64)
    log_p = x - np.log(np.exp(x).sum(-1, keepdims=True))
    value, grad = jax.value_and_grad(
        lambda x: jnp.sum(token_cross_entropy(x, targets, smoothing, excluded))
    )(logits)
    np.testing.assert_allclose(value, -np.sum(q * log_p), rtol=1e-5)
    np.testing.assert_allclose(grad, np.exp(log_p) - q, atol=1e-6)


def test_a_vocabulary_under_three_ids_is_refused_and_three_is_enough():
    # Smoothing spreads over V - 2 ids (not the target, not pad): at least one is needed.
    targets = jnp.ones((1, 1), jnp.int32)
    with pytest.raises(ValueError, match="vocabulary of at least 3, got 2"):
        label_smoothed_cross_entropy(jnp.zeros((1, 1, 2)), targets, smoothing=0.1, pad_id=0)
    loss, n = label_smoothed_cross_entropy(jnp.zeros((1, 1, 3)), targets, smoothing=0.1, pad_id=0)
    np.testing.assert_allclose(loss, np.log(3.0), rtol=1e-6)  # uniform p: -sum q log(1/3)
    assert int(n) == 1


def test_a_pad_id_inside_the_vocabulary_takes_no_smoothing_mass_and_counts_nothing():
    """pad need not be id 0 (fairseq's is 1, Marian's the last id): ids below and above it
    are ordinary targets."""
    v, pad = 9, 3  # 9 - 2 != 9 ^ 2 (with 7, as elsewhere in this file, they are equal)
    rng = np.random.default_rng(4)
    logits = rng.normal(size=(2, 4, v)).astype(np.float32)
    targets = np.array([[0, 1, 2, 3], [4, 8, 3, 5]], np.int32)
    q = np.asarray(smoothed_target_distribution(targets, v, smoothing=0.2, pad_id=pad))
    for b in range(2):
        for t in range(4):
            want = np.zeros(v)
            if targets[b, t] != pad:
                want[:] = 0.2 / (v - 2)
                want[pad] = 0.0
                want[targets[b, t]] = 0.8
            np.testing.assert_allclose(q[b, t], want, rtol=1e-6, err_msg=f"row {b, t}")
    loss, n = label_smoothed_cross_entropy(logits, targets, smoothing=0.2, pad_id=pad)
    want_loss, want_n = _explicit_smoothed_ce(logits, targets, 0.2, pad)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    assert int(n) == want_n == 6


@pytest.mark.parametrize("decay", [-0.5, 1.0, 1.5])
def test_the_reinforce_baseline_s_decay_must_be_in_0_1(decay):
    from transformer_jax.losses import hard_attention_surrogate, init_reinforce_baseline

    aux = {"log_prob": jnp.zeros((1, 2)), "entropy": jnp.zeros((1, 2))}
    args = (jnp.zeros((1, 2, 4)), jnp.ones((1, 2), jnp.int32), aux, init_reinforce_baseline())
    with pytest.raises(ValueError, match=f"decay must be in \\[0, 1\\), got {decay}"):
        hard_attention_surrogate(*args, pad_id=0, decay=decay)
    hard_attention_surrogate(*args, pad_id=0, decay=0.0)


def test_the_losses_take_their_scalars_by_keyword_only():
    """smoothing and pad_id (and the surrogate's pad_id, entropy_weight and decay) are all
    numbers: taken by position, two swapped would go unnoticed."""
    from transformer_jax.losses import hard_attention_surrogate, init_reinforce_baseline

    logits, targets = jnp.zeros((1, 2, 4)), jnp.ones((1, 2), jnp.int32)
    with pytest.raises(TypeError):
        label_smoothed_cross_entropy(logits, targets, 0.1, 0)
    with pytest.raises(TypeError):
        smoothed_target_distribution(targets, 4, 0.1, 0)
    aux = {"log_prob": jnp.zeros((1, 2)), "entropy": jnp.zeros((1, 2))}
    with pytest.raises(TypeError):
        hard_attention_surrogate(logits, targets, aux, init_reinforce_baseline(), 0)
    hard_attention_surrogate(logits, targets, aux, init_reinforce_baseline(), pad_id=0)


def test_the_surrogate_s_defaults_are_an_entropy_weight_of_0_01_and_xu_s_decay_of_0_9():
    from transformer_jax.losses import hard_attention_surrogate

    rng = np.random.default_rng(5)
    logits = jnp.asarray(rng.normal(size=(1, 3, 5)), jnp.float32)
    targets = jnp.array([[1, 2, 0]])
    aux = {
        "log_prob": jnp.asarray(rng.normal(size=(1, 3)), jnp.float32),
        "entropy": jnp.ones((1, 3)),
    }
    state = {"mean": jnp.float32(-1.0), "weight": jnp.float32(0.5)}
    default = hard_attention_surrogate(logits, targets, aux, state, pad_id=0)
    explicit = hard_attention_surrogate(
        logits, targets, aux, state, pad_id=0, entropy_weight=0.01, decay=0.9
    )
    chex.assert_trees_all_equal(default, explicit)
    other = hard_attention_surrogate(logits, targets, aux, state, pad_id=0, entropy_weight=0.02)
    assert float(other[0]) != float(default[0])  # the entropy term counts


def test_the_first_step_s_empty_baseline_computes_no_nan_even_where_unused():
    """Under jax_debug_nans a NaN anywhere stops the step, the branch a `where` drops
    included: the empty baseline's division is guarded, not only masked."""
    from transformer_jax.losses import hard_attention_surrogate, init_reinforce_baseline

    aux = {"log_prob": jnp.zeros((1, 2)), "entropy": jnp.zeros((1, 2))}
    with jax.debug_nans(True):
        surrogate, _ = hard_attention_surrogate(
            jnp.zeros((1, 2, 4)),
            jnp.ones((1, 2), jnp.int32),
            aux,
            init_reinforce_baseline(),
            pad_id=0,
        )
    assert np.isfinite(float(surrogate))


def test_the_surrogate_does_not_depend_on_which_id_is_pad():
    """Swapping ids 0 and 3 (targets and logit columns) and calling 3 the pad gives the same
    surrogate and baseline: ids below the pad are real tokens too."""
    from transformer_jax.losses import hard_attention_surrogate

    rng = np.random.default_rng(6)
    logits = jnp.asarray(rng.normal(size=(2, 4, 6)), jnp.float32)
    targets = jnp.array([[1, 2, 5, 0], [4, 3, 0, 0]])
    aux = {
        "log_prob": jnp.asarray(rng.normal(size=(2, 4)), jnp.float32),
        "entropy": jnp.ones((2, 4)),
    }
    state = {"mean": jnp.float32(-1.0), "weight": jnp.float32(0.5)}
    swap = jnp.array([3, 1, 2, 0, 4, 5])
    a = hard_attention_surrogate(logits, targets, aux, state, pad_id=0)
    b = hard_attention_surrogate(logits[..., swap], swap[targets], aux, state, pad_id=3)
    chex.assert_trees_all_close(a, b, rtol=1e-6)


def test_the_first_step_has_no_baseline_yet():
    """Before any update the baseline is 0: the advantage is the log-likelihood to come."""
    from transformer_jax.losses import hard_attention_surrogate, init_reinforce_baseline

    logits = jnp.asarray(np.random.default_rng(7).normal(size=(1, 3, 5)), jnp.float32)
    targets = jnp.array([[2, 4, 0]])
    aux = {"log_prob": jnp.array([[0.5, -1.5, 2.0]]), "entropy": jnp.zeros((1, 3))}
    got, _ = hard_attention_surrogate(logits, targets, aux, init_reinforce_baseline(), pad_id=0)
    log_p = np.asarray(jax.nn.log_softmax(logits))
    tok = [log_p[0, 0, 2], log_p[0, 1, 4]]
    want = -(tok[0] + tok[1]) * 0.5 - tok[1] * -1.5
    np.testing.assert_allclose(float(got), want, rtol=1e-5)


def test_the_baseline_averages_over_real_tokens_even_one_or_none():
    from transformer_jax.losses import hard_attention_surrogate, init_reinforce_baseline

    logits = jnp.asarray(np.random.default_rng(2).normal(size=(1, 3, 5)), jnp.float32)
    aux = {"log_prob": jnp.zeros((1, 3)), "entropy": jnp.zeros((1, 3))}
    log_p = np.asarray(jax.nn.log_softmax(logits))
    for targets, mean in (([[4, 0, 0]], 0.5 * log_p[0, 0, 4]), ([[0, 0, 0]], 0.0)):
        _, state = hard_attention_surrogate(
            logits, jnp.array(targets), aux, init_reinforce_baseline(), pad_id=0, decay=0.5
        )
        np.testing.assert_allclose(state["mean"], mean, rtol=1e-6, err_msg=str(targets))
        np.testing.assert_allclose(state["weight"], 0.5)


@pytest.mark.parametrize("d_model,warmup,factor", [(512, 4000, 1.0), (64, 10, 2.0)])
def test_noam_equals_formula_at_step_one_warmup_and_ten_warmups(d_model, warmup, factor):
    sched = noam_schedule(d_model, warmup, factor)
    for step in (1, warmup, 10 * warmup):
        expected = factor * d_model**-0.5 * min(step**-0.5, step * warmup**-1.5)
        # optax's count is the number of updates done so far: step - 1.
        np.testing.assert_allclose(float(sched(step - 1)), expected, rtol=1e-6)
    # Peak at warm-up, linear before it, 1/sqrt(step) after.
    np.testing.assert_allclose(
        float(sched(warmup - 1)), factor / np.sqrt(d_model * warmup), rtol=1e-6
    )
    np.testing.assert_allclose(float(sched(0)) * warmup, float(sched(warmup - 1)), rtol=1e-5)
    np.testing.assert_allclose(
        float(sched(4 * warmup - 1)) * 2, float(sched(warmup - 1)), rtol=1e-5
    )


def _numpy_adam(grads, lrs, b1=0.9, b2=0.98, eps=1e-9):
    m = v = np.zeros_like(grads[0])
    updates = []
    for t, (g, lr) in enumerate(zip(grads, lrs), start=1):
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        m_hat, v_hat = m / (1 - b1**t), v / (1 - b2**t)
        updates.append(-lr * m_hat / (np.sqrt(v_hat) + eps))
    return updates


@pytest.mark.parametrize("clip_norm", [None, 1.0])
def test_optimizer_is_adam_0_9_0_98_on_noam_with_optional_clipping(clip_norm):
    d_model, warmup = 16, 4
    tx, _ = make_optimizer(
        OptimizerConfig(schedule="noam", d_model=d_model, warmup_steps=warmup, clip_norm=clip_norm)
    )
    grads = [np.array([3.0, -4.0]), np.array([0.1, 0.2]), np.array([-0.3, 0.05])]
    clipped = [g * min(1.0, clip_norm / np.linalg.norm(g)) if clip_norm else g for g in grads]
    lrs = [float(noam_schedule(d_model, warmup)(i)) for i in range(3)]
    expected = _numpy_adam(clipped, lrs)
    params = jnp.zeros(2)
    state = tx.init(params)
    for g, want in zip(grads, expected):
        upd, state = tx.update(jnp.asarray(g, jnp.float32), state, params)
        chex.assert_trees_all_close(np.asarray(upd), want.astype(np.float32), rtol=1e-5)
        params = optax.apply_updates(params, upd)


def test_params_ema_averages_the_updated_params_and_leaves_updates_alone():
    decay = 0.6
    params = {"w": jnp.array([1.0, -2.0]), "b": jnp.array(0.5)}
    plain = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(0.1))
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(0.1), params_ema(decay))
    p_plain, p, s_plain, s = params, params, plain.init(params), tx.init(params)
    ema = None
    rng = np.random.default_rng(0)
    for n in range(1, 6):
        grads = {
            "w": jnp.asarray(rng.normal(size=2), jnp.float32),
            "b": jnp.asarray(rng.normal(), jnp.float32),
        }
        u_plain, s_plain = plain.update(grads, s_plain, p_plain)
        u, s = tx.update(grads, s, p)
        p_plain, p = optax.apply_updates(p_plain, u_plain), optax.apply_updates(p, u)
        chex.assert_trees_all_equal(p, p_plain)  # training is unchanged
        # The recurrence written out: uniform average first, then forgetting at `decay`.
        d = min(decay, (n - 1) / n)
        new = {k: np.asarray(v, np.float64) for k, v in p.items()}
        ema = new if ema is None else {k: d * ema[k] + (1 - d) * new[k] for k in new}
        chex.assert_trees_all_close(find_params_ema(s), ema, rtol=1e-6)
    assert find_params_ema(s_plain) is None


@pytest.mark.parametrize("scale", [0.1, 10.0])  # below and above the clipping norm
def test_clip_by_global_norm_is_optaxs_with_its_state(scale):
    grads = {"w": jnp.array([[0.3, -0.4], [1.2, 0.5]]) * scale, "b": jnp.array([0.25]) * scale}
    ours, theirs = clip_by_global_norm(1.0), optax.clip_by_global_norm(1.0)
    params = jax.tree.map(jnp.zeros_like, grads)
    # The same (empty) state: a checkpoint written with either restores with the other.
    assert jax.tree.structure(ours.init(params)) == jax.tree.structure(theirs.init(params))
    got, _ = ours.update(grads, ours.init(params))
    want, _ = theirs.update(grads, theirs.init(params))
    chex.assert_trees_all_close(got, want, rtol=1e-6)
    assert float(optax.tree.norm(got)) == pytest.approx(min(1.0, float(optax.tree.norm(grads))))


def test_clip_by_global_norm_reads_the_norm_it_is_given():
    grads = {"w": jnp.array([3.0, 4.0])}  # norm 5
    tx = clip_by_global_norm(1.0)
    state = tx.init(grads)
    given, _ = tx.update(grads, state, global_norm=jnp.float32(10.0))
    chex.assert_trees_all_close(given, {"w": jnp.array([0.3, 0.4])}, rtol=1e-6)
    below, _ = tx.update(grads, state, global_norm=jnp.float32(0.5))
    chex.assert_trees_all_equal(below, grads)  # a norm under the limit leaves them alone
    with pytest.raises(ValueError, match="max_norm"):
        clip_by_global_norm(0.0)


def _step_state(tx):
    params = {"w": jnp.array([0.5, -1.0, 2.0]), "b": jnp.array(0.25)}
    return TrainState.create(params=params, tx=tx, rng=jax.random.PRNGKey(0))


def _weighted_loss(weights):
    """loss_fn whose summed loss is sum(weights * params) over 4 tokens: the gradient of the
    summed loss is `weights`, its mean weights / 4."""

    def loss_fn(params, batch, *, rng, extra, deterministic):
        loss = sum(jnp.sum(w * params[k]) for k, w in weights.items())
        return loss, {"n_tokens": jnp.float32(4.0)}, None

    return loss_fn


def test_train_step_updates_with_the_clipped_mean_gradient():
    tx, _ = make_optimizer(OptimizerConfig(learning_rate=0.1, clip_norm=1.0, ema_decay=0.9))
    weights = {"w": jnp.array([8.0, -4.0, 2.0]), "b": jnp.array(12.0)}  # mean norm 3.8
    state, metrics = jax.jit(make_train_step(_weighted_loss(weights)))(_step_state(tx), {})
    mean = jax.tree.map(lambda w: w / 4.0, weights)
    reference = optax.chain(
        optax.clip_by_global_norm(1.0), optax.adam(optax.constant_schedule(0.1)), params_ema(0.9)
    )
    start = _step_state(reference)
    updates, opt_state = reference.update(mean, start.opt_state, start.params)
    chex.assert_trees_all_close(state.params, optax.apply_updates(start.params, updates), rtol=1e-6)
    chex.assert_trees_all_close(state.opt_state, opt_state, rtol=1e-6)
    assert float(metrics["grad_norm"]) == pytest.approx(float(optax.tree.norm(mean)), rel=1e-6)
    assert float(metrics["nonfinite"]) == 0.0 and int(state.step) == 1


@pytest.mark.parametrize("bad", [np.inf, np.nan, 1e30])  # 1e30: its square overflows float32
def test_train_step_skips_an_update_whose_gradient_norm_is_not_finite(bad):
    tx, _ = make_optimizer(OptimizerConfig(learning_rate=0.1, clip_norm=1.0, ema_decay=0.9))
    weights = {"w": jnp.array([8.0, bad, 2.0], jnp.float32), "b": jnp.array(12.0)}
    before = _step_state(tx)
    state, metrics = jax.jit(make_train_step(_weighted_loss(weights)))(before, {})
    assert float(metrics["nonfinite"]) == 1.0 and int(state.step) == 1
    chex.assert_trees_all_equal(state.params, before.params)
    chex.assert_trees_all_equal(state.opt_state, before.opt_state)


def test_params_ema_rejects_a_decay_outside_0_1():
    for bad in (0.0, 1.0, -0.5):
        with pytest.raises(ValueError, match="decay"):
            params_ema(bad)
