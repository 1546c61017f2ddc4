"""train: training and evaluation entry points over the datasets shipped in the package."""
