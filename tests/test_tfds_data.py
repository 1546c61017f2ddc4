"""Training on any prepared TFDS dataset (`--dataset tfds:NAME[/CONFIG]`): translation on
`wmt14_translate/de-en`, language models on `lm1b` (word and byte level), exact resume, the
training data streamed into the token cache once (the ids those of the in-memory reading, the
tokenizer on at most spm_sample sentences), and every bad dataset refused with exit code 2
before training.

The datasets are real prepared TFDS datasets, written offline by TFDS's own builders for those
names with their download replaced by a few made-up examples (`prepare_offline`): the same
array_record files and dataset_info.json a download would leave, read back through the
unpatched `as_data_source` path, also by the CLI. `tfds.testing.mock_data` cannot serve this
(TFDS 4.9.10): its data source mock sets `__getitems__` as an unbound attribute, so batched
reads fail with a TypeError; without metadata files it replaces the split dict with a
MagicMock that holds no split names; and its text is random letters, the same in every split.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import tensorflow_datasets as tfds
from etils import epath
from helpers import mtimes, tiny_lm_config, train_losses
from tensorflow_datasets.datasets.lm1b import lm1b_dataset_builder
from tensorflow_datasets.translate import wmt14, wmt_t2t

from train import lm, translate
from train.core import cli
from train.core.metrics import read_metrics
from train.data import tfds_source, token_cache
from train.data.batching import PairArrays
from train.lm import cli as lm_cli
from train.lm.task import load_stream, load_vocab
from train.lm.text import TextVocab
from train.translate import cli as translate_cli
from train.translate import sources
from train.translate.sources import TfdsSource, encode_pairs
from train.translate.tokenizer import load_tokenizer

WORDS = [f"w{i}" for i in range(40)]


def parallel(n, seed):
    """{'de': ..., 'en': ...} examples of a made-up language and its 'translation' (the words
    reversed and upper-cased): learnable, and enough text for a small SentencePiece model."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        words = list(rng.choice(WORDS, rng.integers(3, 9)))
        out.append({"de": " ".join(words), "en": " ".join(w.upper() for w in reversed(words))})
    return out


def sentences(n, seed):
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, len(WORDS) + 1)
    return [
        {"text": " ".join(rng.choice(WORDS, rng.integers(4, 12), p=p / p.sum()))} for _ in range(n)
    ]


def prepare_offline(builder_cls, splits, data_dir, *, config=None):
    """Prepares TFDS's dataset `builder_cls` in `data_dir` (array_record) from `splits`
    ({split: [example, ...]}) instead of its download."""

    class Offline(builder_cls, skip_registration=True):
        name = builder_cls.name
        # The builder's own module, which TFDS would find from the class (this one lives in
        # the test module) through importlib_resources (not installed: reading needs none).
        code_path = epath.Path(sys.modules[builder_cls.__module__].__file__)

        @classmethod
        def _get_pkg_dir_path(cls):
            return cls.code_path.parent

        def _split_generators(self, dl_manager):
            return {
                split: ((f"{split}-{i}", ex) for i, ex in enumerate(examples))
                for split, examples in splits.items()
            }

    with tfds_source.without_bucket_metadata():
        builder = Offline(config=config, data_dir=str(data_dir), file_format="array_record")
    builder.download_and_prepare(
        download_config=tfds.download.DownloadConfig(try_download_gcs=False)
    )


@pytest.fixture(scope="module")
def tfds_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("tfds")
    wmt = {"train": parallel(400, 0), "validation": parallel(40, 1), "test": parallel(16, 2)}
    prepare_offline(wmt14.Wmt14Translate, wmt, root, config="de-en")
    # A translation dataset without a train split.
    prepare_offline(wmt_t2t.WmtT2tTranslate, {"test": parallel(8, 3)}, root, config="de-en")
    # lm1b has no validation split: the last 1% of train is held out for it.
    lm1b = {"train": sentences(300, 4), "test": sentences(30, 5)}
    prepare_offline(lm1b_dataset_builder.Builder, lm1b, root)
    return root


