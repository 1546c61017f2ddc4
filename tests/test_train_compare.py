"""train.compare on two tiny models (GRU, Transformer) and real Multi30k: the table has one
row per model with the right columns and finite numbers, compare.json says what the table
says, the numbers are the ones the runs logged (metrics.jsonl, sacreBLEU of the written
translations), the validation curve and its plot exist, and a second run reuses the rows.
"""

from __future__ import annotations

import json
import math
import os

import chex
import numpy as np
import pytest
import sacrebleu

from train.data.datasets import load_multi30k
from train.translate import compare

# Every test here trains runs (several processes, or every model).
pytestmark = pytest.mark.slow

MODELS = ["gru", "transformer"]
STEPS, EVAL_EVERY, SENTENCES = 4, 2, 16
# Written out here, not taken from compare.py, so a renamed or dropped column fails.
HEADER = [
    "model",
    "parameters",
    "train min",
    "steps",
    "val ppl",
    "test ppl",
    "test BLEU greedy",
    "test BLEU beam 4",
]


def run_fields(data_dir):
    return dict(
        steps=STEPS,
        eval_every=EVAL_EVERY,
        log_every=1,
        eval_sentences=SENTENCES,
        eval_batch_size=16,
        progress=False,
        plots=False,
        data_dir=str(data_dir),
    )


@pytest.fixture(scope="module")
def compared(tmp_path_factory, data_dir):
    """(workdir, returned summary, run fields) of one tiny comparison."""
    workdir = tmp_path_factory.mktemp("compare")
    fields = run_fields(data_dir)
    summary = compare.compare(str(workdir), models=MODELS, preset="tiny", overrides=fields)
    return workdir, summary, fields


def table_rows(path):
    """The markdown table of `path` as lists of cells: header, then the data rows."""
    with open(path, encoding="utf-8") as f:
        lines = [line.strip() for line in f if line.startswith("|")]
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines]
    assert all(set(c) <= set("-: ") for c in cells[1]), "the second line separates the header"
    return cells[0], cells[2:]


