"""transformer_jax: the Transformer of "Attention Is All You Need" and the seq2seq models before it."""
from transformer_jax.attention import (
    attend,
    attention_weights,
    combine_masks,
    dot_product_attention,
    make_causal_mask,
    make_padding_mask,
)
from transformer_jax.config import TransformerConfig
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
from transformer_jax.model import Transformer
from transformer_jax.optim import OptimizerConfig, make_optimizer, noam_schedule, params_ema
from transformer_jax.positional import PositionalEncoding, sinusoidal_positions, sinusoids_at
from transformer_jax.decode import (
    beam_search,
    greedy_decode,
    model_step_fn,
    search_beam,
    search_greedy,
)
from transformer_jax.seq2seq import (
    BahdanauSeq2Seq,
    GRUSeq2Seq,
    HardAttentionSeq2Seq,
    LuongLocalMSeq2Seq,
    LuongLocalSeq2Seq,
    LuongSeq2Seq,
    RNNSeq2SeqConfig,
)
from transformer_jax.convs2s import ConvS2S, ConvS2SConfig
from transformer_jax.baselines import BASELINES, make_baseline
from transformer_jax.marian_tokenizer import MarianTokenizer
from transformer_jax.marian import (
    GenerationDefaults,
    load_marian,
    marian_config,
    marian_generation_defaults,
    marian_params,
    read_marian_weights,
)
