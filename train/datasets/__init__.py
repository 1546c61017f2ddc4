"""TFDS builders for the datasets shipped with the package (offline first)."""
