"""xl_jax: Transformer-XL with relative positional attention and memory carried as explicit
state."""

from xl_jax.adaptive import AdaptiveEmbedding, ProjectedAdaptiveLogSoftmax
from xl_jax.attention import RelativeMultiHeadAttention, rel_shift, sinusoid_embedding
from xl_jax.config import TransformerXLConfig
from xl_jax.data import LMBatches, lm_batches, num_lm_batches
from xl_jax.generate import generate, sampling_logits
from xl_jax.memory import Memory, attention_mask, init_memory, update_memory
from xl_jax.model import TransformerXL
from xl_jax.pytorch import load_pytorch_state_dict

__all__ = [
    "AdaptiveEmbedding",
    "attention_mask",
    "generate",
    "init_memory",
    "lm_batches",
    "LMBatches",
    "load_pytorch_state_dict",
    "Memory",
    "num_lm_batches",
    "ProjectedAdaptiveLogSoftmax",
    "rel_shift",
    "RelativeMultiHeadAttention",
    "sampling_logits",
    "sinusoid_embedding",
    "TransformerXL",
    "TransformerXLConfig",
    "update_memory",
]
