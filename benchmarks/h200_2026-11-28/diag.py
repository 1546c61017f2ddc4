"""Issue 49, second device call: which part of the fused backward goes wrong on the GPU.

    PYTHONPATH=$PWD python benchmarks/h200_2026-11-28/diag.py [--quick]

The first call (ab_run1.json) found the forward right and faster, and dqu right, but dqv, dk,
dv and dR wrong on the GPU (right when interpreted). Each variant below changes one setting of
xl_jax.fused_attention; each row gives the relative error of every gradient against the XLA
path, with the kernels' own forward residuals and with the XLA path's (o, lse).
"""

import json
import sys
import time

import jax
import jax.numpy as jnp

from xl_jax import fused_attention as fa
from xl_jax.attention import rel_shift
from xl_jax.memory import attention_mask

quick = "--quick" in sys.argv
interpret = jax.default_backend() != "gpu"
B, T, M, H, K = (2, 16, 16, 2, 16) if quick else (2, 128, 128, 4, 64)
S = M + T
block = 8 if quick else 64
scale = K**-0.5
ks = jax.random.split(jax.random.PRNGKey(0), 6)
shapes = [(B, T, H, K), (B, T, H, K), (B, S, H, K), (B, S, H, K), (S, H, K)]
args = [jax.random.normal(k, s) for k, s in zip(ks, shapes)]
valid = jnp.array([M, M // 3])
kstart = M - valid
do = jax.random.normal(ks[5], (B, T, H, K))


def ref(qu, qv, k, v, r):
    pos = rel_shift(jnp.einsum("bthk,shk->bhts", qv, r)) * scale
    s = jnp.einsum("bthk,bshk->bhts", qu, k) * scale + pos
    mask = attention_mask(valid, q_len=T, mem_len=M, same_length=False)
    s = jnp.where(mask, s, -1e30)
    lse = jax.nn.logsumexp(s, -1)
    w = jnp.where(mask, jnp.exp(s - lse[..., None]), 0.0)
    return jnp.einsum("bhts,bshk->bthk", w, v), lse


with jax.default_matmul_precision("highest"):
    o_ref, lse_ref = jax.jit(ref)(*args)
    _, vjp = jax.vjp(lambda *a: ref(*a)[0], *args)
    want = vjp(do)


def err(a, b):
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


variants = {
    "base": {},
    "bwd stages 1": dict(BACKWARD_TRITON_OPTIONS={"num_stages": 1}),
    "volatile": dict(VOLATILE_SCRATCH=True),
    "volatile + bwd stages 1": dict(
        VOLATILE_SCRATCH=True, BACKWARD_TRITON_OPTIONS={"num_stages": 1}
    ),
    "bwd warps 8": dict(BACKWARD_TRITON_OPTIONS={"num_warps": 8}),
    "all stages 1": dict(TRITON_OPTIONS={"num_warps": 4, "num_stages": 1}),
}
defaults = dict(
    TRITON_OPTIONS=dict(fa.TRITON_OPTIONS),
    BACKWARD_TRITON_OPTIONS={},
    VOLATILE_SCRATCH=False,
)
rows = {}
for name, settings in variants.items():
    for key, value in {**defaults, **settings}.items():
        setattr(fa, key, value)
    statics = (M, False, scale, 0.0, block, interpret)
    seed = jnp.zeros((1,), jnp.int32)
    start = time.perf_counter()
    try:
        o, lse = jax.jit(lambda *a: fa._forward(*a, kstart, seed, statics=statics))(*args)
        own = jax.jit(
            lambda o, lse, *a: fa._backward(*a, kstart, seed, o, lse, do, statics=statics)
        )(o, lse, *args)
        given = jax.jit(
            lambda o, lse, *a: fa._backward(*a, kstart, seed, o, lse, do, statics=statics)
        )(o_ref, lse_ref, *args)
        rows[name] = {
            "out": err(o, o_ref),
            "lse": err(lse, lse_ref),
            **{f"{n}": err(g, w) for n, g, w in zip(("qu", "qv", "k", "v", "r"), own, want)},
            **{
                f"{n}|ref res": err(g, w)
                for n, g, w in zip(("qu", "qv", "k", "v", "r"), given, want)
            },
        }
    except Exception as e:  # noqa: BLE001
        rows[name] = {"error": f"{type(e).__name__}: {e}"[:1500]}
    rows[name]["s"] = round(time.perf_counter() - start, 1)
    print(name, json.dumps(rows[name]), flush=True)
out = sys.argv[sys.argv.index("--out") + 1] if "--out" in sys.argv else None
if out:
    with open(f"{out}/diag.json", "w") as f:
        json.dump(rows, f, indent=1)
