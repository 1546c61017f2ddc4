"""Decoding on hand-written step functions, checked against brute-force enumeration in NumPy.

The model-level checks (cached decoding equals the full forward pass, beam_size=1 equals greedy
on a Transformer) are in test_transformer_decode.py.
"""

from __future__ import annotations

import functools
import itertools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax.decoding.search import search_beam, search_greedy

PAD, BOS, EOS = 0, 1, 2
SPECIAL = dict(pad_id=PAD, bos_id=BOS, eos_id=EOS)


# ---------------------------------------------------------------- a prefix-dependent toy "model"
# The logits at each step are a random table looked up by a hash of the WHOLE prefix (and of
# the example), so a beam search that reorders its cache wrongly gets different logits.

V = 6
L = 3
P = 4099  # table rows; hash collisions are harmless since NumPy and JAX share the table
TABLE = np.random.default_rng(0).normal(size=(P, V)).astype(np.float32) * 2.0


def _code(example: int, prefix: list[int]) -> int:
    code = example + 1
    for tok in prefix:
        code = (code * 7 + tok + 1) % P
    return code


def _np_log_probs(example: int, prefix: list[int]) -> np.ndarray:
    logits = TABLE[_code(example, prefix)].astype(np.float64)
    logits[[PAD, BOS]] = -np.inf
    m = logits.max()
    return logits - m - np.log(np.exp(logits - m).sum())


def _init_cache(batch: int):
    return {
        "example": jnp.arange(batch, dtype=jnp.int32),
        "code": jnp.arange(batch, dtype=jnp.int32) + 1,
    }


def _step_fn(tokens, cache, index):
    del index  # the prefix hash already encodes the position
    code = (cache["code"] * 7 + tokens + 1) % P
    return jnp.asarray(TABLE)[code], {"example": cache["example"], "code": code}


def _brute_force(example: int, alpha: float) -> list[tuple[float, list[int]]]:
    """Every hypothesis (ended by EOS, or L tokens long) with its GNMT score, best first."""
    hyps = []
    for n in range(1, L + 1):
        for seq in itertools.product([EOS, 3, 4, 5], repeat=n):
            if EOS in seq[:-1] or (n < L and seq[-1] != EOS):
                continue
            prefix, lp = [BOS], 0.0
            for tok in seq:
                lp += _np_log_probs(example, prefix)[tok]
                prefix.append(tok)
            hyps.append((lp / ((5.0 + n) / 6.0) ** alpha, list(seq) + [PAD] * (L - n)))
    return sorted(hyps, key=lambda h: -h[0])


def _np_greedy(example: int) -> list[int]:
    prefix, out = [BOS], []
    for _ in range(L):
        tok = int(np.argmax(_np_log_probs(example, prefix)))
        out.append(tok)
        prefix.append(tok)
        if tok == EOS:
            break
    return out + [PAD] * (L - len(out))


@functools.partial(jax.jit, static_argnames=("batch", "beam", "alpha", "max_len"))
def _beam(batch, beam, alpha, max_len=L, step_fn=_step_fn):
    return search_beam(
        step_fn,
        _init_cache(batch),
        batch_size=batch,
        beam_size=beam,
        max_len=max_len,
        length_penalty_alpha=alpha,
        **SPECIAL,
    )


@functools.partial(jax.jit, static_argnames=("batch",))
def _greedy(batch):
    return search_greedy(_step_fn, _init_cache(batch), batch_size=batch, max_len=L, **SPECIAL)


# ----------------------------------------------------------------------------------- tests


@pytest.mark.parametrize("alpha", [0.0, 0.6, 1.0])
def test_exhaustive_beam_equals_brute_force_ranking(alpha):
    # 1 + 3 + 9 + 27 = 40 hypotheses; a beam of 40 never has to prune, so it must return
    # exactly the brute-force ranking.
    n_hyps = 40
    tokens, scores = _beam(3, n_hyps, alpha)
    chex.assert_shape(tokens, (3, n_hyps, L))
    chex.assert_shape(scores, (3, n_hyps))
    for b in range(3):
        expected = _brute_force(b, alpha)
        assert len(expected) == n_hyps
        np.testing.assert_array_equal(np.asarray(tokens[b]), np.array([h[1] for h in expected]))
        chex.assert_trees_all_close(
            np.asarray(scores[b]),
            np.array([h[0] for h in expected], np.float32),
            rtol=1e-5,
            atol=1e-5,
        )


def test_small_beam_returns_best_first_and_valid_scores():
    tokens, scores = _beam(3, 4, 0.6)
    s = np.asarray(scores)
    assert np.all(np.diff(s, axis=1) <= 0), "scores must be sorted best first"
    for b in range(3):
        table = {tuple(h[1]): h[0] for h in _brute_force(b, 0.6)}
        for w in range(4):
            # Each returned hypothesis is a real one, with its true score.
            np.testing.assert_allclose(s[b, w], table[tuple(np.asarray(tokens[b, w]))], rtol=1e-5)
        # The top beam can be no better than the true optimum.
        assert s[b, 0] <= _brute_force(b, 0.6)[0][0] + 1e-5


