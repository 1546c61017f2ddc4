"""Checks shared by the baseline tests (test_seq2seq.py, test_convs2s.py).

Each takes any model that follows the translation-model protocol. Model calls go through
`jit_apply`, compiled once per (model, method, shapes): on the CPU the compile, not the run,
is what a test waits for, so they also compile with XLA's cheap settings.
"""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax

from transformer_jax.decoding import decode

PAD, BOS, EOS = 0, 1, 2


@functools.cache
def _jitted(model, method, static: tuple):
    kwargs = dict(static)

    def run(params, *args, rngs=None):
        return model.apply({"params": params}, *args, method=method, rngs=rngs, **kwargs)

    return jax.jit(run)  # with the suite's cheap compile settings (fast_compile.py)


# A batch of three sentence pairs of different lengths, padded at the end.
SRC = np.array(
    [
        [5, 6, 7, 8, 9, 10, 11, 2, 0, 0],
        [12, 13, 2, 0, 0, 0, 0, 0, 0, 0],
        [14, 15, 16, 17, 18, 19, 20, 21, 22, 2],
    ],
    np.int32,
)
TGT = np.array([[1, 20, 21, 22, 23, 0], [1, 24, 25, 26, 27, 28], [1, 29, 30, 0, 0, 0]], np.int32)


def check_padding_invariance(model, params, logits, *, alone: bool = True) -> None:
    """`logits` (of SRC, TGT) are unchanged by more padding on both sides and, if `alone`,
    for the short middle sentence run by itself with no padding at all."""
    more = jit_apply(
        model,
        params,
        np.pad(SRC, ((0, 0), (0, 5)), constant_values=PAD),
        np.pad(TGT, ((0, 0), (0, 3)), constant_values=PAD),
    )
    chex.assert_trees_all_close(more[:, : TGT.shape[1]], logits, atol=1e-5)
    if alone:
        chex.assert_trees_all_close(
            jit_apply(model, params, SRC[1:2, :3], TGT[1:2]), logits[1:2], atol=1e-5
        )


def random_params(model, *args, seed: int = 0):
    """Parameters of model.init(key, *args) drawn by NumPy instead of by flax's initialisers.

    Only the shapes come from flax (traced, never compiled): the orthogonal initialiser of the
    GRU cells compiles a QR decomposition, slow on a CPU for what the tests need. Kernels get
    std 1 / sqrt(fan_in); biases are nonzero, so a reference checks where every bias goes.
    """
    shapes = jax.eval_shape(model.init, jax.random.key(0), *args)["params"]
    rng = np.random.default_rng(seed)

    def draw(shape):
        std = 0.3 if len(shape.shape) == 1 else shape.shape[-2] ** -0.5
        return jnp.asarray(rng.normal(0.0, std, shape.shape), jnp.float32)

    return jax.tree_util.tree_map(draw, shapes)


def jit_apply(model, params, *args, method=None, rngs=None, **static):
    """model.apply({'params': params}, *args, method=method, **static), jitted and cached."""
    return _jitted(model, method, tuple(sorted(static.items())))(params, *args, rngs=rngs)


def _decode_step(module, tokens, cache, index):
    return module.decode_step(tokens, cache, index=index)


def run_cached(model, params, src, tgt) -> jax.Array:
    """Feeds tgt [B, T] one token at a time through decode_step; -> logits [B, T, V]."""
    cache = jit_apply(model, params, src, method="init_decode_cache", max_len=tgt.shape[1])
    for leaf in jax.tree_util.tree_leaves(cache):
        assert leaf.shape[0] == src.shape[0]  # beam search repeats / gathers axis 0
    out = []
    for i in range(tgt.shape[1]):
        logits, cache = jit_apply(
            model, params, jnp.asarray(tgt[:, i]), cache, jnp.int32(i), method=_decode_step
        )
        out.append(logits)
    return jnp.stack(out, axis=1)


