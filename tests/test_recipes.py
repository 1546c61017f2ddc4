"""The papers' recipes as presets (wmt14_base, wmt14_big, wt103_base, enwik8_base): each trains
a few steps on small files written here, its model shrunk through `--model.*` flags, and the
recipe's fields reach the saved run config; the shipped corpora are refused. Checkpoint
averaging: the mean of the restored checkpoints' evaluation parameters, used by a run's
evaluation and by inference."""

from __future__ import annotations

import json
import math
from contextlib import closing

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from train import lm, translate
from train.bench.config import BenchConfig
from train.core import cli
from train.core.checkpoint import Checkpoints
from train.core.inference import (
    average_checkpoints,
    inference_template,
    params_for_inference,
    restore_for_inference,
)
from train.core.metrics import read_metrics
from train.core.parallel import DataParallel
from train.core.task import eval_params, init_state
from train.lm import cli as lm_cli
from train.translate import cli as translate_cli
from train.translate.config import WMT_BUCKETS
from transformer_jax.optim import find_params_ema, make_optimizer

# The models shrunk (through the command line, as a user would) so a recipe trains in seconds.
SMALL_TRANSFORMER = [
    *("--model.n_encoder_layers", "1", "--model.n_decoder_layers", "1"),
    *("--model.d_model", "32", "--model.n_heads", "2", "--model.d_ff", "64"),
]
SMALL_XL = [
    *("--model.n_layers", "1", "--model.d_model", "32", "--model.n_heads", "2"),
    *("--model.d_head", "16", "--model.d_inner", "64"),
]
QUIET = ["--plots", "false", "--progress", "false"]


def write_lines(path, lines) -> str:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return str(path)


def saved_config(workdir) -> dict:
    return json.loads((workdir / "config.json").read_text())


# ----------------------------------------------------------------------------- translation
@pytest.fixture(scope="module")
def parallel_files(tmp_path_factory):
    """A made-up language and its 'translation' (the words reversed and upper-cased)."""
    root = tmp_path_factory.mktemp("parallel")
    rng = np.random.default_rng(0)
    words = [f"w{i}" for i in range(40)]
    out = {}
    for name, n in (("train", 300), ("valid", 24), ("newstest", 16)):
        src = [" ".join(rng.choice(words, rng.integers(3, 9))) for _ in range(n)]
        tgt = [" ".join(w.upper() for w in reversed(s.split())) for s in src]
        out[name] = (write_lines(root / f"{name}.xx", src), write_lines(root / f"{name}.yy", tgt))
    return out


def file_flags(files) -> list[str]:
    (src, tgt), (vsrc, vtgt), (tsrc, ttgt) = files["train"], files["valid"], files["newstest"]
    return [
        *("--train_src", src, "--train_tgt", tgt, "--valid_src", vsrc, "--valid_tgt", vtgt),
        *("--test_src", tsrc, "--test_tgt", ttgt, "--src_lang", "xx", "--tgt_lang", "yy"),
    ]


@pytest.mark.slow
@pytest.mark.parametrize("preset, dropout, kept", [("wmt14_base", 0.1, 5), ("wmt14_big", 0.3, 20)])
def test_a_wmt14_recipe_trains_on_files_and_evaluates_an_average(
    preset, dropout, kept, parallel_files, tmp_path, capsys
):
    workdir = tmp_path / "run"
    argv = [
        *("--preset", preset, "--workdir", str(workdir)),
        *file_flags(parallel_files),
        *SMALL_TRANSFORMER,
        # The data's vocabulary is far below 32k, the batch is shrunk, and two checkpoints
        # in four steps give the average something to average.
        *("--vocab_size", "300", "--tokens_per_batch", "512"),
        *("--steps", "4", "--checkpoint_every", "2", *QUIET),
    ]
    assert translate_cli.main(argv) == cli.EXIT_OK
    out = capsys.readouterr().out
    saved = saved_config(workdir)
    recipe = {
        "preset": preset,
        "optimizer": "noam",
        "warmup_steps": 4000,
        "lr_factor": 1.0,
        "label_smoothing": 0.1,
        "beam_size": 4,
        "length_penalty": 0.6,
        "decode_margin": 50,
        "buckets": list(WMT_BUCKETS),
        "keep_checkpoints": kept,
        "average_checkpoints": kept,
    }
    assert {k: saved[k] for k in recipe} == recipe
    model = saved["model_config"]
    assert model["dropout"] == dropout and model["share_embeddings"] and model["tie_output"]
    assert (model["d_model"], model["n_encoder_layers"]) == (32, 1)  # the flags shrank it
    # Evaluation averaged the two checkpoints saved (of the `kept` asked for) and scored the
    # test set with them.
    assert f"the mean of the last 2 checkpoints (steps 2, 4); {kept} asked for" in out
    records = read_metrics(str(workdir))
    assert [r["steps"] for r in records if r["split"] == "averaged"] == [[2, 4]]
    test = [r for r in records if r["split"] == "newstest"]
    assert len(test) == 1 and test[0]["beam_size"] == 4 and math.isfinite(test[0]["bleu"])
    # One line a sentence (counted in bytes: an untrained model's pieces may decode to control
    # characters that str.splitlines takes for line ends).
    assert (workdir / "translations" / "newstest.step4.yy").read_bytes().count(b"\n") == 16


