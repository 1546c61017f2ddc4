"""Language models on the user's text: word, char and byte levels, the vocabulary from the
training counts, a file split by byte counts, exact resume, changed files refused, and
generation from a text run."""

from __future__ import annotations

import math
import shutil

import numpy as np
import pytest

from train import lm
from train.core import cli
from train.core.metrics import read_metrics
from train.data.text_files import DataError
from train.lm import cli as lm_cli
from train.lm.generate import generate_text
from train.lm.text import EOS, UNK, TextVocab


def write_text(path, n_lines, seed):
    """Lines of a made-up language with a Zipf-like word distribution (the rare words make
    min_count and max_vocab matter)."""
    rng = np.random.default_rng(seed)
    words = [f"t{i}" for i in range(60)]
    p = 1.0 / np.arange(1, 61)
    lines = [
        " ".join(rng.choice(words, rng.integers(4, 12), p=p / p.sum())) for _ in range(n_lines)
    ]
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return str(path)


@pytest.fixture(scope="module")
def texts(tmp_path_factory):
    root = tmp_path_factory.mktemp("text")
    return {
        "train": write_text(root / "train.txt", 600, 0),
        "valid": write_text(root / "valid.txt", 60, 1),
        "test": write_text(root / "test.txt", 60, 2),
    }


def text_config(texts, **overrides):
    fields = {
        **dict(
            steps=6,
            decay_steps=6,
            log_every=3,
            checkpoint_every=3,
            eval_tokens=400,
            plots=False,
            progress=False,
            train_text=texts["train"],
            valid_text=texts["valid"],
            test_text=texts["test"],
        ),
        **overrides,
    }
    return lm.config_for_data("ptb", "tiny", **fields)


# ----------------------------------------------------------------------------- vocabulary
def test_the_vocabulary_follows_the_training_counts():
    lines = ["a a a b b c", "a b d"]
    vocab = TextVocab.build(lines, "word")
    assert vocab.symbols == (EOS, UNK, "a", "b", "c", "d")  # count, then code point order
    assert TextVocab.build(lines, "word", min_count=2).symbols == (EOS, UNK, "a", "b")
    assert TextVocab.build(lines, "word", max_vocab=3).symbols == (EOS, UNK, "a")
    rare = TextVocab.build(lines, "word", min_count=2)
    assert rare.encode_lines(["a c z"]).tolist() == [2, 1, 1, 0]  # unknown words -> <unk>
    chars = TextVocab.build(["ab a"], "char")
    assert chars.symbols == (EOS, UNK, "a", " ", "b")  # spaces are characters
    assert chars.decode(chars.encode_lines(["ab a", "b"])) == "ab a\nb\n"
    with pytest.raises(DataError, match="min_count 9"):
        TextVocab.build(lines, "word", min_count=9)


def test_the_model_takes_its_vocabulary_size_from_the_data(texts):
    config = text_config(texts)
    expected = TextVocab.build(open(texts["train"]).read().splitlines(), "word")
    assert config.dataset == "text" and config.model_config.vocab_size == expected.vocab_size
    assert text_config(texts, max_vocab=20).model_config.vocab_size == 20
    assert text_config(texts, level="byte").model_config.vocab_size == 256


def test_making_a_config_reads_no_data_its_source_counts_the_vocabulary(texts, tmp_path):
    """`lm.make_config` is pure: a text run's vocabulary size is given (the files need not
    exist yet); `lm.config_for_data` has the data's source count it first (what the command
    line does), and the two agree."""
    missing = str(tmp_path / "nowhere.txt")
    config = lm.make_config("text", "tiny", train_text=missing, valid_text=missing, vocab_size=7)
    assert config.model_config.vocab_size == 7 and config.train_text == missing
    with pytest.raises(ValueError, match="vocab_size: a text run's vocabulary is counted"):
        lm.make_config("text", "tiny", train_text=missing, valid_text=missing)
    with pytest.raises(ValueError, match=r"vocab_size: fixed by the dataset \(10000\)"):
        lm.make_config("ptb", "tiny", vocab_size=7)
    byte = lm.make_config("text", "tiny", train_text=missing, valid_text=missing, level="byte")
    assert byte.model_config.vocab_size == 256  # the byte level's, fixed
    counted = lm.config_for_data(
        "text", "tiny", train_text=texts["train"], valid_text=texts["valid"]
    )
    given = lm.make_config(
        "text",
        "tiny",
        train_text=texts["train"],
        valid_text=texts["valid"],
        vocab_size=counted.model_config.vocab_size,
    )
    assert counted == given
    with pytest.raises(ValueError, match="train_text: dataset 'text' needs the training file"):
        lm.config_for_data("text", "tiny")
    with pytest.raises(DataError, match="no such file"):
        lm.config_for_data("text", "tiny", train_text=missing, valid_text=missing)


