"""The floor of each framework's CPU training step: the bench's step's matrix products alone.

    python benchmarks/cpu_vs_torch_2026-11-28f_amd25/floor.py transformer 32 16 20
    python benchmarks/cpu_vs_torch_2026-11-28f_amd25/floor.py transformer 64 32 10
    python benchmarks/cpu_vs_torch_2026-11-28f_amd25/floor.py xl 16 35 20

For the `cpu_vs_torch` models (`python -m train.bench --only cpu_vs_torch`), a program made of
the products their training step runs and nothing else, in jax and in torch: the same
projections, attention products, feed-forward products and tied output layer, forward and
backward (the input and weight gradients autodiff asks for), chained as the model chains
them. Left out: softmax, LayerNorm, ReLU, residual adds, the rel-shift, the loss, the head
transposes (the floor reshapes [N, H K] to [B, T, H, K]: wrong maths, no copy), the embedding
lookups and the optimizer. `jax floor + update` adds the step's optimizer update
(`make_optimizer`'s chain: clipping by the global norm, Adam, the parameter average) on the
floor's gradients.

The floors are timed with the bench's own arms (`train.bench.cpu_vs_torch`: the project's
jitted step and eager PyTorch's), the arms taking turns step by step, each step blocked on;
medians. Eager PyTorch's full step over the jax floor is the most the project's step could
reach against it on this machine if everything but the products cost nothing.
"""

from __future__ import annotations

import dataclasses
import statistics
import sys

from train.core.host_memory import keep_host_memory

keep_host_memory()  # as the bench and the commands run

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import torch  # noqa: E402

from train.bench import cpu_vs_torch as cvt  # noqa: E402
from train.bench.config import BenchConfig  # noqa: E402
from train.bench.timing import time_interleaved  # noqa: E402
from transformer_jax.layers import dense_product, tied_logits  # noqa: E402
from transformer_jax.optim import OptimizerConfig, make_optimizer  # noqa: E402


