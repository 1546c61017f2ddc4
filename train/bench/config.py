"""What one benchmark run measures: the sections and `BenchConfig`, the sizes of every model
and loop, with its two presets (`full` for one GPU, `quick` for a CPU)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from train.bench.random_models import opus_mt_config
from train.lm import config as lm_config
from train.translate import registry
from transformer_jax.config import TransformerConfig
from xl_jax.config import TransformerXLConfig

SECTIONS = (
    "matmul",
    "train_transformer",
    "train_xl_enwik8",
    "train_xl_wt103",
    "decode",
    "xl_eval",
    "cpu_vs_torch",
    "data",
)
# cpu_vs_torch and data run only when asked for: they time the CPU even on an accelerator
# machine (data also writes a corpus of about 1.5 GB).
DEFAULT_SECTIONS = SECTIONS[:-2]
XL_SECTIONS = {"train_xl_enwik8": "enwik8", "train_xl_wt103": "wt103"}
# The sections `--target` compiles for a device this host does not have.
TARGET_SECTIONS = ("train_transformer", *XL_SECTIONS)


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    """The sizes of one benchmark run (`full` for an accelerator, `quick` for a CPU).

    Attributes:
      dtype: compute dtype of every model ('float32' | 'bfloat16').
      steps, warmup: timed and untimed training steps of each training benchmark.
      matmul_size, matmul_repeats: the square product that measures the matrix rate.
      transformer, transformer_batch, transformer_len: the Transformer training step, on
        [batch, len] sources and targets.
      transformer_min_len: 0: every row of those batches is len tokens long; else each source
        and target row's length is drawn from [min, len] and the rest padded, so the step's
        real (non-pad) tokens fall below its padded ones (the bench reports both).
      xl: (name, config, batch) per Transformer-XL training benchmark; segment and memory
        lengths are the config's tgt_len and mem_len.
      decode_sizes: (name, config) of each model the decode section compares the engines on
        (random weights, float32).
      decode_batches: batch sizes (rows per call) of the decode section; batch 1 decodes
        `decode_latency_sentences` sentences one by one (latency), a larger batch
        `decode_sentences` sentences, sorted by length (throughput).
      decode_sentences, decode_latency_sentences: see decode_batches.
      decode_source_lengths: (min, max) source length of the random sentences, EOS counted.
      decode_buckets: the lengths sources are padded to (our search compiles one program per
        bucket, batch and search); output positions are the bucket + decode_margin.
      beam_size, decode_length_penalty: the beam search (alpha: GNMT's in ours, length **
        alpha in the engines).
      decode_rounds: timed rounds (each engine's pass in turn) after one untimed round.
      decode_threads: CPU threads of CTranslate2 and torch.
      xl_eval: the Transformer-XL of the evaluation comparison.
      attn_lengths: attention lengths A compared (XL memory M = A; vanilla window = A).
      xl_eval_tgt_len, xl_eval_batch: XL's evaluation segment length and batch.
      vanilla_batch: sliding windows evaluated at once by the vanilla model.
      eval_repeats: timed calls per length and model.
      torch_transformer, torch_shapes: the translation model compared with PyTorch on the CPU
        and its step shapes (sentences, length) (sources and targets alike).
      torch_xl, torch_xl_batch: the Transformer-XL compared with PyTorch (segment and memory
        lengths: its tgt_len and mem_len).
      torch_steps, torch_warmup: timed and untimed interleaved steps of that comparison.
      torch_compile: also time a `torch.compile`d PyTorch step.
      data_pairs, data_lm_tokens: the synthetic corpus of the data section (sentence pairs,
        LM text tokens); data_loader_seconds: how long each loader is drawn from.
    """

    dtype: str
    steps: int
    warmup: int
    matmul_size: int
    matmul_repeats: int
    transformer: TransformerConfig
    transformer_batch: int
    transformer_len: int
    xl: tuple[tuple[str, TransformerXLConfig, int], ...]
    decode_sizes: tuple[tuple[str, TransformerConfig], ...]
    decode_batches: tuple[int, ...]
    decode_sentences: int
    decode_latency_sentences: int
    decode_source_lengths: tuple[int, int]
    decode_buckets: tuple[int, ...]
    beam_size: int
    decode_length_penalty: float
    decode_margin: int
    decode_rounds: int
    decode_threads: int
    xl_eval: TransformerXLConfig
    attn_lengths: tuple[int, ...]
    xl_eval_tgt_len: int
    xl_eval_batch: int
    vanilla_batch: int
    eval_repeats: int
    torch_transformer: TransformerConfig
    torch_shapes: tuple[tuple[int, int], ...]
    torch_xl: TransformerXLConfig
    torch_xl_batch: int
    torch_steps: int
    torch_warmup: int
    torch_compile: bool
    # The data section is a CPU measure of the same size in both presets (issue 24's goals).
    transformer_min_len: int = 0
    data_pairs: int = 1_000_000
    data_lm_tokens: int = 100_000_000
    data_loader_seconds: float = 5.0

    def __post_init__(self):
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype: expected 'float32' or 'bfloat16', got {self.dtype!r}")
        for name in (
            "steps",
            "matmul_size",
            "matmul_repeats",
            "transformer_batch",
            "transformer_len",
            "decode_sentences",
            "decode_latency_sentences",
            "beam_size",
            "decode_rounds",
            "decode_threads",
            "xl_eval_tgt_len",
            "xl_eval_batch",
            "vanilla_batch",
            "eval_repeats",
            "torch_xl_batch",
            "torch_steps",
            "data_pairs",
            "data_lm_tokens",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.transformer_min_len <= self.transformer_len:
            raise ValueError(
                f"transformer_min_len: must be in [0, transformer_len={self.transformer_len}], "
                f"got {self.transformer_min_len}"
            )
        for name in ("warmup", "decode_margin", "decode_length_penalty", "torch_warmup"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)}")
        if not self.attn_lengths or min(self.attn_lengths) < 1:
            raise ValueError(f"attn_lengths: must be positive lengths, got {self.attn_lengths}")
        if not self.decode_batches or min(self.decode_batches) < 1:
            raise ValueError(f"decode_batches: must be batch sizes >= 1, got {self.decode_batches}")
        low, high = self.decode_source_lengths
        if not 2 <= low <= high:
            raise ValueError(
                f"decode_source_lengths: expected (min, max) with 2 <= min <= max (a word and "
                f"EOS), got {self.decode_source_lengths}"
            )
        if any(len(c) != 2 for c in self.decode_sizes):
            raise ValueError("decode_sizes: expected (name, TransformerConfig) pairs")
        if any(len(s) != 2 or min(s) < 1 for s in self.torch_shapes):
            raise ValueError(
                f"torch_shapes: expected (sentences, length) pairs >= 1, got {self.torch_shapes}"
            )

    def replace(self, **changes) -> BenchConfig:
        return dataclasses.replace(self, **changes)

    @classmethod
    def full(cls, dtype: str = "bfloat16") -> BenchConfig:
        """The paper-sized models, for one GPU (about 8 minutes on an H100)."""
        dt = jnp.dtype(dtype)
        return cls(
            dtype=dtype,
            steps=20,
            warmup=3,
            matmul_size=8192,
            matmul_repeats=10,
            # 768 x 32 = 24,576 tokens on each side: the paper's "~25k source and target tokens".
            transformer=TransformerConfig.base(dtype=dt),
            transformer_batch=768,
            transformer_len=32,
            # The papers' base models at train.lm's recipe batches (one definition of each).
            xl=tuple(
                (
                    name,
                    getattr(TransformerXLConfig, name)(dtype=dt),
                    lm_config.PRESETS[name]["batch_size"],
                )
                for name in ("enwik8_base", "wt103_base")
            ),
            **_decode(sentences=128, latency_sentences=16, rounds=5),
            decode_buckets=(12, 16, 20, 24, 32),
            xl_eval=TransformerXLConfig.enwik8_base(dtype=dt, dropout=0.0),
            attn_lengths=(800, 1800, 2800, 3800),
            xl_eval_tgt_len=128,
            xl_eval_batch=16,
            vanilla_batch=4,
            eval_repeats=5,
            **_cpu_vs_torch(steps=25, warmup=3),
        )

    @classmethod
    def quick(cls, dtype: str = "float32") -> BenchConfig:
        """Shrunk models of the same families: every section runs on a 2-core CPU in minutes."""
        dt = jnp.dtype(dtype)
        small_xl = dict(n_layers=2, n_heads=4, d_model=128, d_head=32, d_inner=512, dtype=dt)
        return cls(
            dtype=dtype,
            steps=5,
            warmup=2,
            matmul_size=512,
            matmul_repeats=5,
            transformer=TransformerConfig.base(
                src_vocab_size=1000,
                tgt_vocab_size=1000,
                d_model=128,
                n_heads=4,
                d_ff=512,
                n_encoder_layers=2,
                n_decoder_layers=2,
                dtype=dt,
            ),
            transformer_batch=16,
            transformer_len=32,
            xl=(
                (
                    "enwik8_base (quick: 2 x 128, 64 + 64)",
                    TransformerXLConfig.enwik8_base(tgt_len=64, mem_len=64, **small_xl),
                    4,
                ),
                (
                    "wt103_base (quick: 2 x 128, V 4000, 32 + 32)",
                    TransformerXLConfig.wt103_base(
                        vocab_size=4000,
                        cutoffs=(1000, 2000, 3000),
                        tgt_len=32,
                        mem_len=32,
                        **small_xl,
                    ),
                    4,
                ),
            ),
            # The section's cost is the OPUS-MT size: 74M parameters to convert, compile (our
            # search: one program per bucket, batch and search, so two buckets) and decode.
            **_decode(sentences=32, latency_sentences=4, rounds=2),
            decode_buckets=(16, 32),
            xl_eval=TransformerXLConfig.enwik8_base(dropout=0.0, **small_xl),
            attn_lengths=(64, 128, 256),
            xl_eval_tgt_len=16,
            xl_eval_batch=2,
            vanilla_batch=2,
            eval_repeats=3,
            **_cpu_vs_torch(steps=5, warmup=2),
        )


def _decode(*, sentences: int, latency_sentences: int, rounds: int) -> dict:
    """The decode section's models and searches, the same in both presets (the engines are
    compared at the sizes people serve): the `cpu` translation preset's Transformer (pre-LN:
    transformers' Marian cannot hold it, CTranslate2 can) and an OPUS-MT-sized Marian model."""
    cpu = registry.build_model_config("transformer", "cpu", vocab_size=4000)
    return dict(
        decode_sizes=(("cpu", cpu), ("opus-mt", opus_mt_config())),
        decode_batches=(1, 32),
        decode_sentences=sentences,
        decode_latency_sentences=latency_sentences,
        # Source lengths of everyday sentences, EOS counted.
        decode_source_lengths=(8, 30),
        beam_size=4,
        decode_length_penalty=0.6,
        decode_margin=16,
        decode_rounds=rounds,
        decode_threads=2,
    )


def _cpu_vs_torch(*, steps: int, warmup: int) -> dict:
    """The CPU comparison with PyTorch: the `cpu` presets' models at their own sizes in both
    presets (a CPU measure; `full` times more steps), dropout off (no random numbers timed)."""
    # The vocabulary of train.translate's cpu preset (its tokenizer's size).
    transformer = registry.build_model_config("transformer", "cpu", vocab_size=4000)
    # train.lm's cpu preset for PTB words, taken from it so that the two cannot drift apart.
    lm = lm_config.make_config("ptb", "cpu")
    xl = lm.model_config.replace(dropout=0.0, dropatt=0.0)
    return dict(
        torch_transformer=transformer.replace(dropout=0.0, attention_dropout=0.0),
        torch_shapes=((32, 16), (64, 32)),
        torch_xl=xl,
        torch_xl_batch=lm.batch_size,
        torch_steps=steps,
        torch_warmup=warmup,
        torch_compile=True,
    )
