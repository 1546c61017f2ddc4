"""train.data.token_cache: training files encoded once into a cache keyed by their bytes and
options, reused, rebuilt when incomplete, read memory-mapped (each process only its rows),
giving exactly the batches and streams of the in-memory path; the tokenizer's sample; and the
data benchmark at a tiny size."""

from __future__ import annotations

import os

import numpy as np
import pytest
from helpers import made_up_corpus, mtimes, write_lines

from train import lm, translate
from train.bench.config import BenchConfig
from train.bench.run import run_benchmarks
from train.data import token_cache
from train.data.batching import PairArrays, TokenBatcher
from train.data.text_files import DataError, files_sha256, iter_parallel, read_parallel
from train.data.tokenizers import SentencePieceTokenizer, multi30k_tokenizer
from train.lm.task import train_batches
from train.translate import sources
from train.translate.sources import FilesSource, encode_pairs, multi30k_pairs
from xl_jax.data import lm_batches


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("parallel")
    src, tgt = made_up_corpus(300, 0)
    return write_lines(root / "train.xx", src), write_lines(root / "train.yy", tgt)


@pytest.fixture(scope="module")
def tokenizer(files, tmp_path_factory):
    pairs, _ = read_parallel(*files)
    return SentencePieceTokenizer.train_or_load(
        [s for pair in pairs for s in pair], tmp_path_factory.mktemp("spm"), vocab_size=300
    )


def cache(files, tokenizer, root, *, skip_empty=False):
    """`pairs_cache` of the two parallel files `files`."""
    source = token_cache.file_pairs(
        *files, train_sha256=files_sha256(*files), skip_empty=skip_empty
    )
    return token_cache.pairs_cache(source, tokenizer, str(root))


def sample_sentences(src_path, tgt_path, *, sample, seed=0):
    """The tokenizer's sample (`sample_pairs`) of two parallel files, read as the task reads
    them (`iter_parallel`)."""
    return token_cache.sample_pairs(iter_parallel(src_path, tgt_path), sample=sample, seed=seed)


def only_entry(root):
    (entry,) = [e for e in os.listdir(root) if ".tmp-" not in e]
    return os.path.join(root, entry)


# ----------------------------------------------------------------------------- the cache
def test_the_cache_is_built_once_then_reused_without_encoding(files, tokenizer, tmp_path):
    first, meta = cache(files, tokenizer, tmp_path)
    directory = only_entry(tmp_path)
    before = mtimes(directory)
    again, meta_again = cache(files, tokenizer, tmp_path)
    assert meta["built"] and not meta_again["built"]
    assert mtimes(directory) == before  # nothing written the second time
    assert isinstance(again.src, np.memmap) and again.src.dtype == np.uint16
    pairs, _ = read_parallel(*files)
    assert meta["pairs"] == len(again) == len(pairs) == 300
    for name in ("src", "src_offsets", "tgt", "tgt_offsets"):
        assert np.array_equal(getattr(first, name), getattr(again, name))
    # The ids are the in-memory encoding: sources end with eos, targets have none.
    encoded = encode_pairs(tokenizer, pairs)
    for i in (0, 17, 299):
        s0, s1 = again.src_offsets[i : i + 2]
        t0, t1 = again.tgt_offsets[i : i + 2]
        assert list(again.src[s0:s1]) == encoded[i][0] and encoded[i][0][-1] == tokenizer.eos_id
        assert list(again.tgt[t0:t1]) == encoded[i][1]


def test_the_cache_is_keyed_by_the_bytes_and_the_options(files, tokenizer, tmp_path):
    root = tmp_path / "cache"
    cache(files, tokenizer, root)
    # The same bytes under other names: the same cache.
    copies = tuple(str(tmp_path / f"copy{i}") for i in range(2))
    for path, copy in zip(files, copies):
        with open(path, "rb") as f, open(copy, "wb") as g:
            g.write(f.read())
    assert not cache(copies, tokenizer, root)[1]["built"]
    assert len(os.listdir(root)) == 1
    # Other options, other bytes: other caches.
    assert cache(files, tokenizer, root, skip_empty=True)[1]["built"]
    with open(copies[1], "a") as f, open(copies[0], "a") as g:
        f.write("EXTRA\n")
        g.write("extra\n")
    arrays, meta = cache(copies, tokenizer, root)
    assert meta["built"] and meta["pairs"] == len(arrays) == 301
    assert len(os.listdir(root)) == 3