def metrics_lines(model_dir):
    with open(os.path.join(model_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def read_lines(path):
    with open(path, encoding="utf-8") as f:
        return f.read().splitlines()


def test_the_table_has_one_row_per_model_with_finite_numbers(compared):
    workdir, _, _ = compared
    header, rows = table_rows(workdir / "compare.md")
    assert header == HEADER
    assert [r[0] for r in rows] == MODELS
    for row in rows:
        assert len(row) == len(HEADER)
        numbers = [float(c.replace(",", "")) for c in row[1:]]
        assert all(math.isfinite(x) for x in numbers), row
        assert int(row[1].replace(",", "")) > 1000 and int(row[3]) == STEPS
        assert numbers[3] > 1.0 and numbers[4] > 1.0  # perplexities
        assert 0.0 <= numbers[5] <= 100.0 and 0.0 <= numbers[6] <= 100.0  # BLEU


def test_the_json_matches_the_table(compared):
    workdir, summary, _ = compared
    with open(workdir / "compare.json") as f:
        saved = json.load(f)
    assert saved == json.loads(json.dumps(summary))
    assert saved["beam_size"] == 4 and saved["preset"] == "tiny"
    _, rows = table_rows(workdir / "compare.md")
    assert [r["model"] for r in saved["rows"]] == [r[0] for r in rows]
    for cells, row in zip(rows, saved["rows"]):
        assert int(cells[1].replace(",", "")) == row["params"]
        assert abs(float(cells[2]) - row["train_seconds"] / 60) <= 0.05 + 1e-9
        assert int(cells[3]) == row["steps"]
        got = np.array([float(c) for c in cells[4:]])
        want = np.array([row["val_ppl"], row["test_ppl"], row["bleu_greedy"], row["bleu_beam"]])
        chex.assert_trees_all_close(got, want, atol=0.005 + 1e-9, rtol=0)


def test_the_numbers_are_the_ones_the_runs_logged(compared):
    workdir, summary, fields = compared
    for row in summary["rows"]:
        model_dir = workdir / row["model"]
        records = metrics_lines(model_dir)
        val = [r for r in records if r["split"] == "validation"]
        test = [r for r in records if r["split"] == "test_2016_flickr"]
        train = [r for r in records if r["split"] == "train"]
        assert val[-1]["step"] == test[-1]["step"] == STEPS
        chex.assert_trees_all_close(
            np.array([row["val_nll"], row["val_ppl"], row["test_ppl"], row["bleu_beam"]]),
            np.array([val[-1]["nll"], math.exp(val[-1]["nll"]), test[-1]["ppl"], test[-1]["bleu"]]),
            rtol=1e-9,
        )
        # Training time runs on past the last training line (the final evaluation and save)
        # and is part of the whole run's time: an order of events, not a speed.
        assert train[-1]["elapsed"] <= row["train_seconds"] <= test[-1]["total_seconds"]
        assert row["test_sentences"] == SENTENCES
        # sacreBLEU recomputed from the translations each decoder wrote, against the shipped
        # references (the Multi30k test split), which the run also wrote beside them.
        directory = model_dir / "translations"
        references = [
            en
            for _, en in load_multi30k("test_2016_flickr", data_dir=fields["data_dir"])[:SENTENCES]
        ]
        assert read_lines(directory / "test_2016_flickr.reference.en") == references
        for key, name in (
            ("bleu_beam", f"test_2016_flickr.step{STEPS}.en"),
            ("bleu_greedy", f"test_2016_flickr.step{STEPS}.greedy.en"),
        ):
            hypotheses = read_lines(directory / name)
            assert len(hypotheses) == len(references) == SENTENCES
            expected = sacrebleu.corpus_bleu(hypotheses, [references]).score
            assert row[key] == pytest.approx(expected, abs=1e-9)


def test_the_validation_curve_and_its_plot(compared):
    workdir, summary, _ = compared
    for row in summary["rows"]:
        curve = summary["curves"][row["model"]]
        records = metrics_lines(workdir / row["model"])
        assert curve["steps"] == list(range(EVAL_EVERY, STEPS + 1, EVAL_EVERY))
        elapsed = {r["step"]: r["elapsed"] for r in records if r["split"] == "train"}
        assert curve["seconds"] == [elapsed[s] for s in curve["steps"]]
        assert curve["seconds"] == sorted(curve["seconds"]) and curve["seconds"][0] >= 0
        assert curve["val_nll"] == [r["nll"] for r in records if r["split"] == "validation"]
    with open(workdir / "plots" / "compare_val_loss.png", "rb") as f:
        png = f.read()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000


def test_a_second_run_reuses_the_rows_through_the_cli(compared):
    workdir, summary, fields = compared
    before = {m: metrics_lines(workdir / m) for m in MODELS}
    os.remove(workdir / "compare.md")
    argv = [
        "--workdir",
        str(workdir),
        "--preset",
        "tiny",
        "--models",
        *MODELS,
        "--steps",
        str(STEPS),
        "--eval_every",
        str(EVAL_EVERY),
    ]
    for name in ("log_every", "eval_sentences", "eval_batch_size", "data_dir", "progress"):
        argv += ["--set", f"{name}={fields[name]}"]
    assert compare.main(argv) == 0
    assert {m: metrics_lines(workdir / m) for m in MODELS} == before  # nothing retrained
    with open(workdir / "compare.json") as f:
        again = json.load(f)
    assert again["rows"] == json.loads(json.dumps(summary["rows"]))
    assert again["command"].startswith("python -m train.compare --workdir ")
    _, rows = table_rows(workdir / "compare.md")
    assert [r[0] for r in rows] == MODELS


def test_another_budget_in_the_same_workdir_is_an_error(compared):
    workdir, _, fields = compared
    before = metrics_lines(workdir / "gru")
    with pytest.raises(ValueError, match="gru run of another setting"):
        compare.compare(
            str(workdir), models=["gru"], preset="tiny", overrides={**fields, "steps": STEPS + 1}
        )
    assert metrics_lines(workdir / "gru") == before


# ------------------------------------------------------------------------ no training below
def test_val_curve_takes_the_time_of_the_last_training_line(tmp_path):
    lines = [
        {"step": 0, "split": "validation", "loss": 9.0, "nll": 9.0},  # before any time: dropped
        {"step": 2, "split": "train", "loss": 5.0, "elapsed": 10.0},
        {"step": 3, "split": "validation", "loss": 4.5, "nll": 4.0},  # no train line at 3
        {"step": 4, "split": "train", "loss": 4.0, "elapsed": 20.0},
        {"step": 4, "split": "validation", "loss": "inf", "nll": "inf"},
        {"step": 4, "split": "test_2016_flickr", "loss": 3.0, "nll": 3.0},
    ]
    with open(tmp_path / "metrics.jsonl", "w") as f:
        f.writelines(json.dumps(line) + "\n" for line in lines)
    assert compare.val_curve(str(tmp_path)) == {
        "steps": [3, 4],
        "seconds": [10.0, 20.0],
        "val_nll": [4.0, math.inf],
    }


def test_markdown_table_formats_each_column():
    row = {
        "model": "luong",
        "params": 1234567,
        "train_seconds": 600.0,
        "steps": 1500,
        "val_ppl": 12.3456,
        "test_ppl": 13.0,
        "bleu_greedy": 25.549,
        "bleu_beam": 27.0,
    }
    text = compare.markdown_table([row], beam_size=5)
    assert text.splitlines()[0].endswith("| test BLEU greedy | test BLEU beam 5 |")
    assert text.splitlines()[1] == "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
    assert text.splitlines()[2] == (
        "| luong | 1,234,567 | 10.0 | 1500 | 12.35 | 13.00 | 25.55 | 27.00 |"
    )


def test_model_configs_share_the_tokenizer_and_validate_the_models(tmp_path):
    configs = compare.model_configs(
        ["transformer", "gru"], preset="tiny", workdir=str(tmp_path), overrides={"steps": 7}
    )
    assert list(configs) == ["transformer", "gru"]
    assert {c.tokenizer_dir for c in configs.values()} == {str(tmp_path / "tokenizer")}
    assert {c.steps for c in configs.values()} == {7}
    assert {c.eval_every for c in configs.values()} == {compare.EVAL_EVERY["tiny"]}
    assert configs["gru"].optimizer == "adam" and configs["transformer"].optimizer == "noam"
    assert compare.default_models()[0] == "gru" and compare.default_models()[-1] == "transformer"
    for models, match in (
        (["gru", "gru"], "each model once"),
        (["rnn"], "not in the registry"),
        ([], "at least one"),
    ):
        with pytest.raises(ValueError, match=match):
            compare.model_configs(models, preset="tiny", workdir=str(tmp_path))
    with pytest.raises(ValueError, match="steps"):
        compare.model_configs(
            ["gru"], preset="tiny", workdir=str(tmp_path), overrides={"steps": -1}
        )


def test_parse_args():
    workdir, kwargs = compare.parse_args(
        [
            "--models",
            "gru",
            "transformer",
            "--preset",
            "tiny",
            "--minutes",
            "1.5",
            "--set",
            "eval_sentences=8",
            "--workdir",
            "W",
        ]
    )
    assert workdir == "W"
    assert kwargs["models"] == ["gru", "transformer"] and kwargs["preset"] == "tiny"
    assert kwargs["overrides"] == {"minutes": 1.5, "eval_sentences": 8}
    assert kwargs["command"] == (
        "python -m train.compare --models gru transformer --preset "
        "tiny --minutes 1.5 --set eval_sentences=8 --workdir W"
    )
    workdir, kwargs = compare.parse_args([])
    assert kwargs["models"] is None and kwargs["preset"] == "cpu" and kwargs["overrides"] == {}
    assert workdir.startswith(os.path.join("runs", "compare-cpu-"))
    for bad in (["--set", "no_such_field=1"], ["--models", "rnn"], ["--preset", "huge"]):
        with pytest.raises(SystemExit):
            compare.parse_args(bad)
