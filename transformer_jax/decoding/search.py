"""Greedy and beam search over a plain step function: pure, jittable, and blind to models.

`search_greedy` and `search_beam` take a step function
`step_fn(tokens [R], cache, index) -> (logits [R, V], cache)` and know nothing of models, so
they can be tested on hand-written logits. `transformer_jax.decoding.decode` runs them on a
translation model's `decode_step`, as one program or driven from the host a few steps at a
time; both are built from `Parts`, a search as a loop over fixed shapes.

Shapes (transformer_jax/shapes.py): B batch, W beams, O = max_len output positions, V vocabulary,
R = B * W rows fed to the step function.

Conventions shared by both searches:
  * Decoding starts from BOS at position 0; the token decoded at step i is fed back at step i+1.
  * pad_id and bos_id are never emitted: their logits are set to -inf before the softmax, so
    log-probabilities are renormalised over the tokens that may be emitted.
  * After EOS a row emits only pad_id; once every row has ended the `lax.while_loop` stops.
  * Everything traces under `jit` with fixed shapes (nothing recompiles). A model whose cache
    grows with the output (the Transformer's self-attention keys/values) and that answers
    `grow_decode_cache` is decoded in stages (`cache_stages`): a cache of 16 positions while
    the outputs are at most 16 long, then 32, 64, ... up to O, each stage its own
    `lax.while_loop` over fixed shapes. A step's attention and a beam's reorder then cost
    about the positions written so far rather than O. Every stage is compiled, so a search
    compiles about log2(O / 16) + 1 loop bodies.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

Array = jax.Array
Cache = Any
# step_fn(tokens [R] int32, cache, index int32 scalar) -> (logits [R, V], cache)
StepFn = Callable[[Array, Cache, Array], tuple[Array, Cache]]
# grow(cache, positions) -> the cache with room for that many positions (the new ones empty)
GrowFn = Callable[[Cache, int], Cache]
# expand(cache, beams) -> the cache of B sentences as the state of B * beams beam rows
ExpandFn = Callable[[Cache, int], Cache]
# reorder(cache, parent [B, W]) -> the cache after slot w took the hypothesis of parent[b, w]
ReorderFn = Callable[[Cache, Array], Cache]


def _masked_logits(logits: Array, *, pad_id: int, bos_id: int) -> Array:
    """[R, V] logits -> [R, V] float32 with pad and bos impossible (-inf): no search emits
    either."""
    vocab = jnp.arange(logits.shape[-1])
    return jnp.where((vocab == pad_id) | (vocab == bos_id), -jnp.inf, logits.astype(jnp.float32))


def _allowed_log_probs(logits: Array, *, pad_id: int, bos_id: int) -> Array:
    """[R, V] logits -> [R, V] float32 log-probs with pad and bos impossible (-inf)."""
    return jax.nn.log_softmax(_masked_logits(logits, pad_id=pad_id, bos_id=bos_id), axis=-1)


def _argmax(x: Array) -> Array:
    """[R, V] -> [R] int32: `jnp.argmax(x, axis=-1)` (the first maximum; a NaN counts as the
    maximum, as there) as two plain reductions, a max and a min over the indices that reach
    it. XLA:CPU runs argmax's paired (value, index) reduction unvectorised, at about twice the
    time (`benchmarks/decode_2026-11-27b/`)."""
    best = jnp.max(x, axis=-1, keepdims=True)
    index = lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    hit = (x == best) | jnp.isnan(x)
    return jnp.min(jnp.where(hit, index, x.shape[-1]), axis=-1)


# Chunk width of `_beam_candidates`' first pass.
_TOP_K_CHUNK = 32


def _candidate_lp(x: Array, is_pad: Array, shift: Array, lse: Array, lp: Array, finished: Array):
    """A beam step's candidate log-probs from masked logits `x` (any entries of a row, or a
    chunk's maximum): (x - shift) - lse is `jax.nn.log_softmax`'s own arithmetic (shift: the
    row's maximum, lse: log of the sum of exp(x - shift)); an alive hypothesis (log-prob lp)
    adds it, a finished one offers only itself, followed by pad. Every argument broadcasts
    against x."""
    return jnp.where(finished, jnp.where(is_pad, lp, -jnp.inf), lp + ((x - shift) - lse))


def _beam_candidates(
    logits: Array,
    log_prob: Array,
    finished: Array,
    penalty: Array,
    *,
    k: int,
    pad_id: int,
    bos_id: int,
) -> tuple[Array, Array]:
    """A beam step's selection: the k best candidates by length-normalised score.

    Args:
      logits: [B * W, V] the step's logits (pad and bos are masked here).
      log_prob, finished: [B, W] the hypotheses' total log-probs and whether they have ended.
      penalty: [B, W] the length penalty each hypothesis' candidates are divided by.
    Returns:
      cand_lp [B, k] float32, the chosen candidates' total log-probs, and flat [B, k] int32,
      their indices in [W * V] (beam w's token t at w * V + t), best first: exactly
      `lax.top_k` of the scores cand_lp / penalty over [B, W * V], ties to the lower index.

    The scores are never written out. Within a beam row every candidate's score is the same
    non-decreasing function of its masked logit (float rounding is monotone), so a chunk of
    `_TOP_K_CHUNK` logits has the score of its largest. The k best candidates lie in the k
    chunks with the best scores (a chunk left out has k chunks ahead of it, each holding a
    candidate ahead of all of its own), and only those k * `_TOP_K_CHUNK` candidates are
    scored, by the very same arithmetic. A row's logits are read twice (chunk maxima, then
    the softmax sum). Before, the scores of all [B, W * V] candidates were written twice
    (for the chunk maxima and for the gather, each behind a padding copy): a beam step of
    the OPUS-MT-sized model is faster for it (`benchmarks/decode_2026-11-27c/`).
    """
    b, w = log_prob.shape
    v = logits.shape[-1]
    width = _TOP_K_CHUNK
    vocab = jnp.arange(v)
    x = _masked_logits(logits, pad_id=pad_id, bos_id=bos_id).reshape(b, w, v)
    lp, done, pen = log_prob[..., None], finished[..., None], penalty[..., None]
    if v < 2 * width:  # too few chunks to leave any out: score every candidate
        cand = _candidate_lp(x, vocab == pad_id, *_log_softmax_terms(x), lp, done)
        _, flat = lax.top_k((cand / pen).reshape(b, w * v), k)
        return jnp.take_along_axis(cand.reshape(b, w * v), flat, axis=1), flat.astype(jnp.int32)

    whole = v - v % width
    chunk_max = jnp.max(x[..., :whole].reshape(b, w, whole // width, width), axis=-1)
    if whole < v:  # the row's last, shorter chunk
        chunk_max = jnp.concatenate([chunk_max, jnp.max(x[..., whole:], -1, keepdims=True)], -1)
    chunks = chunk_max.shape[-1]
    # [B, W, 1]: the row's maximum, from the chunk maxima rather than a third read of the row
    shift, lse = _log_softmax_terms(x, jnp.max(chunk_max, axis=-1, keepdims=True))
    has_pad = jnp.arange(chunks) == pad_id // width
    chunk_score = _candidate_lp(chunk_max, has_pad, shift, lse, lp, done) / pen  # [B, W, C]
    best = _top_k_order(_float_order(chunk_score).reshape(b, w * chunks), k)
    best = jnp.sort(best, axis=-1)  # index order, so that ties still go to the lower index
    beam, chunk = best // chunks, best % chunks  # [B, k]

    def per_beam(y: Array) -> Array:  # [B, W, 1] -> [B, k, 1]: the chosen chunks' rows
        return jnp.take_along_axis(y, beam[..., None], axis=1)

    token = chunk[..., None] * width + jnp.arange(width)  # [B, k, width]
    inside = token < v
    token = jnp.minimum(token, v - 1)
    index = (beam[..., None] * v + token).reshape(b, -1)  # [B, k * width] in [W * V]
    near = jnp.take_along_axis(x.reshape(b, w * v), index, axis=1)
    cand = _candidate_lp(
        near.reshape(token.shape),
        token == pad_id,
        per_beam(shift),
        per_beam(lse),
        per_beam(lp),
        per_beam(done),
    )
    # The chunks are in index order, so top_k's ties go to the lower index, as over every
    # candidate. But a last chunk's positions past the vocabulary (beam w's, between w's last
    # token and w + 1's first) must lose even to an impossible (-inf) candidate, so the
    # scores are ranked as integers of the same order, with room below -inf.
    order = _float_order(cand / per_beam(pen))
    order = jnp.where(inside, order, jnp.iinfo(jnp.int32).min).reshape(b, -1)
    at = _top_k_order(order, k)  # [B, k] positions among the k * width scored
    flat = jnp.take_along_axis(index, at, axis=1).astype(jnp.int32)
    return jnp.take_along_axis(cand.reshape(b, -1), at, axis=1), flat


def _top_k_order(order: Array, k: int) -> Array:
    """`lax.top_k(order, k)[1]` of [R, N] int32 with N >= k, as k rounds of a max and the
    first index that reaches it, each pick then set to the int32 minimum: XLA:CPU's TopK
    sorts the row, and sorts int32 far slower (`benchmarks/decode_2026-11-27c/`). At least k
    entries must be above the int32
    minimum (a pick becomes it, and may be picked again after those)."""
    n = order.shape[-1]
    index = lax.broadcasted_iota(jnp.int32, order.shape, order.ndim - 1)
    picks = []
    for _ in range(k):
        top = jnp.max(order, axis=-1, keepdims=True)
        pick = jnp.min(jnp.where(order == top, index, n), axis=-1, keepdims=True)
        picks.append(pick)
        order = jnp.where(index == pick, jnp.iinfo(jnp.int32).min, order)
    return jnp.concatenate(picks, axis=-1)


def _float_order(x: Array) -> Array:
    """float32 -> int32 of the same order (NaN-free; -0.0 and 0.0 equal, as `lax.top_k` has
    them): a negative float's bits read as an integer fall as the float rises, so they are
    mirrored."""
    bits = lax.bitcast_convert_type(jnp.where(x == 0, 0.0, x), jnp.int32)
    return jnp.where(bits < 0, bits ^ jnp.int32(0x7FFFFFFF), bits)


def _log_softmax_terms(x: Array, shift: Array | None = None) -> tuple[Array, Array]:
    """[..., V] masked logits -> (shift, lse) [..., 1]: `jax.nn.log_softmax(x)` is
    (x - shift) - lse. shift: the rows' maxima when the caller has them already (None:
    computed here)."""
    if shift is None:
        shift = jnp.max(x, axis=-1, keepdims=True)
    return shift, jnp.log(jnp.sum(jnp.exp(x - shift), axis=-1, keepdims=True))


def cache_stages(max_len: int, first: int = 16) -> tuple[int, ...]:
    """The cache lengths a staged search runs through: first, 2 * first, ... below max_len,
    then max_len (just (max_len,) when max_len <= first)."""
    if first < 1:
        raise ValueError(f"the first cache stage must be at least 1 position, got {first}")
    stages = []
    while first < max_len:
        stages.append(first)
        first *= 2
    return (*stages, max_len)


def staged_while_loop(cond, body, state, *, stages: Sequence[int], grow: GrowFn | None):
    """`lax.while_loop(cond, body, state)`, run as one loop per stage: the loop of stage k also
    stops at step stages[k], and before it the cache (the state's last element, sized for
    stages[k - 1] positions) is grown to stages[k]. State element 0 is the step index."""
    if len(stages) > 1 and grow is None:
        raise ValueError(f"decoding in stages {tuple(stages)} needs a grow function")
    for k, limit in enumerate(stages):
        if k:
            state = (*state[:-1], grow(state[-1], limit))
        state = lax.while_loop(lambda st, limit=limit: cond(st) & (st[0] < limit), body, state)
    return state


class Parts(NamedTuple):
    """A search as a loop over fixed shapes, for `search_greedy` / `search_beam` and for the
    programs of `transformer_jax.decoding.decode`, which drive it from the host and drop finished
    sentences.

    init(cache) -> state; cond(state) -> bool scalar; body(state) -> state. State element 0 is
    the step index, the last the step function's cache; every other leaf leads with the batch
    (B, or B * W beam rows in batch-major order).
    done(state) -> [B] bool: the sentences whose outputs no later step changes (every
    hypothesis has ended; or only beam 0 is returned and it is final), so they may leave the
    batch.
    outputs(state) -> the search's result, every array leading with B.
    """

    init: Callable[[Cache], tuple]
    cond: Callable[[tuple], Array]
    body: Callable[[tuple], tuple]
    done: Callable[[tuple], Array]
    outputs: Callable[[tuple], tuple[Array, ...]]


def greedy_parts(
    step_fn: StepFn, *, batch_size: int, max_len: int, bos_id: int, eos_id: int, pad_id: int
) -> Parts:
    """Greedy decoding as a loop (`search_greedy`): state (i, tokens [B, O], last [B],
    finished [B], cache)."""

    def cond(state):
        i, _, _, finished, _ = state
        return (i < max_len) & ~jnp.all(finished)

    def body(state):
        i, tokens, last, finished, cache = state
        logits, cache = step_fn(last, cache, i)
        # argmax of the log-probs (not of the raw logits) so that beam_size=1 ranks the very
        # same float32 numbers and returns exactly this output.
        nxt = _argmax(_allowed_log_probs(logits, pad_id=pad_id, bos_id=bos_id))
        nxt = jnp.where(finished, pad_id, nxt).astype(jnp.int32)
        tokens = lax.dynamic_update_slice(tokens, nxt[:, None], (0, i))
        return i + 1, tokens, nxt, finished | (nxt == eos_id), cache

    def init(cache):
        return (
            jnp.zeros((), jnp.int32),
            jnp.full((batch_size, max_len), pad_id, jnp.int32),
            jnp.full((batch_size,), bos_id, jnp.int32),
            jnp.zeros((batch_size,), bool),
            cache,
        )

    # A finished row only writes pad over pad from then on.
    return Parts(init, cond, body, done=lambda state: state[3], outputs=lambda state: (state[1],))


def gnmt_length_penalty(length: Array, alpha: float) -> Array:
    """GNMT length penalty ((5 + length) / 6) ** alpha (Wu et al. 2016, eq. 14), float32."""
    return ((5.0 + length.astype(jnp.float32)) / 6.0) ** alpha


def search_greedy(
    step_fn: StepFn,
    cache: Cache,
    *,
    batch_size: int,
    max_len: int,
    bos_id: int,
    eos_id: int,
    pad_id: int,
    stages: Sequence[int] | None = None,
    grow: GrowFn | None = None,
) -> Array:
    """Greedy decoding with any step function.

    Args:
      step_fn: (tokens [B], cache, index) -> (logits [B, V], cache).
      cache: the step function's initial state (for a model: `init_decode_cache(src, ...)`),
        with room for stages[0] positions.
      batch_size: B.
      max_len: O, the number of output positions.
      stages: the cache lengths to decode in (`cache_stages`; ending in O); None: (O,), one
        loop over a cache of O positions.
      grow: grows the cache between stages (a model's `grow_decode_cache`).
    Returns:
      [B, O] int32 tokens after BOS: the argmax at each step, pad_id after EOS.
    """

    parts = greedy_parts(
        step_fn, batch_size=batch_size, max_len=max_len, bos_id=bos_id, eos_id=eos_id, pad_id=pad_id
    )
    state = staged_while_loop(
        parts.cond, parts.body, parts.init(cache), stages=stages or (max_len,), grow=grow
    )
    return state[1]


def search_beam(
    step_fn: StepFn,
    cache: Cache,
    *,
    batch_size: int,
    beam_size: int,
    max_len: int,
    bos_id: int,
    eos_id: int,
    pad_id: int,
    length_penalty_alpha: float = 0.6,
    best_only: bool = False,
    with_steps: bool = False,
    stages: Sequence[int] | None = None,
    grow: GrowFn | None = None,
    expand: ExpandFn | None = None,
    reorder: ReorderFn | None = None,
) -> tuple[Array, Array] | tuple[Array, Array, Array]:
    """Beam search with any step function.

    Each of the W beam slots holds one hypothesis, alive or finished. At every step the
    candidates are each alive hypothesis extended by every allowed token, plus each finished
    hypothesis unchanged (extended by pad at no cost); the W with the best length-normalised
    score log P / lp(len) survive. All alive candidates share one length, so among them this is
    plain log-prob ranking; the normalisation only decides between finished and alive ones. A
    finished hypothesis keeps its slot, which is what makes beam_size=1 exactly greedy.

    Slots that never receive a possible candidate (W larger than the number of distinct
    hypotheses) hold pad tokens and score -inf.

    Args:
      step_fn: (tokens [B*W], cache, index) -> (logits [B*W, V], cache); batch-major rows,
        beam w of example b at row b * W + w.
      cache: initial state with leading axis B (NOT repeated per beam; this repeats it).
      batch_size: B.
      beam_size: W.
      max_len: O.
      length_penalty_alpha: alpha of the GNMT length penalty; 0 ranks by total log-prob.
      best_only: stop as soon as no example's best finished hypothesis can be beaten any more
        (see `_best_is_final`). Beam 0 (tokens and score) is then exactly what the full search
        returns; beams 1.. are the beam as it stood when the search stopped.
      with_steps: also return the number of decoding steps the search ran (int32 scalar).
      stages, grow: decode in stages of cache length, as `search_greedy`.
      expand: makes the B-row cache the state of B * W rows (a model's
        `expand_decode_cache`); None: every leaf repeated W times.
      reorder: moves the state after each step's selection (a model's
        `reorder_decode_cache`); None: every leaf the step changed is gathered by parent.
    Returns:
      tokens [B, W, O] int32 (pad after EOS) and scores [B, W] float32, best first; a score is
      the total log-prob (EOS included) divided by ((5 + len) / 6) ** alpha, len counting EOS.
      With `with_steps`, the step count as a third value.
    """
    parts = beam_parts(
        step_fn,
        batch_size=batch_size,
        beam_size=beam_size,
        max_len=max_len,
        bos_id=bos_id,
        eos_id=eos_id,
        pad_id=pad_id,
        length_penalty_alpha=length_penalty_alpha,
        best_only=best_only,
        expand=expand,
        reorder=reorder,
    )
    state = staged_while_loop(
        parts.cond, parts.body, parts.init(cache), stages=stages or (max_len,), grow=grow
    )
    tokens, scores = parts.outputs(state)
    return (tokens, scores, state[0]) if with_steps else (tokens, scores)


def beam_parts(
    step_fn: StepFn,
    *,
    batch_size: int,
    beam_size: int,
    max_len: int,
    bos_id: int,
    eos_id: int,
    pad_id: int,
    length_penalty_alpha: float | Array,
    best_only: bool,
    expand: ExpandFn | None,
    reorder: ReorderFn | None,
    return_beams: int | None = None,
) -> Parts:
    """Beam search as a loop (`search_beam`, whose arguments these are): state (i, tokens
    [B, W, O], last [B, W], log_prob [B, W], lengths [B, W], finished [B, W], cache).

    return_beams: the outputs hold the first this many beams (None: all W). With best_only
    and 1, a sentence is done once its best is final: nothing it returns changes after that.
    """
    b_, w_ = batch_size, beam_size
    best_leaves = best_only and return_beams == 1

    def cond(state):
        i, _, _, log_prob, lengths, finished, _ = state
        done = jnp.all(finished)
        if best_only:
            done = done | jnp.all(
                _best_is_final(
                    log_prob, lengths, finished, max_len=max_len, alpha=length_penalty_alpha
                )
            )
        return (i < max_len) & ~done

    def body(state):
        i, tokens, last, log_prob, lengths, finished, old_cache = state
        logits, cache = step_fn(last.reshape(b_ * w_), old_cache, i)
        v_ = logits.shape[-1]
        # Each alive hypothesis extended by every allowed token, each finished one by pad at
        # no cost; the W best by score log P / lp(len), best first.
        cand_len = jnp.where(finished, lengths, i + 1)  # [B, W]
        log_prob, flat = _beam_candidates(
            logits,
            log_prob,
            finished,
            gnmt_length_penalty(cand_len, length_penalty_alpha),
            k=w_,
            pad_id=pad_id,
            bos_id=bos_id,
        )
        parent, token = flat // v_, (flat % v_).astype(jnp.int32)
        lengths = jnp.take_along_axis(cand_len, parent, axis=1)
        parent_finished = jnp.take_along_axis(finished, parent, axis=1)
        # An impossible candidate (-inf) only fills a slot nothing else could: it is dead.
        dead = log_prob == -jnp.inf
        token = jnp.where(parent_finished | dead, pad_id, token)
        tokens = jnp.take_along_axis(tokens, parent[..., None], axis=1)
        tokens = lax.dynamic_update_slice(tokens, token[..., None], (0, 0, i))
        finished = parent_finished | dead | (token == eos_id)
        if reorder is not None:
            cache = reorder(cache, parent)
        else:
            # A leaf the step function hands back untouched (the very same traced value:
            # encoder keys/values, the source mask) was repeated per beam and has only ever
            # been permuted within its sentence, so all W copies are equal and reordering it
            # is the identity (or `expand` left it at one row per sentence, which no reorder
            # touches). Skipping that gather is exact and saves moving [B*W, S, ...] a step.
            rows = (jnp.arange(b_)[:, None] * w_ + parent).reshape(b_ * w_)
            cache = jax.tree_util.tree_map(
                lambda new, old: new if new is old else new[rows], cache, old_cache
            )
        return i + 1, tokens, token, log_prob, lengths, finished, cache

    # Every slot starts from the same BOS; only slot 0 may expand at step 0, else the first
    # step would fill the beam with W copies of the same hypothesis.

    def init(cache):
        init_lp = jnp.where(jnp.arange(w_) == 0, 0.0, -jnp.inf)
        if expand is None:
            cache = jax.tree_util.tree_map(lambda x: jnp.repeat(x, w_, axis=0), cache)
        else:
            cache = expand(cache, w_)
        return (
            jnp.zeros((), jnp.int32),
            jnp.full((b_, w_, max_len), pad_id, jnp.int32),
            jnp.full((b_, w_), bos_id, jnp.int32),
            jnp.broadcast_to(init_lp, (b_, w_)).astype(jnp.float32),
            jnp.zeros((b_, w_), jnp.int32),
            jnp.zeros((b_, w_), bool),
            cache,
        )

    def done(state):
        # A sentence whose every slot has ended (finished or dead) is a fixed point of the
        # step: each slot offers only itself, and top_k keeps the slots in their order.
        _, _, _, log_prob, lengths, finished, _ = state
        ended = jnp.all(finished, axis=1)
        if best_leaves:
            # Only beam 0 is returned, and it is fixed once the best is final; the other
            # beams would still change, which is why `best_only` alone does not allow this.
            ended = ended | _best_is_final(
                log_prob, lengths, finished, max_len=max_len, alpha=length_penalty_alpha
            )
        return ended

    def outputs(state):
        _, tokens, _, log_prob, lengths, _, _ = state
        # The last top_k sorted by exactly these scores, so the slots are already best first.
        scores = log_prob / gnmt_length_penalty(lengths, length_penalty_alpha)
        return tokens[:, :return_beams], scores[:, :return_beams]

    return Parts(init, cond, body, done, outputs)


def _best_is_final(
    log_prob: Array, lengths: Array, finished: Array, *, max_len: int, alpha: float
) -> Array:
    """[B] bool: no alive hypothesis of the example can still end with a score that reaches its
    best finished one, so its beam 0 will not change again (`search_beam(best_only=True)`).

    Args: log_prob [B, W] total log-probs, lengths [B, W], finished [B, W] (the loop state).

    The bound. Write p(n) = ((5 + n) / 6) ** alpha > 0 for the penalty. An alive hypothesis
    with total log-prob s <= 0 at length n ends (by EOS, or still alive at O) with some
    s' <= s (each step adds a log-prob <= 0, and float32 addition of a number <= 0 never
    rounds up) at a length n' in (n, O], so its final score s' / p(n') <= s / p(n'). With
    s <= 0 that is largest where the penalty is largest: every final score is at most
    s / max_{n' >= n} p(n'), which is s / p(O) when alpha >= 0 (dividing a negative log-prob
    by the LONGER hypothesis's larger penalty makes it less negative, so the bound is not
    s / p(n)), and s / p(n) when alpha < 0. The maximum is taken over the penalties as this
    function computes them, not over a formula for them.
    A finished hypothesis keeps its score and its slot, and a candidate evicts it only by
    scoring higher; so once the best finished score is above every alive bound, beam 0 is
    final.

    The comparison is strict and keeps a margin of 1e-5 relative (1e-6 absolute) for the
    float32 rounding of the sums and quotients: a tie or a near-tie goes on searching, and
    the top_k order of exact ties never comes into it. A search that stops later than
    necessary only costs time; one that stopped too early would change the answer.
    """
    penalty = gnmt_length_penalty(jnp.arange(max_len + 1), alpha)  # [O + 1]
    # Largest penalty at any length >= n, for each n: a reversed running maximum.
    largest_from = lax.cummax(penalty, reverse=True)  # [O + 1]
    alive_bound = jnp.where(finished, -jnp.inf, log_prob / largest_from[lengths])  # [B, W]
    finished_score = jnp.where(
        finished, log_prob / gnmt_length_penalty(lengths, alpha), -jnp.inf
    )  # [B, W]
    best = jnp.max(finished_score, axis=1)  # [B]; -inf while none has finished
    reach = jnp.max(alive_bound, axis=1)  # [B]
    margin = 1e-5 * jnp.abs(best) + 1e-6
    return (best > -jnp.inf) & (reach < best - margin)