def test_a_cache_without_its_meta_is_built_again(files, tokenizer, tmp_path):
    first = np.array(cache(files, tokenizer, tmp_path)[0].src)  # a copy: the file is cut below
    directory = only_entry(tmp_path)
    os.remove(os.path.join(directory, token_cache.META_FILE))  # a copy cut short
    with open(os.path.join(directory, "src.bin"), "r+b") as f:
        f.truncate(10)
    # A build killed halfway (its process gone) leaves a temporary directory behind.
    stale = f"{directory}.tmp-{os.uname().nodename}-999999999"
    os.makedirs(stale)
    again, meta = cache(files, tokenizer, tmp_path)
    assert meta["built"] and np.array_equal(first, again.src)
    assert not os.path.exists(stale)


def test_streaming_reads_refuse_bad_files_as_read_parallel_does(tmp_path):
    src, tgt = made_up_corpus(5, 0)
    good = write_lines(tmp_path / "s.de", src)
    cases = {
        "short": write_lines(tmp_path / "short.en", tgt[:4]),
        "empty": write_lines(tmp_path / "empty.en", []),
        "holes": write_lines(tmp_path / "holes.en", tgt[:1] + [""] + tgt[2:]),
    }
    for path in cases.values():
        with pytest.raises(DataError) as expected:
            read_parallel(good, path)
        with pytest.raises(DataError) as streamed:
            list(iter_parallel(good, path))
        assert str(streamed.value) == str(expected.value)
    skipped: list[int] = []
    pairs = list(iter_parallel(good, cases["holes"], skip_empty=True, skipped=skipped))
    assert (pairs, skipped[0]) == read_parallel(good, cases["holes"], skip_empty=True)


