"""train.data.token_cache, piece by piece and without a tokenizer: the key, the ids' dtype,
the build-once directory (complete or absent, stale builds removed, a race lost), the writer's
range check, the reservoir sample, the flattening with eos, and both caches with a made-up
tokenizer. tests/test_token_cache.py checks the same module end to end with SentencePiece."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys

import numpy as np
import pytest

from train.data import token_cache
from train.data.batching import PairArrays


# ----------------------------------------------------------------------------- key and dtype
def test_the_key_is_the_sha256_of_the_sorted_parts_with_the_format():
    text = json.dumps({"a": 1, "b": [2, 3], "format": token_cache.FORMAT}, sort_keys=True)
    assert token_cache.cache_key(b=[2, 3], a=1) == hashlib.sha256(text.encode()).hexdigest()
    assert token_cache.cache_key(a=1) != token_cache.cache_key(a=2)
    assert token_cache.cache_key() == hashlib.sha256(b'{"format": 1}').hexdigest()
    assert token_cache.FORMAT == 1


@pytest.mark.parametrize(
    "vocab, dtype",
    [(1, np.uint16), (300, np.uint16), (65_535, np.uint16), (65_536, np.uint16),
     (65_537, np.int32), (267_735, np.int32)],
)  # fmt: skip
def test_ids_take_uint16_up_to_65536_words_then_int32(vocab, dtype):
    assert token_cache.ids_dtype(vocab) == np.dtype(dtype)


# ----------------------------------------------------------------------------- the directory
def build_writing(value, calls):
    def build(directory):
        calls.append(directory)
        assert os.listdir(directory) == []  # an empty, new directory
        with open(os.path.join(directory, "data.txt"), "w") as f:
            f.write(value)
        return {"value": value}

    return build


def test_cached_builds_once_into_kind_and_key_then_reads_the_meta(tmp_path):
    calls = []
    key = "ab" * 32
    directory, meta = token_cache.cached(str(tmp_path), "lm", key, build_writing("x", calls))
    assert directory == os.path.join(str(tmp_path), "lm-" + key[:24])
    assert len(calls) == 1 and calls[0].startswith(directory + ".tmp-")
    assert not os.path.exists(calls[0])  # renamed into place
    assert sorted(os.listdir(tmp_path)) == ["lm-" + key[:24]]
    assert sorted(os.listdir(directory)) == ["data.txt", "meta.json"]
    assert meta["built"] is True and meta["value"] == "x"
    assert meta["format"] == token_cache.FORMAT and meta["kind"] == "lm" and meta["key"] == key
    assert meta["process_index"] == 0 and 0 <= meta["seconds"] < 60
    assert meta["seconds"] == round(meta["seconds"], 3)  # milliseconds
    text = open(os.path.join(directory, "meta.json")).read()
    on_disk = json.loads(text)
    assert text == json.dumps(on_disk, indent=2)  # for people too
    assert on_disk == {k: v for k, v in meta.items() if k != "built"}
    again, meta2 = token_cache.cached(str(tmp_path), "lm", key, build_writing("y", calls))
    assert again == directory and len(calls) == 1  # not built again
    assert meta2 == {**on_disk, "built": False}
    assert open(os.path.join(directory, "data.txt")).read() == "x"


def test_the_build_s_seconds_are_its_clock_s_difference_in_milliseconds(tmp_path, monkeypatch):
    clock = iter([1000.0, 1001.23456])
    monkeypatch.setattr(token_cache.time, "monotonic", lambda: next(clock))
    _, meta = token_cache.cached(str(tmp_path), "lm", "5" * 64, build_writing("x", []))
    assert meta["seconds"] == 1.235


def test_cached_makes_its_root(tmp_path):
    root = tmp_path / "a" / "b"
    directory, _ = token_cache.cached(str(root), "lm", "k" * 30, build_writing("x", []))
    assert os.path.isdir(directory) and os.path.dirname(directory) == str(root)


def test_a_directory_without_meta_or_of_another_format_is_built_again(tmp_path):
    key = "cd" * 32
    directory = os.path.join(str(tmp_path), "lm-" + key[:24])
    os.makedirs(directory)
    open(os.path.join(directory, "half.bin"), "w").close()  # a copy cut short
    calls = []
    _, meta = token_cache.cached(str(tmp_path), "lm", key, build_writing("x", calls))
    assert len(calls) == 1 and meta["built"] is True
    assert sorted(os.listdir(directory)) == ["data.txt", "meta.json"]  # the old file gone
    # Another format's cache is read as none.
    json.dump({"format": 0}, open(os.path.join(directory, "meta.json"), "w"))
    assert token_cache.read_meta(directory) is None
    _, meta = token_cache.cached(str(tmp_path), "lm", key, build_writing("y", calls))
    assert len(calls) == 2 and meta["value"] == "y"


def test_read_meta_is_none_when_missing_or_unreadable(tmp_path):
    assert token_cache.read_meta(str(tmp_path / "nothing")) is None
    (tmp_path / "meta.json").write_text("{not json")
    assert token_cache.read_meta(str(tmp_path)) is None
    (tmp_path / "meta.json").write_text(json.dumps({"format": 1, "x": 2}))
    assert token_cache.read_meta(str(tmp_path)) == {"format": 1, "x": 2}
    (tmp_path / "meta.json").write_text(json.dumps({"x": 2}))  # no format
    assert token_cache.read_meta(str(tmp_path)) is None


def test_a_failed_build_leaves_nothing_and_raises(tmp_path):
    def build(directory):
        open(os.path.join(directory, "part.bin"), "w").close()
        raise RuntimeError("encoder died")

    with pytest.raises(RuntimeError, match="encoder died"):
        token_cache.cached(str(tmp_path), "lm", "e" * 64, build)
    assert os.listdir(tmp_path) == []


def dead_pid():
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_stale_builds_of_dead_processes_on_this_host_are_removed_and_no_other(tmp_path):
    key = "f0" * 32
    name = "lm-" + key[:24]
    host = socket.gethostname()
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        keep = [
            f"{name}.tmp-{host}-{os.getpid()}x",  # not a pid
            f"{name}.tmp-{host}-{alive.pid}",  # alive
            f"{name}.tmp-otherhost-{dead_pid()}",  # another machine's: its process is not ours
            f"lm-{'0' * 24}.tmp-{host}-{dead_pid()}",  # another cache's
        ]
        stale = f"{name}.tmp-{host}-{dead_pid()}"
        for entry in [*keep, stale]:
            os.makedirs(tmp_path / entry)
        token_cache.cached(str(tmp_path), "lm", key, build_writing("x", []))
        assert sorted(os.listdir(tmp_path)) == sorted([*keep, name])
        with pytest.raises(subprocess.TimeoutExpired):  # asked if it lives (signal 0), no more
            alive.wait(timeout=0.5)
    finally:
        alive.kill()
        alive.wait()


def test_a_stale_build_removed_meanwhile_by_another_process_is_no_error(tmp_path, monkeypatch):
    entry = tmp_path / f"lm-{'4' * 24}.tmp-{socket.gethostname()}-{dead_pid()}"
    os.makedirs(entry / "part")

    def kill(pid, signal):  # the process is gone, and another builder clears its directory
        shutil.rmtree(entry)
        raise ProcessLookupError

    monkeypatch.setattr(token_cache.os, "kill", kill)
    directory, _ = token_cache.cached(str(tmp_path), "lm", "4" * 64, build_writing("x", []))
    assert os.listdir(tmp_path) == [os.path.basename(directory)]


def test_a_build_of_another_user_alive_is_kept(tmp_path, monkeypatch):
    def kill(pid, signal):
        raise PermissionError

    monkeypatch.setattr(token_cache.os, "kill", kill)
    entry = f"lm-{'1' * 24}.tmp-{socket.gethostname()}-1"
    os.makedirs(tmp_path / entry)
    token_cache.cached(str(tmp_path), "lm", "1" * 64, build_writing("x", []))
    assert entry in os.listdir(tmp_path)


def test_a_race_lost_to_another_builder_returns_its_cache(tmp_path, monkeypatch):
    key = "2" * 64
    directory = os.path.join(str(tmp_path), "lm-" + key[:24])

    def build(tmp):  # another process renames its complete cache into place meanwhile
        os.makedirs(directory)
        json.dump({"format": 1, "value": "theirs"}, open(os.path.join(directory, "meta.json"), "w"))
        open(os.path.join(directory, "x"), "w").close()  # not empty: our rename fails
        return {"value": "ours"}

    found, meta = token_cache.cached(str(tmp_path), "lm", key, build)
    assert found == directory and meta == {"format": 1, "value": "theirs", "built": True}
    assert sorted(os.listdir(tmp_path)) == ["lm-" + key[:24]]  # ours removed


def test_a_rename_that_fails_for_another_reason_raises(tmp_path, monkeypatch):
    def rename(src, dst):
        raise OSError("disk gone")

    monkeypatch.setattr(token_cache.os, "rename", rename)
    with pytest.raises(OSError, match="disk gone"):
        token_cache.cached(str(tmp_path), "lm", "3" * 64, build_writing("x", []))
    assert os.listdir(tmp_path) == []


# ----------------------------------------------------------------------------- ids on disk
@pytest.mark.parametrize("dtype", [np.uint16, np.int32, np.uint8])
def test_the_writer_appends_ids_in_its_dtype_and_counts_them(tmp_path, dtype):
    path = str(tmp_path / "ids.bin")
    writer = token_cache.ArrayWriter(path, dtype)
    top = np.iinfo(dtype).max
    writer.write(np.array([0, 5, top], np.int64))
    writer.write(np.zeros(0, np.int64))
    writer.write([7])
    assert writer.count == 4 and writer.close() == 4
    assert np.array_equal(np.fromfile(path, dtype), [0, 5, top, 7])
    assert os.path.getsize(path) == 4 * np.dtype(dtype).itemsize
    meta = {"counts": {"ids": 4}, "dtype": np.dtype(dtype).name}
    ids = token_cache.open_ids(str(tmp_path), "ids", meta)
    assert ids.dtype == dtype and np.array_equal(ids, [0, 5, top, 7])
    with pytest.raises(ValueError):
        ids[0] = 1  # read-only


@pytest.mark.parametrize(
    "ids, shown",
    [([3, 65_536], "[3, 65536]"), ([-1, 4], "[-1, 4]"), ([70_000], "[70000, 70000]")],
)
def test_the_writer_refuses_ids_its_dtype_cannot_hold(tmp_path, ids, shown):
    writer = token_cache.ArrayWriter(str(tmp_path / "ids.bin"), np.uint16)
    with pytest.raises(ValueError, match=re.escape(f"ids.bin: ids outside uint16 ({shown})")):
        writer.write(np.array(ids))
    assert writer.count == 0
    writer.close()
    assert os.path.getsize(tmp_path / "ids.bin") == 0


def test_an_empty_stream_opens_as_an_empty_array(tmp_path):
    ids = token_cache.open_ids(str(tmp_path), "none", {"counts": {"none": 0}, "dtype": "int32"})
    assert ids.shape == (0,) and ids.dtype == np.int32


def test_flatten_concatenates_and_ends_each_with_eos():
    flat, n = token_cache._flatten([[4, 5], [], [6]], eos_id=None)
    assert flat.tolist() == [4, 5, 6] and n.tolist() == [2, 0, 1]
    assert flat.dtype == np.int64 and n.dtype == np.int64
    flat, n = token_cache._flatten([[4, 5], [], [6]], eos_id=2)
    assert flat.tolist() == [4, 5, 2, 2, 6, 2] and n.tolist() == [3, 1, 2]
    flat, n = token_cache._flatten([], eos_id=2)
    assert flat.tolist() == [] and n.tolist() == []
    with pytest.raises(TypeError):
        token_cache._flatten([[4]], 2)


def test_chunks_split_a_stream_in_order():
    assert list(token_cache._chunks(iter(range(7)), 3)) == [[0, 1, 2], [3, 4, 5], [6]]
    assert list(token_cache._chunks(range(6), 3)) == [[0, 1, 2], [3, 4, 5]]
    assert list(token_cache._chunks([], 3)) == []


# ----------------------------------------------------------------------------- the sample
def pairs(n):
    return [(f"s{i}", f"t{i}") for i in range(n)]


def reservoir(n, keep, seed, chunk):
    """Algorithm R, one draw at a time, as a reference: the indices of the pairs kept. The
    stream is read `chunk` pairs at a time, and a chunk that goes past the first `keep` pairs
    draws a slot for each of its pairs, those that fill the reservoir too (unused)."""
    rng = np.random.default_rng(seed)
    kept = list(range(min(n, keep)))
    for first in range(0, n, chunk):
        last = min(first + chunk, n)
        if last <= keep:
            continue
        for i in range(first, last):
            j = int(rng.integers(0, i + 1))
            if i >= keep and j < keep:
                kept[j] = i
    return sorted(kept)


def test_the_sample_is_every_sentence_when_the_pairs_have_no_more():
    for n, sample in [(3, 6), (3, 7), (3, 100), (1, 2)]:
        sentences, count = token_cache.sample_pairs(pairs(n), sample=sample)
        assert count == n
        assert sentences == [side for i in range(n) for side in (f"s{i}", f"t{i}")]


@pytest.mark.parametrize("chunk", [1, 3, 4, 7, 50_000])
@pytest.mark.parametrize(
    "n, sample, seed", [(20, 8, 0), (20, 9, 3), (30, 2, 1), (9, 16, 5), (20, 20, 2), (9, 100, 0)]
)
def test_the_sample_is_algorithm_r_whatever_the_chunk(monkeypatch, chunk, n, sample, seed):
    monkeypatch.setattr(token_cache, "CHUNK_PAIRS", chunk)
    sentences, count = token_cache.sample_pairs(iter(pairs(n)), sample=sample, seed=seed)
    kept = reservoir(n, sample // 2, seed, chunk)
    assert count == n and len(sentences) == 2 * len(kept) == 2 * min(n, sample // 2)
    assert sentences == [side for i in kept for side in (f"s{i}", f"t{i}")]


def test_the_sample_s_seed_is_0_by_default():
    assert token_cache.sample_pairs(pairs(30), sample=8) == token_cache.sample_pairs(
        pairs(30), sample=8, seed=0
    )
    assert token_cache.sample_pairs(pairs(30), sample=8) != token_cache.sample_pairs(
        pairs(30), sample=8, seed=1
    )


def test_the_sample_draws_every_pair_alike_and_depends_on_the_seed(monkeypatch):
    monkeypatch.setattr(token_cache, "CHUNK_PAIRS", 3)
    n, keep, seeds = 10, 4, 600
    hits = np.zeros(n)
    draws = set()
    for seed in range(seeds):
        sentences, _ = token_cache.sample_pairs(pairs(n), sample=2 * keep, seed=seed)
        kept = [int(s[1:]) for s in sentences[::2]]
        hits[kept] += 1
        draws.add(tuple(kept))
    # Each pair is kept with probability keep / n = 0.4: 240 of 600, sd 12.
    assert np.all(np.abs(hits - seeds * keep / n) < 60), hits
    assert len(draws) > 100
    assert token_cache.sample_pairs(pairs(n), sample=8, seed=1) == token_cache.sample_pairs(
        pairs(n), sample=8, seed=1
    )


@pytest.mark.parametrize("sample", [1, 0, -4])
def test_a_sample_under_one_pair_is_refused(sample):
    with pytest.raises(
        ValueError, match=f"spm_sample: at least one pair \\(2 sentences\\), got {sample}"
    ):
        token_cache.sample_pairs(pairs(3), sample=sample)


def test_the_sample_takes_its_arguments_by_keyword():
    with pytest.raises(TypeError):
        token_cache.sample_pairs(pairs(3), 4)


# ----------------------------------------------------------------------------- the caches
class Letters:
    """A made-up tokenizer: each letter its id (a=3, b=4, ...), eos 2."""

    eos_id = 2

    def __init__(self, vocab_size=40, sha="letters"):
        self.vocab_size, self.sha = vocab_size, sha
        self.encoded = 0

    def sha256(self):
        return self.sha

    def encode_batch(self, texts):
        self.encoded += len(texts)
        return [[ord(c) - ord("a") + 3 for c in text] for text in texts]

    def encode_targets(self, texts):
        self.encoded += len(texts)
        return [[ord(c) - ord("a") + 10 for c in text] for text in texts]


def source_of(items, skipped_count=0, fingerprint=None):
    def read(skipped):  # counts into `skipped` (from the 0 the cache gives it)
        yield from items
        skipped[0] += skipped_count

    return token_cache.PairSource(
        read=read, fingerprint=fingerprint or {"name": "made-up"}, origin={"files": ["a", "b"]}
    )


@pytest.mark.parametrize("chunk", [2, 50_000])
def test_pairs_cache_writes_sources_with_eos_and_targets_without(tmp_path, monkeypatch, chunk):
    monkeypatch.setattr(token_cache, "CHUNK_PAIRS", chunk)
    tokenizer, logged = Letters(), []
    source = source_of([("ab", "c"), ("c", "ab"), ("abc", "a")], skipped_count=4)
    arrays, meta = token_cache.pairs_cache(source, tokenizer, str(tmp_path), log=logged.append)
    assert isinstance(arrays, PairArrays)
    assert arrays.src.tolist() == [3, 4, 2, 5, 2, 3, 4, 5, 2]
    assert arrays.src_offsets.tolist() == [0, 3, 5, 9]
    assert arrays.tgt.tolist() == [12, 10, 11, 10]
    assert arrays.tgt_offsets.tolist() == [0, 1, 3, 4]
    assert arrays.src.dtype == np.uint16 and arrays.src_offsets.dtype == np.int64
    assert isinstance(arrays.src, np.memmap) and isinstance(arrays.tgt, np.memmap)
    assert meta["counts"] == {"src": 9, "tgt": 4} and meta["pairs"] == 3
    assert meta["skipped"] == 4 and meta["vocab_size"] == 40 and meta["files"] == ["a", "b"]
    assert meta["dtype"] == "uint16" and meta["kind"] == "translate" and meta["built"] is True
    assert meta["key"] == token_cache.cache_key(name="made-up", tokenizer_sha256="letters")
    (entry,) = os.listdir(tmp_path)
    assert entry == "translate-" + meta["key"][:24]
    (line,) = logged
    assert line.startswith("data: encoded 3 training pairs (9 source, 4 target tokens) in 0s")
    assert line.endswith(f"into {os.path.join(str(tmp_path), entry)}")
    # The same source and tokenizer again: read from disk, nothing encoded, nothing logged.
    tokenizer.encoded = 0
    again, meta2 = token_cache.pairs_cache(source, tokenizer, str(tmp_path), log=logged.append)
    assert tokenizer.encoded == 0 and len(logged) == 1 and meta2["built"] is False
    assert again.src.tolist() == arrays.src.tolist()
    with pytest.raises(TypeError):  # the log by keyword
        token_cache.pairs_cache(source, tokenizer, str(tmp_path), logged.append)
    # Another tokenizer: another cache.
    _, meta3 = token_cache.pairs_cache(source, Letters(sha="other"), str(tmp_path))
    assert meta3["built"] is True and len(os.listdir(tmp_path)) == 2


def test_pairs_cache_of_a_large_vocabulary_keeps_int32_ids(tmp_path):
    arrays, meta = token_cache.pairs_cache(
        source_of([("a", "a")]), Letters(vocab_size=70_000), str(tmp_path)
    )
    assert meta["dtype"] == "int32" and arrays.src.dtype == np.int32
    assert meta["skipped"] == 0  # a source that skipped nothing


def test_stream_cache_writes_the_chunks_once(tmp_path):
    calls, logged = [], []

    def chunks():
        calls.append(1)
        return [np.array([1, 2, 3]), np.array([], np.int64), np.array([70_000])]

    tokens = token_cache.stream_cache(
        str(tmp_path), chunks, dtype=np.int32, log=logged.append, what="train.txt", level="word"
    )
    assert tokens.tolist() == [1, 2, 3, 70_000] and tokens.dtype == np.int32
    (entry,) = os.listdir(tmp_path)
    assert entry == "lm-" + token_cache.cache_key(level="word")[:24]
    meta = token_cache.read_meta(os.path.join(str(tmp_path), entry))
    assert meta["counts"] == {"tokens": 4} and meta["dtype"] == "int32" and meta["level"] == "word"
    (line,) = logged
    assert line.startswith("data: encoded train.txt (4 tokens) in 0s into ")
    again = token_cache.stream_cache(
        str(tmp_path), chunks, dtype=np.int32, log=logged.append, level="word"
    )
    assert len(calls) == 1 and len(logged) == 1 and again.tolist() == tokens.tolist()
    with pytest.raises(TypeError):  # the dtype and the key's parts by keyword
        token_cache.stream_cache(str(tmp_path), chunks, np.int32)
    with pytest.raises(ValueError, match="ids outside uint16"):
        token_cache.stream_cache(str(tmp_path), chunks, dtype=np.uint16, level="char")
    assert len(os.listdir(tmp_path)) == 1  # the refused build left nothing


def test_file_pairs_read_two_files_as_a_frozen_source(tmp_path):
    from train.data.text_files import DataError

    (tmp_path / "a.src").write_text("x y\n\nz\n")
    (tmp_path / "a.tgt").write_text("1\n2\n3\n")
    paths = str(tmp_path / "a.src"), str(tmp_path / "a.tgt")
    source = token_cache.file_pairs(*paths, train_sha256="abc")
    assert source.fingerprint == {"train_sha256": "abc", "skip_empty": False}
    assert source.origin == {"files": list(paths)}
    with pytest.raises(DataError):  # an empty line is an error unless skipped
        list(source.read([0]))
    skipping = token_cache.file_pairs(*paths, train_sha256="abc", skip_empty=True)
    skipped = [0]
    assert list(skipping.read(skipped)) == [("x y", "1"), ("z", "3")] and skipped == [1]
    assert skipping.fingerprint["skip_empty"] is True
    with pytest.raises(dataclasses.FrozenInstanceError):
        source.origin = {}
    with pytest.raises(TypeError):
        token_cache.file_pairs(*paths, "abc")
