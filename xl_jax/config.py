"""TransformerXLConfig: one frozen dataclass passed whole to every module of `xl_jax`.

Field names follow the official PyTorch code (kimiyoung/transformer-xl, `MemTransformerLM`)
where it has one: `n_layers` = `n_layer`, `n_heads` = `n_head`, `norm_first` = `pre_lnorm`,
`tie_weights` = `tie_weight`; `d_head` is the per-head width (K), so the attention width is
`n_heads * d_head` and need not equal `d_model`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import jax.numpy as jnp

from transformer_jax.attention import IMPLEMENTATIONS

REMAT_MODES = ("attention", "full", "none")
# The attention core's choices plus the fused relative-attention kernels (xl_jax.fused_attention).
ATTENTION_IMPLS = (*IMPLEMENTATIONS, "pallas")
TAIL_MODES = ("grouped", "dense")


@dataclasses.dataclass(frozen=True)
class TransformerXLConfig:
    """Hyper-parameters of a Transformer-XL language model (attn_type 0 of the reference).

    Attributes:
      vocab_size: V, number of token ids.
      n_layers: depth, the number of layers.
      n_heads: H, the attention heads.
      d_model: D, the model width.
      d_head: K, the head width.
      d_inner: the feed-forward width.
      d_embed: width of the (first cluster's) embedding table; defaults to `d_model`. When it
        differs from `d_model` the embedding is projected to `d_model`.
      dropout: on word and position embeddings, on each sublayer output, inside the
        feed-forward and on the final hidden state (as the reference).
      dropatt: on the attention probabilities.
      tgt_len: training segment length (T). The model accepts any T; this is the default for
        data batching and for `generate`'s prompt reading.
      mem_len: memory length (M) of `init_memory` when no other is asked for.
      same_length: every query attends to at most `M` keys (its distance < M), where M is the
        length of the memory passed in; see `xl_jax.memory.attention_mask`.
      clamp_len: relative distances above it use the embedding of `clamp_len`; only when > 0.
      norm_first: pre-LN (`pre_lnorm`): LayerNorm before each sublayer, and, as the
        reference, no final LayerNorm.
      tie_weights: the softmax reuses the embedding tables.
      cutoffs: adaptive input/softmax cluster boundaries (ascending, < vocab_size); empty
        means a full softmax.
      div_val: cluster i has embedding width `d_embed // div_val**i`.
      tie_projs: per cluster (len(cutoffs) + 1 entries, or empty = none), whether the softmax
        reuses the embedding's projection.
      untie_r: separate u (`r_w_bias`) and v (`r_r_bias`) per layer instead of shared ones.
      layer_norm_eps: LayerNorm epsilon (PyTorch's default 1e-5).
      remat: what the backward pass keeps of each layer (the layers run in a scan, one at a
        time); numerics are identical in every mode, only memory and recomputation differ.

        - 'attention' (default): keep the projections' outputs, recompute the attention core,
          so no [B, H, T, S] score, weight or dropatt tensor is kept per layer; costs the
          three attention products ((q+u)k, (q+v)R, weights x v) and their elementwise work
          once more per step (measured memory and time: benchmarks/README.md).
        - 'full': keep only each layer's input and recompute the whole layer (least memory).
        - 'none': keep everything, the layers unrolled (fastest where memory allows; 3 to 4
          score-sized tensors per layer).

      softmax_tails: how the adaptive softmax computes the NLL of tail-cluster targets (full
        log-probabilities, without targets, are always dense). 'grouped' (default): each tail
        only for the tokens whose targets fall in it (see `xl_jax.adaptive`); 'dense': every
        tail for every token. The same NLL and gradients either way.
      dtype: compute dtype. Parameters are float32, or float64 when dtype is float64 (which
        needs `jax_enable_x64`); attention logits, softmax and loss are at least float32.
      attention_impl: "auto" (cuDNN's fused kernel, with the position term as its bias, on a
        GPU in half precision where it applies, else XLA), "xla" or "cudnn" (see
        `transformer_jax.attention.dot_product_attention`), or "pallas": the fused relative
        attention of `xl_jax.fused_attention` (position term, rel-shift, masks, online softmax
        and dropatt in one blockwise kernel, no [B, H, T, S] tensor in memory) wherever its
        shapes allow, else "auto"'s path: Triton on a GPU, Mosaic on a TPU
        (`xl_jax.fused_attention_tpu`), interpreted (slowly) on a CPU.
    """

    vocab_size: int
    n_layers: int
    n_heads: int
    d_model: int
    d_head: int
    d_inner: int
    d_embed: int | None = None
    dropout: float = 0.1
    dropatt: float = 0.0
    tgt_len: int = 128
    mem_len: int = 128
    same_length: bool = False
    clamp_len: int = -1
    norm_first: bool = False
    tie_weights: bool = True
    cutoffs: tuple[int, ...] = ()
    div_val: int = 1
    tie_projs: tuple[bool, ...] = ()
    untie_r: bool = False
    layer_norm_eps: float = 1e-5
    remat: Literal["attention", "full", "none"] = "attention"
    softmax_tails: Literal["grouped", "dense"] = "grouped"
    dtype: Any = jnp.float32
    attention_impl: Literal["auto", "xla", "cudnn", "pallas"] = "auto"

    def __post_init__(self):
        # Lists are accepted for convenience but stored as tuples so the config stays hashable
        # (it is a static argument of jitted functions).
        object.__setattr__(self, "cutoffs", tuple(int(c) for c in self.cutoffs))
        object.__setattr__(self, "tie_projs", tuple(bool(t) for t in self.tie_projs))
        if self.d_embed is None:
            object.__setattr__(self, "d_embed", self.d_model)
        for name in (
            "vocab_size",
            "n_layers",
            "n_heads",
            "d_model",
            "d_head",
            "d_inner",
            "d_embed",
            "tgt_len",
            "div_val",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.d_model % 2:
            # The sinusoid position embedding is sin and cos halves of width d_model / 2.
            raise ValueError(f"d_model must be even, got {self.d_model}")
        if self.mem_len < 0:
            raise ValueError(f"mem_len must be >= 0, got {self.mem_len}")
        for name in ("dropout", "dropatt"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)}")
        if self.same_length and self.mem_len == 0:
            # The reference masks every key in that case (NaN attention).
            raise ValueError("same_length needs mem_len > 0")
        c = self.cutoffs
        if c and (list(c) != sorted(set(c)) or c[0] < 1 or c[-1] >= self.vocab_size):
            raise ValueError(f"cutoffs must be strictly increasing in [1, vocab_size), got {c}")
        if self.tie_projs and len(self.tie_projs) != len(c) + 1:
            raise ValueError(
                f"tie_projs needs len(cutoffs) + 1 = {len(c) + 1} entries, got "
                f"{len(self.tie_projs)}"
            )
        if self.d_embed // self.div_val ** len(c) < 1:
            raise ValueError(
                f"div_val={self.div_val} leaves the last cluster of d_embed={self.d_embed} "
                "with width 0"
            )
        if self.remat not in REMAT_MODES:
            raise ValueError(f"remat must be one of {REMAT_MODES}, got {self.remat!r}")
        if self.softmax_tails not in TAIL_MODES:
            raise ValueError(
                f"softmax_tails must be one of {TAIL_MODES}, got {self.softmax_tails!r}"
            )
        if self.attention_impl not in ATTENTION_IMPLS:
            raise ValueError(
                f"attention_impl must be one of {ATTENTION_IMPLS}, got {self.attention_impl!r}"
            )
        try:
            dtype = jnp.dtype(self.dtype)
        except TypeError:
            dtype = None
        if dtype not in (
            jnp.dtype(jnp.float32),
            jnp.dtype(jnp.float64),
            jnp.dtype(jnp.bfloat16),
            jnp.dtype(jnp.float16),
        ):
            raise ValueError(f"dtype must be a float type, got {self.dtype!r}")
        # One spelling ('bfloat16', jnp.bfloat16, ...), so configs compare and save alike.
        object.__setattr__(self, "dtype", dtype)

    # ----------------------------------------------------------------- derived quantities
    @property
    def param_dtype(self):
        """float32, or float64 when computing in float64 (to compare with references)."""
        return jnp.float64 if jnp.dtype(self.dtype) == jnp.float64 else jnp.float32

    @property
    def cluster_bounds(self) -> tuple[int, ...]:
        """The cluster boundaries `(0, *cutoffs, vocab_size)`; cluster i holds the ids
        `[bounds[i], bounds[i + 1])`."""
        return (0, *self.cutoffs, self.vocab_size)

    def cluster_width(self, i: int) -> int:
        """Embedding width of cluster i (the whole vocabulary is cluster 0 when div_val == 1)."""
        return self.d_embed // self.div_val**i

    def replace(self, **changes) -> TransformerXLConfig:
        return dataclasses.replace(self, **changes)

    # ----------------------------------------------------------------------------- presets
    @classmethod
    def tiny(cls, **overrides) -> TransformerXLConfig:
        """For tests: 2 layers of width 32, a 64-token vocabulary."""
        kw = dict(
            vocab_size=64,
            n_layers=2,
            n_heads=2,
            d_model=32,
            d_head=16,
            d_inner=64,
            dropout=0.0,
            dropatt=0.0,
            tgt_len=8,
            mem_len=8,
        )
        return cls(**{**kw, **overrides})

    @classmethod
    def seed_small(cls, **overrides) -> TransformerXLConfig:
        """The configuration of the PyTorch tutorial this project grew from (word-level PTB).

        d_head 17 and d_inner 71 are deliberately odd, so a head-width or width mix-up fails
        loudly instead of passing by coincidence.
        """
        kw = dict(
            vocab_size=10000,
            n_layers=4,
            n_heads=3,
            d_model=32,
            d_head=17,
            d_inner=71,
            dropout=0.1,
            dropatt=0.0,
            tgt_len=33,
            mem_len=41,
        )
        return cls(**{**kw, **overrides})

    @classmethod
    def ptb(cls, **overrides) -> TransformerXLConfig:
        """Word-level Penn Treebank (10k vocabulary, ~0.93M training tokens), ~6M parameters.

        The paper's PTB model is 16 layers x 380 wide (24M parameters) and needs heavy
        regularisation. We keep its recipe (strong dropout and dropatt, tied full softmax: a
        10k vocabulary gains nothing from adaptive softmax, tgt_len = mem_len = 70) and shrink
        it to 4 layers x 256 (4 heads x 64, d_inner 1024), which trains in minutes on one
        accelerator and is still usable on CPU; with 4x fewer parameters per token of data,
        dropout 0.3 instead of 0.45 is enough.
        """
        kw = dict(
            vocab_size=10000,
            n_layers=4,
            n_heads=4,
            d_model=256,
            d_head=64,
            d_inner=1024,
            dropout=0.3,
            dropatt=0.1,
            tgt_len=70,
            mem_len=70,
        )
        return cls(**{**kw, **overrides})

    @classmethod
    def enwik8_base(cls, **overrides) -> TransformerXLConfig:
        """The paper's 12-layer enwik8 model (byte-level, 204 symbols in the reference)."""
        kw = dict(
            vocab_size=204,
            n_layers=12,
            n_heads=8,
            d_model=512,
            d_head=64,
            d_inner=2048,
            dropout=0.1,
            dropatt=0.0,
            tgt_len=512,
            mem_len=512,
        )
        return cls(**{**kw, **overrides})

    @classmethod
    def wt103_base(cls, **overrides) -> TransformerXLConfig:
        """The paper's base WikiText-103 model: 16 x 410, adaptive input and softmax."""
        kw = dict(
            vocab_size=267735,
            n_layers=16,
            n_heads=10,
            d_model=410,
            d_head=41,
            d_inner=2100,
            dropout=0.1,
            dropatt=0.0,
            tgt_len=150,
            mem_len=150,
            cutoffs=(20000, 40000, 200000),
            div_val=1,
            tie_projs=(False, True, True, True),
        )
        return cls(**{**kw, **overrides})
