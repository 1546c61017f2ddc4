"""Training losses: label-smoothed cross-entropy (section 5.4 of the paper), summed over real
tokens, and the REINFORCE surrogate of hard attention.

Shapes: B batch, T target length, V vocabulary.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from transformer_jax.platform import compile_platform

Array = jax.Array


def label_smoothed_cross_entropy(
    logits: Array,
    targets: Array,
    *,
    smoothing: float,
    pad_id: int,
) -> tuple[Array, Array]:
    """Summed cross-entropy against a label-smoothed target distribution.

    The target distribution q puts 1 - smoothing on the true token, smoothing / (V - 2) on
    every other token except pad, and 0 on pad (the Annotated Transformer's distribution; its
    KL(q || p) differs from this cross-entropy by the entropy of q, a constant). Positions
    whose target is pad count nothing.

    Args:
      logits: [B, T, V] (any float dtype; computed in float32).
      targets: [B, T] int token ids, pad_id where there is no token.
      smoothing: in [0, 1); 0 gives the plain negative log-likelihood.
      pad_id: the padding id.
    Returns:
      (loss_sum, n_tokens): float32 scalar sum of -sum_v q_v log p_v over real positions,
      and the int32 number of real (non-pad) target positions.
    """
    if not 0.0 <= smoothing < 1.0:
        raise ValueError(f"smoothing must be in [0, 1), got {smoothing!r}")
    vocab = logits.shape[-1]
    if vocab < 3:
        raise ValueError(f"label smoothing needs a vocabulary of at least 3, got {vocab}")
    loss = token_cross_entropy(logits, targets, smoothing, pad_id)  # [B, T]
    real = targets != pad_id
    return jnp.sum(jnp.where(real, loss, 0.0)), jnp.sum(real, dtype=jnp.int32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def token_cross_entropy(
    logits: Array, targets: Array, smoothing: float = 0.0, excluded_id: int | None = None
) -> Array:
    """Per-position cross-entropy -sum_v q_v log softmax(logits)_v: [..., V], [...] -> [...]
    in float32 (float64 for float64 logits).

    q puts 1 - smoothing on the target and spreads smoothing evenly over the other ids but
    `excluded_id` (pad; None excludes nothing); smoothing 0 is the negative log-likelihood.
    Its VJP is the closed form (softmax - q) * cotangent, built in one pass over the logits
    from an iota compare: autodiff's gradient of the target's log-probability is a scatter
    into a zeroed [..., V] array, several extra passes over the largest array of a step.
    """
    return _token_cross_entropy_fwd(logits, targets, smoothing, excluded_id)[0]


def _smoothing_weights(vocab: int, smoothing: float, excluded_id: int | None) -> float:
    """The q of every id that is neither the target nor excluded."""
    return smoothing / (vocab - 1 - (excluded_id is not None))


def _token_cross_entropy_fwd(logits, targets, smoothing, excluded_id):
    vocab = logits.shape[-1]
    x = logits.astype(jnp.promote_types(logits.dtype, jnp.float32))
    if compile_platform(logits) == "cpu":
        lse = jax.nn.logsumexp(x, axis=-1)  # [...]
        total = jnp.sum(x, axis=-1) if smoothing else None
        true_logit = jnp.take_along_axis(x, targets[..., None], axis=-1)[..., 0]
    else:
        lse, total, true_logit = _one_pass_statistics(x, targets)
    true_lp = true_logit - lse
    loss = -(1.0 - smoothing) * true_lp
    if smoothing:
        # Sum of log p over the ids that share the smoothing mass: all but the target and
        # the excluded id.
        rest_lp = total - vocab * lse - true_lp
        if excluded_id is not None:
            rest_lp = rest_lp - (x[..., excluded_id] - lse)
        loss = loss - _smoothing_weights(vocab, smoothing, excluded_id) * rest_lp
    return loss, (logits, lse, targets)


def _one_pass_statistics(x: Array, targets: Array) -> tuple[Array, Array, Array]:
    """(logsumexp, sum, the target's logit) over the last axis of x [..., V], targets [...],
    in one pass: a reduction of (running max, sum of exp below it, sum, target logit), the
    first two as an online softmax keeps them.

    The two-pass form (max, then the sum of exp(x - max); the sum and the target's logit
    apart) reads the [N, V] logits four times; on a GPU that was most of a Transformer
    step's elementwise bytes (benchmarks/target_h200_2026-12-02/). The CPU keeps that form,
    and its numbers: this one rounds differently (partial sums are rescaled as the maximum
    grows).
    """
    # A finite floor instead of -inf as the identity: exp(floor - floor) is 1, never NaN.
    floor = jnp.asarray(jnp.finfo(x.dtype).min, x.dtype)
    zero = jnp.zeros((), x.dtype)
    is_target = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1) == targets[..., None]

    def combine(a, b):
        (m1, s1, t1, y1), (m2, s2, t2, y2) = a, b
        m = jnp.maximum(m1, m2)
        return m, s1 * jnp.exp(m1 - m) + s2 * jnp.exp(m2 - m), t1 + t2, y1 + y2

    m, s, total, target = jax.lax.reduce(
        (x, jnp.ones_like(x), x, jnp.where(is_target, x, zero)),
        (floor, zero, zero, zero),
        combine,
        (x.ndim - 1,),
    )
    return m + jnp.log(s), total, target


def _token_cross_entropy_bwd(smoothing, excluded_id, saved, grad):
    logits, lse, targets = saved
    vocab = logits.shape[-1]
    ids = jnp.arange(vocab)
    other = _smoothing_weights(vocab, smoothing, excluded_id)
    if excluded_id is not None:
        other = jnp.where(ids == excluded_id, 0.0, other)  # [V]
    q = jnp.where(ids == targets[..., None], 1.0 - smoothing, other)  # [..., V]
    p = jnp.exp(logits.astype(lse.dtype) - lse[..., None])
    d_logits = grad[..., None] * (p - q)
    return d_logits.astype(logits.dtype), None


token_cross_entropy.defvjp(_token_cross_entropy_fwd, _token_cross_entropy_bwd)


def smoothed_target_distribution(
    targets: Array, vocab_size: int, *, smoothing: float, pad_id: int
) -> Array:
    """The q of `label_smoothed_cross_entropy`, written out: [...] ids -> [..., V] float32.

    1 - smoothing on the target, smoothing / (V - 2) on every other id but pad, 0 on pad; a
    pad target's row is all 0 (it counts nothing). The loss never builds this array; it is
    for plots and tests.
    """
    q = jnp.full(targets.shape + (vocab_size,), smoothing / (vocab_size - 2), jnp.float32)
    q = jnp.where(jnp.arange(vocab_size) == pad_id, 0.0, q)
    q = jnp.where(jax.nn.one_hot(targets, vocab_size, dtype=bool), 1.0 - smoothing, q)
    return jnp.where((targets == pad_id)[..., None], 0.0, q)


# ----------------------------------------------------------------------------- REINFORCE
# Hard attention samples a source position s_t ~ a_t per step, so no gradient reaches the
# attention score through the sample. The score-function (REINFORCE) estimator supplies it:
#   grad E[log p(y)] = E[ sum_t (R_t - b_t) grad log a_t(s_t) ] + E[grad log p(y | s)],
# R_t = sum_{t' >= t} log p(y_t' | ...) the log-likelihood still to come (s_t changes the
# decoder state, hence every later token; earlier ones it cannot), b_t a baseline that does not
# depend on s (unbiased whatever it is; it only lowers the variance). We keep Xu et al.'s moving
# average of the per-token log-likelihood and use b_t = that average * the tokens still to come.


def init_reinforce_baseline() -> dict[str, Array]:
    """The moving-average baseline's state: {'mean', 'weight'} float32 scalars.

    'mean' is the exponential moving average of the per-token log-likelihood started at 0;
    'weight' = 1 - decay^k after k updates, so mean / weight is the bias-corrected average
    (as Adam corrects its moments) and the first batches do not see a baseline of 0.
    """
    return {"mean": jnp.zeros((), jnp.float32), "weight": jnp.zeros((), jnp.float32)}


def score_function_surrogate(log_prob: Array, reward: Array, baseline: Array | float) -> Array:
    """-(reward - baseline) * log_prob, with the advantage held constant.

    Its gradient is minus the REINFORCE estimate of grad E[reward] for a sample whose
    log-probability is `log_prob` (shapes broadcast; elementwise).
    """
    return -jax.lax.stop_gradient(reward - baseline) * log_prob


def hard_attention_surrogate(
    logits: Array,
    targets: Array,
    aux: dict[str, Array],
    baseline: dict[str, Array],
    *,
    pad_id: int,
    entropy_weight: float = 0.01,
    decay: float = 0.9,
) -> tuple[Array, dict[str, Array]]:
    """The term a training loss adds for hard attention's REINFORCE, summed over real tokens.

    Used as::

        logits, aux = model.apply({'params': p}, src, tgt_in, deterministic=False,
                                  rngs={'sample': k1, 'dropout': k2},
                                  method='logits_and_attention')
        loss_sum, n_tokens = label_smoothed_cross_entropy(logits, tgt_out, ...)
        surrogate, baseline = hard_attention_surrogate(logits, tgt_out, aux, baseline, ...)
        loss_sum = loss_sum + surrogate       # differentiate this; carry `baseline` as state

    The gradient of the sum is minus (the REINFORCE estimate of the gradient of the expected
    log-likelihood + entropy_weight * the gradient of the attention entropies), the reward
    being the unsmoothed log-likelihood to come (see above). Its value is not a loss to report.

    Args:
      logits: [B, T, V] from the same pass that drew the positions.
      targets: [B, T] ids, pad_id where there is no token.
      aux: the model's per-step 'log_prob' [B, T] (log a_t(s_t)) and 'entropy' [B, T].
      baseline: `init_reinforce_baseline()` or the state this function returned last step.
      entropy_weight: lambda_e, the weight of the entropy bonus (0 switches it off).
      decay: of the baseline's moving average (Xu et al.: 0.9).
    Returns:
      (surrogate_sum float32 scalar, the updated baseline state).
    """
    if not 0.0 <= decay < 1.0:
        raise ValueError(f"decay must be in [0, 1), got {decay!r}")
    real = targets != pad_id  # [B, T]
    log_p = jax.nn.log_softmax(jax.lax.stop_gradient(logits).astype(jnp.float32), axis=-1)
    token_lp = jnp.where(real, jnp.take_along_axis(log_p, targets[..., None], -1)[..., 0], 0.0)
    # Reverse cumulative sums along T: what is still to come from step t on.
    to_come = jnp.flip(jnp.cumsum(jnp.flip(token_lp, -1), -1), -1)  # R_t [B, T]
    remaining = jnp.flip(jnp.cumsum(jnp.flip(real, -1), -1), -1).astype(jnp.float32)
    per_token = jnp.where(
        baseline["weight"] > 0, baseline["mean"] / jnp.maximum(baseline["weight"], 1e-12), 0.0
    )
    surrogate = (
        score_function_surrogate(aux["log_prob"], to_come, per_token * remaining)
        - entropy_weight * aux["entropy"]
    )
    batch_mean = token_lp.sum() / jnp.maximum(real.sum(), 1)
    new_baseline = {
        "mean": decay * baseline["mean"] + (1.0 - decay) * batch_mean,
        "weight": decay * baseline["weight"] + (1.0 - decay),
    }
    return jnp.sum(jnp.where(real, surrogate, 0.0)), new_baseline