def read_split(root, name, split):
    """A prepared split read directly with TFDS (the order a run reads it in)."""
    return list(tfds.builder(name, data_dir=str(root)).as_data_source(split=split))


def read_pairs(root, split, name="wmt14_translate/de-en"):
    """A translation split's (de, en) pairs, read directly with TFDS, in its order."""
    return [(ex["de"].decode(), ex["en"].decode()) for ex in read_split(root, name, split)]


def wmt_config(root, **overrides):
    """The translation run of `translate_argv` as a config (what its data depends on)."""
    fields = dict(dataset="tfds:wmt14_translate/de-en", data_dir=str(root), vocab_size=300)
    return translate.make_config("transformer", "tiny", **{**fields, **overrides})


class ByteTokenizer:
    """A stand-in for SentencePiece where no model needs training: a sentence's UTF-8 bytes
    (+ 3 past the special ids); its 'model' is a file of its own, part of a cache's key."""

    vocab_size, eos_id = 259, 2

    def __init__(self, directory):
        self.model_path = Path(directory) / "bytes.model"
        self.model_path.write_bytes(b"bytes + 3")

    def encode_batch(self, sentences):
        return [[b + 3 for b in s.encode()] for s in sentences]

    encode_targets = encode_batch  # one joint "model", as SentencePieceTokenizer's

    def sha256(self):
        return hashlib.sha256(self.model_path.read_bytes()).hexdigest()


def exit_code(main, argv) -> int:
    """A CLI main's exit code: returned, or raised by argparse (a bad value while the config
    is made)."""
    try:
        return main(argv)
    except SystemExit as e:
        return e.code


def translate_argv(tfds_dir, workdir, *extra):
    return [
        "--preset",
        "tiny",
        "--dataset",
        "tfds:wmt14_translate/de-en",
        "--data_dir",
        str(tfds_dir),
        "--src_lang",
        "de",
        "--tgt_lang",
        "en",
        "--workdir",
        str(workdir),
        "--vocab_size",
        "300",
        "--log_every",
        "2",
        "--checkpoint_every",
        "2",
        "--plots",
        "false",
        "--progress",
        "false",
        *extra,
    ]


