"""Sampling text from a trained Transformer-XL work directory, the memory carried from the
prompt into every generated segment (`xl_jax.generate`).

    python -m train.lm --workdir W --generate "the company said" --num_tokens 100 \\
        --top_k 40 --temperature 0.8 --seed 0
"""

from __future__ import annotations

import sys

import jax
import numpy as np

from train.core.inference import params_for_inference
from train.lm.task import TASK, load_vocab
from train.lm.text import ByteVocab, TextVocab, tokens
from xl_jax.generate import generate

UNK = "<unk>"
SPACE = "_"  # PTB's character level spells the space between words as '_'


def encode_prompt(vocab, text: str, *, level: str) -> list[int]:
    """Prompt text -> ids. PTB word level: lower-cased words, unknown ones as <unk>; PTB
    character level: characters, spaces as '_'. A text run's vocabulary takes the prompt as
    its training text was read (words, characters or UTF-8 bytes; unknown ones as <unk>)."""
    if isinstance(vocab, ByteVocab):
        return vocab.encode_bytes(text.encode("utf-8")).tolist() or [vocab.eos_id]
    if isinstance(vocab, TextVocab):
        return vocab.encode_lines([text]).tolist()[:-1] or [vocab.eos_id]  # no <eos> after it
    if level == "word":
        return [_id_or(vocab, s, UNK) for s in text.lower().split()] or [vocab.eos_id]
    symbols = [SPACE if c.isspace() else c for c in " ".join(text.lower().split())]
    unknown = sorted({s for s in symbols if _id_or(vocab, s, None) is None})
    if unknown:
        raise ValueError(f"prompt: characters {unknown} are not in PTB's character vocabulary")
    return [vocab.token_to_id(s) for s in symbols] or [vocab.eos_id]


def unknown_in_prompt(vocab, text: str, *, level: str) -> list[str]:
    """The prompt's words (or characters) that the run's vocabulary lacks, in order, once
    each: `encode_prompt` reads them as <unk>."""
    if isinstance(vocab, ByteVocab):
        return []  # every byte has an id
    if isinstance(vocab, TextVocab):
        symbols = tokens(text, vocab.level)
        missing = [s for s in symbols if s != UNK and vocab.token_to_id(s) == 1]
    elif level == "word":
        missing = [s for s in text.lower().split() if _id_or(vocab, s, None) is None]
    else:
        return []  # PTB's characters: an unknown one is an error (encode_prompt)
    return list(dict.fromkeys(missing))


def _id_or(vocab, symbol: str, fallback: str | None) -> int | None:
    try:
        return vocab.token_to_id(symbol)
    except KeyError:
        return None if fallback is None else vocab.token_to_id(fallback)


def decode_text(vocab, ids, *, level: str) -> str:
    """ids -> text: words joined by spaces (characters joined, '_' a space), <eos> a line
    break."""
    if isinstance(vocab, (ByteVocab, TextVocab)):
        return vocab.decode(ids)
    symbols = [vocab.symbols[i] for i in np.asarray(ids).reshape(-1).tolist()]
    if level == "word":
        return " ".join("\n" if s == vocab.EOS else s for s in symbols).replace(" \n ", "\n")
    return "".join("\n" if s == vocab.EOS else (" " if s == SPACE else s) for s in symbols)


def generate_text(
    workdir: str,
    prompt: str,
    *,
    num_tokens: int = 100,
    seed: int = 0,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
) -> str:
    """The continuation of `prompt` sampled from `workdir`'s checkpoint (the best by
    validation loss, else the latest; with average_checkpoints N, the mean of the last N)."""
    config, model, params, dp = params_for_inference(TASK, workdir)
    level = config.data_level()
    vocab = load_vocab(config)
    unknown = unknown_in_prompt(vocab, prompt, level=level)
    if unknown:
        shown = ", ".join(repr(s) for s in unknown[:10]) + (", ..." if len(unknown) > 10 else "")
        print(
            f"prompt: {len(unknown)} not in the run's vocabulary, read as {UNK}: {shown}",
            file=sys.stderr,
            flush=True,
        )
    ids = np.asarray([encode_prompt(vocab, prompt, level=level)], np.int32)  # [1, P]
    # replicate: a run with sharding='fsdp' may hold parts of the weights on other hosts.
    out = generate(
        model,
        jax.device_get(dp.replicate(params)),
        ids,
        num_tokens=num_tokens,
        rng=jax.random.PRNGKey(seed),
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
    )
    return decode_text(vocab, out[0], level=level)
