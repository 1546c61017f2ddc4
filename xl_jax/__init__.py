"""xl_jax: Transformer-XL with relative positional attention and memory carried as explicit state."""
