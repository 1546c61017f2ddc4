"""TransformerConfig: every hyper-parameter of the encoder-decoder Transformer, validated once."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax.attention import IMPLEMENTATIONS

# TransformerConfig.quantize's choices: the weights our own decoding runs with
# (transformer_jax.int8 computes them). Not CTranslate2's
# (interchange.ct2.CT2_QUANTIZATIONS).
DECODE_QUANTIZATIONS = ("int8",)

POSITIONAL = ("sinusoidal", "sinusoidal_concat", "learned")
# config.activation -> the FFN's function. gelu is the exact (erf) form, as PyTorch's and
# Marian's; "swish" and "silu" are one function, x * sigmoid(x), under its two names.
ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "relu": jax.nn.relu,
    "gelu": functools.partial(jax.nn.gelu, approximate=False),
    "swish": jax.nn.silu,
    "silu": jax.nn.silu,
}
_DTYPES = (np.dtype(jnp.float32), np.dtype(jnp.bfloat16), np.dtype(jnp.float16))


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """Hyper-parameters of `Transformer`; the defaults are the paper's base model (Table 3).

    Attributes:
      src_vocab_size: V of the source side. The default 37000 is the paper's shared WMT14
        En-De BPE vocabulary.
      tgt_vocab_size: V of the target side (the same default).
      d_model: D, the model width.
      n_heads: H, the attention heads (K = D / H).
      d_ff: inner width of the position-wise FFN.
      activation: the FFN's nonlinearity: "relu" (the paper), "gelu" (exact, erf-based) or
        "swish" / "silu" (x * sigmoid(x), OPUS-MT's Marian models).
      n_encoder_layers: the encoder stack's depth (N in the paper).
      n_decoder_layers: the decoder stack's depth (N in the paper).
      dropout: residual dropout on every sublayer output and on the embedding + position sums.
      attention_dropout: dropout on the attention weights (the paper uses none; the Annotated
        Transformer and tensor2tensor do).
      norm_first: False is the paper's post-LN, LayerNorm(x + Sublayer(x)); True is pre-LN,
        x + Sublayer(LayerNorm(x)) with a final LayerNorm on each stack.
      layer_norm_eps: the LayerNorms' epsilon (tensor2tensor's 1e-6; PyTorch's and Marian's
        is 1e-5).
      positional: "sinusoidal" (sin/cos interleaved, the paper's formula), "sinusoidal_concat"
        (all sines then all cosines, tensor2tensor's layout) or "learned" (max_len rows).
      max_len: rows of the learned table, the longest sequence "learned" accepts; sinusoidal
        positions work at any length.
      scale_embeddings: multiply token embeddings by sqrt(D) before adding positions (section
        3.4); False adds them unscaled.
      share_embeddings: one table for source and target tokens (needs equal vocab sizes).
      tie_output: the pre-softmax projection is the transposed target embedding.
      output_bias: add a learned [V] bias to the tied logits (Marian's `final_logits_bias`);
        an untied projection always has its own bias.
      pad_id: the padding id, inside both vocabularies.
      bos_id: the id decoding starts from. It may equal pad_id, as in Marian, which starts
        decoding from pad. Then the decoder's self-attention masks no target position as
        padding (it could not tell the start from a pad): it is causal only, which with
        right-padded targets still keeps every pad out of what a real position sees.
      eos_id: the id that ends a sentence; it differs from pad_id and bos_id.
      dtype: compute dtype (float32, bfloat16 or float16). Parameters are always float32;
        attention logits, softmax, output logits and the loss are float32. In half precision
        the output projection multiplies in `dtype` with float32 results (its gradient too).
      attention_impl: "auto" (cuDNN's fused kernel on a GPU in half precision where it
        applies, else XLA), "xla" or "cudnn"; see `transformer_jax.attention`.
      quantize: None, or "int8" for inference with int8 weights
        (`transformer_jax.int8`: the params come from `quantize_params`; such a
        model is not trained).
    """

    src_vocab_size: int = 37000
    tgt_vocab_size: int = 37000
    d_model: int = 512
    n_heads: int = 8
    d_ff: int = 2048
    activation: str = "relu"
    n_encoder_layers: int = 6
    n_decoder_layers: int = 6
    dropout: float = 0.1
    attention_dropout: float = 0.0
    norm_first: bool = False
    layer_norm_eps: float = 1e-6
    positional: str = "sinusoidal"
    max_len: int = 512
    scale_embeddings: bool = True
    share_embeddings: bool = True
    tie_output: bool = True
    output_bias: bool = False
    pad_id: int = 0
    bos_id: int = 1
    eos_id: int = 2
    dtype: Any = jnp.float32
    attention_impl: str = "auto"
    quantize: str | None = None

    def __post_init__(self):
        for name in (
            "src_vocab_size",
            "tgt_vocab_size",
            "d_model",
            "n_heads",
            "d_ff",
            "n_encoder_layers",
            "n_decoder_layers",
            "max_len",
        ):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.d_model % self.n_heads:
            raise ValueError(
                f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})"
            )
        for name in ("dropout", "attention_dropout"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {value!r}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(
                f"activation must be one of {tuple(ACTIVATIONS)}, got {self.activation!r}"
            )
        if not self.layer_norm_eps > 0.0:
            raise ValueError(f"layer_norm_eps must be positive, got {self.layer_norm_eps!r}")
        if self.output_bias and not self.tie_output:
            raise ValueError(
                "output_bias applies to the tied output projection; with "
                "tie_output=False the projection has its own bias"
            )
        if self.attention_impl not in IMPLEMENTATIONS:
            raise ValueError(
                f"attention_impl must be one of {IMPLEMENTATIONS}, got {self.attention_impl!r}"
            )
        if self.quantize not in (None, *DECODE_QUANTIZATIONS):
            raise ValueError(
                f"quantize must be None or one of {DECODE_QUANTIZATIONS}, got {self.quantize!r}"
            )
        if self.positional not in POSITIONAL:
            raise ValueError(f"positional must be one of {POSITIONAL}, got {self.positional!r}")
        if self.positional.startswith("sinusoidal") and self.d_model % 2:
            raise ValueError(f"d_model must be even for sinusoidal positions, got {self.d_model}")
        if self.share_embeddings and self.src_vocab_size != self.tgt_vocab_size:
            raise ValueError(
                f"share_embeddings needs src_vocab_size == tgt_vocab_size, got "
                f"{self.src_vocab_size} and {self.tgt_vocab_size}"
            )
        specials = {"pad_id": self.pad_id, "bos_id": self.bos_id, "eos_id": self.eos_id}
        for name, value in specials.items():
            if not 0 <= value < min(self.src_vocab_size, self.tgt_vocab_size):
                raise ValueError(f"{name} ({value}) must be a token id in both vocabularies")
        if self.eos_id in (self.pad_id, self.bos_id):
            raise ValueError(
                f"pad_id, bos_id and eos_id: eos_id must differ from the other two "
                f"(bos_id may equal pad_id), got {specials}"
            )
        try:
            dtype = np.dtype(self.dtype)
        except TypeError:
            dtype = None
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        # Normalise ("bfloat16", jnp.bfloat16, ...) to one hashable value.
        object.__setattr__(self, "dtype", dtype)

    @property
    def head_dim(self) -> int:
        """K, the width of one head."""
        return self.d_model // self.n_heads

    def replace(self, **overrides) -> TransformerConfig:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **overrides)

    @classmethod
    def tiny(cls, **overrides) -> TransformerConfig:
        """A model for tests and toy tasks: 2+2 layers of width 64."""
        fields = dict(
            src_vocab_size=32,
            tgt_vocab_size=32,
            d_model=64,
            n_heads=4,
            d_ff=128,
            n_encoder_layers=2,
            n_decoder_layers=2,
            max_len=64,
        )
        return cls(**{**fields, **overrides})

    @classmethod
    def base(cls, **overrides) -> TransformerConfig:
        """The paper's base model: 512 / 8 heads / 2048 / 6+6 layers / dropout 0.1."""
        return cls(**overrides)

    @classmethod
    def big(cls, **overrides) -> TransformerConfig:
        """The paper's big model: 1024 / 16 heads / 4096 / 6+6 layers / dropout 0.3 (En-De)."""
        fields = dict(d_model=1024, n_heads=16, d_ff=4096, dropout=0.3)
        return cls(**{**fields, **overrides})