# ----------------------------------------------------------------------------- batches
def old_batches(pairs, epochs, *, tokens_per_batch, buckets, num_devices=1, seed=0):
    """The batches the in-memory TokenBatcher gave before the cache, the slow obvious way:
    bucket members as lists, each row padded by hand, the (seed, epoch) shuffle."""
    members = {L: [] for L in buckets}
    for s, t in pairs:
        L = next((b for b in buckets if b >= max(len(s), len(t) + 1)), None)
        if L is not None:
            members[L].append((s, t))
    counts = {L: len(m) for L, m in members.items() if m}
    rows = {L: tokens_per_batch // L // num_devices * num_devices for L in counts}
    for epoch in range(epochs):
        rng = np.random.default_rng([seed, epoch])
        plan = []
        for L in sorted(counts):
            order = np.concatenate([rng.permutation(counts[L]), np.full(-counts[L] % rows[L], -1)])
            plan.extend((L, chunk) for chunk in order.reshape(-1, rows[L]))
        for i in rng.permutation(len(plan)):
            L, chunk = plan[i]
            batch = {k: np.zeros((len(chunk), L), np.int32) for k in ("src", "tgt_in", "tgt_out")}
            for r, m in enumerate(chunk):
                if m >= 0:
                    s, t = members[L][m]
                    batch["src"][r, : len(s)] = s
                    batch["tgt_in"][r, : len(t) + 1] = [1, *t]
                    batch["tgt_out"][r, : len(t) + 1] = [*t, 2]
            yield batch


def assert_same_batches(a, b, n):
    for _ in range(n):
        x, y = next(a), next(b)
        assert x.keys() == y.keys()
        for k in x:
            assert x[k].dtype == y[k].dtype == np.int32 and np.array_equal(x[k], y[k]), k


def test_multi30k_batches_are_those_of_the_in_memory_path_before_the_cache(data_dir, tokenizer_dir):
    tokenizer = multi30k_tokenizer(tokenizer_dir, vocab_size=1000, data_dir=data_dir)
    config = dict(tokens_per_batch=1024, buckets=(12, 16, 24, 32, 48), seed=3)
    multi30k = translate.make_config("transformer", "tiny", data_dir=str(data_dir))
    pairs = encode_pairs(tokenizer, multi30k_pairs(multi30k, "train"))
    batcher = TokenBatcher(pairs, **config)
    epochs = 2
    assert_same_batches(
        batcher.iterate(0), old_batches(pairs, epochs, **config), epochs * batcher.num_batches
    )


def test_cached_batches_equal_the_in_memory_ones(files, tokenizer, tmp_path):
    arrays, _ = cache(files, tokenizer, tmp_path)
    pairs = encode_pairs(tokenizer, read_parallel(*files)[0])
    config = dict(tokens_per_batch=96, buckets=(8, 12, 16, 24), num_devices=2, seed=5)
    memory, cached = TokenBatcher(pairs, **config), TokenBatcher(arrays, **config)
    assert memory.shape_set() == cached.shape_set()
    assert memory.num_dropped == cached.num_dropped and memory.num_examples == 300
    n = 2 * memory.num_batches + 3
    assert_same_batches(memory.iterate(4), cached.iterate(4), n)
    half = lambda rows: slice(rows // 2, rows)  # noqa: E731 - process 1 of 2
    assert_same_batches(memory.iterate(7, half), cached.iterate(7, half), n)


class Recorded:
    """A token array that records which positions are read."""

    def __init__(self, array):
        self.array, self.read = array, set()

    def __getitem__(self, index):
        self.read.update(np.asarray(index).ravel().tolist())
        return self.array[index]


def test_a_process_reads_only_the_tokens_of_its_own_rows(files, tokenizer, tmp_path):
    arrays, _ = cache(files, tokenizer, tmp_path)
    src, tgt = Recorded(arrays.src), Recorded(arrays.tgt)
    recorded = PairArrays(src, arrays.src_offsets, tgt, arrays.tgt_offsets)
    config = dict(tokens_per_batch=96, buckets=(12, 16, 24), num_devices=2, seed=1)
    batcher, whole = TokenBatcher(recorded, **config), TokenBatcher(arrays, **config)
    second = lambda rows: slice(rows // 2, rows)  # noqa: E731
    for _, (mine, everything) in zip(range(5), zip(batcher.iterate(0, second), whole.iterate(0))):
        for k in mine:
            assert np.array_equal(mine[k], everything[k][second(len(everything[k]))])
    # Which pairs were the second halves of those batches: their tokens, and no others, read.
    wanted_src, wanted_tgt = set(), set()
    for L, members in batcher._epoch_plan(0)[:5]:
        for pair in batcher._members[L][members[second(len(members))]]:
            if pair >= 0:
                wanted_src.update(range(*arrays.src_offsets[pair : pair + 2]))
                wanted_tgt.update(range(*arrays.tgt_offsets[pair : pair + 2]))
    assert wanted_src and src.read == wanted_src and tgt.read == wanted_tgt


# ----------------------------------------------------------------------------- sampling
def test_the_tokenizer_sample_is_at_most_spm_sample_sentences_in_file_order(files):
    pairs, _ = read_parallel(*files)
    everything = [s for pair in pairs for s in pair]
    assert sample_sentences(*files, sample=600) == (everything, 300)
    assert sample_sentences(*files, sample=10_000)[0] == everything
    sample, count = sample_sentences(*files, sample=41)
    assert count == 300 and len(sample) == 40
    index = {pair: i for i, pair in enumerate(pairs)}
    positions = [index[(s, t)] for s, t in zip(sample[::2], sample[1::2])]  # whole pairs
    assert positions == sorted(positions) and len(set(positions)) == 20
    assert sample_sentences(*files, sample=41) == (sample, count)  # seeded
    assert sample_sentences(*files, sample=41, seed=1)[0] != sample


def test_spm_sample_names_its_own_tokenizer_trained_on_the_sample(files, tmp_path, monkeypatch):
    seen = []

    def spy(path, sentences, **kw):
        seen.append(len(sentences))
        return real(path, sentences, **kw)

    real = sources.write_model
    monkeypatch.setattr(sources, "write_model", spy)
    made = []
    for sample in (600, 200, 200):
        config = translate.make_config(
            "transformer",
            "tiny",
            vocab_size=300,
            spm_sample=sample,
            train_src=files[0],
            train_tgt=files[1],
            valid_src=files[0],
            valid_tgt=files[1],
        )
        made.append(FilesSource(config).tokenizer(str(tmp_path)).model_path)
    assert seen == [600, 200]  # the third found the second's model
    assert made[0] != made[1] == made[2]


# ----------------------------------------------------------------------------- LM streams
@pytest.fixture(scope="module")
def text(tmp_path_factory):
    root = tmp_path_factory.mktemp("text")
    src, tgt = made_up_corpus(400, 4)
    return write_lines(root / "train.txt", src + tgt), write_lines(root / "valid.txt", src[:50])


@pytest.mark.parametrize("level", ["word", "char", "byte"])
def test_the_lm_stream_cache_equals_the_in_memory_stream(text, level, tmp_path):
    fields = dict(train_text=text[0], valid_text=text[1], level=level)
    if level == "byte":
        fields = dict(train_text=text[0], level=level, split_bytes=(3000, 500, 400))
    config = lm.config_for_data("text", "tiny", **fields)
    for split in ("train", "valid"):
        memory = lm.load_stream(config, split)
        cached = lm.load_stream(config, split, cache_dir=str(tmp_path))
        assert memory.dtype == np.int32 and isinstance(cached, np.memmap)
        assert cached.dtype == (np.uint8 if level == "byte" else np.uint16)
        assert np.array_equal(memory, cached)
    before = {e: mtimes(tmp_path / e) for e in os.listdir(tmp_path)}
    assert len(before) == 2  # one cache a split
    lm.load_stream(config, "train", cache_dir=str(tmp_path))
    assert {e: mtimes(tmp_path / e) for e in os.listdir(tmp_path)} == before


def test_a_vocabulary_past_65536_words_round_trips_through_the_cache(tmp_path):
    # WikiText-103 has 267,735 words: ids past 65,535 do not fit uint16, and must come back
    # from the cache exactly as encoded.
    words = [f"v{i}" for i in range(70_000)]
    lines = [" ".join(words[i : i + 100]) for i in range(0, len(words), 100)]
    train = write_lines(tmp_path / "train.txt", lines)
    config = lm.config_for_data("text", "tiny", train_text=train, valid_text=train)
    assert config.model_config.vocab_size == 70_002  # and <eos>, <unk>
    memory = lm.load_stream(config, "train")
    cached = lm.load_stream(config, "train", cache_dir=str(tmp_path / "cache"))
    assert len(memory) == 70_000 + len(lines) and memory.max() == 70_001
    assert cached.dtype == np.int32 and np.array_equal(cached, memory)


def test_a_process_share_of_the_cached_lm_batches_is_its_rows(text, tmp_path):
    config = lm.config_for_data("text", "tiny", train_text=text[0], valid_text=text[1])
    cached = lm.load_stream(config, "train", cache_dir=str(tmp_path))
    memory = lm.load_stream(config, "train")
    whole = lm_batches(
        memory, batch_size=config.batch_size, tgt_len=config.model_config.tgt_len, drop_last=True
    )
    batches, from_step = train_batches(cached, config)
    assert len(batches) == len(whole) and config.batch_size == 8
    rows = lambda n: slice(2, 6)  # noqa: E731 - a middle process's rows
    for step, batch in zip(range(len(batches) + 2), from_step(0, rows)):
        inputs, targets = whole[step % len(whole)]
        assert batch["inputs"].dtype == np.int32
        assert np.array_equal(batch["inputs"], inputs[2:6])
        assert np.array_equal(batch["targets"], targets[2:6])


# ----------------------------------------------------------------------------- the bench
@pytest.mark.slow
def test_the_data_bench_runs_tiny_and_reports_every_figure(tmp_path):
    config = BenchConfig.quick().replace(
        data_pairs=3000, data_lm_tokens=20_000, data_loader_seconds=0.2
    )
    results = run_benchmarks(
        config,
        sections=("data",),
        out=str(tmp_path / "out"),
        cache_dir=str(tmp_path / "cache"),
        raise_errors=True,
        log=lambda _: None,
    )
    data = results["data"]
    for name in ("translate", "lm"):
        r = data[name]
        assert r["prepare"]["peak_rss_bytes"] > 0 and r["loader"]["batches"] > 0
        assert any("encoded" in line for line in r["prepare"]["log"])  # built the first time
        assert not any("encoded" in line for line in r["reuse"]["log"])  # found the second
        assert r["loader_over_step"] == pytest.approx(r["step_s"] * r["loader"]["batches_per_s"])
    assert "| translate |" in open(tmp_path / "out" / "bench.md").read()
    # Only the corpus stays in the cache directory: the work directories are removed.
    assert os.listdir(tmp_path / "cache") == ["data-3000-pairs-20000-tokens"]