def test_greedy_equals_numpy_greedy():
    got = np.asarray(_greedy(3))
    np.testing.assert_array_equal(got, np.array([_np_greedy(b) for b in range(3)]))


def test_beam_one_equals_greedy():
    tokens, _ = _beam(3, 1, 0.6)
    np.testing.assert_array_equal(np.asarray(tokens[:, 0]), np.asarray(_greedy(3)))


def test_beam_ranks_hand_written_probabilities():
    # Step 0: P(3) = .5, P(4) = .4, P(EOS) = .1. After 3: EOS/3/4 each about 1/3.
    # After 4: EOS .9. Greedy takes 3 and ends with P = .5 * .34; beam 2 must find 4 EOS (.36).
    probs0 = np.array([0, 0, 0.1, 0.5, 0.4])
    after = {3: np.array([0, 0, 0.34, 0.33, 0.33]), 4: np.array([0, 0, 0.9, 0.05, 0.05])}

    # The logits depend only on the last token (BOS at step 0, then the first emitted one).
    table = jnp.log(jnp.stack([probs0, probs0, probs0, after[3], after[4]]) + 1e-30)

    def step_fn(tokens, cache, index):
        return table[tokens], cache

    cache = jnp.zeros((1,), jnp.int32)
    run = jax.jit(
        lambda w: search_beam(
            step_fn,
            cache,
            batch_size=1,
            beam_size=w,
            max_len=2,
            length_penalty_alpha=0.0,
            **SPECIAL,
        ),
        static_argnums=0,
    )
    tokens, scores = run(2)
    np.testing.assert_array_equal(np.asarray(tokens[0]), [[4, EOS], [3, EOS]])
    chex.assert_trees_all_close(np.asarray(scores[0]), np.log([0.4 * 0.9, 0.5 * 0.34]), rtol=1e-5)
    greedy = search_greedy(step_fn, cache, batch_size=1, max_len=2, **SPECIAL)
    np.testing.assert_array_equal(np.asarray(greedy), [[3, EOS]])
    tokens1, _ = run(1)
    np.testing.assert_array_equal(np.asarray(tokens1[:, 0]), np.asarray(greedy))


def _biased_step_fn(tokens, cache, index):
    # pad and bos have by far the largest logits; EOS wins from step 1 on.
    logits = jnp.array([50.0, 40.0, -5.0, 1.0, 0.5])
    logits = jnp.where(index >= 1, logits.at[EOS].set(30.0), logits)
    return jnp.broadcast_to(logits, (tokens.shape[0], 5)), cache


def test_never_emits_pad_or_bos_and_pads_after_eos():
    cache = jnp.zeros((2,), jnp.int32)
    greedy = np.asarray(search_greedy(_biased_step_fn, cache, batch_size=2, max_len=5, **SPECIAL))
    np.testing.assert_array_equal(greedy, [[3, EOS, PAD, PAD, PAD]] * 2)
    tokens, scores = search_beam(
        _biased_step_fn, cache, batch_size=2, beam_size=3, max_len=5, **SPECIAL
    )
    tokens = np.asarray(tokens)
    assert not np.any(tokens[..., 0] == PAD) and not np.any(tokens == BOS)
    for row in tokens.reshape(-1, 5):
        if EOS in row:
            e = list(row).index(EOS)
            assert np.all(row[e + 1 :] == PAD)
            assert not np.any(row[:e] == PAD)
        else:
            assert not np.any(row == PAD)
    assert np.all(np.isfinite(np.asarray(scores)))


def test_beam_wider_than_hypotheses_leaves_dead_slots():
    # V = 5 allows EOS, 3, 4; max_len 1 has 3 hypotheses, so slots 4 and 5 are dead.
    cache = jnp.zeros((1,), jnp.int32)
    tokens, scores = search_beam(
        _biased_step_fn, cache, batch_size=1, beam_size=5, max_len=1, **SPECIAL
    )
    np.testing.assert_array_equal(np.asarray(tokens[0, :, 0]), [3, 4, EOS, PAD, PAD])
    s = np.asarray(scores[0])
    assert np.all(np.isfinite(s[:3])) and np.all(s[3:] == -np.inf)