def masked_log_softmax(logits) -> np.ndarray:
    """Log-probs with pad and bos impossible, as transformer_jax.decoding.search scores tokens."""
    vocab = jnp.arange(logits.shape[-1])
    logits = jnp.where((vocab == PAD) | (vocab == BOS), -jnp.inf, logits)
    return np.asarray(jax.nn.log_softmax(logits, axis=-1))


def chosen_mask(tokens: np.ndarray) -> np.ndarray:
    """True up to and including each row's first EOS: the positions a decoder chose."""
    eos = tokens == EOS
    return (np.cumsum(eos, axis=-1) - eos) == 0


def teacher_forced_log_probs(model, params, src, out_tokens) -> np.ndarray:
    """Log-probs [B, L, V] of the teacher-forced pass over a decoder's own output [B, L]."""
    tgt_in = np.concatenate([np.full((len(src), 1), BOS), out_tokens[:, :-1]], axis=1)
    return masked_log_softmax(jit_apply(model, params, src, tgt_in.astype(np.int32)))


def check_greedy_and_beam(model, params, src, *, max_len=7, beam_size=3) -> None:
    """Greedy output == argmax of the teacher-forced pass over it; beam scores == the
    length-normalised teacher-forced log-prob of each hypothesis (so the cache follows its beam
    when the search reorders rows)."""
    greedy = np.asarray(decode.greedy_decode(model, params, src, max_len=max_len))
    chosen = chosen_mask(greedy)
    argmax = teacher_forced_log_probs(model, params, src, greedy).argmax(-1)
    np.testing.assert_array_equal(np.where(chosen, argmax, -1), np.where(chosen, greedy, -1))
    assert np.all(greedy[~chosen] == PAD)

    beams, scores = decode.beam_search(model, params, src, beam_size=beam_size, max_len=max_len)
    beams, scores = np.asarray(beams), np.asarray(scores)
    for w in range(beam_size):
        hyp = beams[:, w]
        lp = teacher_forced_log_probs(model, params, src, hyp)
        chosen = chosen_mask(hyp)
        token_lp = np.take_along_axis(lp, hyp[..., None], axis=-1)[..., 0]
        total = np.where(chosen, token_lp, 0.0).sum(-1)
        penalty = ((5.0 + chosen.sum(-1)) / 6.0) ** 0.6
        chex.assert_trees_all_close(scores[:, w], total / penalty, atol=1e-4, rtol=1e-4)
    assert np.all(np.diff(scores, axis=1) <= 1e-6)  # best first


# Four sentence pairs: the decoder input starts with BOS, the output ends with EOS.
OVERFIT_SRC = np.array(
    [[5, 6, 7, 2, 0], [8, 9, 10, 11, 2], [12, 13, 2, 0, 0], [14, 15, 16, 17, 2]], np.int32
)
OVERFIT_TGT = np.array(
    [[1, 20, 21, 22, 2, 0], [1, 23, 24, 2, 0, 0], [1, 25, 26, 27, 28, 2], [1, 29, 20, 25, 2, 0]],
    np.int32,
)


def overfit_losses(model, *, steps: int, lr: float = 1e-2) -> tuple[float, float]:
    """Adam on the four OVERFIT pairs (loss over non-pad targets); -> (first, last) loss."""
    src, tgt_in, tgt_out = OVERFIT_SRC, OVERFIT_TGT[:, :-1], OVERFIT_TGT[:, 1:]
    weights = (tgt_out != PAD).astype(np.float32)
    opt = optax.adam(lr)

    def loss_fn(params):
        logits = model.apply({"params": params}, src, tgt_in)
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, tgt_out)
        return (losses * weights).sum() / weights.sum()

    @jax.jit
    def train(params):
        def step(carry, _):
            params, state = carry
            loss, grads = jax.value_and_grad(loss_fn)(params)
            updates, state = opt.update(grads, state, params)
            return (optax.apply_updates(params, updates), state), loss

        _, losses = jax.lax.scan(step, (params, opt.init(params)), None, length=steps)
        return losses

    losses = train(random_params(model, src, tgt_in))
    return float(losses[0]), float(losses[-1])
