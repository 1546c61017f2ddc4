"""The copy task of the Annotated Transformer: learn to output the source sequence.

    python -m train.copy_task [--steps 400] [--seed 0]

A 2+2-layer Transformer is trained with the Noam schedule and label smoothing on random
sequences of 10 symbols, then greedily decodes `1 2 3 4 5 6 7 8 9 10`, which it must copy.

Vocabulary: the Annotated Transformer's 11 ids (0 = pad, data symbols 1..10) plus BOS = 11 and
EOS = 12, since the decoding protocol reserves BOS and EOS ids that are never data.
The logic is `train_copy_task`, importable so a test can run a shortened version.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from transformer_jax import (
    OptimizerConfig,
    Transformer,
    TransformerConfig,
    greedy_decode,
    label_smoothed_cross_entropy,
    make_optimizer,
)

PAD, BOS, EOS = 0, 11, 12
N_SYMBOLS = 10  # data symbols 1..10
SEQ_LEN = 10


def copy_config(**overrides) -> TransformerConfig:
    """The copy-task model: 2+2 layers, width 64 (small enough for a shared 2-core CPU)."""
    fields = dict(
        src_vocab_size=13,
        tgt_vocab_size=13,
        d_model=64,
        n_heads=4,
        d_ff=256,
        n_encoder_layers=2,
        n_decoder_layers=2,
        dropout=0.1,
        max_len=SEQ_LEN + 1,
        pad_id=PAD,
        bos_id=BOS,
        eos_id=EOS,
    )
    return TransformerConfig(**{**fields, **overrides})


def random_batch(rng: np.random.Generator, batch_size: int) -> tuple[np.ndarray, ...]:
    """-> src [B, 10], decoder input [B, 11] (BOS first), targets [B, 11] (EOS last)."""
    seq = rng.integers(1, N_SYMBOLS + 1, size=(batch_size, SEQ_LEN), dtype=np.int32)
    bos = np.full((batch_size, 1), BOS, np.int32)
    eos = np.full((batch_size, 1), EOS, np.int32)
    return seq, np.concatenate([bos, seq], 1), np.concatenate([seq, eos], 1)


def train_copy_task(
    *,
    steps: int = 400,
    batch_size: int = 64,
    warmup_steps: int = 200,
    factor: float = 1.0,
    smoothing: float = 0.1,
    seed: int = 0,
    config: TransformerConfig | None = None,
    log_every: int = 50,
    log=print,
) -> tuple[float, dict]:
    """Trains the copy task and returns (mean loss per token of the last step, params)."""
    config = config or copy_config()
    model = Transformer(config)
    data_rng = np.random.default_rng(seed)
    init_rng, dropout_rng = jax.random.split(jax.random.PRNGKey(seed))
    src, tgt_in, _ = random_batch(data_rng, batch_size)
    params = model.init(init_rng, src, tgt_in)["params"]
    tx, _ = make_optimizer(
        OptimizerConfig(
            schedule="noam", d_model=config.d_model, warmup_steps=warmup_steps, lr_factor=factor
        )
    )
    opt_state = tx.init(params)

    @jax.jit
    def train_step(params, opt_state, src, tgt_in, targets, step):
        def loss_fn(p):
            logits = model.apply(
                {"params": p},
                src,
                tgt_in,
                deterministic=False,
                rngs={"dropout": jax.random.fold_in(dropout_rng, step)},
            )
            loss_sum, n_tokens = label_smoothed_cross_entropy(
                logits, targets, smoothing=smoothing, pad_id=config.pad_id
            )
            return loss_sum / n_tokens

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    loss = float("nan")
    for step in range(steps):
        params, opt_state, loss = train_step(
            params, opt_state, *random_batch(data_rng, batch_size), step
        )
        if log is not None and (step + 1) % log_every == 0:
            log(f"step {step + 1:4d}  loss {float(loss):.4f}")
    return float(loss), params


def decode_copy(config: TransformerConfig, params, src: np.ndarray) -> np.ndarray:
    """Greedy copy of src [B, 10] -> [B, 11] (10 symbols then EOS, if it learned)."""
    return np.asarray(
        greedy_decode(Transformer(config), params, jnp.asarray(src), max_len=SEQ_LEN + 1)
    )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    start = time.time()
    config = copy_config()
    loss, params = train_copy_task(steps=args.steps, seed=args.seed, config=config)
    src = np.arange(1, SEQ_LEN + 1, dtype=np.int32)[None]
    out = decode_copy(config, params, src)[0]
    decoded = [int(t) for t in out if t not in (EOS, PAD)]
    print("source: ", " ".join(map(str, src[0])))
    print("decoded:", " ".join(map(str, decoded)))
    print(f"final loss {loss:.4f}, copied: {decoded == list(src[0])}, {time.time() - start:.1f} s")
