"""Greedy and beam-search decoding of a translation model, written once for every model.

Models reach this file only through the translation-model protocol::

    init_decode_cache(src, *, max_len) -> cache      every leaf has leading axis B
    decode_step(tokens [B], cache, *, index) -> (logits [B, V], cache)
    grow_decode_cache(cache, *, max_len) -> cache    optional: room for more positions
    expand_decode_cache(cache, *, beams) -> cache    optional: B sentences -> B * W beam rows
    reorder_decode_cache(cache, parent [B, W]) -> cache   with expand: a beam step's reorder

`greedy_decode` and `beam_search` run the pure searches of `transformer_jax.decoding.search` (whose
docstring gives the conventions both share) on the model's `decode_step`, as compiled
programs. A model that answers `grow_decode_cache` is decoded in stages of cache length
(`cache_stages`). Where the source is decoded on a CPU, the host drives the search a few steps
at a time and lets finished sentences leave the batch (`_drive`); under `jit`, on a source
split over several devices or on an accelerator the search is one program
(`_drops_by_default` says why).

Shapes (transformer_jax/shapes.py): B batch, W beams, O = max_len output positions, V vocabulary.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from transformer_jax.decoding.search import (
    Array,
    Cache,
    GrowFn,
    Parts,
    StepFn,
    beam_parts,
    cache_stages,
    greedy_parts,
    staged_while_loop,
)


def model_step_fn(model, params) -> StepFn:
    """The protocol's `decode_step` as a plain step function."""

    def step_fn(tokens: Array, cache: Cache, index: Array) -> tuple[Array, Cache]:
        return model.apply({"params": params}, tokens, cache, index=index, method="decode_step")

    return step_fn


def _init_cache(model, params, src: Array, max_len: int) -> Cache:
    return model.apply({"params": params}, src, max_len=max_len, method="init_decode_cache")


def _model_stages(model, max_len: int, stages: Sequence[int] | None) -> tuple[int, ...]:
    """The cache lengths `model` is decoded in: `stages` (default `cache_stages(max_len)`) when
    it answers `grow_decode_cache`, else (max_len,); ValueError unless they rise to max_len."""
    if not hasattr(model, "grow_decode_cache"):
        stages = (max_len,)
    elif stages is None:
        stages = cache_stages(max_len)
    stages = tuple(int(n) for n in stages)
    if not stages or stages[-1] != max_len or any(a >= b for a, b in zip(stages, stages[1:])):
        raise ValueError(f"stages must rise to max_len {max_len}, got {stages}")
    return stages


def _model_grow(model, params) -> GrowFn:
    def grow(cache: Cache, positions: int) -> Cache:
        return model.apply({"params": params}, cache, max_len=positions, method="grow_decode_cache")

    return grow


def _beam_hooks(model, params) -> dict:
    """The model's `expand_decode_cache` and `reorder_decode_cache` as a search's expand and
    reorder functions, if it has them (else the search repeats and gathers every leaf)."""
    if not hasattr(model, "expand_decode_cache"):
        return {}

    def expand(cache: Cache, beams: int) -> Cache:
        return model.apply({"params": params}, cache, beams=beams, method="expand_decode_cache")

    def reorder(cache: Cache, parent: Array) -> Cache:
        return model.apply({"params": params}, cache, parent, method="reorder_decode_cache")

    return {"expand": expand, "reorder": reorder}


@dataclasses.dataclass(frozen=True)
class _Search:
    """A search apart from the model, its parameters, the batch and the length penalty (a
    traced argument): hashable, so each program below compiles once per model, search and
    shapes."""

    max_len: int
    beam_size: int | None = None  # None: greedy
    best_only: bool = False
    return_beams: int | None = None  # None: all beam_size

    def parts(self, model, params, batch_size: int, alpha: Array) -> Parts:
        c = model.config
        common = dict(
            batch_size=batch_size,
            max_len=self.max_len,
            bos_id=c.bos_id,
            eos_id=c.eos_id,
            pad_id=c.pad_id,
        )
        step_fn = model_step_fn(model, params)
        if self.beam_size is None:
            return greedy_parts(step_fn, **common)
        hooks = {"expand": None, "reorder": None, **_beam_hooks(model, params)}
        return beam_parts(
            step_fn,
            **common,
            beam_size=self.beam_size,
            length_penalty_alpha=alpha,
            best_only=self.best_only,
            return_beams=self.return_beams,
            **hooks,
        )


