"""Translation on the user's own parallel files: reading them (plain and gzipped, every bad
input refused with a message naming the file and line), training and evaluating on them with
several test sets, outputs named by the run's languages (or src and tgt), a refused start that
leaves the work directory as it was, exact resume, and files that changed behind a resumed
run."""

from __future__ import annotations

import gzip
import json
import os
import re
import shutil

import pytest
import sacrebleu
from helpers import made_up_corpus, tree_of, write_lines

from train import translate
from train.core import cli
from train.core.checkpoint import Checkpoints
from train.core.inference import saved_config
from train.core.metrics import read_metrics
from train.data.text_files import DataError, read_parallel, set_name
from train.data.tokenizers import SentencePieceTokenizer
from train.translate import cli as translate_cli
from train.translate import sources
from train.translate.sources import multi30k_pairs


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("files")
    out = {}
    for name, n, seed, gz in (
        ("train", 400, 0, False),
        ("valid", 40, 1, False),
        ("news", 24, 2, True),
        ("talks", 16, 3, False),
    ):
        src, tgt = made_up_corpus(n, seed)
        ext = ".gz" if gz else ""
        out[name] = (
            write_lines(root / f"{name}.xx{ext}", src, gz=gz),
            write_lines(root / f"{name}.yy{ext}", tgt, gz=gz),
        )
    return out


def file_config(files, tmp_path, **overrides):
    fields = dict(
        vocab_size=300,
        steps=6,
        log_every=3,
        checkpoint_every=3,
        src_lang="xx",
        tgt_lang="yy",
        train_src=files["train"][0],
        train_tgt=files["train"][1],
        valid_src=files["valid"][0],
        valid_tgt=files["valid"][1],
        test_src=(files["news"][0], files["talks"][0]),
        test_tgt=(files["news"][1], files["talks"][1]),
        eval_sentences=0,
        plots=False,
        progress=False,
    )
    return translate.make_config("transformer", "tiny", **{**fields, **overrides})


# ----------------------------------------------------------------------------- reading
def test_parallel_files_plain_and_gzipped_read_the_same(tmp_path):
    src, tgt = made_up_corpus(10, 0)
    plain = read_parallel(write_lines(tmp_path / "a.de", src), write_lines(tmp_path / "a.en", tgt))
    zipped = read_parallel(
        write_lines(tmp_path / "b.de.gz", src, gz=True),
        write_lines(tmp_path / "b.en.gz", tgt, gz=True),
    )
    assert plain == zipped == (list(zip(src, tgt)), 0)
    assert set_name("/x/newstest2014.de.gz") == "newstest2014"


def test_bad_parallel_files_are_refused_naming_file_and_line(tmp_path):
    good_src, good_tgt = made_up_corpus(5, 0)
    src = write_lines(tmp_path / "s.de", good_src)
    with pytest.raises(DataError, match=r"t\.en has 4 lines|s\.de has 5 lines, .*t\.en has 4"):
        read_parallel(src, write_lines(tmp_path / "t.en", good_tgt[:4]))
    with pytest.raises(DataError, match="no such file"):
        read_parallel(src, str(tmp_path / "missing.en"))
    with pytest.raises(DataError, match="empty.en: the file is empty"):
        read_parallel(src, write_lines(tmp_path / "empty.en", []))
    (tmp_path / "latin1.en").write_bytes(
        "\n".join(good_tgt[:2]).encode()
        + "\nna\xefve\n".encode("latin-1")
        + "\n".join(good_tgt[3:]).encode()
        + b"\n"
    )
    with pytest.raises(DataError, match=r"latin1\.en, line 3: not UTF-8"):
        read_parallel(src, str(tmp_path / "latin1.en"))
    holes = good_tgt[:1] + [""] + good_tgt[2:]
    with pytest.raises(DataError, match=r"holes\.en, line 2: empty"):
        read_parallel(src, write_lines(tmp_path / "holes.en", holes))
    pairs, skipped = read_parallel(src, str(tmp_path / "holes.en"), skip_empty=True)
    assert skipped == 1 and len(pairs) == 4 and good_src[1] not in [s for s, _ in pairs]


@pytest.mark.parametrize(
    "overrides, field",
    [
        (dict(train_src="a.de"), "train_src, train_tgt"),
        (dict(train_src="a.de", train_tgt="a.en"), "valid_src, valid_tgt"),
        (dict(test_src=("t.de",), test_tgt=()), "test_src, test_tgt"),
        (dict(src_lang="fr"), "src_lang, tgt_lang"),
    ],
)
def test_inconsistent_file_options_name_the_fields(overrides, field):
    with pytest.raises(ValueError, match=field):
        translate.make_config("transformer", "tiny", **overrides)


def test_multi30k_runs_in_either_direction(data_dir):
    config = translate.make_config(
        "transformer", "tiny", src_lang="en", tgt_lang="de", data_dir=str(data_dir)
    )
    de_en = translate.make_config("transformer", "tiny", data_dir=str(data_dir))
    forward, backward = multi30k_pairs(de_en, "validation"), multi30k_pairs(config, "validation")
    assert backward == [(en, de) for de, en in forward]