@pytest.mark.parametrize(
    "argv, field",
    [
        (["--level", "syllable"], "level"),
        (["--split_bytes", "10,10,10"], "split_bytes"),
        (["--train_text", "/nonexistent/train.txt"], "/nonexistent/train.txt: no such file"),
        (["--valid_text", "none"], "valid_text"),
    ],
)
def test_bad_text_options_are_usage_errors(texts, argv, field, tmp_path, capsys):
    args = [
        "--preset",
        "tiny",
        "--workdir",
        str(tmp_path / "run"),
        "--train_text",
        texts["train"],
        "--valid_text",
        texts["valid"],
        *argv,
    ]
    with pytest.raises(SystemExit) as e:
        lm_cli.main(args)
    assert e.value.code == cli.EXIT_USAGE
    assert field in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


# ----------------------------------------------------------------------------- training
@pytest.fixture(scope="module")
def straight(texts, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("straight") / "run"
    final = lm.train_and_evaluate(text_config(texts), str(workdir))
    return workdir, final


def train_lines(workdir):
    return [(r["step"], r["loss"]) for r in read_metrics(str(workdir)) if r["split"] == "train"]


@pytest.mark.slow
def test_a_word_level_run_on_text_trains_and_resumes_exactly(straight, texts, tmp_path):
    workdir, final = straight
    assert final["step"] == 6 and math.isfinite(final["test_ppl"])
    assert final["test_ppl"] < text_config(texts).model_config.vocab_size  # learnt something
    resumed = tmp_path / "run"
    lm.train_and_evaluate(text_config(texts, steps=3), str(resumed))
    again = lm.train_and_evaluate(text_config(texts), str(resumed))
    assert train_lines(resumed) == train_lines(workdir)
    assert again["test_ppl"] == final["test_ppl"]


@pytest.mark.slow
def test_changed_training_text_on_resume_is_refused(straight, texts, tmp_path, capsys):
    workdir = tmp_path / "run"
    shutil.copytree(straight[0], workdir)
    train = texts["train"]
    shutil.move(train, train + ".orig")
    try:
        with open(train + ".orig") as f, open(train, "w") as g:
            g.write(f.read().replace("t1 ", "t2 ", 1))
        code = lm_cli.main(["--workdir", str(workdir), "--steps", "9"])
    finally:
        shutil.move(train + ".orig", train)
    err = capsys.readouterr().err
    assert code == cli.EXIT_USAGE, err
    assert "train_text" in err and "not the files this run started with" in err


@pytest.mark.slow
def test_generation_from_a_text_run_uses_its_vocabulary(straight, texts):
    text = generate_text(str(straight[0]), "t0 t1 zzz", num_tokens=12, seed=0)
    vocab = TextVocab.build(open(texts["train"]).read().splitlines(), "word")
    words = text.split()
    assert set(words) <= set(vocab.symbols)
    assert len(words) + text.count("\n") == 12  # each <eos> a line break


@pytest.mark.slow
def test_a_byte_level_run_splits_one_file_and_reports_bpc(texts, tmp_path):
    size = len(open(texts["train"], "rb").read())
    config = text_config(
        texts,
        level="byte",
        valid_text=None,
        test_text=None,
        split_bytes=(size - 2000, 1000, 1000),
        eval_tokens=0,
    )
    final = lm.train_and_evaluate(config, str(tmp_path / "run"))
    assert final["test_bpc"] == pytest.approx(final["test_nll"] / math.log(2.0))
    assert math.isfinite(final["test_bpc"]) and final["test_bpc"] < 8.0  # below a uniform byte
    tests = [r for r in read_metrics(str(tmp_path / "run")) if r["split"] == "test"]
    # 1,000 test bytes, in segments of eval_tgt_len rows of eval_batch_size: every whole one.
    assert 0 < tests[0]["n_tokens"] <= 1000


def test_each_kind_of_data_owns_its_rules_through_one_table(monkeypatch):
    """Both tasks: one table from a kind of data to its source class, and a config checks a
    kind's fields by asking that class (patched, the config follows it)."""
    from train import translate
    from train.lm import sources as lm_sources
    from train.translate import sources as translate_sources

    assert set(translate_sources.SOURCES) == {"multi30k", "tfds", "files"}
    assert set(lm_sources.SOURCES) == {"ptb", "text", "tfds"}
    assert (
        lm_sources.source_kind("tfds:lm1b") == "tfds"
        and lm_sources.source_kind("ptb_char") == "ptb"
    )
    config = translate.make_config("transformer", "tiny")
    assert config.source_class() is translate_sources.Multi30kSource
    assert (config.src_lang, config.tgt_lang) == ("de", "en")  # Multi30k's own defaults
    assert lm.make_config("ptb", "tiny").source_class() is lm_sources.PtbSource

    def refuse(config):
        raise ValueError(f"refused by {type(config).__name__}'s source")

    monkeypatch.setattr(translate_sources.Multi30kSource, "check_fields", staticmethod(refuse))
    monkeypatch.setattr(lm_sources.PtbSource, "check_fields", staticmethod(refuse))
    with pytest.raises(ValueError, match="refused by TranslateConfig's source"):
        translate.make_config("transformer", "tiny")
    with pytest.raises(ValueError, match="refused by LMConfig's source"):
        lm.make_config("ptb", "tiny")
