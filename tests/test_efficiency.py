"""What the CPU can prove about training efficiency, on the project's own train step and loop:

  * no host round-trip inside a step: the compiled step holds no host callback or transfer, and
    the loop reads its metrics only in one transfer per logging interval;
  * the state's buffers are donated (updated in place);
  * the compiled Transformer-XL step does not keep a [B, H, T, M + T] float32 score tensor per
    layer for the backward pass (it grows by less than one such tensor per layer);
  * no recompilation after warm-up across 100 steps of bucketed data through the trainer
    (`train.core.loop.fit`), which compiles the step once per shape of the batcher's shape set and
    logs how many.

Tiny configs (the 8 fake CPU devices of conftest.py split the batch).
"""

from __future__ import annotations

import json
import re
import threading

import jax
import jax.monitoring
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import calls_to

from train.core.loop import LoopConfig, train_loop
from train.core.metrics import MetricsWriter
from train.core.parallel import CompiledStep, DataParallel
from train.core.state import TrainState
from train.data.batching import TokenBatcher
from train.lm import make_loss_fn as lm_loss_fn
from train.translate import make_loss_fn
from transformer_jax import Transformer, TransformerConfig
from xl_jax import TransformerXL, TransformerXLConfig, init_memory

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


def _one_device() -> DataParallel:
    """The jit path on one device: what these tests check does not depend on the device count
    (test_compiled_train_step_has_no_host_round_trip also runs on all 8), and compiling for
    one is faster."""
    return DataParallel("jit", devices=jax.devices()[:1])


def _transformer(vocab: int = 32):
    cfg = TransformerConfig.tiny(
        src_vocab_size=vocab,
        tgt_vocab_size=vocab,
        d_model=32,
        d_ff=64,
        n_heads=2,
        n_encoder_layers=1,
        n_decoder_layers=1,
    )
    model = Transformer(cfg)
    dummy = jnp.ones((1, 4), jnp.int32)
    params = model.init(jax.random.PRNGKey(0), dummy, dummy)["params"]
    state = TrainState.create(params=params, tx=optax.adam(1e-3), rng=jax.random.PRNGKey(1))
    return make_loss_fn(model, smoothing=0.1, pad_id=cfg.pad_id), state


def _xl(cfg: TransformerXLConfig, batch: int):
    model = TransformerXL(cfg)
    params = model.init(jax.random.PRNGKey(0), jnp.ones((1, 4), jnp.int32), init_memory(cfg, 1))[
        "params"
    ]
    state = TrainState.create(
        params=params, tx=optax.adam(1e-3), rng=jax.random.PRNGKey(1), extra=init_memory(cfg, batch)
    )
    return lm_loss_fn(model), state


