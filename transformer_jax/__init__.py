"""transformer_jax: the Transformer of "Attention Is All You Need" and the seq2seq models
before it.

Released OPUS-MT (Marian) checkpoints load with `load_marian`; `save_marian` writes a
Transformer back in that format (transformers' `MarianMTModel` loads it), and `save_ct2`
exports any Transformer to CTranslate2 for serving (`transformer_jax.interchange.ct2`, the
'serve' extra).

The model core is at the top level (config, model, layers, attention, positional, losses,
optim); three subpackages hold the rest, one concern each: `decoding` (the searches, their
driver, int8), `baselines` (the seq2seq models before the Transformer) and `interchange`
(other systems' formats: OPUS-MT/Marian, CTranslate2). Every public name is exported here."""

from transformer_jax.attention import (
    attend,
    attention_weights,
    combine_masks,
    dot_product_attention,
    make_causal_mask,
    make_padding_mask,
)
from transformer_jax.baselines.convs2s import ConvS2S, ConvS2SConfig
from transformer_jax.baselines.registry import BASELINES, make_baseline
from transformer_jax.baselines.seq2seq import (
    BahdanauSeq2Seq,
    GRUSeq2Seq,
    HardAttentionSeq2Seq,
    LuongLocalMSeq2Seq,
    LuongLocalSeq2Seq,
    LuongSeq2Seq,
    RNNSeq2SeqConfig,
)
from transformer_jax.config import TransformerConfig
from transformer_jax.decoding.decode import beam_search, greedy_decode, model_step_fn
from transformer_jax.decoding.search import cache_stages, search_beam, search_greedy
from transformer_jax.int8 import quantize_params
from transformer_jax.interchange.ct2 import save_ct2
from transformer_jax.interchange.marian import (
    GenerationDefaults,
    load_marian,
    marian_config,
    marian_generation_defaults,
    marian_params,
    read_marian_weights,
)
from transformer_jax.interchange.marian_export import marian_fields, marian_state, save_marian
from transformer_jax.interchange.marian_tokenizer import MarianTokenizer
from transformer_jax.layers import (
    DecoderLayer,
    EncoderLayer,
    FeedForward,
    MultiHeadAttention,
)
from transformer_jax.losses import (
    hard_attention_surrogate,
    init_reinforce_baseline,
    label_smoothed_cross_entropy,
    score_function_surrogate,
    smoothed_target_distribution,
    token_cross_entropy,
)
from transformer_jax.model import Transformer, quantized
from transformer_jax.optim import OptimizerConfig, make_optimizer, noam_schedule, params_ema
from transformer_jax.positional import PositionalEncoding, sinusoidal_positions, sinusoids_at

__all__ = [
    "attend",
    "attention_weights",
    "BahdanauSeq2Seq",
    "BASELINES",
    "beam_search",
    "combine_masks",
    "ConvS2S",
    "ConvS2SConfig",
    "DecoderLayer",
    "dot_product_attention",
    "EncoderLayer",
    "FeedForward",
    "GenerationDefaults",
    "greedy_decode",
    "cache_stages",
    "quantize_params",
    "quantized",
    "GRUSeq2Seq",
    "hard_attention_surrogate",
    "HardAttentionSeq2Seq",
    "init_reinforce_baseline",
    "label_smoothed_cross_entropy",
    "load_marian",
    "LuongLocalMSeq2Seq",
    "LuongLocalSeq2Seq",
    "LuongSeq2Seq",
    "make_baseline",
    "make_causal_mask",
    "make_optimizer",
    "make_padding_mask",
    "marian_config",
    "marian_fields",
    "marian_generation_defaults",
    "marian_params",
    "marian_state",
    "MarianTokenizer",
    "model_step_fn",
    "MultiHeadAttention",
    "noam_schedule",
    "OptimizerConfig",
    "params_ema",
    "PositionalEncoding",
    "read_marian_weights",
    "RNNSeq2SeqConfig",
    "save_ct2",
    "save_marian",
    "score_function_surrogate",
    "search_beam",
    "search_greedy",
    "sinusoidal_positions",
    "sinusoids_at",
    "smoothed_target_distribution",
    "token_cross_entropy",
    "Transformer",
    "TransformerConfig",
]
