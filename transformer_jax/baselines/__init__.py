"""The seq2seq models the Transformer replaced, kept as baselines: the recurrent
encoder-decoders (`seq2seq`), ConvS2S (`convs2s`), and the registry that builds them by name
(`registry`)."""