def _batches(kind: str, n_rows: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    while True:
        if kind == "transformer":
            yield {
                k: rng.integers(3, 32, (n_rows, 10), dtype=np.int32)
                for k in ("src", "tgt_in", "tgt_out")
            }
        else:
            yield {
                k: rng.integers(0, 64, (n_rows, 8), dtype=np.int32) for k in ("inputs", "targets")
            }


def _setup(kind: str):
    if kind == "transformer":
        return _transformer()
    return _xl(TransformerXLConfig.tiny(), batch=8)


# ----------------------------------------------------------------------------- host round-trips
# Instructions of a compiled program that talk to the host: Python callbacks (jax.debug.print,
# pure_callback, io_callback), host offloading, and send/recv/infeed/outfeed.
_HOST_CALL = re.compile(r'custom_call_target="[^"]*(callback|Host)[^"]*"', re.IGNORECASE)
_HOST_OP = re.compile(r"= [^=]*\b(send|recv|send-done|recv-done|infeed|outfeed)\(")


def _host_instructions(compiled) -> list[str]:
    return [
        line.strip()
        for line in compiled.as_text().splitlines()
        if _HOST_CALL.search(line) or _HOST_OP.search(line)
    ]


@pytest.mark.parametrize("kind", ["transformer", "xl"])
def test_compiled_train_step_has_no_host_round_trip(kind):
    """(A transfer guard cannot prove this on a CPU, where device memory is host memory and
    the guard never fires; the compiled program itself can.)"""
    loss_fn, state = _setup(kind)
    dp = DataParallel("jit")
    state = dp.put_state(state)
    batch = dp.put_batch(next(_batches(kind, 8)))
    compiled = dp.compile_train_step(loss_fn, state).lower(state, batch).compile()
    assert _host_instructions(compiled) == []
    if kind == "xl":
        return

    # The check does see one: the same step with a host callback inside the loss.
    def chatty_loss_fn(params, batch, **kw):
        loss_sum, sums, extra = loss_fn(params, batch, **kw)
        jax.debug.callback(lambda x: None, loss_sum)
        return loss_sum, sums, extra

    chatty = dp.compile_train_step(chatty_loss_fn, state).lower(state, batch).compile()
    assert len(_host_instructions(chatty)) >= 1


class _DeviceOnly:
    """A metric value the loop may carry but not read: any conversion to a host value raises.
    Only the (patched) `fetch` unwraps it."""

    def __init__(self, value):
        self.value = value

    def _read(self, *args, **kwargs):
        raise AssertionError("the loop read a metric outside DataParallel.fetch")

    __float__ = __int__ = __bool__ = __index__ = __array__ = __format__ = item = _read


def test_loop_reads_metrics_only_through_one_fetch_per_logging_interval(tmp_path, monkeypatch):
    loss_fn, state = _transformer()
    dp = _one_device()
    state = dp.put_state(state)
    compiled_step = dp.compile_train_step(loss_fn, state)

    def step(state, batch):
        state, metrics = compiled_step(state, batch)
        return state, {k: _DeviceOnly(v) for k, v in metrics.items()}

    fetched = []
    fetch = dp.fetch

    def counting_fetch(pending):
        fetched.append(len(pending))
        return fetch([{k: v.value for k, v in m.items()} for m in pending])

    monkeypatch.setattr(dp, "fetch", counting_fetch)
    gets = calls_to(monkeypatch, jax, "device_get")
    result = train_loop(
        state,
        dp=dp,
        train_step=step,
        batches=_batches("transformer", 8),
        config=LoopConfig(steps=30, log_every=10, progress=False),
        writer=MetricsWriter(str(tmp_path)),
    )
    assert result.reason == "steps"
    assert fetched == [10, 10, 10]  # three intervals, each fetched whole
    assert len(gets) == 1 + 3  # the start step, then one transfer per interval
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [10, 20, 30]
    assert all(np.isfinite(r["loss"]) for r in lines)


# ----------------------------------------------------------------------------- donation
@pytest.mark.parametrize("kind", ["transformer", "xl"])
def test_train_step_donates_the_state_buffers(kind):
    loss_fn, state = _setup(kind)
    dp = _one_device()
    state = dp.put_state(state)
    step = dp.compile_train_step(loss_fn, state)
    batch = dp.put_batch(next(_batches(kind, 8)))
    compiled = step.lower(state, batch).compile()
    assert "input_output_alias" in compiled.as_text()
    new_state, _ = compiled(state, batch)
    leaves = jax.tree.leaves(state)
    assert leaves and all(x.is_deleted() for x in leaves)
    assert not any(x.is_deleted() for x in jax.tree.leaves(new_state))


# ----------------------------------------------------------------------------- XL scores
def _xl_step_temp_bytes(n_layers: int, *, b: int, h: int, t: int, m: int, **overrides) -> int:
    """Temporary bytes of the compiled XL train step on one device (d_head 4, d_model 32: the
    [B, H, T, M + T] scores dwarf every [B, T, D] or [B, M + T, 3 H K] activation)."""
    cfg = TransformerXLConfig.tiny(
        n_layers=n_layers,
        n_heads=h,
        d_head=4,
        d_model=32,
        d_inner=64,
        vocab_size=32,
        tgt_len=t,
        mem_len=m,
        **overrides,
    )
    loss_fn, state = _xl(cfg, batch=b)
    dp = _one_device()
    state = dp.put_state(state)
    batch = dp.put_batch({k: np.zeros((b, t), np.int32) for k in ("inputs", "targets")})
    compiled = dp.compile_train_step(loss_fn, state).lower(state, batch).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_xl_step_does_not_keep_a_score_tensor_per_layer():
    """Going from 2 to 4 layers may add the layers' smaller activations, not another score
    tensor per layer: the backward pass holds the scores of the layer it is computing only.
    The same measure with remat='none' (everything kept) shows the tensors it is looking for."""
    b, h, t, m = 2, 8, 64, 192
    score = b * h * t * (m + t) * 4  # one layer's float32 scores (1 MiB)
    default = TransformerXLConfig.tiny().remat
    per_layer = {}
    for mode in (default, "none"):
        two, four = (_xl_step_temp_bytes(n, b=b, h=h, t=t, m=m, remat=mode) for n in (2, 4))
        per_layer[mode] = (four - two) / 2 / score
    # Less than one score tensor a layer (remat='attention' keeps the projections' outputs,
    # measured 0.43 here; 'none' keeps 1.47 score-sized tensors a layer, 3.8 before the VJP of
    # `transformer_jax.attention.masked_softmax`, which keeps the attention weights alone).
    assert per_layer[default] < 0.75, per_layer
    assert per_layer["none"] > 1.0, per_layer


# ----------------------------------------------------------------------------- recompilation
def _random_pairs(seed: int, n: int) -> list[tuple[list[int], list[int]]]:
    """n (source, target) id lists of 2-21 and 1-21 tokens over ids 4..31."""
    rng = np.random.default_rng(seed)
    return [
        (
            list(rng.integers(4, 32, rng.integers(2, 22))),
            list(rng.integers(4, 32, rng.integers(1, 22))),
        )
        for _ in range(n)
    ]


def test_trainer_compiles_once_per_shape_then_never_again_over_100_bucketed_steps(tmp_path):
    batcher = TokenBatcher(
        _random_pairs(0, 400), tokens_per_batch=512, buckets=(8, 16, 24), num_devices=8
    )
    shapes = batcher.shape_set()
    assert len(shapes) == 3
    # The warm-up: the steps until every shape has appeared once (the stream is seeded).
    first_seen, seen = [], set()
    for k, batch in enumerate(batcher.iterate(0)):
        if batch["src"].shape not in seen:
            seen.add(batch["src"].shape)
            first_seen.append(k)
        if len(seen) == len(shapes):
            break
    warm_steps = first_seen[-1] + 1

    yielded = []  # shapes of the batches handed to the trainer

    def batches(start):
        for batch in batcher.iterate(start):
            yielded.append(batch["src"].shape)
            yield batch

    compiles = []  # the batch being trained when a compile happened

    def listener(event, duration, **kw):
        if event == COMPILE_EVENT and yielded:
            compiles.append(len(yielded) - 1)

    loss_fn, state = _transformer()
    dp = _one_device()
    state = dp.put_state(state)
    step = dp.compile_train_step(loss_fn, state)
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        result = train_loop(
            state,
            dp=dp,
            train_step=step,
            batches=batches(0),
            config=LoopConfig(steps=warm_steps + 100, log_every=50, progress=False),
            writer=MetricsWriter(str(tmp_path)),
        )
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert int(result.state.step) == warm_steps + 100 and len(yielded) == warm_steps + 100
    assert set(yielded[warm_steps:]) == set(shapes)  # the 100 steps used every shape
    # Every compilation while training happened at a shape's first batch, none after warm-up.
    during = [k for k in compiles if k < len(yielded)]
    assert len(during) >= len(shapes) and set(during) <= set(first_seen)
    assert max(during) < warm_steps
    # Bounded by the batcher's shape set, and counted by the step.
    assert step.compiled_shapes == len(shapes)


def test_shapes_compiled_in_the_background_run_the_steps_a_lazy_step_runs():
    """`compile_for(background=True)` returns once the shapes are lowered; each step of a
    shape then waits for its executable or, when its compilation has not started, compiles
    it itself. Every shape gets one executable, `on_done` runs once with their count, and the
    losses equal a lazily compiled step's to the bit."""
    batcher = TokenBatcher(
        _random_pairs(1, 200), tokens_per_batch=256, buckets=(8, 16, 24), num_devices=1
    )
    stream = list(zip(range(12), batcher.iterate(0)))
    examples = {}
    for _, batch in stream:
        examples.setdefault(batch["src"].shape, batch)
    assert len(examples) == 3  # the 12 steps meet every shape
    loss_fn, init = _transformer()
    dp = _one_device()
    losses, done = {}, []

    class Lowerings:  # the step's jitted function, counting its lowerings
        def __init__(self, jitted):
            self.jitted, self.count = jitted, 0

        def lower(self, *args):
            self.count += 1
            return self.jitted.lower(*args)

    for background in (False, True):
        state = dp.put_state(init)
        step = dp.compile_train_step(loss_fn, state)
        step.jitted = lowerings = Lowerings(step.jitted)
        if background:
            # One thread, and the last shape's batch first: its compilation is still queued
            # behind the others', so that step compiles it itself.
            order = sorted(
                examples.values(), key=lambda b: b["src"].shape != stream[0][1]["src"].shape
            )
            assert (
                dp.compile_ahead(
                    step, state, order[::-1], workers=1, background=True, on_done=done.append
                )
                == 3
            )
        losses[background] = []
        for _, batch in stream:
            state, metrics = step(state, dp.put_batch(batch))
            losses[background].append((float(metrics["loss_sum"]), float(metrics["grad_norm"])))
        step.wait_compiled()
        assert step.compiled_shapes == 3 and lowerings.count == 3  # none compiled twice
    assert done == [3]
    assert losses[True] == losses[False]


def test_the_background_set_ends_once_however_its_compilations_end():
    """`on_done` runs exactly once, when every member of the background set is over:
    compiled, failed in its thread, or dropped by `cancel_compiles` (a stopping run). A
    run's cache tally stops listening there, so a run that stops or fails before its shapes
    are compiled leaves no listener behind. Its count is the shapes that got an executable."""
    gate = threading.Event()

    class Lowered:  # a lowering whose compilation waits for the gate; width 3 fails
        def __init__(self, width):
            self.width = width

        def compile(self):
            gate.wait(timeout=60)
            if self.width == 3:
                raise RuntimeError("XLA could not compile width 3")
            return f"executable for width {self.width}"

    class Jitted:
        def lower(self, state, batch):
            return Lowered(batch["x"].shape[0])

    def batches(*widths):
        return [{"x": np.zeros((w,), np.int32)} for w in widths]

    # One thread: width 1 is compiling (held at the gate) while widths 2 and 4 wait in
    # its queue; the stopping run drops them.
    step, done = CompiledStep(Jitted()), []
    assert (
        step.compile_for(None, batches(1, 2, 4), workers=1, background=True, on_done=done.append)
        == 3
    )
    step.cancel_compiles()
    assert done == []  # width 1 is still compiling
    gate.set()
    step.wait_compiled()
    assert done == [1] and step.compiled_shapes == 1

    # A compilation that fails in its thread ends the set too; its error reaches the waiter.
    step, done = CompiledStep(Jitted()), []
    step.compile_for(None, batches(2, 3), workers=1, background=True, on_done=done.append)
    with pytest.raises(RuntimeError, match="width 3"):
        step.wait_compiled()
    assert done == [1] and step.compiled_shapes == 1