def transformer_floor(b: int, t: int):
    """The 3+3-layer, D 256, H 4, FF 512, V 4000 translation step's products -> (shapes of
    the weights, jax logits(params, src, tgt), torch logits(params, src, tgt))."""
    d, h, f, v, n_layers, n = 256, 4, 512, 4000, 3, b * t
    shapes = {"E": (v, d)}
    for i in range(n_layers):
        for part in ("q", "k", "v", "o"):
            shapes[f"e{i}s{part}"] = shapes[f"d{i}s{part}"] = shapes[f"d{i}c{part}"] = (d, d)
        shapes[f"e{i}f1"] = shapes[f"d{i}f1"] = (d, f)
        shapes[f"e{i}f2"] = shapes[f"d{i}f2"] = (f, d)

    def j_attn(p, pre, xq, xkv):
        # dense_product: the model's projections, with its kernel-gradient form.
        q, k, w = (dense_product(x, p[pre + s]) for x, s in ((xq, "q"), (xkv, "k"), (xkv, "v")))
        q, k, w = (x.reshape(b, t, h, d // h) for x in (q, k, w))
        s = jnp.einsum("bthk,bshk->bhts", q, k)  # the model's einsums
        o = jnp.einsum("bhts,bshk->bthk", s, w).reshape(n, d)
        return dense_product(o, p[pre + "o"])

    def j_logits(p, x, y):
        for i in range(n_layers):
            x = j_attn(p, f"e{i}s", x, x)
            x = dense_product(dense_product(x, p[f"e{i}f1"]), p[f"e{i}f2"])
        for i in range(n_layers):
            y = j_attn(p, f"d{i}s", y, y)
            y = j_attn(p, f"d{i}c", y, x)
            y = dense_product(dense_product(y, p[f"d{i}f1"]), p[f"d{i}f2"])
        return tied_logits(y, p["E"])

    def t_attn(p, pre, xq, xkv):
        q, k, w = (
            (x @ p[pre + s]).view(b, t, h, d // h) for x, s in ((xq, "q"), (xkv, "k"), (xkv, "v"))
        )
        q, k, w = (x.transpose(1, 2) for x in (q, k, w))  # views, as torch's MHA
        o = ((q @ k.transpose(-1, -2)) @ w).transpose(1, 2).reshape(n, d)
        return o @ p[pre + "o"]

    def t_logits(p, x, y):
        for i in range(n_layers):
            x = t_attn(p, f"e{i}s", x, x)
            x = (x @ p[f"e{i}f1"]) @ p[f"e{i}f2"]
        for i in range(n_layers):
            y = t_attn(p, f"d{i}s", y, y)
            y = t_attn(p, f"d{i}c", y, x)
            y = (y @ p[f"d{i}f1"]) @ p[f"d{i}f2"]
        return y @ p["E"].T

    return shapes, (n, d), (n, d), j_logits, t_logits


def xl_floor(b: int, t: int):
    """The 3-layer, D 256, H 4 x 64, inner 768, V 10000 Transformer-XL step's products, memory
    t -> (shapes, src shape, memory shape, jax logits, torch logits). The input is the segment's
    [B, T, D]; the memory a constant [B, M, D] per layer."""
    d, h, k, inner, v, n_layers, m = 256, 4, 64, 768, 10000, 3, t
    s_len = t + m
    shapes = {"E": (v, d)}
    # The positional embedding is a constant (sinusoids in the model): no gradient.
    pos_np = np.random.default_rng(1).normal(0, 1, (s_len, d)).astype(np.float32)
    j_pos, t_pos = jnp.asarray(pos_np), torch.from_numpy(pos_np)
    for i in range(n_layers):
        shapes[f"l{i}qkv"], shapes[f"l{i}r"], shapes[f"l{i}o"] = (
            (d, 3 * h * k),
            (d, h * k),
            (h * k, d),
        )
        shapes[f"l{i}f1"], shapes[f"l{i}f2"] = (d, inner), (inner, d)

    def j_logits(p, x, mem):
        for i in range(n_layers):
            cat = jnp.concatenate([mem[i], x], axis=1)  # [B, S, D], as the model's layer
            qkv = (cat @ p[f"l{i}qkv"]).reshape(b, s_len, 3, h, k)
            q, kk, w = qkv[:, -t:, 0], qkv[:, :, 1], qkv[:, :, 2]
            r = (j_pos @ p[f"l{i}r"]).reshape(s_len, h, k)
            pos = jnp.einsum("bthk,shk->bhts", q, r)
            s = jnp.einsum("bthk,bshk->bhts", q, kk) + pos  # the shared core's product
            o = jnp.einsum("bhts,bshk->bthk", s, w).reshape(b, t, h * k)
            x = ((o @ p[f"l{i}o"]) @ p[f"l{i}f1"]) @ p[f"l{i}f2"]
        return tied_logits(x.reshape(b * t, d), p["E"])

    def t_logits(p, x, mem):
        for i in range(n_layers):
            cat = torch.cat([mem[i], x], dim=1)
            qkv = (cat @ p[f"l{i}qkv"]).view(b, s_len, 3, h, k)
            q, kk, w = (qkv[:, :, j].transpose(1, 2) for j in range(3))
            q = q[:, :, -t:]
            r = (t_pos @ p[f"l{i}r"]).view(s_len, h, k).permute(1, 2, 0)  # [H, K, S]
            s = q @ kk.transpose(-1, -2) + q @ r  # [B, H, T, S]
            o = (s @ w).transpose(1, 2).reshape(b, t, h * k)
            x = ((o @ p[f"l{i}o"]) @ p[f"l{i}f1"]) @ p[f"l{i}f2"]
        return x.reshape(b * t, d) @ p["E"].T

    return shapes, (b, t, d), (n_layers, b, m, d), j_logits, t_logits


def main(model: str, b: int, t: int, steps: int) -> None:
    shapes, x_shape, y_shape, j_logits, t_logits = (
        transformer_floor if model == "transformer" else xl_floor
    )(b, t)
    rng = np.random.default_rng(0)
    params = {k: jnp.asarray(rng.normal(0, 0.05, s), jnp.float32) for k, s in shapes.items()}
    x = jnp.asarray(rng.normal(0, 1, x_shape), jnp.float32)
    y = jnp.asarray(rng.normal(0, 1, y_shape), jnp.float32)
    # The Transformer's step differentiates both inputs (the embeddings' gradients); the XL's
    # memory is a constant.
    n_inputs = 3 if model == "transformer" else 2
    # A random gradient of the logits, as the loss gives the output layer: with a constant
    # one (the gradient of a sum) XLA turns the table's gradient into a row sum, no product.
    ct = jnp.asarray(rng.normal(0, 1e-3, (b * t, shapes["E"][0])), jnp.float32)

    def backward(p, x, y, ct):
        # The logits are returned too: the step's loss reads them (unread, XLA drops their
        # product).
        logits, vjp = jax.vjp(j_logits, p, x, y)
        return logits, vjp(ct)[:n_inputs]

    grad = jax.jit(backward)
    hlo = grad.lower(params, x, y, ct).compile().as_text()
    tx, _ = make_optimizer(OptimizerConfig(learning_rate=1e-3, clip_norm=1.0, ema_decay=0.99))

    def floor_step(p, opt_state, x, y, ct):
        logits, (g, *_) = backward(p, x, y, ct)
        updates, opt_state = tx.update(g, opt_state, p, global_norm=optax.global_norm(g))
        return optax.apply_updates(p, updates), opt_state, logits

    step = jax.jit(floor_step, donate_argnums=(0, 1))
    tp = {k: torch.tensor(np.asarray(w), requires_grad=True) for k, w in params.items()}
    tx_, ty_ = torch.tensor(np.asarray(x)), torch.tensor(np.asarray(y))
    t_ct = torch.tensor(np.asarray(ct))
    if model == "transformer":
        tx_.requires_grad_(True)
        ty_.requires_grad_(True)

    tr = cvt.import_torch_reference()
    cpu = jax.devices("cpu")[0]
    config = dataclasses.replace(BenchConfig.quick(), torch_compile=False, torch_steps=steps)
    if model == "transformer":
        setup = cvt._transformer_arms(config, b, t, cpu, tr)
    else:
        config = dataclasses.replace(config, torch_xl_batch=b)
        setup = cvt._xl_arms(config, cpu, tr)
    box = {"state": (jax.tree.map(jnp.copy, params), tx.init(params))}

    def jax_floor(i):
        jax.block_until_ready(grad(params, x, y, ct))

    def jax_floor_update(i):
        *box["state"], _ = jax.block_until_ready(step(*box["state"], x, y, ct))

    def torch_floor(i):
        for w in (*tp.values(), tx_, ty_):
            w.grad = None
        t_logits(tp, tx_, ty_).backward(t_ct)

    arms = {
        "project": setup["arms"]["project"],
        "torch_eager": setup["arms"]["torch_eager"],
        "jax_floor": jax_floor,
        "jax_floor_update": jax_floor_update,
        "torch_floor": torch_floor,
    }
    for arm in arms.values():
        arm(0)  # compiled and warm before timing
    times = time_interleaved(arms, warmup=2, steps=steps)
    ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    print(f"{setup['name']}: {hlo.count(' dot(')} products in the jax floor's program")
    print("  median ms: " + ", ".join(f"{k} {v:.1f}" for k, v in ms.items()))
    eager = ms["torch_eager"]
    print(
        f"  eager PyTorch's step over: the project's {eager / ms['project']:.3f}, "
        f"the jax floor {eager / ms['jax_floor']:.3f}, "
        f"the jax floor + update {eager / ms['jax_floor_update']:.3f}"
    )
    print(
        f"  above its floor: the project's step {ms['project'] - ms['jax_floor']:.1f} ms, "
        f"eager PyTorch's {eager - ms['torch_floor']:.1f} ms; "
        f"torch floor / jax floor {ms['torch_floor'] / ms['jax_floor']:.3f}"
    )


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
