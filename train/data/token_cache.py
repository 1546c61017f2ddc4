"""Token ids encoded once, written to disk, and read memory-mapped: training data of any size.

A corpus is never held as Python strings all at once. Translation pairs (a `PairSource`:
the user's files, a TFDS dataset's train split) are read twice, as streams: once to check
them and draw the sentences the tokenizer trains on (at most `spm_sample`, `sample_pairs`),
once to encode them chunk by chunk (SentencePiece's batched encode, on every core) into the
cache (`pairs_cache`). A language-model text or TFDS split is encoded the same way into one
token stream (`stream_cache`). Training then reads the cache
memory-mapped, each process only the tokens of its own rows (`PairArrays.pack`,
`xl_jax.data.LMBatches.batch`).

A cache is a directory named by a sha256 of everything its ids depend on (the input files'
bytes or the prepared TFDS copy's dataset_info.json, the tokenizer or vocabulary, the
options), under the run's `cache_dir` (W/token_cache by default; never copied up to a remote
W)::

    <cache_dir>/<kind>-<key>/
        <name>.bin            the ids of one stream, concatenated, raw (dtype in meta.json:
                              uint16 when the vocabulary fits, else int32; bytes as uint8)
        <name>_offsets.npy    int64 [P + 1]: where each sequence starts (translation)
        meta.json             counts, dtype, the options: written last

It is built under a temporary name and renamed into place once meta.json is written, so a
cache that exists is whole: a build killed halfway is never used, and the next run builds
it again. The next run with the same inputs and options (a resumed one, another run on the
same files) opens it without encoding anything; other bytes or options make another key.
Past one process, `train.core.run.prepare_data` has process 0 prepare first while the others
wait; they then open its cache (a shared cache_dir: the local work directory, or a shared
--cache_dir) or, on a machine of their own, build the same one.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import os
import shutil
import socket
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import jax
import numpy as np

from train.core.workdir import TOKEN_CACHE
from train.data.batching import PairArrays
from train.data.text_files import iter_parallel

# Bumped when the layout or the meaning of a cache changes, so old caches are not read.
FORMAT = 1
META_FILE = "meta.json"
CACHE_DIR = TOKEN_CACHE  # below the (local) work directory, by default
# Pairs encoded per SentencePiece call: large enough that the call's threads have work,
# small enough that a chunk's strings and id lists stay a few tens of MB.
CHUNK_PAIRS = 50_000


def cache_key(**parts: Any) -> str:
    """A sha256 of the named parts (JSON-serialisable values), the format included."""
    text = json.dumps({"format": FORMAT, **parts}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def ids_dtype(vocab_size: int) -> np.dtype:
    """The narrowest dtype of the cache's ids: half the disk and page cache of int32 for any
    vocabulary up to 65,536 (every SentencePiece model the presets train)."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.int32)


def cached(
    root: str, kind: str, key: str, build: Callable[[str], dict[str, Any]]
) -> tuple[str, dict[str, Any]]:
    """-> (the cache directory of `key`, its meta), built first by `build(directory)` (which
    writes its arrays into the empty `directory` and returns the meta) when there is none.
    meta['built'] says whether this call built it."""
    directory = os.path.join(root, f"{kind}-{key[:24]}")
    meta = read_meta(directory)
    if meta is not None:
        return directory, {**meta, "built": False}
    if os.path.isdir(directory):  # no meta: an incomplete copy, never to be used
        shutil.rmtree(directory)
    os.makedirs(root, exist_ok=True)
    _remove_stale(directory)
    tmp = f"{directory}.tmp-{socket.gethostname()}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    start = time.monotonic()
    try:
        meta = {"format": FORMAT, "kind": kind, "key": key, **build(tmp)}
        meta["process_index"] = jax.process_index()  # the builder (past one process: 0)
        meta["seconds"] = round(time.monotonic() - start, 3)
        with open(os.path.join(tmp, META_FILE), "w") as f:
            json.dump(meta, f, indent=2)
        try:
            os.rename(tmp, directory)
        except OSError:  # another builder renamed the same cache into place first
            if read_meta(directory) is None:
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return directory, {**read_meta(directory), "built": True}


def read_meta(directory: str) -> dict[str, Any] | None:
    """A complete cache's meta, or None (missing, or written by another format)."""
    try:
        with open(os.path.join(directory, META_FILE)) as f:
            meta = json.load(f)
    except (OSError, ValueError):
        return None
    return meta if meta.get("format") == FORMAT else None


