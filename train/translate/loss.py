"""The training loss of a translation model: label-smoothed cross-entropy over the real
target tokens (and, for hard attention, its REINFORCE term), in train.core.step's protocol."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from transformer_jax.losses import hard_attention_surrogate, label_smoothed_cross_entropy


def make_loss_fn(
    model: nn.Module,
    *,
    smoothing: float,
    pad_id: int,
    aux_loss: str | None = None,
    free_running: bool = False,
):
    """The train.core.step loss protocol for a translation model on {'src','tgt_in','tgt_out'}
    (and 'teacher_forcing' [B], the step's ratio, when free_running): label-smoothed
    cross-entropy summed over real target tokens, plus the unsmoothed nll.

    aux_loss 'hard_attention_surrogate': in training, hard attention's REINFORCE term is added
    to the differentiated sum (not to the reported nll), and its moving-average baseline is the
    carried state `extra`.
    """

    def loss_fn(params, batch, *, rng, extra, deterministic):
        rngs, kwargs = None, {}
        if not deterministic:
            rngs = {"dropout": rng}
            if aux_loss or free_running:  # positions and teacher-forcing coins
                rngs["sample"] = jax.random.fold_in(rng, 1)
            if free_running:
                kwargs["teacher_forcing"] = batch["teacher_forcing"][0]
        if aux_loss and not deterministic:
            logits, aux = model.apply(
                {"params": params},
                batch["src"],
                batch["tgt_in"],
                deterministic=False,
                rngs=rngs,
                method="logits_and_attention",
                **kwargs,
            )
        else:
            logits, aux = (
                model.apply(
                    {"params": params},
                    batch["src"],
                    batch["tgt_in"],
                    deterministic=deterministic,
                    rngs=rngs,
                    **kwargs,
                ),
                None,
            )
        loss_sum, n_tokens = label_smoothed_cross_entropy(
            logits, batch["tgt_out"], smoothing=smoothing, pad_id=pad_id
        )
        if smoothing:
            nll_sum, _ = label_smoothed_cross_entropy(
                logits, batch["tgt_out"], smoothing=0.0, pad_id=pad_id
            )
        else:
            nll_sum = loss_sum
        sums = {"n_tokens": n_tokens.astype(jnp.float32), "nll_sum": nll_sum}
        if aux is not None:
            surrogate, extra = hard_attention_surrogate(
                logits, batch["tgt_out"], aux, extra, pad_id=pad_id
            )
            sums["loss_sum"] = loss_sum  # reported; the surrogate is there for its gradient
            loss_sum = loss_sum + surrogate
        return loss_sum, sums, extra

    return loss_fn
