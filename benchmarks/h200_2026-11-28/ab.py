"""Issue 49 on one GPU: the fused relative-attention kernels (xl_jax.fused_attention) against
today's path (position scores in XLA, rel-shift, cuDNN with the bias), in one call.

    PYTHONPATH=$PWD python benchmarks/h200_2026-11-28/ab.py --out OUT          # on the GPU
    PYTHONPATH=$PWD python benchmarks/h200_2026-11-28/ab.py --quick --out OUT  # CPU dry run

Sections, each kept apart so one failure leaves the others' figures:
  correct: kernels against the XLA path on the device (float32 and bfloat16, dropout's mask);
  micro: one attention call's forward + backward at enwik8_base's shape, per kernel variant
    (block size, warps, stages) and for today's path;
  train: the enwik8_base training step (remat none, bf16) with attention_impl 'auto' (today)
    and 'pallas' (the fastest variant of `micro`), each with its profile, transpose-fusion
    count and the loss after the same steps from the same state.
Results go to OUT/ab.json as they come; a table is printed last.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback

import jax
import jax.numpy as jnp

from xl_jax import fused_attention as fa
from xl_jax.attention import rel_shift
from xl_jax.memory import attention_mask

RESULTS: dict = {}


def save(out):
    with open(os.path.join(out, "ab.json"), "w") as f:
        json.dump(RESULTS, f, indent=1, default=str)


def section(name, out):
    def wrap(fn):
        def run(*a, **kw):
            start = time.perf_counter()
            try:
                RESULTS[name] = fn(*a, **kw)
            except Exception as e:  # noqa: BLE001 - keep the other sections' figures
                RESULTS[name] = {"error": f"{type(e).__name__}: {e}"[:4000]}
                traceback.print_exc()
            RESULTS.setdefault("seconds", {})[name] = round(time.perf_counter() - start, 1)
            save(out)
            print(f"[{name}] {time.perf_counter() - start:.1f} s", flush=True)

        return run

    return wrap


def xla_path(qu, qv, k, v, r, valid, *, mem_len, same_length, scale, impl):
    from transformer_jax.attention import dot_product_attention

    t = qu.shape[1]
    pos = jnp.einsum("bthk,shk->bhts", qv, r, preferred_element_type=jnp.float32)
    mask = attention_mask(valid, q_len=t, mem_len=mem_len, same_length=same_length)
    return dot_product_attention(
        qu, k, v, mask=mask, bias=rel_shift(pos) * scale, scale=scale, implementation=impl
    )


def inputs(b, t, m, h, k, dtype, seed=0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 5)
    s = m + t
    shapes = [(b, t, h, k), (b, t, h, k), (b, s, h, k), (b, s, h, k), (s, h, k)]
    return [jax.random.normal(key, sh).astype(dtype) for key, sh in zip(ks, shapes)]


def rel_err(a, b):
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def grads(fn, args, ct):
    loss = lambda *a: jnp.sum(fn(*a).astype(jnp.float32) * ct)  # noqa: E731
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))(*args)


def correct(shape, interpret):
    b, t, m, h, k = shape
    out = {}
    valid = jnp.array([m] + [m // 3] * (b - 1))
    scale = k**-0.5
    kw = dict(mem_len=m, same_length=False, scale=scale)
    for dtype in (jnp.float32, jnp.bfloat16):
        args = inputs(b, t, m, h, k, dtype)
        ref_args = [a.astype(jnp.float32) for a in args]
        fused = lambda *a: fa.relative_attention(*a, valid, interpret=interpret, **kw)  # noqa
        plain = lambda *a: xla_path(*a, valid, impl="xla", **kw)  # noqa: E731
        ct = jax.random.normal(jax.random.PRNGKey(1), (b, t, h, k))
        with jax.default_matmul_precision("highest"):
            want = jax.jit(plain)(*ref_args)
            want_g = grads(plain, ref_args, ct)
        got = jax.jit(fused)(*args)
        got_g = grads(fused, args, ct)
        out[jnp.dtype(dtype).name] = {
            "out": rel_err(got, want),
            **{n: rel_err(g, w) for n, g, w in zip(("qu", "qv", "k", "v", "r"), got_g, want_g)},
        }
    # Dropout: the kernels' mask is the hash's.
    rate, rng = 0.1, jax.random.PRNGKey(2)
    args = inputs(b, t, m, h, k, jnp.float32, seed=3)
    keep = fa.reference_keep_mask(rng, batch=b, heads=h, q_len=t, k_len=m + t, rate=rate)
    got = jax.jit(
        lambda *a: fa.relative_attention(
            *a, valid, interpret=interpret, dropout_rate=rate, dropout_rng=rng, **kw
        )
    )(*args)
    qu, qv, kk, vv, r = args
    with jax.default_matmul_precision("highest"):
        pos = rel_shift(jnp.einsum("bthk,shk->bhts", qv, r)) * scale
        s = jnp.einsum("bthk,bshk->bhts", qu, kk) * scale + pos
        mask = attention_mask(valid, q_len=t, mem_len=m, same_length=False)
        w = jnp.where(mask, jax.nn.softmax(jnp.where(mask, s, -1e30), -1), 0.0)
        w = jnp.where(keep, w / (1 - rate), 0.0)
        want = jnp.einsum("bhts,bshk->bthk", w, vv)
    out["float32_dropout"] = {"out": rel_err(got, want), "kept": float(jnp.mean(keep))}
    return out


def time_fn(fn, args, repeats):
    jax.block_until_ready(fn(*args))
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def micro(shape, variants, repeats, interpret, on_gpu):
    b, t, m, h, k = shape
    args = inputs(b, t, m, h, k, jnp.bfloat16 if on_gpu else jnp.float32)
    valid = jnp.full((b,), m)
    kw = dict(mem_len=m, same_length=False, scale=k**-0.5)
    ct = jax.random.normal(jax.random.PRNGKey(1), (b, t, h, k)).astype(args[0].dtype)
    out = {"shape": dict(B=b, T=t, M=m, H=h, K=k, dtype=str(args[0].dtype))}

    def fwd_bwd(fn):
        def loss(*a):
            return jnp.sum((fn(*a) * ct).astype(jnp.float32))

        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)))

    arms = {"today (auto)": lambda *a: xla_path(*a, valid, impl="auto", **kw)}
    arms["xla"] = lambda *a: xla_path(*a, valid, impl="xla", **kw)
    for arm, fn in arms.items():
        try:
            out[arm] = {
                "fwd_ms": time_fn(jax.jit(fn), args, repeats),
                "fwd_bwd_ms": time_fn(fwd_bwd(fn), args, repeats),
            }
        except Exception as e:  # noqa: BLE001
            out[arm] = {"error": f"{type(e).__name__}: {e}"[:2000]}
        print(arm, out[arm], flush=True)
    for block, warps, stages in variants:
        name = f"pallas b{block} w{warps} s{stages}"
        fa.TRITON_OPTIONS.update(num_warps=warps, num_stages=stages)

        def fused(*a, block=block):
            return fa.relative_attention(*a, valid, block=block, interpret=interpret, **kw)

        try:
            out[name] = {
                "fwd_ms": time_fn(jax.jit(fused), args, repeats),
                "fwd_bwd_ms": time_fn(fwd_bwd(fused), args, repeats),
                "block": block,
                "num_warps": warps,
                "num_stages": stages,
            }
        except Exception as e:  # noqa: BLE001
            out[name] = {"error": f"{type(e).__name__}: {e}"[:2000]}
        print(name, out[name], flush=True)
    return out


def best_variant(micro_out):
    ok = [v for n, v in micro_out.items() if n.startswith("pallas") and "fwd_bwd_ms" in v]
    return min(ok, key=lambda v: v["fwd_bwd_ms"]) if ok else None


def train(quick, profile_dir, steps, variant):
    from train.bench.config import BenchConfig
    from train.bench.train_steps import bench_train_step, xl_train_setup

    config = BenchConfig.quick() if quick else BenchConfig.full()
    name, xl, batch = config.xl[0]
    xl = xl.replace(remat="none")
    if quick:
        xl = xl.replace(tgt_len=16, mem_len=16, d_head=16)
    out = {}
    if variant:
        fa.TRITON_OPTIONS.update(num_warps=variant["num_warps"], num_stages=variant["num_stages"])
        fa.MAX_BLOCK = variant["block"]
    for impl in ("auto", "pallas"):
        try:
            bench = xl_train_setup(name, xl.replace(attention_impl=impl), batch, config)
            res = bench_train_step(
                bench,
                steps=steps,
                warmup=3,
                rates={},
                nominal_peak=None if quick else 989e12,
                profile_dir=profile_dir,
            )
            out[impl] = res
        except Exception as e:  # noqa: BLE001
            out[impl] = {"error": f"{type(e).__name__}: {e}"[:4000]}
            traceback.print_exc()
        print(impl, {k: out[impl].get(k) for k in ("step_s_median", "final_loss", "error")})
    return out


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--only", default="correct,micro,train")
    p.add_argument("--profile_dir", default=None, help="traces (default: OUT/profile)")
    a = p.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    on_gpu = jax.default_backend() == "gpu"
    interpret = not on_gpu
    RESULTS["env"] = {
        "backend": jax.default_backend(),
        "devices": [str(d) for d in jax.devices()],
        "jax": jax.__version__,
        "argv": sys.argv,
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
    }
    only = a.only.split(",")
    if a.quick:
        corr_shape, micro_shape = (2, 16, 16, 2, 16), (2, 32, 32, 2, 16)
        variants, repeats, steps = [(16, 4, 2), (8, 4, 2)], 2, 2
    else:
        corr_shape, micro_shape = (2, 128, 128, 4, 64), (22, 512, 512, 8, 64)
        variants = [(64, 4, 1), (64, 8, 1), (32, 4, 1)]
        repeats, steps = 20, 10
    if "correct" in only:
        section("correct", a.out)(correct)(corr_shape, interpret)
    variant = None
    if "micro" in only:
        section("micro", a.out)(micro)(micro_shape, variants, repeats, interpret, on_gpu)
        if isinstance(RESULTS.get("micro"), dict):
            variant = best_variant(RESULTS["micro"])
    RESULTS["chosen_variant"] = variant
    if "train" in only:
        profile_dir = a.profile_dir or os.path.join(a.out, "profile")
        section("train", a.out)(train)(a.quick, profile_dir, steps, variant)
    save(a.out)
    print("\n== summary")
    print(json.dumps(RESULTS.get("correct"), indent=1))
    for n, v in (RESULTS.get("micro") or {}).items():
        print(f"micro {n}: {v}")
    for impl, v in (RESULTS.get("train") or {}).items():
        if isinstance(v, dict):
            prof = v.get("profile") or {}
            print(
                f"train {impl}: step {1e3 * (v.get('step_s_median') or 0):.2f} ms, "
                f"tok/s {v.get('tokens_per_s')}, mfu {v.get('mfu_vs_nominal_bf16')}, "
                f"loss {v.get('final_loss')}, compile {v.get('compile_s')}, "
                f"categories {prof.get('categories') if isinstance(prof, dict) else None}, "
                f"error {v.get('error')}"
            )
    print("seconds", RESULTS.get("seconds"))


if __name__ == "__main__":
    main()
