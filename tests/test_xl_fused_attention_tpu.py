"""xl_jax.fused_attention_tpu: the Mosaic relative-attention kernels in Pallas' interpret mode
against the XLA path (forward, every gradient, masks, dropout, a model over segments
with clamp_len), across a batch split over devices, and compiled for two TPU slices.

Interpret mode runs operations Mosaic cannot lower (a per-row gather), so the kernels are
also compiled for v5e and v6e slices, in a subprocess with libtpu on its path (as
tests/test_target.py does); without libtpu those tests skip, saying so."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import REPO
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from test_xl_fused_attention import B, H, K, _grads, _inputs, _lm_config, _xla_attention

from xl_jax import TransformerXL, init_memory
from xl_jax import attention as xl_attention
from xl_jax import fused_attention as fa
from xl_jax import fused_attention_tpu as fat

# The folder holding libtpu (the TPU compiler), installed aside by .ci/run.
TPU_TARGET_PATH = os.environ.get("ATTENTION_JAX_TPU_TARGET_PATH", "")
needs_tpu_compiler = pytest.mark.skipif(
    not os.path.isdir(os.path.join(TPU_TARGET_PATH, "libtpu")),
    reason="libtpu is not installed aside: set ATTENTION_JAX_TPU_TARGET_PATH to a folder "
    'holding it (pip install --target DIR --no-deps "libtpu==VERSION", the version jax[tpu] '
    "pins; .ci/run does)",
)


def _mosaic(valid, block=8, **kw):
    return lambda *a: fat.relative_attention(*a, valid, block=block, interpret=True, **kw)  # noqa: E731


def _check_against_xla(t, m, valid, same_length, block=8, seed=0):
    args = _inputs(t, m, seed=seed)
    valid = jnp.array(valid)
    kw = dict(mem_len=m, same_length=same_length, scale=K**-0.5)
    fused = _mosaic(valid, block, **kw)
    plain = lambda *a: _xla_attention(*a, valid, **kw)  # noqa: E731
    chex.assert_trees_all_close(fused(*args), plain(*args), atol=2e-6, rtol=2e-6)
    cotangent = jax.random.normal(jax.random.PRNGKey(9), (B, t, H, K))
    got, want = _grads(fused, args, cotangent), _grads(plain, args, cotangent)
    for name, g, w in zip(("qu", "qv", "k", "v", "r"), got, want):
        assert float(jnp.max(jnp.abs(w))) > 0.1, name  # a gradient that flows
        chex.assert_trees_all_close(g, w, atol=5e-6, rtol=5e-6, custom_message=name)


@pytest.mark.parametrize(
    "t,m,valid,same_length",
    [
        (16, 16, (16, 5), False),  # one full memory, one partly empty
        (16, 16, (16, 0), True),  # same_length, an empty memory
        (8, 24, (24, 9), False),  # a memory longer than the segment
        (16, 0, (0, 0), False),  # no memory at all
    ],
)
def test_mosaic_kernels_equal_the_xla_path_in_float32(t, m, valid, same_length):
    _check_against_xla(t, m, valid, same_length)


@pytest.mark.slow
def test_mosaic_kernels_equal_the_xla_path_at_the_tpu_block():
    """One 128-row block, as a TPU runs it: the rolls over 256 lanes, same_length on."""
    _check_against_xla(128, 128, (128, 37), True, block=128, seed=3)


def test_mosaic_dropout_is_the_hash_mask():
    """The same mask as the Triton kernels' (`reference_keep_mask`), forward and backward."""
    t, m, rate = 16, 16, 0.25
    args = _inputs(t, m, seed=1)
    valid = jnp.array([16, 7])
    rng = jax.random.PRNGKey(3)
    kw = dict(mem_len=m, same_length=False, scale=K**-0.5)
    keep = fa.reference_keep_mask(rng, batch=B, heads=H, q_len=t, k_len=m + t, rate=rate)
    fused = _mosaic(valid, dropout_rate=rate, dropout_rng=rng, **kw)
    plain = lambda *a: _xla_attention(*a, valid, keep=keep, rate=rate, **kw)  # noqa: E731
    chex.assert_trees_all_close(fused(*args), plain(*args), atol=2e-6, rtol=2e-6)
    cotangent = jax.random.normal(jax.random.PRNGKey(4), (B, t, H, K))
    for g, w in zip(_grads(fused, args, cotangent), _grads(plain, args, cotangent)):
        chex.assert_trees_all_close(g, w, atol=5e-6, rtol=5e-6)
    other = _mosaic(valid, dropout_rate=rate, dropout_rng=jax.random.PRNGKey(5), **kw)(*args)
    assert float(jnp.max(jnp.abs(other - fused(*args)))) > 1e-2


