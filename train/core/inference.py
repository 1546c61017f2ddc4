"""A trained run's parameters for inference: restored from its best (or latest) checkpoint,
its EMA where it keeps one, or the mean of its last N checkpoints (`average_checkpoints`), as
the commands that translate, generate, export and evaluate read them.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from train.core.checkpoint import (
    CONFIG_FILE,
    Checkpoints,
    load_run_config,
)
from train.core.config import RunConfig
from train.core.parallel import (
    DataParallel,
)
from train.core.state import TrainState
from train.core.task import PyTree, Task, config_from_saved, eval_params, state_maker
from train.core.workdir import (
    pull,
)
from transformer_jax.optim import find_params_ema, make_optimizer


def restore_for_inference(
    task: Task, workdir: str, *, step: int | None = None, dp: DataParallel | None = None
):
    """-> (config, model, state, dp) of a trained work directory's checkpoint `step`
    (default: the best by validation loss, else the latest).

    Only what decoding reads comes back: the params and the optimizer's parameter average.
    Adam's moments and the carried state are neither built nor read (their leaves in the
    returned state are `ocp.PLACEHOLDER`), which halves the memory of a large model's
    inference."""
    config = saved_config(task, workdir)
    checkpoints = Checkpoints(workdir, keep=config.keep_checkpoints)
    try:
        if checkpoints.latest_step() is None:
            raise FileNotFoundError(f"no checkpoint in {checkpoints.directory}: train first")
        step = checkpoints.best_step() if step is None else step
        dp = dp or DataParallel("jit", sharding=config.sharding)
        model = task.build_model(config)
        state, _ = checkpoints.restore(inference_template(task, config, model, dp), step)
    finally:
        checkpoints.close()
    return config, model, state, dp


def params_for_inference(
    task: Task, workdir: str, *, step: int | None = None, dp: DataParallel | None = None
):
    """-> (config, model, params, dp) to decode with: the evaluation parameters of checkpoint
    `step` (default: the best, as `restore_for_inference`), or, when the run averages
    checkpoints (`average_checkpoints`) and no step is asked for, the mean of its last N, as
    its own evaluation used."""
    config = saved_config(task, workdir)
    if step is not None or not config.average_checkpoints:
        config, model, state, dp = restore_for_inference(task, workdir, step=step, dp=dp)
        return config, model, eval_params(state), dp
    dp = dp or DataParallel("jit", sharding=config.sharding)
    model = task.build_model(config)
    params, _ = average_last_checkpoints(task, config, workdir, model, dp)
    return config, model, params, dp


def saved_config(task: Task, workdir: str) -> RunConfig:
    """The run config of a trained work directory (pulling a remote W's local files)."""
    saved = load_run_config(workdir)
    if saved is None:
        raise FileNotFoundError(
            f"{workdir} has no config.json: not a train.{task.name} work directory"
        )
    pull(workdir)  # a remote W: the checksums (and the tokenizer) beside the checkpoints
    return config_from_saved(task, saved, path=os.path.join(workdir, CONFIG_FILE))


def inference_template(
    task: Task, config: RunConfig, model: nn.Module, dp: DataParallel
) -> TrainState:
    """The global-layout state of `config` as a restore template: shapes and shardings, nothing
    computed, with only the leaves decoding reads (the params and the optimizer's parameter
    average); the others are `ocp.PLACEHOLDER`, which orbax neither builds nor reads."""
    tx, _ = make_optimizer(task.optimizer_config(config))
    create = state_maker(task, config, model, tx)
    abstract = jax.eval_shape(
        jax.jit(create, out_shardings=dp.state_shardings(jax.eval_shape(create, 0))), 0
    )
    keep = {id(x) for x in jax.tree.leaves(find_params_ema(abstract.opt_state))}
    return abstract.replace(
        opt_state=jax.tree.map(
            lambda x: x if id(x) in keep else ocp.PLACEHOLDER, abstract.opt_state
        ),
        extra=jax.tree.map(lambda _: ocp.PLACEHOLDER, abstract.extra),
    )


def average_last_checkpoints(
    task: Task, config: RunConfig, workdir: str, model: nn.Module, dp: DataParallel
) -> tuple[PyTree, list[int]]:
    """-> (the mean evaluation parameters of the last `config.average_checkpoints` checkpoints
    of `workdir`, their steps). Fewer are averaged when fewer were saved.

    A manager of its own: one orbax manager registers one handler per item, and the run's
    restores whole states (see checkpoint._restore_args)."""
    checkpoints = Checkpoints(workdir, keep=config.keep_checkpoints)
    try:
        steps = sorted(checkpoints.all_steps())[-config.average_checkpoints :]
        if not steps:
            raise FileNotFoundError(f"no checkpoint in {checkpoints.directory}: train first")
        template = inference_template(task, config, model, dp)
        return average_checkpoints(checkpoints, template, steps), steps
    finally:
        checkpoints.close()


def average_checkpoints(
    checkpoints: Checkpoints, template: TrainState, steps: Sequence[int]
) -> PyTree:
    """The element-wise mean of the evaluation parameters (`eval_params`: the EMA where the run
    keeps one) of checkpoints `steps`, restored into `template` (`inference_template`).

    One pass: each checkpoint is read once, only its evaluation parameters (the raw ones are
    not read when an EMA stands in for them), and added to a running sum in float32 (float64
    for float64 parameters), so memory holds two copies of the parameters whatever N. The mean
    has the parameters' own dtypes."""
    if not steps:
        raise ValueError("average_checkpoints: no checkpoint steps to average")
    if find_params_ema(template.opt_state) is not None:
        template = template.replace(params=jax.tree.map(lambda _: ocp.PLACEHOLDER, template.params))
    total = None
    for step in steps:
        state, _ = checkpoints.restore(template, step)
        params = eval_params(state)
        total = _sum_in_float32(params) if total is None else _accumulate(total, params)
        del state, params
    dtypes = [x.dtype for x in jax.tree.leaves(eval_params(template))]
    leaves = [(x / len(steps)).astype(d) for x, d in zip(jax.tree.leaves(total), dtypes)]
    return jax.tree.unflatten(jax.tree.structure(total), leaves)


@jax.jit
def _sum_in_float32(params: PyTree) -> PyTree:
    return jax.tree.map(lambda x: x.astype(jnp.promote_types(x.dtype, jnp.float32)), params)


@functools.partial(jax.jit, donate_argnums=0)
def _accumulate(total: PyTree, params: PyTree) -> PyTree:
    return jax.tree.map(lambda t, x: t + x.astype(t.dtype), total, params)


# ----------------------------------------------------------------------------- the run