def _remove_stale(directory: str) -> None:
    """Temporary directories of builds on this machine whose process is gone (killed)."""
    parent, name = os.path.split(directory)
    prefix = f"{name}.tmp-{socket.gethostname()}-"
    for entry in os.listdir(parent):
        if entry.startswith(prefix) and entry[len(prefix) :].isdigit():
            try:
                os.kill(int(entry[len(prefix) :]), 0)
            except ProcessLookupError:
                shutil.rmtree(os.path.join(parent, entry), ignore_errors=True)
            except PermissionError:  # alive, another user's
                pass


class ArrayWriter:
    """Appends id arrays to one raw file in `dtype` (checked to hold every id)."""

    def __init__(self, path: str, dtype: np.dtype):
        self.path, self.dtype, self.count = path, np.dtype(dtype), 0
        self._file = open(path, "wb")  # noqa: SIM115 - closed by close()
        self._max = np.iinfo(self.dtype).max

    def write(self, ids: np.ndarray) -> None:
        ids = np.asarray(ids)
        if ids.size and (ids.min() < 0 or ids.max() > self._max):
            raise ValueError(f"{self.path}: ids outside {self.dtype} ([{ids.min()}, {ids.max()}])")
        self._file.write(ids.astype(self.dtype, copy=False).tobytes())
        self.count += ids.size

    def close(self) -> int:
        self._file.close()
        return self.count


def open_ids(directory: str, name: str, meta: dict[str, Any]) -> np.ndarray:
    """The ids of stream `name`, memory-mapped read-only ([count] of meta's dtype)."""
    count, dtype = meta["counts"][name], np.dtype(meta["dtype"])
    if count == 0:  # mmap cannot map an empty file
        return np.zeros(0, dtype)
    return np.memmap(os.path.join(directory, f"{name}.bin"), dtype, mode="r", shape=(count,))


# ----------------------------------------------------------------------------- translation


@dataclasses.dataclass(frozen=True)
class PairSource:
    """A corpus of (source, target) sentence pairs, read again as a stream on every pass.

    read: skipped -> the pairs in order, one at a time; `skipped` is a one-element list that
      counts the pairs left out for an empty side (read it once the stream is exhausted), as
      `iter_parallel` takes it.
    fingerprint: JSON-serialisable parts that name the pairs exactly (a sha256 of their bytes
      and the options that choose them): part of the key of every tokenizer and cache made
      from them, so other data never reuses one.
    origin: where the pairs come from, for the cache's meta ({'files': [...]} or
      {'dataset': ...}).
    """

    read: Callable[[list[int]], Iterator[tuple[str, str]]]
    fingerprint: Mapping[str, Any]
    origin: Mapping[str, Any]


def file_pairs(
    src_path: str, tgt_path: str, *, train_sha256: str, skip_empty: bool = False
) -> PairSource:
    """Two parallel files as a `PairSource` (`iter_parallel`); train_sha256:
    `files_sha256(src_path, tgt_path)`."""
    return PairSource(
        read=lambda skipped: iter_parallel(
            src_path, tgt_path, skip_empty=skip_empty, skipped=skipped
        ),
        fingerprint={"train_sha256": train_sha256, "skip_empty": skip_empty},
        origin={"files": [src_path, tgt_path]},
    )


def sample_pairs(
    pairs: Iterable[tuple[str, str]], *, sample: int, seed: int = 0
) -> tuple[list[str], int]:
    """The sentences a joint tokenizer trains on, drawn from a stream of pairs -> (sentences,
    the number of pairs).

    At most `sample` sentences: when the pairs have no more (two sentences each), all of
    them, source then target of each pair in stream order (what training on every sentence
    gives); else both sides of a uniform sample of sample // 2 pairs, seeded, in stream order
    (reservoir sampling: one pass, memory for the sample only)."""
    if sample < 2:
        raise ValueError(f"spm_sample: at least one pair (2 sentences), got {sample}")
    keep = sample // 2
    rng = np.random.default_rng(seed)
    reservoir: list[tuple[int, str, str]] = []
    count = 0
    for block in _chunks(pairs, CHUNK_PAIRS):
        first = count
        count += len(block)
        if first + len(block) <= keep:
            reservoir.extend((first + i, s, t) for i, (s, t) in enumerate(block))
            continue
        # Algorithm R: pair i (0-based) replaces slot j ~ U{0..i} when j < keep.
        slots = rng.integers(0, np.arange(first, count) + 1)
        for i, ((s, t), j) in enumerate(zip(block, slots.tolist()), first):
            if i < keep:
                reservoir.append((i, s, t))
            elif j < keep:
                reservoir[j] = (i, s, t)
    reservoir.sort(key=lambda item: item[0])
    return [side for _, s, t in reservoir for side in (s, t)], count


