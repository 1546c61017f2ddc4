"""`python -m train.translate --pretrained DIR`: a Marian folder (built here from random weights
with transformers, as in test_marian) translates sentences and files in input order with the
project's length-sorted batches, equal to decoding each sentence alone, and scores a shipped
Multi30k split with sacreBLEU."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
import sacrebleu

pytest.importorskip("transformers")
pytest.importorskip("torch")

from helpers import SOURCE_TEXT, record_searches, save_marian, save_tokenizer  # noqa: E402

from train.data.datasets import load_multi30k  # noqa: E402
from train.translate import cli  # noqa: E402
from train.translate.pretrained import Pretrained, evaluate_pretrained  # noqa: E402
from transformer_jax import beam_search, greedy_decode, load_marian  # noqa: E402
from transformer_jax.interchange.marian import marian_generation_defaults  # noqa: E402


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("opus")
    save_tokenizer(path)
    save_marian(path, vocab_size=len(json.loads((path / "vocab.json").read_text())))
    return path


def test_batched_translation_equals_one_sentence_at_a_time(folder):
    sentences = list(SOURCE_TEXT[:5])
    pretrained = Pretrained(str(folder), greedy=True, eval_batch_size=2)
    progress = []
    batched = pretrained.translate(sentences, progress=progress.append)
    assert sum(progress) == 5 and all(progress)  # each batch reported as it ends
    settings = pretrained.settings
    model, params, tokenizer = load_marian(folder)
    for sentence, got in zip(sentences, batched):
        src = jnp.asarray(tokenizer.encode([sentence], max_len=settings.buckets[-1]))
        bucket = min(b for b in settings.buckets if b >= src.shape[1])
        alone = np.asarray(
            greedy_decode(model, params, src, max_len=bucket + settings.decode_margin)
        )
        assert got == tokenizer.decode(alone[0])


@pytest.mark.slow
def test_the_command_line_translates_a_file_and_scores_multi30k(folder, tmp_path, capsys):
    source = tmp_path / "de.txt"
    source.write_text("\n".join(SOURCE_TEXT[:3]) + "\n", encoding="utf-8")
    out = tmp_path / "en.txt"
    assert (
        cli.main(
            [
                "--pretrained",
                str(folder),
                "--translate_file",
                str(source),
                "--output",
                str(out),
                "--beam_size",
                "2",
            ]
        )
        == 0
    )
    written = out.read_text(encoding="utf-8").splitlines()
    # The same sentences given on the command line: the same lines.
    capsys.readouterr()
    assert (
        cli.main(["--pretrained", str(folder), "--beam_size", "2", "--translate", *SOURCE_TEXT[:3]])
        == 0
    )
    assert capsys.readouterr().out.splitlines() == written
    # ... and the library's beam search of each sentence alone.
    settings = Pretrained(str(folder), beam_size=2).settings
    model, params, tokenizer = load_marian(folder)
    assert len(written) == 3
    for sentence, got in zip(SOURCE_TEXT[:3], written):
        src = jnp.asarray(tokenizer.encode([sentence], max_len=settings.buckets[-1]))
        bucket = min(b for b in settings.buckets if b >= src.shape[1])
        src = jnp.pad(
            src, ((0, 0), (0, bucket - src.shape[1])), constant_values=model.config.pad_id
        )
        tokens, _ = beam_search(
            model,
            params,
            src,
            beam_size=2,
            max_len=bucket + settings.decode_margin,
            length_penalty=settings.length_penalty,
        )
        assert got == tokenizer.decode(np.asarray(tokens)[0, 0])

    data_dir = tmp_path / "tfds"
    result = evaluate_pretrained(str(folder), data_dir=str(data_dir), sentences=6, beam_size=1)
    assert result["sentences"] == 6 and len(result["hypotheses"]) == 6
    # sacreBLEU of those hypotheses against the shipped Multi30k references.
    references = [en for _, en in load_multi30k("test_2016_flickr", data_dir=str(data_dir))[:6]]
    assert result["bleu"] == pytest.approx(
        sacrebleu.corpus_bleu(result["hypotheses"], [references]).score, abs=1e-9
    )
    assert (
        cli.main(
            [
                "--pretrained",
                str(folder),
                "--eval",
                "--eval_sentences",
                "6",
                "--data_dir",
                str(data_dir),
            ]
        )
        == 0
    )
    assert "test_2016_flickr: BLEU" in capsys.readouterr().out


def test_decoding_flags_reach_the_search_from_a_folder(folder, monkeypatch, capsys):
    """Each decoding flag of --translate reaches the search; without them the folder's
    generation defaults apply (issue 48)."""
    calls = record_searches(monkeypatch)
    shipped = marian_generation_defaults(folder)
    margin = Pretrained(str(folder)).settings.decode_margin

    def searched(*flags) -> dict:
        calls.clear()
        assert cli.main(["--pretrained", str(folder), "--translate", "Hallo.", *flags]) == 0
        (call,) = calls  # one sentence, one batch
        return call

    call = searched()
    assert (call["search"], call["beam_size"], call["length_penalty"]) == (
        "beam",
        shipped.beam_size,
        0.6,
    )
    assert call["max_len"] == call["src_len"] + margin and call["rows"] == 64
    call = searched("--beam_size", "3", "--length_penalty", "2.0", "--eval_batch_size", "8")
    assert (call["beam_size"], call["length_penalty"], call["rows"]) == (3, 2.0, 8)
    call = searched("--greedy", "--max_output_len", "5")
    assert (call["search"], call["max_len"]) == ("greedy", 5)
    call = searched("--decode_margin", "3")
    assert call["max_len"] == call["src_len"] + 3 != call["src_len"] + margin
    # --eval hands the same flags to the folder's evaluation.
    asked = []

    def evaluate(folder, **kwargs):
        asked.append(kwargs)
        return dict(split="test", bleu=0.0, sentences=0, seconds=0.0, hypotheses=[])

    monkeypatch.setattr(cli, "evaluate_pretrained", evaluate)
    flags = ["--greedy", "--max_output_len", "5", "--eval_batch_size", "8"]
    assert cli.main(["--pretrained", str(folder), "--eval", *flags]) == 0
    assert asked[0]["greedy"] and asked[0]["max_output_len"] == 5
    assert asked[0]["eval_batch_size"] == 8
    capsys.readouterr()


def test_a_folder_without_tokenizer_cannot_translate(tmp_path):
    save_marian(tmp_path)
    with pytest.raises(FileNotFoundError, match="no tokenizer"):
        Pretrained(str(tmp_path))


def test_translate_file_is_checked_as_training_files_and_keeps_blank_lines(
    folder, tmp_path, capsys
):
    source = tmp_path / "de.txt"
    source.write_text(f"{SOURCE_TEXT[0]}\n\n   \n{SOURCE_TEXT[1]}\n", encoding="utf-8")
    out = tmp_path / "en.txt"
    argv = ["--pretrained", str(folder), "--greedy", "--translate_file", str(source)]
    assert cli.main([*argv, "--output", str(out)]) == 0
    written = out.read_text(encoding="utf-8").split("\n")
    assert written[1:3] == ["", ""]  # blank lines translated as blank lines
    assert written[0] and written[3]
    capsys.readouterr()
    assert cli.main(["--pretrained", str(folder), "--greedy", "--translate", SOURCE_TEXT[1]]) == 0
    assert capsys.readouterr().out.strip() == written[3]
    # A missing file and bytes that are not UTF-8: a usage error naming the file (and line).
    for path, says in [
        (tmp_path / "missing.txt", "missing.txt: no such file"),
        (tmp_path / "latin1.txt", "latin1.txt, line 2: not UTF-8"),
    ]:
        if path.name == "latin1.txt":
            path.write_bytes(b"ein Haus\nein \xfcberaus gutes Haus\n")
        code = cli.main(["--pretrained", str(folder), "--translate_file", str(path)])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and says in err[0], err