@pytest.mark.slow
def test_a_model_over_segments_through_the_mosaic_kernels(monkeypatch):
    """Three segments carrying the memory (empty, partly filled, full), clamp_len on, the
    'pallas' model with its kernel call sent to the Mosaic kernels (interpreted): per-token
    losses and parameter gradients equal the 'xla' model's."""

    def mosaic(*args, **kw):
        return fat.relative_attention(*args, block=8, interpret=True, **kw)

    monkeypatch.setattr(xl_attention.fused_attention, "relative_attention", mosaic)
    fused_cfg = _lm_config(attention_impl="pallas", same_length=True)
    xla_cfg = _lm_config(attention_impl="xla", same_length=True)
    assert fused_cfg.clamp_len > 0
    tokens = jax.random.randint(jax.random.PRNGKey(0), (B, 3, 8), 0, xla_cfg.vocab_size)
    params = TransformerXL(xla_cfg).init(jax.random.PRNGKey(1), tokens[:, 0])["params"]

    def run(cfg, params):
        memory, losses = init_memory(cfg, B), []
        for seg in range(3):
            nll, memory = TransformerXL(cfg).apply(
                {"params": params}, tokens[:, seg], memory, targets=tokens[:, seg]
            )
            losses.append(nll)
        return jnp.stack(losses)

    chex.assert_trees_all_close(run(fused_cfg, params), run(xla_cfg, params), atol=1e-5)
    grad = lambda cfg: jax.grad(lambda p: jnp.mean(run(cfg, p)))(params)  # noqa: E731
    chex.assert_trees_all_close(grad(fused_cfg), grad(xla_cfg), atol=1e-6, rtol=1e-5)


def test_a_batch_split_over_devices_runs_its_rows_on_each(monkeypatch):
    """With the batch placed on 4 devices the calls run under shard_map, each device on its
    own rows; R's gradient (R whole on each) is summed over them."""
    b, t, m = 4, 8, 8
    keys = jax.random.split(jax.random.PRNGKey(0), 5)
    s = m + t
    shapes = [(b, t, H, K), (b, t, H, K), (b, s, H, K), (b, s, H, K), (s, H, K)]
    args = [jax.random.normal(key, shape) for key, shape in zip(keys, shapes)]
    valid = jnp.array([8, 3, 0, 5])
    mesh = Mesh(np.asarray(jax.devices()[:4]), ("data",))
    rows, whole = NamedSharding(mesh, PartitionSpec("data")), NamedSharding(mesh, PartitionSpec())
    placed = [jax.device_put(a, rows) for a in args[:4]] + [jax.device_put(args[4], whole)]
    seen = []
    batch_mesh = fat._batch_mesh
    monkeypatch.setattr(fat, "_batch_mesh", lambda x: seen.append(batch_mesh(x)) or seen[-1])
    kw = dict(mem_len=m, same_length=False, scale=K**-0.5)
    cotangent = jax.random.normal(jax.random.PRNGKey(9), (b, t, H, K))

    def grads(fn, *a):
        return jax.grad(lambda *x: jnp.sum(fn(*x[:5], x[5]) * cotangent), argnums=range(5))(*a)

    def mosaic(*a):
        return fat.relative_attention(*a, block=8, interpret=True, **kw)

    got = jax.jit(lambda *a: grads(mosaic, *a))(*placed, jax.device_put(valid, rows))
    assert seen and seen[0][1] == ("data",)
    want = grads(lambda *a: _xla_attention(*a, **kw), *args, valid)
    for name, g, w in zip(("qu", "qv", "k", "v", "r"), got, want):
        chex.assert_trees_all_close(g, w, atol=5e-6, rtol=5e-6, custom_message=name)


def test_a_tpu_program_takes_the_kernels_only_at_the_tpu_tile():
    for t, m, width, takes in [(128, 128, 64, True), (128, 0, 128, True), (64, 64, 64, False)]:
        assert fa.applies(head_width=width, q_len=t, mem_len=m, on_gpu=False, on_tpu=True) == takes
    assert not fa.applies(head_width=32, q_len=128, mem_len=128, on_gpu=False, on_tpu=True)


@pytest.mark.slow
@needs_tpu_compiler
@pytest.mark.parametrize("target", ["v5e:2x2", "v6e:2x2"])
def test_the_mosaic_kernels_compile_for_a_tpu_slice(target, tmp_path):
    """Forward and backward (value_and_grad) of the dispatcher in a TPU program, bfloat16
    (and the backward in float32), dropout and same_length on, the batch split over the
    slice's 4 chips: one Mosaic call forward and three backward (forward again, dq + dR,
    dk + dv)."""
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        PYTHONPATH=os.pathsep.join([TPU_TARGET_PATH, REPO, os.path.join(REPO, "tests")]),
    )
    env.pop("XLA_FLAGS", None)  # the suite's XLA:CPU flags
    script = os.path.join(REPO, "tests", "tpu_xl_attention_programs.py")
    done = subprocess.run(
        [sys.executable, script, target],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=str(tmp_path),
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["devices"] == 4
    assert out["forward"]["mosaic_calls"] == 1
    assert out["backward"]["mosaic_calls"] == out["backward_float32"]["mosaic_calls"] == 3
