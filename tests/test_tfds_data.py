"""Training on any prepared TFDS dataset (`--dataset tfds:NAME[/CONFIG]`): translation on
`wmt14_translate/de-en`, language models on `lm1b` (word and byte level), exact resume, and
every bad dataset refused with exit code 2 before training.

The datasets are real prepared TFDS datasets, written offline by TFDS's own builders for those
names with their download replaced by a few made-up examples (`prepare_offline`): the same
array_record files and dataset_info.json a download would leave, read back through the
unpatched `as_data_source` path, also by the CLI. `tfds.testing.mock_data` cannot serve this
(TFDS 4.9.10): its data source mock sets `__getitems__` as an unbound attribute, so batched
reads fail with a TypeError; without metadata files it replaces the split dict with a
MagicMock that holds no split names; and its text is random letters, the same in every split.
"""

from __future__ import annotations

import json
import shutil
import sys

import numpy as np
import pytest
import tensorflow_datasets as tfds
from etils import epath
from helpers import tiny_lm_config, train_losses
from tensorflow_datasets.datasets.lm1b import lm1b_dataset_builder
from tensorflow_datasets.translate import wmt14, wmt_t2t

from train import lm
from train.core import cli
from train.core.metrics import read_metrics
from train.data import tfds_source
from train.lm import cli as lm_cli
from train.lm.task import load_stream, load_vocab
from train.lm.text import TextVocab
from train.translate import cli as translate_cli

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
    assert translate_cli.main(["--workdir", str(resumed), "--steps", "6"]) == 0
    assert train_losses(resumed) == train_losses(straight)


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