def test_multi30k_training_pairs_are_encoded_once_per_direction_and_model(
    data_dir, tokenizer_dir, tmp_path, monkeypatch
):
    """Runs in one process (a notebook, a test session) encode Multi30k's train split once for
    the same direction and tokenizer model, wherever its file lies; a caller's change to its
    list is its own; the other direction, or another model, is encoded again."""
    calls, encode = [], sources.encode_pairs
    monkeypatch.setattr(
        sources, "encode_pairs", lambda t, pairs: calls.append(pairs[0]) or encode(t, pairs)
    )
    sources._encoded_corpus.cache_clear()
    de_en = translate.make_config("transformer", "tiny", data_dir=str(data_dir))
    en_de = translate.replace(de_en, src_lang="en", tgt_lang="de")
    source = sources.translation_source(de_en)
    (model,) = tokenizer_dir.glob("*.model")
    copied = tmp_path / "elsewhere.model"
    shutil.copy(model, copied)
    first = source.training_pairs(SentencePieceTokenizer(model), "unused", print)
    first.append(([5], [6]))
    again = source.training_pairs(SentencePieceTokenizer(copied), "unused", print)
    assert again == first[:-1] and len(calls) == 1
    assert again == encode(SentencePieceTokenizer(model), multi30k_pairs(de_en, "train"))
    backward = sources.translation_source(en_de).training_pairs(
        SentencePieceTokenizer(model), "unused", print
    )
    assert len(calls) == 2 and calls[1] == calls[0][::-1]
    assert backward[0] == encode(SentencePieceTokenizer(model), [calls[1]])[0]
    # Another model: its own ids.
    sentences = [s for pair in multi30k_pairs(de_en, "validation") for s in pair]
    other = SentencePieceTokenizer.train_or_load(sentences, tmp_path, vocab_size=600)
    assert source.training_pairs(other, "unused", print) == encode(
        other, multi30k_pairs(de_en, "train")
    )
    assert len(calls) == 3


