"""The decoders a translation model is compared in, behind one interface, and their helpers.

    served = Served(config, params, tokenizer, folder="exports", beam_size=4, length_penalty=0.6)
    for name, factory in ENGINES:
        try:
            engine = factory(served)            # exports and loads the model (timed apart)
        except Unavailable as e:
            print(name, "unavailable:", e)
            continue
        tokens = engine.decode(src, greedy=True, max_len=48)      # [B, S] ids -> [B, <=O] ids

Every engine reads our source ids ([B, S], pad-padded, each row ending with EOS) and returns
our target ids, one row per source: the tokens, EOS where the output ended, then pad (a row
may be shorter than max_len). `until_eos` cuts a row to what counts.

- `ours`: `transformer_jax.decoding.decode.greedy_decode` and `beam_search` (GNMT length penalty,
  best_only), jitted: each source shape compiles once. `ours int8`: the same searches over
  the model's int8 form (`transformer_jax.int8`).
- `ctranslate2 float32` / `ctranslate2 int8`: a `save_ct2` export in CTranslate2, its weights
  quantized as named, `ct2_translate` (inter_threads 1, intra_threads `threads`).
- `transformers`: a `save_marian` folder in `MarianMTModel.generate`, where Marian can express
  the model (post-LN, sines-then-cosines positions, LayerNorm epsilon 1e-5), else unavailable
  with the reason. Rows are cut to their longest source (the attention mask covers the rest).

The beam searches differ: CTranslate2 and transformers divide the summed log-probs by
length ** alpha (alpha = `length_penalty`), ours by GNMT's ((5 + length) / 6) ** alpha, and
they keep finished hypotheses apart; so their beam outputs can differ from ours where greedy
ones agree. ctranslate2 and transformers (with torch) are optional, imported by their
factories: a missing package makes its engine `Unavailable`, as does a device it cannot use.
Another engine is one more (name, factory) entry in `ENGINES`.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import os
import platform
import subprocess
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from train.data.batching import eval_batches
from transformer_jax.config import TransformerConfig
from transformer_jax.decoding import decode
from transformer_jax.interchange.marian import GenerationDefaults
from transformer_jax.model import Transformer, quantized


class Unavailable(Exception):
    """An engine cannot run here: its package is missing, it cannot express the model, or it
    has no device like JAX's. The message says which."""


@dataclasses.dataclass(frozen=True)
class Served:
    """One model as every engine gets it.

    Attributes:
      config: the Transformer's config (float32 weights; our search computes in its dtype).
      params: its 'params' collection (NumPy or jax arrays, float32).
      tokenizer: the pieces of its ids, as `save_ct2` takes them (`vocab_size` and
        `id_to_piece`, or a MarianTokenizer).
      folder: where the engines' exports are written (one sub-folder each).
      beam_size, length_penalty: the beam search (alpha in each engine's own formula).
      threads: CPU threads of CTranslate2 (intra_threads) and torch.
      device: 'cpu' or 'cuda': where CTranslate2 and transformers run.
      marian_tokenizer: the tokenizer whose files `save_marian` writes beside the model (a
        MarianTokenizer or the project's SentencePiece one); None writes none (every engine
        reads ids).
      generation: the search the Marian folder ships (generation_config.json); None: beam
        `beam_size`, transformers' default length. `decode` passes its own either way.
      reuse_exports: an export folder that exists is loaded as it is (a rerun on the same
        weights); else it is written again.
    """

    config: TransformerConfig
    params: Any
    tokenizer: Any
    folder: str
    beam_size: int = 4
    length_penalty: float = 0.6
    threads: int = 2
    device: str = "cpu"
    marian_tokenizer: Any = None
    generation: GenerationDefaults | None = None
    reuse_exports: bool = False


# decode(src [B, S] int32, *, greedy, max_len O) -> [B, <= O] int ids
Decode = Callable[..., np.ndarray]


