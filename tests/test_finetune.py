"""Fine-tuning a pretrained Marian model (`python -m train.translate --pretrained DIR`): it
starts from the folder's weights with the folder's own tokenizer and Marian's decoder start =
pad convention, scores the pretrained model before the first step, lowers the loss, and goes
through the trainer's usual machinery (fsdp over the 8 test devices, EMA, checkpoints) with an
exact resume. The folder is a random MarianMTModel written by transformers, as in test_marian.
"""

from __future__ import annotations

import json
import os

import jax
import numpy as np
import pytest
from helpers import SOURCE_TEXT, TARGET_TEXT, save_marian, save_tokenizer, train_losses

from train import translate
from train.core.checkpoint import save_run_config
from train.core.config import config_to_dict
from train.core.inference import params_for_inference
from train.core.metrics import read_metrics
from train.core.parallel import DataParallel
from train.core.task import init_state
from train.translate import cli
from transformer_jax import MarianTokenizer, Transformer, greedy_decode, load_marian
from transformer_jax.optim import make_optimizer, make_schedule

pytest.importorskip("transformers")
pytest.importorskip("torch")
pytestmark = pytest.mark.filterwarnings("ignore:Recommended. pip install sacremoses")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("opus")
    save_tokenizer(path)
    save_marian(path, vocab_size=len(json.loads((path / "vocab.json").read_text())))
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Parallel training, validation and test files of the sentences the tokenizer knows."""
    root = tmp_path_factory.mktemp("files")
    paths = {}
    for name, rows in (("train", slice(0, 6)), ("valid", slice(0, 4)), ("test", slice(2, 6))):
        for lang, text in (("de", SOURCE_TEXT), ("en", TARGET_TEXT)):
            path = root / f"{name}.{lang}"
            path.write_text("\n".join(text[rows] * (4 if name == "train" else 1)) + "\n")
            paths[f"{name}_{lang}"] = str(path)
    return paths


def finetune_config(folder, files, **overrides):
    fields = dict(
        pretrained=str(folder),
        train_src=files["train_de"],
        train_tgt=files["train_en"],
        valid_src=files["valid_de"],
        valid_tgt=files["valid_en"],
        test_src=(files["test_de"],),
        test_tgt=(files["test_en"],),
        steps=8,
        learning_rate=3e-3,  # a random model, a few steps: the recipe's 5e-5 would not show
        adam_warmup_steps=2,
        tokens_per_batch=256,  # 8 rows of 32: one a device
        buckets=(32,),  # the test tokenizer's pieces are short: ~23 a sentence
        log_every=1,
        checkpoint_every=4,
        eval_batch_size=8,
        beam_size=2,
        decode_margin=6,
        ema_decay=0.5,
        sharding="fsdp",
        progress=False,
        plots=False,
    )
    fields.update(overrides)
    return translate.make_config("transformer", "finetune", **fields)


@pytest.fixture(scope="module")
def straight(folder, files, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("finetuned")
    config = finetune_config(folder, files)
    return config, workdir, translate.train_and_evaluate(config, str(workdir))


@pytest.mark.slow
def test_finetuning_starts_from_the_checkpoint_and_lowers_the_loss(folder, straight):
    config, workdir, final = straight
    model, params, _ = load_marian(folder)
    assert config.model_config == model.config  # the folder's architecture and special ids

    losses = train_losses(workdir)
    assert [s for s, _ in losses] == list(range(1, 9))
    assert losses[-1][1] < losses[0][1] - 0.5
    records = {r["split"]: r for r in read_metrics(str(workdir)) if r["step"] == 0}
    before = records["pretrained/validation"]
    assert final["val_ppl"] < before["ppl"]
    # The figures before the first step are the folder's weights': the same teacher-forced
    # validation loss as load_marian's parameters give (no re-initialisation).
    dp = DataParallel("jit")
    data = translate.TASK.prepare(config, str(workdir), dp, log=lambda _: None)
    state = init_state(translate.TASK, config, model, _tx(config), dp, params=params)
    loss_fn = translate.TASK.loss_fn(config, model)
    ppl = data.evaluate(dp, dp.compile_eval_step(loss_fn, state), params)["ppl"]
    np.testing.assert_allclose(before["ppl"], ppl, rtol=1e-5)
    # ... and the state that training started from holds those weights exactly.
    start = init_state(
        translate.TASK,
        config,
        model,
        _tx(config),
        dp,
        params=translate.TASK.initial_params(config),
    )
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(start.params), params)
    # BLEU and chrF before and after, on validation and the test set.
    for key in ("start_val_bleu", "val_bleu", "val_chrf", "start_test_bleu", "test_chrf"):
        assert key in final
    assert final["start_test_bleu"] == records["pretrained/test"]["bleu"]
    # Marian's conventions in the batches: the decoder starts from pad, sources end with EOS.
    batch = next(data.batches(0))
    mc = config.model_config
    assert mc.bos_id == mc.pad_id
    assert (batch["tgt_in"][:, 0] == mc.pad_id).all()
    real = batch["src"][:, 0] != mc.pad_id
    assert real.any() and (batch["tgt_out"][real] == mc.eos_id).sum(1).tolist() == [1] * sum(real)
    # The run's tokenizer is the folder's, copied into W: a resume needs the folder no more.
    tokenizer = translate.load_tokenizer(config, str(workdir))
    assert isinstance(tokenizer, MarianTokenizer)
    assert tokenizer.sha256() == MarianTokenizer.from_folder(folder).sha256()
    assert os.path.dirname(tokenizer.files["vocab.json"]).startswith(str(workdir))


def _tx(config):
    return make_optimizer(config.optimizer_config())[0]


@pytest.mark.slow
def test_a_resumed_finetuning_repeats_the_uninterrupted_one(folder, files, straight, tmp_path):
    config, workdir, final = straight
    first = translate.train_and_evaluate(translate.replace(config, steps=4), str(tmp_path))
    assert first["step"] == 4
    # The folder is gone: the resume reads neither its weights nor its tokenizer.
    moved = tmp_path.parent / (tmp_path.name + "_moved")
    os.rename(folder, moved)
    try:
        second = translate.train_and_evaluate(config, str(tmp_path))
    finally:
        os.rename(moved, folder)
    assert train_losses(tmp_path) == train_losses(workdir)
    assert second["val_loss"] == final["val_loss"]
    assert second["test_bleu"] == final["test_bleu"]
    assert second["start_test_bleu"] == final["start_test_bleu"]


def test_the_command_line_fine_tunes_with_its_own_recipe(folder, tmp_path):
    config, _, _ = cli.config_from_args(["--pretrained", str(folder), "--steps", "3"])
    assert config.preset == "finetune" and config.pretrained == str(folder)
    assert (config.optimizer, config.learning_rate, config.adam_warmup_steps) == ("adam", 5e-5, 200)
    schedule = make_schedule(config.optimizer_config())
    np.testing.assert_allclose(
        [schedule(0), schedule(99), schedule(199), schedule(5000)],
        [5e-5 / 200, 5e-5 / 2, 5e-5, 5e-5],
        rtol=1e-6,
    )
    assert config.model_config == load_marian(folder)[0].config
    assert config.data_source() == "multi30k"  # no files: the shipped corpus
    # Dropout may change; the architecture may not.
    config, _, _ = cli.config_from_args(["--pretrained", str(folder), "--model.dropout", "0.3"])
    assert config.model_config.dropout == 0.3
    with pytest.raises(SystemExit):
        cli.config_from_args(["--pretrained", str(folder), "--model.d_model", "64"])
    with pytest.raises(SystemExit):
        cli.config_from_args(["--pretrained", str(folder), "--model", "gru"])
    with pytest.raises(SystemExit):
        cli.config_from_args(["--preset", "finetune"])
    with pytest.raises(SystemExit):
        cli.config_from_args(["--pretrained", str(tmp_path / "missing")])


@pytest.mark.slow
def test_a_finetuned_run_exports_to_transformers_and_ctranslate2(straight, tmp_path, capsys):
    """--export_marian and --export_ct2 of the fine-tuned work directory: transformers'
    MarianMTModel and CTranslate2 decode greedily as our greedy search does, with the
    parameters the run decodes with (its EMA here)."""
    import torch
    import transformers

    ctranslate2 = pytest.importorskip("ctranslate2")
    from transformer_jax.interchange.ct2 import ct2_translate

    config, workdir, _ = straight
    hf_dir, ct2_dir = tmp_path / "marian", tmp_path / "ct2"
    argv = ["--workdir", str(workdir), "--export_marian", str(hf_dir), "--export_ct2", str(ct2_dir)]
    assert cli.main(argv) == 0
    assert "wrote the CTranslate2 model" in capsys.readouterr().out

    ours_config, _, params, _ = params_for_inference(translate.TASK, str(workdir))
    model = Transformer(ours_config.model_config)
    tokenizer = translate.load_tokenizer(config, str(workdir))
    src = tokenizer.encode(SOURCE_TEXT)
    tokens = np.asarray(greedy_decode(model, params, src, max_len=10))
    pad = model.config.pad_id

    hf = transformers.MarianMTModel.from_pretrained(hf_dir).eval()
    with torch.no_grad():
        out = hf.generate(
            input_ids=torch.tensor(src),
            attention_mask=torch.tensor(src != pad),
            num_beams=1,
            do_sample=False,
            max_length=11,
        )
    ref = out.numpy()[:, 1:]
    np.testing.assert_array_equal(tokens[:, : ref.shape[1]], ref)
    assert (tokens[:, ref.shape[1] :] == pad).all()
    # The exported tokenizer is the run's: transformers encodes as ours.
    hf_tokenizer = transformers.MarianTokenizer.from_pretrained(hf_dir)
    np.testing.assert_array_equal(hf_tokenizer(SOURCE_TEXT, padding=True)["input_ids"], src)

    translator = ctranslate2.Translator(str(ct2_dir), device="cpu", compute_type="float32")
    np.testing.assert_array_equal(ct2_translate(translator, tokenizer, src, max_len=10), tokens)


def test_an_export_marian_cannot_express_is_an_error_naming_the_field(tmp_path, capsys):
    """A pre-LN run (the CPU preset's model) to Marian: an error naming norm_first before any
    checkpoint is read (the work directory holds none), and nothing is written."""
    config = translate.make_config("transformer", "cpu")
    save_run_config(str(tmp_path / "w"), config_to_dict(config))
    out = tmp_path / "marian"
    assert cli.main(["--workdir", str(tmp_path / "w"), "--export_marian", str(out)]) == 1
    assert "norm_first" in capsys.readouterr().err
    assert not out.exists()
    # Exporting needs a trained run or a folder to export from.
    with pytest.raises(SystemExit):
        cli.main(["--export_ct2", str(out)])


def test_the_origin_is_chosen_once_and_gives_what_differs(folder, tmp_path):
    """`model_origin`: from scratch without --pretrained, from the Marian folder with it. The
    origin gives the model config (the folder's, vocab_size with it), the tokenizer (copied into
    the run, so the folder may go), the initial weights and the baseline."""
    from train.translate.origin import FromMarian, FromScratch, model_origin

    scratch = translate.make_config("transformer", "tiny")
    assert scratch.origin == FromScratch() and scratch.origin.initial_params(None) is None
    assert not scratch.origin.has_baseline and scratch.origin.trains_tokenizer
    assert scratch.origin.describe("transformer") == "transformer"
    with pytest.raises(ValueError, match="'finetune' fine-tunes a model: give its folder"):
        translate.make_config("transformer", "finetune")

    tuned = translate.make_config("transformer", "finetune", pretrained=str(folder))
    origin = tuned.origin
    assert origin == model_origin(str(folder)) == FromMarian(str(folder))
    assert origin.has_baseline and not origin.trains_tokenizer
    assert tuned.model_config == load_marian(folder)[0].config
    assert tuned.vocab_size == tuned.model_config.tgt_vocab_size
    assert origin.describe("transformer") == f"transformer fine-tuned from {folder}"
    params = origin.initial_params(tuned.model_config)
    expected = load_marian(folder)[1]
    assert jax.tree.structure(params) == jax.tree.structure(expected)
    jax.tree.map(np.testing.assert_array_equal, params, expected)
    with pytest.raises(ValueError, match="model.d_model: a pretrained model's architecture"):
        translate.make_config(
            "transformer", "finetune", pretrained=str(folder), model_overrides={"d_model": 64}
        )
    with pytest.raises(ValueError, match="model: --pretrained fine-tunes a Transformer"):
        translate.make_config("gru", "finetune", pretrained=str(folder))
    with pytest.raises(ValueError, match="is not a folder"):
        translate.make_config("transformer", "finetune", pretrained=str(tmp_path / "missing"))

    # The tokenizer is copied into the run the first time; later the folder is not read.
    copy_of = tmp_path / "copy"
    copy_of.mkdir()
    for f in folder.iterdir():
        (copy_of / f.name).write_bytes(f.read_bytes())
    moved = translate.make_config("transformer", "finetune", pretrained=str(copy_of))
    first = moved.origin.tokenizer(str(tmp_path / "tok"), moved.model_config, None)
    assert (tmp_path / "tok" / "marian" / "vocab.json").exists()
    for f in copy_of.iterdir():
        f.unlink()
    again = moved.origin.tokenizer(str(tmp_path / "tok"), moved.model_config, None)
    assert again.encode_batch(["Ein Mann"]) == first.encode_batch(["Ein Mann"])


@pytest.mark.slow
def test_an_exported_folder_decodes_as_its_run(straight, tmp_path, capsys):
    """--export_marian carries the run's decoding settings (decoding.json): `--pretrained
    EXPORT --translate` gives the same lines as `--workdir W --translate`, greedy and by beam,
    including outputs cut at the run's length cap (its bucket + decode_margin), where the
    folder's own generation defaults alone would allow another length."""
    from train.translate.pretrained import DECODING_FILE, Pretrained, read_decoding

    config, workdir, _ = straight
    assert config.beam_size == 2 and config.buckets == (32,) and config.decode_margin == 6
    export = tmp_path / "export"
    assert cli.main(["--workdir", str(workdir), "--export_marian", str(export)]) == 0
    assert read_decoding(str(export)) == {
        "beam_size": 2,
        "length_penalty": config.length_penalty,
        "decode_margin": 6,
        "eval_batch_size": 8,
        "buckets": (32,),
    }
    sentences = [*SOURCE_TEXT[:4], " ".join(SOURCE_TEXT[:2])]
    capsys.readouterr()

    def lines(*argv):
        assert cli.main([*argv, "--translate", *sentences]) == 0
        return capsys.readouterr().out.splitlines()

    for search in (["--beam_size", "1"], []):
        ours = lines("--workdir", str(workdir), *search)
        exported = lines("--pretrained", str(export), *search)
        assert len(ours) == len(sentences) and exported == ours, search
    # The model runs to the cap: the last sentence's 37 pieces (kept whole, as the run keeps
    # them) pad its batch to 64, so its outputs may have 64 + 6 pieces, past the 32 + 6 of a
    # source cut to the largest bucket.
    tokenizer = Pretrained(str(export)).tokenizer
    assert max(len(tokenizer.encode_batch([line])[0]) for line in ours) > 38
    # Without the run's file the folder decodes by its generation defaults: another cap.
    (export / DECODING_FILE).unlink()
    assert lines("--pretrained", str(export)) != ours


def test_a_bad_decoding_file_is_an_error_naming_it(tmp_path):
    from train.translate.pretrained import DECODING_FILE, read_decoding

    assert read_decoding(str(tmp_path)) is None
    path = tmp_path / DECODING_FILE
    for text, message in (
        ("{", "not a readable JSON file"),
        ("[]", "expected an object"),
        ('{"beam": 2}', "beam is not a decoding setting"),
        ('{"beam_size": 0}', "beam_size must be an integer >= 1"),
        ('{"decode_margin": 1.5}', "decode_margin must be an integer >= 0"),
        ('{"length_penalty": "x"}', "length_penalty must be a number"),
        ('{"buckets": [32, 16]}', "buckets must be increasing positive integers"),
    ):
        path.write_text(text)
        with pytest.raises(ValueError, match=message) as info:
            read_decoding(str(tmp_path))
        assert DECODING_FILE in str(info.value)
    path.write_text('{"buckets": [16, 32], "beam_size": 3}')
    assert read_decoding(str(tmp_path)) == {"buckets": (16, 32), "beam_size": 3}