def test_the_wmt14_recipes_refuse_multi30k(tmp_path, capsys):
    for preset in ("wmt14_base", "wmt14_big"):
        with pytest.raises(ValueError, match=f"preset: {preset} is the WMT14 recipe"):
            translate.make_config("transformer", preset)
    with pytest.raises(SystemExit) as e:
        translate_cli.main(["--preset", "wmt14_base", "--workdir", str(tmp_path / "run")])
    assert e.value.code == cli.EXIT_USAGE
    assert "--train_src" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()
    # The recipes size the Transformer only.
    with pytest.raises(ValueError, match="no sizes for preset 'wmt14_base'"):
        translate.make_config(
            "gru", "wmt14_base", train_src="a", train_tgt="b", valid_src="c", valid_tgt="d"
        )


# ----------------------------------------------------------------------------- language models
@pytest.fixture(scope="module")
def word_texts(tmp_path_factory):
    """Word-level text with 20,100 distinct words, so WikiText-103's first cut-off (20k) fits
    its vocabulary and the other two do not."""
    root = tmp_path_factory.mktemp("words")
    rng = np.random.default_rng(0)
    words = np.array([f"v{i}" for i in range(20_100)])
    train = [" ".join(chunk) for chunk in np.split(rng.permutation(words), 2010)]
    # 200 lines of 11 tokens: 275 a row of 8, four whole evaluation segments of 64.
    held_out = [" ".join(rng.choice(words[:200], 10)) for _ in range(400)]
    return {
        "train": write_lines(root / "wiki.train.tokens", train),
        "valid": write_lines(root / "wiki.valid.tokens", held_out[:200]),
        "test": write_lines(root / "wiki.test.tokens", held_out[200:]),
    }


@pytest.mark.slow
def test_the_wt103_recipe_trains_on_word_text_with_its_clusters(word_texts, tmp_path):
    workdir = tmp_path / "run"
    argv = [
        *("--preset", "wt103_base", "--workdir", str(workdir)),
        *("--train_text", word_texts["train"], "--valid_text", word_texts["valid"]),
        *("--test_text", word_texts["test"], *SMALL_XL),
        *("--batch_size", "8", "--eval_batch_size", "8", "--steps", "3", *QUIET),
    ]
    assert lm_cli.main(argv) == cli.EXIT_OK
    saved = saved_config(workdir)
    recipe = {
        "dataset": "text",
        "level": "word",
        "learning_rate": 2.5e-4,
        "warmup_steps": 0,
        "decay_steps": 200_000,
        "clip_norm": 0.25,
        "eval_tgt_len": 64,
        "eval_mem_len": 640,
    }
    assert {k: saved[k] for k in recipe} == recipe
    model = saved["model_config"]
    # The data's vocabulary (20,100 words, <eos>, <unk>), the cut-offs below it, the paper's
    # segment and memory, adaptive clusters of one width (div_val 1).
    assert model["vocab_size"] == 20_102
    assert model["cutoffs"] == [20_000] and model["tie_projs"] == [False, True]
    assert (model["tgt_len"], model["mem_len"], model["div_val"]) == (150, 150, 1)
    assert (model["d_model"], model["n_layers"]) == (32, 1)
    records = read_metrics(str(workdir))
    test = [r for r in records if r["split"] == "test"]
    assert len(test) == 1 and math.isfinite(test[0]["ppl"])