# The programs of a search. `_whole_search` is the search as one program: it runs under a
# caller's own `jit` and on sources split over several devices. The others are the pieces the
# host drives between (`_drive`): start, advance a few steps, grow the cache, keep some rows.


@functools.partial(jax.jit, static_argnames=("model", "search", "stages"))
def _whole_search(model, params, src: Array, alpha: Array, *, search: _Search, stages):
    parts = search.parts(model, params, src.shape[0], alpha)
    state = staged_while_loop(
        parts.cond,
        parts.body,
        parts.init(_init_cache(model, params, src, stages[0])),
        stages=stages,
        grow=_model_grow(model, params) if len(stages) > 1 else None,
    )
    return parts.outputs(state)


@functools.partial(jax.jit, static_argnames=("model", "search", "cache_len"))
def _start(model, params, src: Array, alpha: Array, *, search: _Search, cache_len: int):
    parts = search.parts(model, params, src.shape[0], alpha)
    return parts.init(_init_cache(model, params, src, cache_len))


@functools.partial(jax.jit, static_argnames=("model", "search"), donate_argnames=("state",))
def _advance(model, params, state, limit: Array, alpha: Array, *, search: _Search):
    """Steps until step `limit` or the loop's own end -> (state, done [B], over, outputs):
    which sentences have ended, whether the whole search has, and its outputs so far."""
    parts = search.parts(model, params, state[1].shape[0], alpha)
    state = lax.while_loop(lambda st: parts.cond(st) & (st[0] < limit), parts.body, state)
    return state, parts.done(state), ~parts.cond(state), parts.outputs(state)


@functools.partial(jax.jit, static_argnames=("model", "cache_len"))
def _grow_state(model, params, state, *, cache_len: int):
    return (*state[:-1], _model_grow(model, params)(state[-1], cache_len))


@jax.jit
def _keep_rows(state, keep: Array):
    """The state of the sentences `keep` [B'] (indices into the batch), in that order."""
    batch = state[1].shape[0]

    def take(x: Array) -> Array:
        if x.ndim == 0:  # the step index
            return x
        if x.shape[0] % batch:
            raise ValueError(
                f"a decode state leaf of shape {x.shape} does not lead with the batch ({batch}"
                " sentences, or a multiple: their beam rows)"
            )
        per = x.shape[0] // batch
        rows = x.reshape(batch, per, *x.shape[1:])[keep]
        return rows.reshape(keep.shape[0] * per, *x.shape[1:])

    return jax.tree_util.tree_map(take, state)


# Every program a search compiles (a test counts their compilations).
_PROGRAMS = (_whole_search, _start, _advance, _grow_state, _keep_rows)

# Steps between two looks at which sentences have ended. A look costs a round trip to the host,
# and each batch size a search shrinks to compiles programs of its own; every 4 steps, shrinking
# to a half, was the fastest of the settings tried (`benchmarks/decode_2026-11-27c/`).
_CHECK_EVERY = 4


# The smallest batch a search shrinks to: a sixteenth of the batch it started with (16 of the CPU
# main job's evaluation batches of 256, 8 of the 128 measured below, 2 of the bench's 32). Each
# batch size compiles programs of its own, and which sizes a search reaches depends on when its
# sentences end, so on the model: a newly trained model met programs that no earlier run on the
# machine had put in the persistent compilation cache, all of them the last few sentences' sizes of
# 1 to 8. The floor takes those off a new model's first pass (benchmarks/decode_2026-11-27d/).
_FLOOR_FRACTION = 16