# ----------------------------------------------------------------------------- training
@pytest.fixture(scope="module")
def straight(files, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("straight") / "run"
    final = translate.train_and_evaluate(file_config(files, workdir), str(workdir))
    return workdir, final


@pytest.mark.slow
def test_a_run_on_files_scores_each_test_set_under_its_name(straight, files):
    workdir, final = straight
    assert final["step"] == 6 and final["reason"] == "steps"
    for name, (_, tgt) in (("news", files["news"]), ("talks", files["talks"])):
        hypotheses = workdir / "translations" / f"{name}.step6.yy"
        with gzip.open(tgt, "rt") if tgt.endswith(".gz") else open(tgt) as f:
            references = f.read().splitlines()
        lines = hypotheses.read_text().splitlines()
        assert len(lines) == len(references)
        assert (
            workdir / "translations" / f"{name}.reference.yy"
        ).read_text().splitlines() == references
        # The scores are sacreBLEU's of those files, recomputed here.
        assert final[f"test_{name}_bleu"] == pytest.approx(translate.bleu(lines, references))
        assert final[f"test_{name}_chrf"] == pytest.approx(
            sacrebleu.corpus_chrf(lines, [references]).score
        )
    splits = {r["split"] for r in read_metrics(str(workdir))}
    assert {"train", "validation", "news", "talks"} <= splits
    assert final["test_bleu"] == final["test_news_bleu"]  # the first set is the run's test


@pytest.mark.slow
def test_a_run_on_files_without_languages_names_its_outputs_src_and_tgt(files, tmp_path):
    """Nothing says what language made-up files are: their outputs are not named de and en.
    Multi30k's stay named by its languages."""
    talks_src, talks_tgt = files["talks"]
    config = file_config(
        files,
        tmp_path,
        steps=1,
        src_lang=None,
        tgt_lang=None,
        test_src=(talks_src,),
        test_tgt=(talks_tgt,),
    )
    workdir = tmp_path / "run"
    translate.train_and_evaluate(config, str(workdir))
    outputs = workdir / "translations"
    written = sorted(os.listdir(outputs))
    assert written == ["talks.reference.tgt", "talks.source.src", "talks.step1.tgt"]
    assert (outputs / "talks.source.src").read_text() == open(talks_src).read()
    assert (outputs / "talks.reference.tgt").read_text() == open(talks_tgt).read()
    assert translate.make_config("transformer", "tiny").output_languages() == ("de", "en")


@pytest.mark.slow
def test_a_start_refused_for_bad_files_leaves_the_workdir_as_it_found_it(files, tmp_path, capsys):
    """Parallel files of 300 and 299 lines are refused while the data is prepared, after the
    start wrote config.json and the files' sha256 (data.json). The refused start takes back
    what it wrote, and nothing of the user's, so the same command with the file fixed trains
    as a new run (it was refused: the files were not those 'this run started with'), and
    says nothing of settings changed since the refused start."""
    src, tgt = made_up_corpus(300, 0)
    train_src = write_lines(tmp_path / "a.src", src)
    train_tgt = write_lines(tmp_path / "a.tgt", tgt[:-1])
    workdir = tmp_path / "run"
    (workdir / "checkpoints").mkdir(parents=True)  # the user's own, empty: it stays
    (workdir / "notes.txt").write_text("the user's own file")
    args = [
        *("--preset", "tiny", "--workdir", str(workdir), "--vocab_size", "300"),
        *("--train_src", train_src, "--train_tgt", train_tgt),
        *("--valid_src", files["valid"][0], "--valid_tgt", files["valid"][1]),
        *("--plots", "false", "--progress", "false"),
    ]
    before = tree_of(workdir)
    code = translate_cli.main([*args, "--steps", "3"])
    err = capsys.readouterr().err
    assert code == cli.EXIT_USAGE, err
    assert f"{train_src} has 300 lines" in err and f"{train_tgt} has 299" in err
    assert tree_of(workdir) == before

    write_lines(train_tgt, tgt)
    code = translate_cli.main([*args, "--steps", "2"])
    out = capsys.readouterr()
    assert code == cli.EXIT_OK, out.err
    assert "resuming" not in out.out and "training from step 0 to 2" in out.out
    assert Checkpoints(str(workdir)).all_steps() == [2]
    assert (workdir / "notes.txt").read_text() == "the user's own file"


@pytest.mark.slow
def test_a_run_on_files_resumes_exactly(straight, files, tmp_path):
    workdir = tmp_path / "run"
    translate.train_and_evaluate(file_config(files, workdir, steps=3), str(workdir))
    final = translate.train_and_evaluate(file_config(files, workdir), str(workdir))

    def train_lines(w):
        return [(r["step"], r["loss"]) for r in read_metrics(str(w)) if r["split"] == "train"]

    assert train_lines(workdir) == train_lines(straight[0])
    assert final["test_news_bleu"] == straight[1]["test_news_bleu"]


@pytest.mark.slow
def test_changed_training_files_on_resume_are_refused(straight, files, tmp_path, capsys):
    workdir = tmp_path / "run"
    shutil.copytree(straight[0], workdir)
    assert json.loads((workdir / "data.json").read_text())["train_src"] == files["train"][0]
    # The same file names with other bytes: the fingerprint in W/data.json catches it.
    train_src = files["train"][0]
    os.replace(train_src, train_src + ".orig")
    try:
        with open(train_src + ".orig") as f:
            lines = f.read().splitlines()
        write_lines(train_src, lines[:-1] + ["w1 w2 w3"])
        code = translate_cli.main(["--workdir", str(workdir), "--steps", "8"])
    finally:
        os.replace(train_src + ".orig", train_src)
    err = capsys.readouterr().err
    assert code == cli.EXIT_USAGE, err
    assert "train_src, train_tgt" in err and "not the files this run started with" in err
    assert max(r["step"] for r in read_metrics(str(workdir))) == 6  # nothing trained


@pytest.mark.slow
def test_a_run_on_files_translates_with_its_own_tokenizer_when_the_files_are_gone(
    straight, files, tmp_path
):
    """Translating and exporting read the run's SentencePiece model, not the training files
    (finding it by their hash reads every byte of them, and fails once they are moved)."""
    workdir, _ = straight
    config = saved_config(translate.TASK, str(workdir))
    found = translate.trained_tokenizer(config, str(workdir)).model_path
    assert found == translate.load_tokenizer(config, str(workdir)).model_path
    with open(files["valid"][0]) as f:
        sentences = f.read().splitlines()[:4]
    before = translate.translate_text(str(workdir), sentences)
    moved = [(path, str(tmp_path / os.path.basename(path))) for path in files["train"]]
    for path, away in moved:
        os.replace(path, away)
    try:
        assert translate.translate_text(str(workdir), sentences) == before
        # Several models of the kind in the folder (a shared tokenizer_dir): which one is the
        # run's is known only from the data, as before.
        shutil.copy(found, found.with_name("files_spm_bpe300_000000000000.model"))
        with pytest.raises(DataError, match="train.xx: no such file"):
            translate.trained_tokenizer(config, str(workdir))
    finally:
        for path, away in moved:
            os.replace(away, path)
        found.with_name("files_spm_bpe300_000000000000.model").unlink(missing_ok=True)
    assert translate.trained_tokenizer(config, str(workdir)).model_path == found


@pytest.mark.slow
def test_a_vocabulary_the_files_cannot_give_is_a_usage_error(files, tmp_path, capsys):
    (src, tgt), (vsrc, vtgt) = files["train"], files["valid"]
    code = translate_cli.main(
        [
            "--preset",
            "tiny",
            "--workdir",
            str(tmp_path / "run"),
            "--train_src",
            src,
            "--train_tgt",
            tgt,
            "--valid_src",
            vsrc,
            "--valid_tgt",
            vtgt,
            "--vocab_size",
            "2000",
        ]
    )
    err = capsys.readouterr().err
    assert code == cli.EXIT_USAGE, err
    # One line naming the flag and the sizes the files can give, not SentencePiece's own words.
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --vocab_size 2000: SentencePiece can")
    assert re.search(r"between \d+ and \d+ pieces of these [\d,]+ training sentences", lines[0])