# ----------------------------------------------------------------------------- translation
@pytest.fixture(scope="module")
def translated(tfds_dir, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("wmt") / "run"
    assert translate_cli.main(translate_argv(tfds_dir, workdir, "--steps", "4")) == 0
    return workdir


@pytest.mark.slow
def test_translation_trains_on_a_tfds_dataset_and_scores_its_test_split(tfds_dir, translated):
    test = read_split(tfds_dir, "wmt14_translate/de-en", "test")
    out = translated / "translations"
    references = (out / "wmt14_translate.test.reference.en").read_text().splitlines()
    assert references == [ex["en"].decode() for ex in test]  # the test split, in its order
    sources = (out / "wmt14_translate.test.source.de").read_text().splitlines()
    assert sources == [ex["de"].decode() for ex in test]
    assert len((out / "wmt14_translate.test.step4.en").read_text().splitlines()) == len(test)
    records = read_metrics(str(translated))
    (final,) = [r for r in records if r["split"] == "wmt14_translate.test"]
    assert final["sentences"] == len(test) and np.isfinite(final["bleu"])
    assert max(r["step"] for r in records if r["split"] == "train") == 4
    # The tokenizer was trained on this dataset's training text, not Multi30k's.
    assert [p.name.split("_")[0] for p in (translated / "tokenizer").glob("*.model")] == ["tfds"]
    saved = json.loads((translated / "data.json").read_text())
    assert saved["dataset"].endswith("wmt14_translate/de-en/1.0.0/dataset_info.json")


@pytest.mark.slow
def test_a_tfds_translation_run_resumes_exactly(tfds_dir, translated, tmp_path):
    straight = tmp_path / "straight"
    assert translate_cli.main(translate_argv(tfds_dir, straight, "--steps", "6")) == 0
    resumed = tmp_path / "resumed"
    shutil.copytree(translated, resumed)
    (cache,) = (resumed / "token_cache").glob("translate-*")
    before = {d: mtimes(d) for d in (cache, resumed / "token_cache", resumed / "tokenizer")}
    assert translate_cli.main(["--workdir", str(resumed), "--steps", "6"]) == 0
    assert train_losses(resumed) == train_losses(straight)
    # The resumed run opened the cache and the tokenizer its first part made: nothing was
    # encoded, trained or written there again.
    assert {d: mtimes(d) for d in before} == before


@pytest.mark.slow
def test_resuming_on_other_data_is_refused(tfds_dir, translated, tmp_path, capsys):
    workdir = tmp_path / "run"
    shutil.copytree(translated, workdir)
    # The dataset is part of the run (not a may-change field) ...
    code = translate_cli.main(
        ["--workdir", str(workdir), "--dataset", "tfds:wmt_t2t_translate/de-en"]
    )
    err = capsys.readouterr().err
    assert code == cli.EXIT_ERROR and "holds a run with a different config" in err
    assert "dataset: saved 'tfds:wmt14_translate/de-en', given 'tfds:wmt_t2t" in err
    # ... and so is the prepared copy: another one under the same name (another data_dir
    # may be given on resume) has another dataset_info.json.
    other = tmp_path / "other"
    prepare_offline(
        wmt14.Wmt14Translate,
        {"train": parallel(300, 7), "validation": parallel(10, 8)},
        other,
        config="de-en",
    )
    code = translate_cli.main(["--workdir", str(workdir), "--data_dir", str(other)])
    err = capsys.readouterr().err
    assert code == cli.EXIT_USAGE, err
    assert "dataset: " in err and "not the files this run started with" in err
    assert max(r["step"] for r in read_metrics(str(workdir))) == 4  # nothing trained


@pytest.mark.slow
def test_the_training_split_is_cached_once_as_its_in_memory_encoding(tfds_dir, translated):
    config, pairs = wmt_config(tfds_dir), read_pairs(tfds_dir, "train")
    (cache,) = (translated / "token_cache").glob("translate-*")
    meta = json.loads((cache / token_cache.META_FILE).read_text())
    assert (meta["pairs"], meta["skipped"], meta["split"]) == (len(pairs), 0, "train")
    models, before = mtimes(translated / "tokenizer"), mtimes(cache)
    # The run's tokenizer is found by its name (the dataset's fingerprint), its cache by its
    # key: nothing is trained or encoded again.
    tokenizer = load_tokenizer(config, str(translated))
    arrays, again = token_cache.pairs_cache(
        TfdsSource(config).stream(), tokenizer, str(translated / "token_cache")
    )
    assert not again["built"] and mtimes(cache) == before
    assert mtimes(translated / "tokenizer") == models
    assert isinstance(arrays.src, np.memmap) and arrays.src.dtype == np.uint16
    expected = PairArrays.from_pairs(encode_pairs(tokenizer, pairs))
    for name in ("src", "src_offsets", "tgt", "tgt_offsets"):
        assert np.array_equal(getattr(arrays, name), getattr(expected, name)), name


def test_a_split_is_streamed_in_batches_in_its_prepared_order(tfds_dir):
    data = tfds_source.open_dataset("tfds:wmt14_translate/de-en", tfds_dir)
    pairs = read_pairs(tfds_dir, "train")
    assert list(data.iter_read("train", ("de", "en"), batch=7)) == pairs
    assert data.read("train", ("de", "en")) == pairs
    assert list(data.iter_read("train[390:]", ("en",), batch=4)) == [(t,) for _, t in pairs[390:]]


def test_the_tfds_tokenizer_trains_on_at_most_spm_sample_sentences(tfds_dir, tmp_path, monkeypatch):
    class Sampled(Exception):
        pass

    seen = []

    def record(path, sentences, *, vocab_size):
        seen.append((os.path.basename(path), list(sentences)))
        raise Sampled  # what it would train on is all this test needs

    monkeypatch.setattr(sources, "write_model", record)
    for sample in (1_000_000, 41):
        with pytest.raises(Sampled):
            load_tokenizer(wmt_config(tfds_dir, spm_sample=sample), str(tmp_path))
    (name, everything), (small_name, small) = seen
    pairs = read_pairs(tfds_dir, "train")
    # Fewer sentences than spm_sample: all of them, in order (what training on the split held
    # in memory gave) ...
    assert everything == [side for pair in pairs for side in pair]
    # ... else both sides of spm_sample // 2 of its pairs, in the split's order.
    drawn = list(zip(small[::2], small[1::2]))
    assert len(drawn) == 20 and len(set(drawn)) == 20
    at = [pairs.index(pair) for pair in drawn]
    assert at == sorted(at)
    assert name.startswith("tfds_spm_bpe300_") and small_name != name  # the sample is in the key


def test_an_unprepared_dataset_is_refused_leaving_no_temporary_folder(tmp_path, scratch_tempdir):
    # TFDS's own builders, made over a directory without a prepared copy, each made an empty
    # temporary folder, looking for metadata on TFDS's bucket.
    look = tfds.core.DatasetInfo.initialize_from_bucket
    with pytest.raises(tfds_source.DataError, match="is not prepared in"):
        tfds_source.open_dataset("tfds:wmt14_translate/de-en", tmp_path / "tfds")
    assert list(scratch_tempdir.iterdir()) == []
    assert tfds.core.DatasetInfo.initialize_from_bucket is look  # TFDS's own, for the others


def test_tfds_pairs_with_an_empty_side_are_left_out_counted_and_cached(tmp_path):
    train = parallel(30, 9)
    train[3]["en"], train[10]["de"] = "", "  "
    root = tmp_path / "tfds"
    prepare_offline(
        wmt14.Wmt14Translate, {"train": train, "validation": parallel(4, 10)}, root, config="de-en"
    )
    kept = [p for p in read_pairs(root, "train") if p[0].strip() and p[1].strip()]
    source, skipped = TfdsSource(wmt_config(root)).stream(), [0]
    assert list(source.read(skipped)) == kept and len(kept) == 28 and skipped == [2]
    tokenizer = ByteTokenizer(tmp_path)
    arrays, meta = token_cache.pairs_cache(source, tokenizer, str(tmp_path / "cache"))
    assert meta["built"] and (meta["pairs"], meta["skipped"]) == (28, 2)
    expected = PairArrays.from_pairs(encode_pairs(tokenizer, kept))
    for name in ("src", "src_offsets", "tgt", "tgt_offsets"):
        assert np.array_equal(getattr(arrays, name), getattr(expected, name)), name
    assert not token_cache.pairs_cache(source, tokenizer, str(tmp_path / "cache"))[1]["built"]
    # The other direction is other data: another cache, its pairs swapped.
    back = TfdsSource(wmt_config(root, src_lang="en", tgt_lang="de")).stream()
    swapped, meta = token_cache.pairs_cache(back, tokenizer, str(tmp_path / "cache"))
    assert meta["built"] and len(os.listdir(tmp_path / "cache")) == 2
    assert np.array_equal(swapped.tgt, arrays.src[arrays.src != tokenizer.eos_id])


def test_eval_sentences_bounds_what_is_read_of_the_evaluation_splits(tfds_dir, tmp_path):
    tokenizer = ByteTokenizer(tmp_path)
    source = TfdsSource(wmt_config(tfds_dir, eval_sentences=5))
    validation, (test,) = source.validation_split(tokenizer), source.test_splits(tokenizer)
    assert (
        list(zip(validation.sources, validation.references))
        == read_pairs(tfds_dir, "validation")[:5]
    )
    assert test.name == "wmt14_translate.test" and len(test.pairs) == 5
    source = TfdsSource(wmt_config(tfds_dir))
    validation, (test,) = source.validation_split(tokenizer), source.test_splits(tokenizer)
    assert (len(validation.pairs), len(test.pairs)) == (40, 16)


# ----------------------------------------------------------------------------- language models
@pytest.mark.slow
@pytest.mark.parametrize("level", ["word", "byte"])
def test_a_language_model_trains_on_lm1b(tfds_dir, tmp_path, level):
    config = tiny_lm_config(tfds_dir, "tfds:lm1b", level=level, eval_tokens=0)
    train = [ex["text"].decode() for ex in read_split(tfds_dir, "lm1b", "train")]
    test = [ex["text"].decode() for ex in read_split(tfds_dir, "lm1b", "test")]
    held = 3  # 1% of the 300 training examples: lm1b has no validation split
    vocab = load_vocab(config)
    if level == "word":
        expected = TextVocab.build(train[:-held], "word")  # counts of the training part only
        assert vocab.symbols == expected.symbols
        assert config.model_config.vocab_size == expected.vocab_size
        assert (
            load_stream(config, "valid").tolist() == expected.encode_lines(train[-held:]).tolist()
        )
    else:
        assert config.model_config.vocab_size == 256
        data = "".join(line + "\n" for line in test).encode()
        assert load_stream(config, "test").tolist() == list(data)  # a newline ends each line
    final = lm.train_and_evaluate(config, str(tmp_path / "run"))
    figure = "test_ppl" if level == "word" else "test_bpc"
    assert final["step"] == 6 and np.isfinite(final[figure])
    # Each split was encoded once into the run's token cache: read back memory-mapped, it is
    # the in-memory stream, and reading it again encodes nothing.
    root = tmp_path / "run" / "token_cache"
    caches = sorted(root.glob("lm-*"))
    assert len(caches) == 3
    before = {c: mtimes(c) for c in caches}
    for split in ("train", "valid", "test"):
        cached = load_stream(config, split, cache_dir=str(root))
        assert isinstance(cached, np.memmap)
        assert cached.dtype == (np.uint16 if level == "word" else np.uint8)
        assert cached.tolist() == load_stream(config, split).tolist(), split
    assert {c: mtimes(c) for c in caches} == before and sorted(root.glob("lm-*")) == caches


# ----------------------------------------------------------------------------- bad datasets
@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--dataset", "tfds:wmt14_translate/fr-en", "--src_lang", "fr"],
            "tfds:wmt14_translate/fr-en is not prepared in {D}; prepare it once (it downloads "
            "the data): python -m train.data.tfds_source wmt14_translate/fr-en --data_dir {D}",
        ),
        (["--dataset", "tfds:wmt41_translate/de-en"], "TFDS has no dataset of that name"),
        (["--dataset", "tfds:wmt14_translate/xx-yy"], "BuilderConfig xx-yy not found"),
        (
            ["--dataset", "tfds:wmt14_translate/de-en", "--src_lang", "fr"],
            "src_lang, tgt_lang: tfds:wmt14_translate/de-en has no language 'fr' (its "
            "languages: de, en)",
        ),
        (["--dataset", "tfds:wmt_t2t_translate/de-en"], "no 'train' split to train on"),
        (["--dataset", "wmt14"], "dataset: expected 'multi30k' or tfds:NAME"),
        (
            ["--dataset", "tfds:wmt14_translate/de-en", "--train_src", "a", "--train_tgt", "b"],
            "or on files, not both",
        ),
    ],
)
def test_bad_translation_datasets_are_usage_errors(tfds_dir, tmp_path, capsys, argv, message):
    base = ["--preset", "tiny", "--data_dir", str(tfds_dir), "--workdir", str(tmp_path / "w")]
    code = exit_code(translate_cli.main, [*base, *argv])
    err = capsys.readouterr().err
    assert code == cli.EXIT_USAGE, err
    assert message.format(D=tfds_dir) in err
    assert not (tmp_path / "w" / "metrics.jsonl").exists()  # nothing trained


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--dataset", "tfds:lm1b", "--data_dir", "{E}"], "tfds:lm1b is not prepared in {E}"),
        (["--dataset", "tfds:lm2b"], "TFDS has no dataset of that name, and none is prepared"),
        (["--dataset", "tfds:lm2b"], "(did you mean lm1b?)"),
        (
            ["--dataset", "tfds:wmt14_translate/de-en"],
            "text_feature: tfds:wmt14_translate/de-en has no text feature 'text' (its text "
            "features: de, en)",
        ),
        (
            ["--dataset", "tfds:wmt14_translate/de-en", "--level", "byte"],  # found later
            "has no text feature 'text'",
        ),
        (
            ["--dataset", "tfds:wmt_t2t_translate/de-en", "--text_feature", "en"],
            "no 'train' split to train on (its splits: test)",
        ),
        (["--dataset", "tfds:"], "invalid choice: 'tfds:'"),
        (["--dataset", "lm1b"], "invalid choice: 'lm1b'"),
    ],
)
def test_bad_lm_datasets_are_usage_errors(tfds_dir, tmp_path, capsys, argv, message):
    empty = tmp_path / "empty"
    argv = [a.format(E=empty) for a in argv]
    base = ["--preset", "tiny", "--data_dir", str(tfds_dir), "--workdir", str(tmp_path / "w")]
    code = exit_code(lm_cli.main, [*base, *argv])
    err = capsys.readouterr().err
    assert code == cli.EXIT_USAGE, err
    assert message.format(E=empty) in err
    assert not (tmp_path / "w" / "metrics.jsonl").exists()