@dataclasses.dataclass
class Engine:
    """A loaded engine: `decode` and what getting it ready took.

    Attributes:
      decode: decode(src [B, S], *, greedy: bool, max_len: int) -> [B, <= max_len] ids.
      export_s: seconds writing the folder it loads (0 for ours, or an export reused).
      load_s: seconds loading it (ours: putting the params on the device; compiling comes at
        the first call of each shape).
    """

    decode: Decode
    export_s: float = 0.0
    load_s: float = 0.0


Factory = Callable[[Served], Engine]


def ours(served: Served, *, quantize: str | None = None) -> Engine:
    """`transformer_jax.decoding.decode` on JAX's default device; with quantize="int8", the model's
    int8 form (`transformer_jax.model.quantized`: its quantization is the load time)."""
    start = time.perf_counter()
    model, params = Transformer(served.config), served.params
    if quantize:
        model, params = quantized(model, params, quantize)
    params = jax.block_until_ready(jax.device_put(params))
    load_s = time.perf_counter() - start

    def run(src: np.ndarray, *, greedy: bool, max_len: int) -> np.ndarray:
        if greedy:
            return np.asarray(decode.greedy_decode(model, params, src, max_len=max_len))
        tokens, _ = decode.beam_search(
            model,
            params,
            src,
            beam_size=served.beam_size,
            max_len=max_len,
            length_penalty=served.length_penalty,
            best_only=True,
            return_beams=1,
        )
        return np.asarray(tokens[:, 0])

    return Engine(run, load_s=load_s)


def _export(served: Served, name: str, write: Callable[[str], None]) -> tuple[str, float]:
    """Writes (or reuses) served.folder/name -> (folder, seconds spent writing)."""
    folder = os.path.join(served.folder, name)
    if served.reuse_exports and os.path.exists(folder):
        return folder, 0.0
    os.makedirs(served.folder, exist_ok=True)
    start = time.perf_counter()
    write(folder)
    return folder, time.perf_counter() - start


def ctranslate2_engine(served: Served, *, quantization: str) -> Engine:
    """A `save_ct2` export with `quantization` weights, in `ctranslate2.Translator`."""
    try:
        import ctranslate2  # optional: the 'serve' extra
    except ImportError as e:
        raise Unavailable(f"ctranslate2 is not installed ({e})") from None
    from transformer_jax.interchange.ct2 import ct2_translate, save_ct2

    if served.device == "cuda" and ctranslate2.get_cuda_device_count() == 0:
        raise Unavailable("JAX runs on a GPU, but ctranslate2 sees no CUDA device")
    folder, export_s = _export(
        served,
        f"ct2-{quantization}",
        lambda f: save_ct2(
            served.config,
            served.params,
            served.tokenizer,
            f,
            quantization=quantization,
            overwrite=True,
        ),
    )
    start = time.perf_counter()
    translator = ctranslate2.Translator(
        folder,
        device=served.device,
        compute_type=quantization,
        inter_threads=1,
        intra_threads=served.threads,
    )
    load_s = time.perf_counter() - start

    def run(src: np.ndarray, *, greedy: bool, max_len: int) -> np.ndarray:
        return ct2_translate(
            translator,
            served.tokenizer,
            src,
            max_len=max_len,
            beam_size=1 if greedy else served.beam_size,
            length_penalty=served.length_penalty,
            max_batch_size=len(src),
        )

    return Engine(run, export_s=export_s, load_s=load_s)