@pytest.mark.slow
def test_the_enwik8_recipe_trains_on_bytes_split_from_one_file(tmp_path):
    rng = np.random.default_rng(0)
    words = [f"<page>{w}</page>" if i % 7 == 0 else w for i, w in enumerate("abcdefghij")]
    text = " ".join(rng.choice(words, 10_000))
    path = tmp_path / "enwik8"
    path.write_bytes(text.encode()[:30_000])
    workdir = tmp_path / "run"
    argv = [
        *("--preset", "enwik8_base", "--workdir", str(workdir), "--train_text", str(path)),
        *("--split_bytes", "24000,3000,3000", *SMALL_XL),
        *("--batch_size", "8", "--eval_batch_size", "8", "--steps", "3", *QUIET),
    ]
    assert lm_cli.main(argv) == cli.EXIT_OK
    saved = saved_config(workdir)
    recipe = {
        "level": "byte",
        "learning_rate": 2.5e-4,
        "warmup_steps": 0,
        "decay_steps": 400_000,
        "clip_norm": 0.25,
        "eval_tgt_len": 80,
        "eval_mem_len": 2100,
    }
    assert {k: saved[k] for k in recipe} == recipe
    model = saved["model_config"]
    assert (model["vocab_size"], model["tgt_len"], model["mem_len"]) == (256, 512, 512)
    assert model["cutoffs"] == [] and model["remat"] == "none"
    test = [r for r in read_metrics(str(workdir)) if r["split"] == "test"]
    assert len(test) == 1 and 0 < test[0]["bpc"] < 8.0  # below a uniform byte


def test_the_lm_recipes_refuse_ptb_and_the_wrong_level(word_texts, tmp_path, capsys):
    with pytest.raises(ValueError, match="preset: wt103_base is a recipe .* word-level text"):
        lm.make_config("ptb", "wt103_base")
    with pytest.raises(ValueError, match="preset: enwik8_base is a recipe"):
        lm.make_config("ptb_char", "enwik8_base")
    with pytest.raises(ValueError, match="level: the enwik8_base recipe is for byte or char"):
        lm.config_for_data(
            "text",
            "enwik8_base",
            train_text=word_texts["train"],
            valid_text=word_texts["valid"],
            level="word",
        )
    with pytest.raises(SystemExit) as e:
        lm_cli.main(["--preset", "wt103_base", "--workdir", str(tmp_path / "run")])
    assert e.value.code == cli.EXIT_USAGE
    assert "--train_text" in capsys.readouterr().err
    # The recipes' batches are the benchmark's (one definition of each).
    assert {n: b for n, _, b in BenchConfig.full().xl} == {"enwik8_base": 22, "wt103_base": 60}


# ----------------------------------------------------------------------------- averaging
def test_averaging_more_checkpoints_than_are_kept_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(ValueError, match="needs keep_checkpoints >= 4, got keep_checkpoints 3"):
        translate.make_config("transformer", "tiny", average_checkpoints=4)
    with pytest.raises(SystemExit) as e:
        translate_cli.main(
            ["--preset", "tiny", "--workdir", str(tmp_path / "run"), "--average_checkpoints", "5"]
        )
    assert e.value.code == cli.EXIT_USAGE
    assert "average_checkpoints" in capsys.readouterr().err


def perturbed(tree, key):
    """`tree` with random numbers added to its float leaves (counters stay)."""
    return jax.tree.map(
        lambda x: (
            x + jax.random.normal(key, x.shape) if jnp.issubdtype(x.dtype, jnp.floating) else x
        ),
        tree,
    )


