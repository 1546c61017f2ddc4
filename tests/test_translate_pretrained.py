"""`python -m train.translate --pretrained DIR`: a Marian folder (built here from random weights
with transformers, as in test_marian) translates sentences and files in input order with the
project's length-sorted batches, equal to decoding each sentence alone, and scores a shipped
Multi30k split with sacreBLEU."""
from __future__ import annotations

import json
import math

import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("transformers")
pytest.importorskip("torch")

from helpers import SOURCE_TEXT, save_marian, save_tokenizer  # noqa: E402

from train.translate import cli  # noqa: E402
from train.translate.pretrained import Pretrained, evaluate_pretrained  # noqa: E402
from transformer_jax import greedy_decode, load_marian  # noqa: E402


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("opus")
    save_tokenizer(path)
    save_marian(path, vocab_size=len(json.loads((path / "vocab.json").read_text())))
    return path


def test_batched_translation_equals_one_sentence_at_a_time(folder):
    sentences = list(SOURCE_TEXT[:5])
    pretrained = Pretrained(str(folder), greedy=True, batch_size=2)
    batched = pretrained.translate(sentences)
    settings = pretrained.settings
    model, params, tokenizer = load_marian(folder)
    for sentence, got in zip(sentences, batched):
        src = jnp.asarray(tokenizer.encode([sentence], max_len=settings.buckets[-1]))
        bucket = min(b for b in settings.buckets if b >= src.shape[1])
        alone = np.asarray(greedy_decode(model, params, src,
                                         max_len=bucket + settings.decode_margin))
        assert got == tokenizer.decode(alone[0])


def test_the_command_line_translates_a_file_and_scores_multi30k(folder, tmp_path, capsys):
    source = tmp_path / "de.txt"
    source.write_text("\n".join(SOURCE_TEXT[:3]) + "\n", encoding="utf-8")
    out = tmp_path / "en.txt"
    assert cli.main(["--pretrained", str(folder), "--translate_file", str(source),
                     "--output", str(out), "--beam_size", "2"]) == 0
    assert len(out.read_text(encoding="utf-8").splitlines()) == 3
    assert cli.main(["--pretrained", str(folder), "--translate", SOURCE_TEXT[0]]) == 0
    assert len(capsys.readouterr().out.strip().splitlines()) == 1

    data_dir = tmp_path / "tfds"
    result = evaluate_pretrained(str(folder), data_dir=str(data_dir), sentences=6,
                                 beam_size=1)
    assert result["sentences"] == 6 and len(result["hypotheses"]) == 6
    assert math.isfinite(result["bleu"]) and 0.0 <= result["bleu"] <= 100.0
    assert cli.main(["--pretrained", str(folder), "--eval", "--eval_sentences", "6",
                     "--data_dir", str(data_dir)]) == 0
    assert "test_2016_flickr: BLEU" in capsys.readouterr().out


def test_a_folder_without_tokenizer_cannot_translate(tmp_path):
    save_marian(tmp_path)
    with pytest.raises(FileNotFoundError, match="no tokenizer"):
        Pretrained(str(tmp_path))