# ----------------------------------------------------------------------------- preparing
class TinyParallelCorpus(tfds.core.GeneratorBasedBuilder):
    """A registered builder whose 'download' is three pairs: what `prepare` runs."""

    VERSION = tfds.core.Version("1.0.0")
    code_path = epath.Path(__file__)

    def _info(self):
        return tfds.core.DatasetInfo(
            builder=self, features=tfds.features.Translation(languages=("de", "en"))
        )

    def _split_generators(self, dl_manager):
        return {"train": self._generate_examples()}

    def _generate_examples(self):
        for i, word in enumerate(["eins", "zwei", "drei"]):
            yield i, {"de": word, "en": f"number {i + 1}"}


def test_the_prepare_command_writes_array_record_without_tensorflow(tmp_path):
    assert tfds_source.main(["tiny_parallel_corpus", "--data_dir", str(tmp_path)]) == 0
    assert list(tmp_path.glob("tiny_parallel_corpus/1.0.0/*.array_record-*"))
    data = tfds_source.open_dataset("tfds:tiny_parallel_corpus", tmp_path)
    pairs = sorted(data.read("train", ("en", "de")))
    assert pairs == [("number 1", "eins"), ("number 2", "zwei"), ("number 3", "drei")]
    # No validation split: the last 1% of train, at least one example, is held out for it.
    assert (data.splits().train, data.splits().validation) == ("train[:2]", "train[2:]")


class NeedsAModule(TinyParallelCorpus):
    """A builder whose preparation imports what is not installed (as lm1b's needs
    TensorFlow's file functions)."""

    def _split_generators(self, dl_manager):
        import a_module_nobody_installed  # noqa: F401

        return super()._split_generators(dl_manager)


def test_a_builder_that_needs_a_missing_module_says_which(tmp_path, capsys):
    assert tfds_source.main(["needs_a_module", "--data_dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "needs the Python module 'a_module_nobody_installed'" in err
