"""Restoring a trained work directory for decoding reads what decoding needs and nothing more:
the parameters and the optimizer's parameter average (EMA), equal to a full restore's, with
Adam's moments and the carried state left as orbax placeholders (never built, never read)."""

from __future__ import annotations

import math

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from helpers import teacher_forced_nll

from train import translate
from train.core.checkpoint import Checkpoints
from train.core.inference import restore_for_inference
from train.core.metrics import read_metrics
from train.core.parallel import DataParallel
from train.core.task import eval_params, init_state
from transformer_jax.optim import find_params_ema, make_optimizer


@pytest.fixture(scope="module")
def trained(tmp_path_factory, data_dir, tokenizer_dir):
    root = tmp_path_factory.mktemp("inference")
    config = translate.make_config(
        "transformer",
        "tiny",
        steps=3,
        ema_decay=0.9,
        eval_sentences=8,
        plots=False,
        progress=False,
        data_dir=str(data_dir),
        tokenizer_dir=str(tokenizer_dir),
        checkpoint_every=3,
    )
    workdir = str(root / "run")
    translate.train_and_evaluate(config, workdir)
    return config, workdir


@pytest.mark.slow
def test_inference_restores_the_params_and_the_ema_only(trained):
    config, workdir = trained
    _, model, state, _ = restore_for_inference(translate.TASK, workdir)
    # The full state, as training restores it.
    tx, _ = make_optimizer(config.optimizer_config())
    checkpoints = Checkpoints(workdir)
    try:
        template = init_state(translate.TASK, config, model, tx, DataParallel("jit"))
        full, _ = checkpoints.restore(template)
    finally:
        checkpoints.close()
    assert int(state.step) == int(full.step) == 3
    jax.tree.map(
        np.testing.assert_array_equal, jax.device_get(state.params), jax.device_get(full.params)
    )
    ema = find_params_ema(state.opt_state)
    assert ema is not None
    jax.tree.map(
        np.testing.assert_array_equal,
        jax.device_get(ema),
        jax.device_get(find_params_ema(full.opt_state)),
    )
    # The EMA is what decoding uses, and it differs from the raw params after 3 steps.
    assert eval_params(state) is ema
    assert any(
        not np.array_equal(a, b)
        for a, b in zip(
            jax.tree.leaves(jax.device_get(ema)), jax.tree.leaves(jax.device_get(state.params))
        )
    )
    # Everything else of the optimizer state was skipped: Adam's two moments per parameter.
    kept = jax.tree.leaves(state.opt_state)
    skipped = [x for x in kept if x is ocp.PLACEHOLDER]
    n_params = len(jax.tree.leaves(state.params))
    assert len(skipped) >= 2 * n_params
    assert len(kept) - len(skipped) == len(jax.tree.leaves(ema))


@pytest.mark.slow
def test_validation_during_training_scores_the_ema(trained):
    # The validation figures logged in training (their loss ranks the checkpoints, and so
    # picks the one --translate decodes with) are the EMA's, recomputed independently from
    # the saved average; the raw parameters' are far from them (their nll is lower here).
    config, workdir = trained
    _, model, state, _ = restore_for_inference(translate.TASK, workdir)
    (logged,) = [r for r in read_metrics(workdir) if r["split"] == "validation"]
    assert logged["step"] == int(state.step) == 3
    tokenizer = translate.load_tokenizer(config, workdir)
    pairs = translate.load_split(config, tokenizer, "validation").pairs
    nll = {
        which: teacher_forced_nll(jax.device_get(params), pairs, config.model_config)[0]
        for which, params in (("ema", find_params_ema(state.opt_state)), ("raw", state.params))
    }
    assert math.isclose(logged["nll"], nll["ema"], rel_tol=1e-5), (logged, nll)
    assert not math.isclose(logged["nll"], nll["raw"], rel_tol=1e-2), (logged, nll)