def transformers_engine(served: Served) -> Engine:
    """A `save_marian` folder in transformers' `MarianMTModel` (torch)."""
    from transformer_jax.interchange.marian_export import marian_fields, save_marian

    try:
        marian_fields(served.config)
    except ValueError as e:
        raise Unavailable(str(e)) from None
    try:
        import torch
        import transformers
    except ImportError as e:
        raise Unavailable(f"transformers and torch are needed ({e})") from None
    if served.device == "cuda" and not torch.cuda.is_available():
        raise Unavailable("JAX runs on a GPU, but torch sees no CUDA device")
    generation = served.generation or GenerationDefaults(beam_size=served.beam_size)
    folder, export_s = _export(
        served,
        "marian",
        lambda f: save_marian(
            served.config,
            served.params,
            served.marian_tokenizer,
            f,
            generation=generation,
            overwrite=True,
        ),
    )
    if served.device == "cpu":
        torch.set_num_threads(served.threads)
    start = time.perf_counter()
    model = transformers.MarianMTModel.from_pretrained(folder).eval().to(served.device)
    load_s = time.perf_counter() - start
    pad = served.config.pad_id

    def run(src: np.ndarray, *, greedy: bool, max_len: int) -> np.ndarray:
        src = np.asarray(src)
        # Columns that are pad in every row are no input of a serving engine.
        width = int(np.max(np.nonzero((src != pad).any(axis=0))[0], initial=0)) + 1
        ids = torch.tensor(src[:, :width], dtype=torch.long, device=served.device)
        with torch.no_grad():
            out = model.generate(
                input_ids=ids,
                attention_mask=ids != pad,
                num_beams=1 if greedy else served.beam_size,
                do_sample=False,
                length_penalty=served.length_penalty,
                max_length=max_len + 1,  # transformers counts the start token
            )
        return out.cpu().numpy()[:, 1:]

    return Engine(run, export_s=export_s, load_s=load_s)


ENGINES: tuple[tuple[str, Factory], ...] = (
    ("ours", ours),
    ("ours int8", functools.partial(ours, quantize="int8")),
    ("ctranslate2 float32", functools.partial(ctranslate2_engine, quantization="float32")),
    ("ctranslate2 int8", functools.partial(ctranslate2_engine, quantization="int8")),
    ("transformers", transformers_engine),
)


def engine_device() -> str:
    """Where the other engines run so as to compare like with like: 'cuda' when JAX's default
    backend is a GPU, else 'cpu'."""
    return "cuda" if jax.default_backend() == "gpu" else "cpu"


# ------------------------------------------------------------------------------ batches, outputs
def source_batches(
    sources: Sequence[Sequence[int]],
    *,
    batch_size: int,
    buckets: Sequence[int],
    pad_id: int,
    bos_id: int,
    eos_id: int,
    sort_by_length: bool = True,
) -> list[dict[str, np.ndarray]]:
    """`train.data.batching.eval_batches` of the sources (each padded to the smallest bucket
    that fits its longest row), without the all-pad rows that only fill the last batch (the
    engines take ragged batches): dicts with 'src' [N, L] and 'index' [N] (each row's
    position in `sources`)."""
    batches = eval_batches(
        [(list(s), []) for s in sources],
        batch_size=batch_size,
        buckets=buckets,
        num_devices=1,
        sort_by_length=sort_by_length,
        pad_id=pad_id,
        bos_id=bos_id,
        eos_id=eos_id,
    )
    return [{k: b[k][b["index"] >= 0] for k in ("src", "index")} for b in batches]


def in_order(batches: Sequence[dict[str, np.ndarray]], outputs: Sequence[np.ndarray], n: int):
    """Each batch's output rows back in the sources' order -> n rows."""
    out: list[np.ndarray] = [None] * n  # type: ignore[list-item]
    for batch, ids in zip(batches, outputs):
        for row, i in enumerate(batch["index"]):
            out[i] = np.asarray(ids[row])
    return out


def until_eos(ids: np.ndarray, eos: int, pad: int) -> list[int]:
    """The tokens of one output up to and with its EOS (pad dropped)."""
    out = []
    for t in np.asarray(ids).tolist():
        if t == pad:
            continue
        out.append(t)
        if t == eos:
            break
    return out


def same_share(ids: Sequence[Sequence[int]], reference: Sequence[Sequence[int]]) -> float:
    """The share of sentences whose tokens equal the reference's exactly."""
    return sum(list(a) == list(b) for a, b in zip(ids, reference)) / max(len(reference), 1)


# ------------------------------------------------------------------------------ the machine
def cpu_model() -> str:
    """The CPU's model name (lscpu), else what `platform` knows."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return platform.processor()
    return next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if "Model name" in ln), "")


def versions() -> dict[str, str]:
    """Installed versions of jax and the engines' packages (those present)."""
    out = {}
    for name in ("jax", "ctranslate2", "transformers", "torch"):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out