def _smaller_batch(alive: int, rows: int, batch: int) -> int:
    """The batch the `alive` unfinished sentences of a batch of `rows` (a search that began
    with `batch`) continue in: the smallest power of two that holds them and at least
    batch // _FLOOR_FRACTION, once that is at most half of `rows`, else `rows`."""
    size = 1 << (max(alive, batch // _FLOOR_FRACTION, 1) - 1).bit_length()
    return size if size <= rows // 2 else rows


def _drive(model, params, src, alpha: Array, *, search: _Search, stages) -> tuple[Array, ...]:
    """A search that drops finished sentences as it goes: the outputs of `_whole_search`.

    Every `_CHECK_EVERY` steps the host reads which sentences have ended (`Parts.done`: no
    later step changes their outputs). Once the unfinished ones fit in half the batch or
    less, the finished ones' outputs are kept and the search goes on with the unfinished
    ones in a batch of the next power of two (at least a sixteenth of the first batch),
    filled up with finished ones. Every sentence goes through the same steps as in the whole
    batch, so the outputs are the same tokens, and the same scores up to float32 rounding (a
    smaller batch's products may round a last bit differently); the steps cost what the
    sentences still being decoded cost, not what the batch's longest output costs.
    """
    batch = src.shape[0]
    state = _start(model, params, src, alpha, search=search, cache_len=stages[0])
    sentence = np.arange(batch)  # the sentence each row holds; -1: a filler
    kept: list[np.ndarray] | None = None
    step = 0
    for k, cache_len in enumerate(stages):
        if k:
            state = _grow_state(model, params, state, cache_len=cache_len)
        while step < cache_len:
            limit = np.int32(min(cache_len, step + _CHECK_EVERY))
            state, done, over, outputs = _advance(model, params, state, limit, alpha, search=search)
            step, over, done = jax.device_get((state[0], over, done))
            if over:
                kept = _gathered(kept, outputs, sentence, np.ones(len(sentence), bool), batch)
                return tuple(jnp.asarray(x) for x in kept)
            size = _smaller_batch(int(np.sum(~done)), len(sentence), batch)
            if size < len(sentence):
                kept = _gathered(kept, outputs, sentence, done, batch)
                order = np.concatenate([np.flatnonzero(~done), np.flatnonzero(done)])[:size]
                state = _keep_rows(state, jnp.asarray(order, jnp.int32))
                sentence = np.where(done, -1, sentence)[order]
    raise AssertionError("a search's last stage ends at max_len, where its loop stops")


def _gathered(kept, outputs, sentence, ready, batch: int) -> list[np.ndarray]:
    """The search's outputs for the whole batch so far, as host arrays: `kept` (or None at
    first) with the rows of `outputs` whose sentence is `ready` written in."""
    outputs = [np.asarray(x) for x in outputs]
    if kept is None:
        kept = [np.zeros((batch, *x.shape[1:]), x.dtype) for x in outputs]
    rows = np.flatnonzero(ready & (sentence >= 0))
    for into, x in zip(kept, outputs):
        into[sentence[rows]] = x[rows]
    return kept


# On a GPU, dropping finished sentences made a batch slower, not faster: the rows it saves
# were worth less than what it costs there, a sync with the host every few steps (the device
# idles while the host looks) and programs compiled for each batch size
# (benchmarks/h200_2026-11-27/). On a CPU a step costs about its rows, and dropping wins
# (`_CHECK_EVERY`).
def _drops_by_default(platforms) -> bool:
    """Whether a search drops finished sentences when drop_finished is None: only when every
    device it runs on (`platforms`, their `jax.Device.platform`) is a CPU."""
    platforms = set(platforms)
    return bool(platforms) and platforms <= {"cpu"}


def _search(model, params, src, alpha, *, search: _Search, stages, drop_finished: bool | None):
    stages = _model_stages(model, search.max_len, stages)
    alpha = jnp.asarray(alpha, jnp.float32)
    if isinstance(src, jax.core.Tracer):  # under the caller's jit: one program
        whole = True
    else:
        src = jnp.asarray(src)  # on JAX's default device, unless already placed
        devices = src.sharding.device_set
        if drop_finished is None:
            drop_finished = _drops_by_default(d.platform for d in devices)
        whole = not drop_finished or src.shape[0] < 2 or len(devices) > 1
    if whole:
        return _whole_search(model, params, src, alpha, search=search, stages=stages)
    return _drive(model, params, src, alpha, search=search, stages=stages)


def greedy_decode(
    model,
    params,
    src: Array,
    *,
    max_len: int,
    stages: tuple[int, ...] | None = None,
    drop_finished: bool | None = None,
) -> Array:
    """Greedy decoding of any protocol model (compiled; `model` is hashed as a static argument).

    Each new (B, S, max_len) compiles a new program: pad sources to a few lengths (as
    `train.translate` buckets them) and keep the batch size fixed, so that they are reused.

    Args:
      model: a translation model (Transformer or baseline) following the protocol.
      params: its 'params' collection.
      src: [B, S] int32 source, padded with pad_id.
      max_len: O, output positions.
      stages: the cache lengths a model with `grow_decode_cache` is decoded in; None:
        `cache_stages(max_len)`; (max_len,): one stage. The output does not depend on it.
      drop_finished: let finished sentences leave the batch as the search goes (the host
        looks every few steps, see `_drive`), so that a batch costs about its sentences'
        own lengths rather than B times the longest. The output does not depend on it. It
        applies to concrete sources on one device; under `jit`, on a source split over
        several devices or with False, the search is one compiled program. None (the
        default): True where the source is decoded on a CPU, False on an accelerator
        (`_drops_by_default` says why).
    Returns:
      [B, O] int32 tokens after BOS, pad_id after EOS.
    """
    (tokens,) = _search(
        model,
        params,
        src,
        0.0,
        search=_Search(max_len=max_len),
        stages=stages,
        drop_finished=drop_finished,
    )
    return tokens


# length_penalty is traced, not static: one compiled search serves every alpha (a sweep of
# the penalty, or runs that differ only in it, compile nothing more). It enters only float
# arithmetic (gnmt_length_penalty, the stopping bound); the penalties of a traced alpha and a
# constant one were equal bit for bit (alpha -0.5, 0, 0.5, 0.6, 1, 1.3, 2; lengths 0..399).
def beam_search(
    model,
    params,
    src: Array,
    *,
    beam_size: int,
    max_len: int,
    length_penalty: float = 0.6,
    best_only: bool = False,
    return_beams: int | None = None,
    stages: tuple[int, ...] | None = None,
    drop_finished: bool | None = None,
) -> tuple[Array, Array]:
    """Beam search over any protocol model (compiled; `model` is hashed as a static argument).

    Like `greedy_decode`, each new (B, S, max_len) compiles a new program: pad to a few shapes.

    Args:
      model, params, src, max_len: as in `greedy_decode`.
      beam_size: W.
      length_penalty: alpha of the GNMT penalty ((5 + len) / 6) ** alpha.
      best_only: stop once every sentence's best hypothesis is final (`search.search_beam`): beam 0
        is exactly the full search's, the other beams are not.
      return_beams: K, how many beams to return, best first; None: all W. With best_only
        and 1 (what a translation keeps), a sentence may leave the batch as soon as its best
        is final, rather than once all its beams have ended: the same tokens and score, in
        fewer steps.
      stages, drop_finished: as in `greedy_decode`. A sentence leaves the batch once all
        its beams have ended (or, above, its best is final), so every beam returned is what
        the search in one batch returns.
    Returns:
      tokens [B, K, O] int32 (pad after EOS) and scores [B, K] float32, best first.
    """
    if return_beams is not None and not 1 <= return_beams <= beam_size:
        raise ValueError(f"return_beams must be in [1, beam_size={beam_size}], got {return_beams}")
    return _search(
        model,
        params,
        src,
        length_penalty,
        search=_Search(
            max_len=max_len,
            beam_size=beam_size,
            best_only=best_only,
            return_beams=None if return_beams == beam_size else return_beams,
        ),
        stages=stages,
        drop_finished=drop_finished,
    )