@pytest.mark.parametrize("ema_decay", [0.0, 0.5])
def test_the_average_is_the_mean_of_the_restored_checkpoints(tmp_path, ema_decay):
    config = translate.make_config(
        "transformer",
        "tiny",
        model_overrides=dict(d_model=16, n_heads=2, d_ff=32, n_encoder_layers=1),
        ema_decay=ema_decay,
        keep_checkpoints=4,
    )
    task, dp = translate.TASK, DataParallel("jit")
    model = task.build_model(config)
    tx, _ = make_optimizer(config.optimizer_config())
    state = init_state(task, config, model, tx, dp)
    # Three checkpoints whose parameters (and EMA) differ by random amounts. One manager
    # for each kind of use, as the library does (orbax registers one handler per item).
    with closing(Checkpoints(str(tmp_path), keep=4)) as checkpoints:
        for step in (1, 2, 3):
            key = jax.random.PRNGKey(step)
            state = state.replace(
                step=state.step + 1,
                params=perturbed(state.params, key),
                opt_state=perturbed(state.opt_state, jax.random.fold_in(key, 1)),
            )
            checkpoints.save(state, meta={})
    with closing(Checkpoints(str(tmp_path), keep=4)) as checkpoints:
        template = inference_template(task, config, model, dp)
        averaged = jax.device_get(average_checkpoints(checkpoints, template, [2, 3]))
    # Independently: each checkpoint restored whole, its evaluation params averaged in float64.
    with closing(Checkpoints(str(tmp_path), keep=4)) as checkpoints:
        restored = [jax.device_get(checkpoints.restore(state, s)[0]) for s in (2, 3)]
    expected = jax.tree.map(
        lambda a, b: (np.float64(a) + np.float64(b)) / 2, *[eval_params(s) for s in restored]
    )
    jax.tree.map(lambda a, e: np.testing.assert_allclose(a, e, rtol=1e-6), averaged, expected)
    assert all(x.dtype == np.float32 for x in jax.tree.leaves(averaged))
    if ema_decay:  # with an EMA, each checkpoint contributes its EMA, not its raw params
        raw = jax.tree.map(lambda a, b: (a + b) / 2, *[s.params for s in restored])
        assert find_params_ema(restored[0].opt_state) is not None
        assert not np.allclose(jax.tree.leaves(raw)[0], jax.tree.leaves(averaged)[0])


@pytest.mark.slow
def test_a_run_evaluates_and_translates_with_the_average(data_dir, tokenizer_dir, tmp_path):
    config = translate.make_config(
        "transformer",
        "tiny",
        model_overrides=dict(d_model=32, n_heads=2, d_ff=64, n_encoder_layers=1),
        steps=6,
        checkpoint_every=3,
        average_checkpoints=2,
        eval_sentences=16,
        beam_size=2,
        plots=False,
        progress=False,
        data_dir=str(data_dir),
        tokenizer_dir=str(tokenizer_dir),
    )
    workdir = tmp_path / "run"
    final = translate.train_and_evaluate(config, str(workdir))
    assert final["averaged_steps"] == [3, 6]
    records = read_metrics(str(workdir))
    # The loop validated the last checkpoint's own parameters at step 6; the final
    # validation (and the test set) used the mean of checkpoints 3 and 6, which differs.
    last = [r for r in records if r["split"] == "validation" and r["step"] == 6]
    averaged = [r for r in records if r["split"] == "averaged"]
    assert len(last) == 1 and averaged[0]["steps"] == [3, 6]
    assert final["val_loss"] == pytest.approx(averaged[0]["loss"])
    assert abs(final["val_loss"] - last[0]["loss"]) > 1e-4
    # --translate decodes with the same average; asked for a step, with that checkpoint.
    _, _, params, _ = params_for_inference(translate.TASK, str(workdir))
    steps = [
        eval_params(restore_for_inference(translate.TASK, str(workdir), step=s)[2]) for s in (3, 6)
    ]
    mean = jax.tree.map(lambda a, b: (np.float64(a) + np.float64(b)) / 2, *jax.device_get(steps))
    jax.tree.map(
        lambda a, e: np.testing.assert_allclose(a, e, rtol=1e-6), jax.device_get(params), mean
    )
    _, _, at_six, _ = params_for_inference(translate.TASK, str(workdir), step=6)
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(at_six), jax.device_get(steps[1]))
