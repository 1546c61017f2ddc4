"""PyTorch twins of the project's models and train step, for the cpu_vs_torch section.

`TorchTransformer` is `transformer_jax.Transformer` as a PyTorch user writes it (one
`nn.Transformer`, a shared embedding tied to the output), with the same shapes and parameter
count; `TorchTrainStep` is `train.core.step.make_train_step` with the project's optax chain
(clip the global gradient norm, Adam, then the parameter EMA of
`transformer_jax.optim.params_ema`). The Transformer-XL twin is `train.bench.xl_torch_reference`
(the official MemTransformerLM's maths).

torch is a test-only dependency: only the cpu_vs_torch section imports this module.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from transformer_jax.config import TransformerConfig
from transformer_jax.positional import sinusoidal_positions

Tensor = torch.Tensor


class TorchTransformer(nn.Module):
    """src [B, S], tgt_in [B, T] int64 -> logits [B, T, V] float32, batch-major.

    Supports the configs the comparison uses: shared source/target embedding tied to the
    output projection, sinusoidal positions, no dropout. Layers as the project's: biased
    projections, ReLU FFN, LayerNorm epsilon 1e-6, a final LayerNorm on each stack when pre-LN
    (`nn.Transformer` adds both), embedding scaled by sqrt(D), padding masked by `pad_id`.
    """

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        if not (cfg.share_embeddings and cfg.tie_output):
            raise ValueError("TorchTransformer: only a shared embedding tied to the output")
        if not cfg.positional.startswith("sinusoidal"):
            raise ValueError(f"TorchTransformer: sinusoidal positions only, got {cfg.positional!r}")
        if cfg.dropout or cfg.attention_dropout:
            raise ValueError(
                "TorchTransformer: dropout must be off (the comparison times no random numbers)"
            )
        d = cfg.d_model
        self.scale, self.pad_id = math.sqrt(d), cfg.pad_id
        self.embed = nn.Embedding(cfg.tgt_vocab_size, d)
        nn.init.normal_(self.embed.weight, std=d**-0.5)
        layout = "concat" if cfg.positional == "sinusoidal_concat" else "interleaved"
        table = np.array(sinusoidal_positions(cfg.max_len, d, layout=layout))
        self.register_buffer("positions", torch.from_numpy(table), persistent=False)
        with warnings.catch_warnings():
            # Nested tensors (an inference fast path) do not apply to pre-LN: torch says so.
            warnings.filterwarnings("ignore", message="enable_nested_tensor is True")
            self.transformer = nn.Transformer(
                d_model=d,
                nhead=cfg.n_heads,
                num_encoder_layers=cfg.n_encoder_layers,
                num_decoder_layers=cfg.n_decoder_layers,
                dim_feedforward=cfg.d_ff,
                dropout=0.0,
                layer_norm_eps=1e-6,
                batch_first=True,
                norm_first=cfg.norm_first,
            )

    def forward(self, src: Tensor, tgt_in: Tensor) -> Tensor:
        s, t = src.shape[1], tgt_in.shape[1]
        x = self.embed(src) * self.scale + self.positions[:s]
        y = self.embed(tgt_in) * self.scale + self.positions[:t]
        src_pad, tgt_pad = src == self.pad_id, tgt_in == self.pad_id
        causal = torch.triu(torch.ones(t, t, dtype=torch.bool), diagonal=1)  # True = masked
        h = self.transformer(
            x,
            y,
            tgt_mask=causal,
            src_key_padding_mask=src_pad,
            tgt_key_padding_mask=tgt_pad,
            memory_key_padding_mask=src_pad,
            tgt_is_causal=True,
        )
        return h @ self.embed.weight.t()


def label_smoothed_loss(
    logits: Tensor, targets: Tensor, *, smoothing: float, pad_id: int
) -> tuple[Tensor, Tensor, Tensor]:
    """`transformer_jax.losses.label_smoothed_cross_entropy` (1 - smoothing on the target,
    smoothing / (V - 2) on every other token but pad) from one log-softmax -> (loss_sum,
    n_tokens, nll_sum), summed over the non-pad targets."""
    vocab = logits.shape[-1]
    log_p = torch.log_softmax(logits.float(), dim=-1)
    true_lp = log_p.gather(-1, targets[..., None])[..., 0]
    rest_lp = log_p.sum(-1) - log_p[..., pad_id] - true_lp
    loss = -(1.0 - smoothing) * true_lp - (smoothing / (vocab - 2)) * rest_lp
    real = targets != pad_id
    return (loss * real).sum(), real.sum(), (-true_lp * real).sum().detach()


def translation_loss_fn(
    model: TorchTransformer, *, smoothing: float
) -> Callable[[Tensor, Tensor, Tensor], tuple[Tensor, Tensor]]:
    """(src, tgt_in, tgt_out) -> (loss_sum, n_tokens): `train.translate.make_loss_fn`'s."""

    def loss_fn(src, tgt_in, tgt_out):
        loss_sum, n_tokens, _ = label_smoothed_loss(
            model(src, tgt_in), tgt_out, smoothing=smoothing, pad_id=model.pad_id
        )
        return loss_sum, n_tokens

    return loss_fn


class XLLossFn:
    """(data, target) [T, B] -> (summed nll, tokens) of a MemTransformerLM, its memory carried
    from call to call (as the project's state.extra): `train.lm.make_loss_fn`'s."""

    def __init__(self, forward: Callable):
        self.forward, self.mems = forward, None

    def __call__(self, data: Tensor, target: Tensor) -> tuple[Tensor, int]:
        nll, self.mems = self.forward(data, target, self.mems)
        return nll.sum(), nll.numel()


class TorchTrainStep:
    """One optimizer step: (loss_sum / n_tokens).backward(), clip the gradient's global norm,
    Adam (torch's defaults but the rate), then the parameter EMA (decay min(d, (n-1)/n) at
    update n, as `params_ema`)."""

    def __init__(
        self,
        model: nn.Module,
        loss_fn: Callable,
        *,
        learning_rate: float,
        clip_norm: float | None,
        ema_decay: float = 0.0,
    ):
        self.params = list(model.parameters())
        self.loss_fn, self.clip_norm, self.ema_decay = loss_fn, clip_norm, ema_decay
        self.optimizer = torch.optim.Adam(self.params, lr=learning_rate)
        self.ema = [p.detach().clone() for p in self.params] if ema_decay else None
        self.count = 0

    def __call__(self, *batch: Tensor) -> Tensor:
        """-> the step's loss per token (a 0-d tensor, detached)."""
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum, n_tokens = self.loss_fn(*batch)
        loss = (
            loss_sum / max(n_tokens, 1)
            if isinstance(n_tokens, int)
            else loss_sum / n_tokens.clamp(min=1)
        )
        loss.backward()
        if self.clip_norm is not None:
            nn.utils.clip_grad_norm_(self.params, self.clip_norm)
        self.optimizer.step()
        if self.ema is not None:
            self.count += 1
            decay = min(self.ema_decay, (self.count - 1) / self.count)
            with torch.no_grad():
                torch._foreach_lerp_(self.ema, self.params, 1.0 - decay)
        return loss.detach()


def count_params(model: nn.Module) -> int:
    """Trainable parameters, each tied tensor once."""
    return sum(p.numel() for p in model.parameters())
