"""transformer_jax: the Transformer of "Attention Is All You Need" and the seq2seq models before it."""
from transformer_jax.attention import (
    attend,
    attention_weights,
    combine_masks,
    dot_product_attention,
    make_causal_mask,
    make_padding_mask,
)
from transformer_jax.decode import (
    beam_search,
    greedy_decode,
    model_step_fn,
    search_beam,
    search_greedy,
)