@pytest.mark.parametrize("beam", [1, 3])
def test_a_cache_leaf_returned_untouched_decodes_as_one_reordered(beam):
    # search_beam skips reordering the leaves a step hands back unchanged (beam-invariant, like
    # encoder keys/values). A step that READS such a per-example leaf must decode exactly like
    # one returning a fresh copy of it (which the search reorders as usual).
    bias = np.random.default_rng(1).normal(size=(3, V)).astype(np.float32) * 2.0

    def step_fn(tokens, cache, index, *, copy):
        code = (cache["code"] * 7 + tokens + 1) % P
        logits = jnp.asarray(TABLE)[code] + cache["bias"]  # [N, V]: bias differs per example
        return logits, {"bias": cache["bias"] + 0.0 if copy else cache["bias"], "code": code}

    def run(copy):
        cache = {"bias": jnp.asarray(bias), "code": jnp.arange(3, dtype=jnp.int32) + 1}
        return jax.jit(
            lambda c: search_beam(
                functools.partial(step_fn, copy=copy),
                c,
                batch_size=3,
                beam_size=beam,
                max_len=L,
                length_penalty_alpha=0.6,
                **SPECIAL,
            )
        )(cache)

    (tokens, scores), (ref_tokens, ref_scores) = run(False), run(True)
    np.testing.assert_array_equal(np.asarray(tokens), np.asarray(ref_tokens))
    np.testing.assert_array_equal(np.asarray(scores), np.asarray(ref_scores))
    # The bias matters: without it the search would pick other hypotheses for some example.
    plain, _ = _beam(3, beam, 0.6)
    assert not np.array_equal(np.asarray(tokens), np.asarray(plain))


# ------------------------------------------------ best_only: stop once the best beam is final


@functools.partial(jax.jit, static_argnames=("batch", "beam", "alpha", "max_len", "best_only"))
def _beam_steps(batch, beam, alpha, max_len, best_only, eos_bias):
    def step_fn(tokens, cache, index):
        logits, new = _step_fn(tokens, cache, index)
        # A per-example EOS bias: some examples end early, others run to max_len.
        return logits.at[:, EOS].add(cache["eos_bias"]), {**new, "eos_bias": cache["eos_bias"]}

    cache = {**_init_cache(batch), "eos_bias": eos_bias}
    return search_beam(
        step_fn,
        cache,
        batch_size=batch,
        beam_size=beam,
        max_len=max_len,
        length_penalty_alpha=alpha,
        best_only=best_only,
        with_steps=True,
        **SPECIAL,
    )


@pytest.mark.parametrize("alpha", [0.0, 0.6, 1.3, 2.0])
@pytest.mark.parametrize("beam", [1, 3, 6])
def test_best_only_returns_the_full_searchs_best_beam(alpha, beam):
    # Six examples, EOS made likely (+2) down to unlikely (-3), so they finish at different
    # steps and some never do within max_len.
    eos_bias = jnp.array([2.0, 1.0, 0.0, -1.0, -2.0, -3.0])
    full_tokens, full_scores, full_steps = _beam_steps(6, beam, alpha, 12, False, eos_bias)
    tokens, scores, steps = _beam_steps(6, beam, alpha, 12, True, eos_bias)
    np.testing.assert_array_equal(np.asarray(tokens[:, 0]), np.asarray(full_tokens[:, 0]))
    np.testing.assert_array_equal(np.asarray(scores[:, 0]), np.asarray(full_scores[:, 0]))
    assert int(steps) <= int(full_steps)


def test_best_only_stops_as_soon_as_the_best_is_final():
    # At step 0 EOS has probability ~0.9; later it is all but impossible, so the full search
    # runs all max_len steps while the hypotheses it extends only lose probability. After
    # step 0, "EOS" (log .9 / lp(1)) beats anything the alive beams can reach (at best
    # log .05 / lp(max_len)), so the early-stopping search ends after one step.
    def step_fn(tokens, cache, index):
        logits = jnp.where(
            index == 0, jnp.array([0.0, 0.0, 3.0, 0.0, 0.0]), jnp.array([0.0, 0.0, -30.0, 0.0, 0.0])
        )
        return jnp.broadcast_to(
            jnp.log(jnp.array([1e-9, 1e-9, 1.0, 1.0, 1.0])) + logits, (tokens.shape[0], 5)
        ), cache

    def run(best_only, alpha):
        return jax.jit(
            lambda c: search_beam(
                step_fn,
                c,
                batch_size=2,
                beam_size=3,
                max_len=10,
                length_penalty_alpha=alpha,
                best_only=best_only,
                with_steps=True,
                **SPECIAL,
            )
        )(jnp.zeros((2,), jnp.int32))

    for alpha in (0.0, 0.6, 2.0):
        full_tokens, full_scores, full_steps = run(False, alpha)
        tokens, scores, steps = run(True, alpha)
        assert int(full_steps) == 10 and int(steps) == 1
        np.testing.assert_array_equal(np.asarray(tokens[:, 0]), [[EOS] + [PAD] * 9] * 2)
        np.testing.assert_array_equal(np.asarray(tokens[:, 0]), np.asarray(full_tokens[:, 0]))
        np.testing.assert_array_equal(np.asarray(scores[:, 0]), np.asarray(full_scores[:, 0]))
