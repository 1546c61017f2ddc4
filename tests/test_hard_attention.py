"""Hard (stochastic) attention and its REINFORCE training.

The sampler draws positions with the attention distribution's frequencies; the surrogate's
gradient is, in expectation, exactly the gradient of the expected reward (checked by summing
over every outcome, and by seeded Monte Carlo); the surrogate of a translation batch matches a
hand computation; and the model learns the copy task with it.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
from translation_checks import SRC, TGT, jit_apply, random_params

from transformer_jax import greedy_decode
from transformer_jax.baselines.registry import make_baseline
from transformer_jax.baselines.seq2seq import hard_attention_sample
from transformer_jax.losses import (
    hard_attention_surrogate,
    init_reinforce_baseline,
    label_smoothed_cross_entropy,
    score_function_surrogate,
)

SCORES = jnp.array([[1.0, -0.5, 0.3, 2.0, 0.0, -1.0]])  # [1, S]
MASK = jnp.array([[True, True, True, True, True, False]])  # the last key is padding
DRAWS = 40000


def _draw(scores, n=DRAWS):
    keys = jax.random.split(jax.random.key(7), n)
    return jax.vmap(lambda k: hard_attention_sample(k, scores, MASK))(keys)  # leaves [N, 1]


def test_sampled_positions_follow_the_attention_distribution():
    position, log_prob, entropy = _draw(SCORES)
    a = np.asarray(jax.nn.softmax(jnp.where(MASK, SCORES, -jnp.inf))[0])
    freq = np.bincount(np.asarray(position[:, 0]), minlength=6) / DRAWS
    assert freq[5] == 0.0  # a masked key is never drawn
    np.testing.assert_array_less(np.abs(freq - a), 4 * np.sqrt(a * (1 - a) / DRAWS) + 1e-9)
    np.testing.assert_allclose(log_prob[:, 0], np.log(a[np.asarray(position[:, 0])]), rtol=1e-5)
    np.testing.assert_allclose(entropy[:, 0], -np.sum(a[:5] * np.log(a[:5])), rtol=1e-5)


def test_the_model_samples_its_first_step_from_its_attention():
    """At step 0 the decoder state does not depend on earlier samples, so every key sees the
    same a_0: the positions drawn over many keys follow it."""
    model = make_baseline("hard_attention", src_vocab_size=32, tgt_vocab_size=32, preset="tiny")
    params = random_params(model, SRC, TGT)
    src, tgt = SRC[2:], TGT[2:]

    @jax.jit
    def positions(keys):
        def one(key):
            aux = model.apply(
                {"params": params},
                src,
                tgt,
                deterministic=False,
                rngs={"sample": key},
                method="logits_and_attention",
            )[1]
            return aux["position"][0, 0], aux["weights"][0, 0]

        return jax.vmap(one)(keys)

    drawn, weights = positions(jax.random.split(jax.random.key(3), 8000))
    a = np.asarray(weights[0])
    chex.assert_trees_all_close(weights, jnp.broadcast_to(weights[0], weights.shape))
    freq = np.bincount(np.asarray(drawn), minlength=a.size) / 8000
    np.testing.assert_array_less(np.abs(freq - a), 4 * np.sqrt(a * (1 - a) / 8000) + 1e-9)


def _exact_gradient(theta, reward):
    """grad_theta E_{s ~ softmax(theta)}[reward(s)] = a * (reward - a . reward)."""
    a = jax.nn.softmax(jnp.where(MASK, theta, -jnp.inf))[0]
    return a * (reward - jnp.dot(a, reward))


def test_reinforce_gradient_is_unbiased_exactly_and_by_sampling():
    reward = jnp.array([0.5, -2.0, 1.0, 3.0, -1.0, 9.0])  # reward of the masked key: never seen
    exact = _exact_gradient(SCORES, reward)
    for baseline in (0.0, 1.3, -4.0):
        # Sum over every outcome s of a(s) * (the surrogate's gradient at s): the expectation
        # of the estimator, with no sampling error. It is -exact whatever the baseline.
        def surrogate_at(theta, s, baseline=baseline):
            log_a = jax.nn.log_softmax(jnp.where(MASK, theta, -jnp.inf))[0]
            return score_function_surrogate(log_a[s], reward[s], baseline)

        a = jax.nn.softmax(jnp.where(MASK, SCORES, -jnp.inf))[0]
        expected = sum(a[s] * jax.grad(surrogate_at)(SCORES, s)[0] for s in range(5))
        chex.assert_trees_all_close(-expected, exact, atol=1e-6)

    # Seeded Monte Carlo through the sampler itself: the mean of per-sample gradients is
    # within 4 standard errors of the exact gradient (baseline: the mean reward).
    def per_sample(theta, key):
        position, log_prob, _ = hard_attention_sample(key, theta, MASK)
        return score_function_surrogate(log_prob[0], reward[position[0]], 1.0)

    grads = jax.jit(jax.vmap(jax.grad(per_sample), in_axes=(None, 0)))(
        SCORES, jax.random.split(jax.random.key(11), DRAWS)
    )[:, 0]  # [N, S]
    mean, se = -np.asarray(grads.mean(0)), np.asarray(grads.std(0)) / np.sqrt(DRAWS)
    np.testing.assert_array_less(np.abs(mean - np.asarray(exact)), 4 * se + 1e-7)


def test_surrogate_matches_a_hand_computation():
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(2, 4, 7)), jnp.float32)
    targets = jnp.array([[3, 4, 2, 0], [5, 6, 3, 2]])
    aux = {
        "log_prob": jnp.asarray(rng.normal(size=(2, 4)), jnp.float32),
        "entropy": jnp.asarray(rng.random((2, 4)), jnp.float32),
    }
    state = {"mean": jnp.float32(-0.9), "weight": jnp.float32(0.19)}  # two updates of 0.9
    got, new_state = hard_attention_surrogate(
        logits, targets, aux, state, pad_id=0, entropy_weight=0.1, decay=0.9
    )
    log_p = np.asarray(jax.nn.log_softmax(logits))
    b = -0.9 / 0.19
    want, lps = 0.0, []
    for i in range(2):
        n = int((np.asarray(targets[i]) != 0).sum())
        tok = [log_p[i, t, int(targets[i, t])] for t in range(n)]
        lps += tok
        for t in range(n):
            advantage = sum(tok[t:]) - b * (n - t)
            want += -advantage * float(aux["log_prob"][i, t]) - 0.1 * float(aux["entropy"][i, t])
    np.testing.assert_allclose(float(got), want, rtol=1e-5)
    np.testing.assert_allclose(float(new_state["mean"]), 0.9 * -0.9 + 0.1 * np.mean(lps), rtol=1e-6)
    np.testing.assert_allclose(float(new_state["weight"]), 0.9 * 0.19 + 0.1, rtol=1e-6)
    # Only log_prob and entropy carry gradient: the advantage is a constant.
    grad = jax.grad(lambda lg: hard_attention_surrogate(lg, targets, aux, state, pad_id=0)[0])(
        logits
    )
    assert not np.any(np.asarray(grad))


def _copy_batch(rng, batch, length=5, n_symbols=8):
    """Symbols 3..3+n_symbols-1, EOS 2 after them: src, decoder input (BOS 1 first), targets."""
    seq = rng.integers(3, 3 + n_symbols, size=(batch, length)).astype(np.int32)
    eos = np.full((batch, 1), 2, np.int32)
    return (
        np.concatenate([seq, eos], 1),
        np.concatenate([np.ones_like(eos), seq], 1),
        np.concatenate([seq, eos], 1),
    )


def test_hard_attention_trains_on_the_copy_task():
    model = make_baseline(
        "hard_attention",
        src_vocab_size=11,
        tgt_vocab_size=11,
        preset="tiny",
        emb_dim=16,
        enc_hidden=32,
        dec_hidden=32,
    )
    rng = np.random.default_rng(0)
    steps, batch = 300, 32
    data = [np.stack(x) for x in zip(*(_copy_batch(rng, batch) for _ in range(steps)))]
    opt = optax.adam(1e-2)

    def loss_fn(params, baseline, src, tgt_in, tgt_out, key):
        logits, aux = model.apply(
            {"params": params},
            src,
            tgt_in,
            deterministic=False,
            rngs={"sample": key},
            method="logits_and_attention",
        )
        loss_sum, n_tokens = label_smoothed_cross_entropy(logits, tgt_out, smoothing=0.0, pad_id=0)
        surrogate, baseline = hard_attention_surrogate(logits, tgt_out, aux, baseline, pad_id=0)
        return (loss_sum + surrogate) / n_tokens, (loss_sum / n_tokens, baseline)

    @jax.jit
    def train(params):
        def step(carry, xs):
            params, opt_state, baseline = carry
            *batch_, i = xs
            grads, (nll, baseline) = jax.grad(loss_fn, has_aux=True)(
                params, baseline, *batch_, jax.random.fold_in(jax.random.key(1), i)
            )
            updates, opt_state = opt.update(grads, opt_state, params)
            return (optax.apply_updates(params, updates), opt_state, baseline), nll

        (params, _, _), nll = jax.lax.scan(
            step, (params, opt.init(params), init_reinforce_baseline()), (*data, jnp.arange(steps))
        )
        return params, nll

    params, nll = train(random_params(model, *data[0][:1], data[1][0]))
    assert float(nll[-20:].mean()) < 0.25 * float(nll[:5].mean()), nll
    src, _, want = _copy_batch(np.random.default_rng(1), 64)
    got = np.asarray(greedy_decode(model, params, src, max_len=6))
    assert (got == want).mean() > 0.9, (got == want).mean()
    # Evaluation attends to the argmax position: on the copy task, the step's own position.
    aux = jit_apply(
        model,
        params,
        src,
        np.concatenate([np.ones((64, 1), np.int32), want[:, :-1]], 1),
        method="logits_and_attention",
    )[1]
    assert (np.asarray(aux["position"]) == np.arange(6)).mean() > 0.8
