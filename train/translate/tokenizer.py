"""Which tokenizer a translation run encodes with, and where it is kept: the model origin's
(`origin.py`): a Marian folder's own, else the joint SentencePiece model of the run's data
source (`sources`)."""

from __future__ import annotations

import glob
import os

from train.core.workdir import local_dir
from train.data.tokenizers import SentencePieceTokenizer, model_file_name
from train.translate.config import TranslateConfig
from train.translate.sources import TranslationSource, translation_source


def load_tokenizer(
    config: TranslateConfig, workdir: str, source: TranslationSource | None = None
) -> SentencePieceTokenizer:
    """The run's tokenizer: a Marian folder's own (`origin.FromMarian.tokenizer`), else its data
    source's joint SentencePiece model: Multi30k's, or the one trained on a sample of the
    training files' or TFDS split's sentences the first time. `source`: the run's, when the
    caller has one (a checked FilesSource knows its files' sha256 and hashes them no more)."""
    directory = tokenizer_dir(config, workdir)
    return config.origin.tokenizer(
        directory,
        config.model_config,
        lambda: (source or translation_source(config)).tokenizer(directory),
    )


def trained_tokenizer(config: TranslateConfig, workdir: str):
    """The tokenizer a trained run encodes with, for translating and exporting it: the one
    SentencePiece model of the run's kind in its tokenizer folder, read without touching the
    training data. Finding it by `load_tokenizer` hashes the data (all of Multi30k's train split,
    2.6 s; every byte of the user's training files), and fails once those files are gone.
    Falls back to `load_tokenizer` when the folder holds none of that kind, or several (a
    tokenizer_dir that runs on different data share)."""
    if config.origin.trains_tokenizer:
        name = translation_source(config).name
        pattern = model_file_name(f"{name}_spm", config.vocab_size, "*")
        found = glob.glob(os.path.join(glob.escape(tokenizer_dir(config, workdir)), pattern))
        if len(found) == 1:
            return SentencePieceTokenizer(found[0])
    return load_tokenizer(config, workdir)


def tokenizer_dir(config: TranslateConfig, workdir: str) -> str:
    """Where the run's SentencePiece model is kept: tokenizer_dir, else W/tokenizer (the local
    copy of a remote W)."""
    return config.tokenizer_dir or os.path.join(local_dir(workdir), "tokenizer")