def pairs_cache(
    source: PairSource, tokenizer, root: str, *, log: Callable[[str], None] | None = None
) -> tuple[PairArrays, dict[str, Any]]:
    """The encoded training pairs of `source`, from the cache (built first when missing,
    reading the source once as a stream) -> (PairArrays of memory-mapped ids, the cache's
    meta; meta['skipped']: the pairs left out for an empty side).

    Sources (`tokenizer.encode_batch`) end with the tokenizer's eos (as
    `train.translate.sources.encode_source` writes them), targets (`tokenizer.encode_targets`)
    have neither bos nor eos. The key: the source's fingerprint and `tokenizer.sha256()`."""
    key = cache_key(
        **source.fingerprint,
        tokenizer_sha256=tokenizer.sha256(),
    )

    def build(directory: str) -> dict[str, Any]:
        dtype = ids_dtype(tokenizer.vocab_size)
        writers = {
            name: ArrayWriter(os.path.join(directory, f"{name}.bin"), dtype)
            for name in ("src", "tgt")
        }
        lengths: dict[str, list[np.ndarray]] = {"src": [], "tgt": []}
        skipped: list[int] = [0]
        for block in _chunks(source.read(skipped), CHUNK_PAIRS):
            for side, name in enumerate(("src", "tgt")):
                encode = tokenizer.encode_batch if name == "src" else tokenizer.encode_targets
                ids = encode([pair[side] for pair in block])
                flat, n = _flatten(ids, eos_id=tokenizer.eos_id if name == "src" else None)
                writers[name].write(flat)
                lengths[name].append(n)
        counts = {}
        for name, writer in writers.items():
            counts[name] = writer.close()
            offsets = np.concatenate([[0], np.cumsum(np.concatenate(lengths[name]))])
            np.save(os.path.join(directory, f"{name}_offsets.npy"), offsets.astype(np.int64))
        return {
            "dtype": dtype.name,
            "counts": counts,
            "pairs": int(sum(len(n) for n in lengths["src"])),
            "skipped": skipped[0],
            "vocab_size": tokenizer.vocab_size,
            **source.origin,
        }

    directory, meta = cached(root, "translate", key, build)
    if log and meta["built"]:
        log(
            f"data: encoded {meta['pairs']:,} training pairs ({meta['counts']['src']:,} source, "
            f"{meta['counts']['tgt']:,} target tokens) in {meta['seconds']:.0f}s into {directory}"
        )
    offsets = {
        name: np.load(os.path.join(directory, f"{name}_offsets.npy"), mmap_mode="r")
        for name in ("src", "tgt")
    }
    arrays = PairArrays(
        src=open_ids(directory, "src", meta),
        src_offsets=np.asarray(offsets["src"]),
        tgt=open_ids(directory, "tgt", meta),
        tgt_offsets=np.asarray(offsets["tgt"]),
    )
    return arrays, meta


def _flatten(ids: list[list[int]], *, eos_id: int | None) -> tuple[np.ndarray, np.ndarray]:
    """id lists -> (their concatenation, each one's length), an `eos_id` ending each when
    given."""
    n = np.fromiter(map(len, ids), np.int64, len(ids))
    flat = np.fromiter(itertools.chain.from_iterable(ids), np.int64, int(n.sum()))
    if eos_id is None:
        return flat, n
    n = n + 1
    out = np.full(int(n.sum()), eos_id, np.int64)
    ends = np.cumsum(n) - 1  # each sequence's last position: its eos
    keep = np.ones(out.size, bool)
    keep[ends] = False
    out[keep] = flat
    return out, n


def _chunks(items: Iterable, size: int) -> Iterator[list]:
    iterator = iter(items)
    while block := list(itertools.islice(iterator, size)):
        yield block


# ----------------------------------------------------------------------------- LM streams


def stream_cache(
    root: str,
    chunks: Callable[[], Iterable[np.ndarray]],
    *,
    dtype: np.dtype,
    log: Callable[[str], None] | None = None,
    what: str = "stream",
    **key_parts: Any,
) -> np.ndarray:
    """One token stream from the cache of `key_parts` (everything its ids depend on), built
    first from `chunks()` (id arrays, in order) when missing -> the ids, memory-mapped [N]."""

    def build(directory: str) -> dict[str, Any]:
        writer = ArrayWriter(os.path.join(directory, "tokens.bin"), dtype)
        for chunk in chunks():
            writer.write(chunk)
        return {"dtype": np.dtype(dtype).name, "counts": {"tokens": writer.close()}, **key_parts}

    directory, meta = cached(root, "lm", cache_key(**key_parts), build)
    if log and meta["built"]:
        log(
            f"data: encoded {what} ({meta['counts']['tokens']:,} tokens) in "
            f"{meta['seconds']:.0f}s into {directory}"
        )
    return open_ids(directory, "tokens", meta)
