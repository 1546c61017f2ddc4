"""train.core.checkpoint on a tiny state, without training: the directory and its test for a
saved step, save and restore (the step, the meta, placeholders, a step saved twice), what is
kept (the last `keep` and the best by val_loss), the checksums and each kind of damage they
report, the errors of a restore, and the run config (saved, read, compared field by field).
test_train_loop.py and test_faults.py check the same module through whole runs."""

from __future__ import annotations

import json
import logging
import os
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from helpers import file_hashes

from train.core import checkpoint
from train.core.checkpoint import Checkpoints, config_mismatches
from train.core.errors import CheckpointError
from train.core.state import TrainState


def state_at(step, scale=1.0):
    params = {"b": jnp.arange(2.0) * scale, "w": jnp.ones((2, 3)) * scale}
    state = TrainState.create(params=params, tx=optax.adam(1e-3), rng=jax.random.PRNGKey(7))
    return state.replace(step=jnp.asarray(step, jnp.int32))


@pytest.fixture
def ckpts(tmp_path):
    manager = Checkpoints(str(tmp_path / "w"), keep=2)
    yield manager
    manager.close()


def test_the_directory_is_w_checkpoints_absolute_or_under_a_remote_w(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert checkpoint.checkpoint_dir("w") == os.path.join(str(tmp_path), "w", "checkpoints")
    assert checkpoint.checkpoint_dir("gs://bucket/run/") == "gs://bucket/run/checkpoints"
    assert checkpoint.checkpoint_dir("gs://bucket/run") == "gs://bucket/run/checkpoints"


def test_a_saved_step_is_a_directory_named_by_its_number(tmp_path):
    w = str(tmp_path / "w")
    assert not checkpoint.has_checkpoint(w) and not os.path.exists(w)  # nothing made
    os.makedirs(os.path.join(w, "checkpoints", "3.orbax-checkpoint-tmp-1"))
    assert not checkpoint.has_checkpoint(w)  # a save being written
    os.makedirs(os.path.join(w, "checkpoints", "3"))
    assert checkpoint.has_checkpoint(w)


@pytest.mark.parametrize("keep", [0, -1])
def test_keep_below_one_is_refused(tmp_path, keep):
    with pytest.raises(ValueError, match=f"keep_checkpoints: must be >= 1, got {keep}"):
        Checkpoints(str(tmp_path), keep=keep)
    assert not os.path.exists(tmp_path / "checkpoints")


def test_a_state_and_its_meta_come_back_as_saved(ckpts):
    state = state_at(5, scale=3.0)
    assert ckpts.latest_step() is None
    assert ckpts.save(state, meta={"elapsed": 12.5, "note": "x"}) is True
    assert ckpts.latest_step() == 5 and ckpts.all_steps() == [5]
    assert ckpts.path(5) == ckpts.directory + "/5" and os.path.isdir(ckpts.path(5))
    restored, meta = ckpts.restore(state_at(0))
    assert meta == {"elapsed": 12.5, "note": "x"}
    assert isinstance(restored, TrainState) and restored.tx is not None
    assert int(restored.step) == 5 and restored.step.dtype == jnp.int32
    jax.tree.map(np.testing.assert_array_equal, restored.params, state.params)
    jax.tree.map(np.testing.assert_array_equal, restored.opt_state, state.opt_state)
    np.testing.assert_array_equal(restored.rng, state.rng)


def test_a_step_saved_already_is_not_written_again(ckpts):
    assert ckpts.save(state_at(2), meta={"v": 1})
    assert ckpts.save(state_at(2, scale=9.0), meta={"v": 2}) is False
    restored, meta = ckpts.restore(state_at(0))
    assert meta == {"v": 1} and float(restored.params["b"][1]) == 1.0


def test_metrics_without_val_loss_are_refused_and_nothing_is_saved(ckpts):
    with pytest.raises(ValueError, match=r"checkpoint metrics need 'val_loss', got \['a', 'z'\]"):
        ckpts.save(state_at(1), meta={}, metrics={"z": 1.0, "a": 2.0})
    assert ckpts.all_steps() == []


def test_the_last_keep_and_the_best_by_val_loss_are_kept(ckpts, tmp_path):
    losses = {1: 3.0, 2: 1.0, 3: 4.0, 4: 5.0, 5: 6.0}
    for step, loss in losses.items():
        ckpts.save(state_at(step), meta={}, metrics={"val_loss": loss, "bleu": 1.0})
    ckpts.save(state_at(6), meta={})  # unranked (a periodic save): never the best
    assert ckpts.all_steps() == [2, 5, 6] and ckpts.best_step() == 2
    assert ckpts.latest_step() == 6
    # Checksums only of the steps kept.
    assert sorted(os.listdir(tmp_path / "w" / "checksums")) == ["2.json", "5.json", "6.json"]
    # The best is the lowest loss, not the highest.
    ckpts.save(state_at(7), meta={}, metrics={"val_loss": 0.5})
    assert ckpts.best_step() == 7 and ckpts.all_steps() == [6, 7]


def test_the_last_three_are_kept_by_default(tmp_path):
    manager = Checkpoints(str(tmp_path / "w"))
    for step in (1, 2, 3, 4, 5):
        manager.save(state_at(step), meta={})
    assert manager.all_steps() == [3, 4, 5]
    manager.close()


def test_keep_one_keeps_the_latest_only_without_metrics(tmp_path):
    manager = Checkpoints(str(tmp_path / "w"), keep=1)
    for step in (1, 2, 3):
        manager.save(state_at(step), meta={})
    assert manager.all_steps() == [3]
    manager.close()


def test_the_checksums_are_the_sha256_of_every_file_of_the_step(ckpts, tmp_path):
    ckpts.save(state_at(4), meta={})
    path = ckpts.checksum_path(4)
    assert path == os.path.join(str(tmp_path / "w"), "checksums", "4.json")
    assert os.listdir(os.path.dirname(path)) == ["4.json"]  # no .tmp left
    saved = json.load(open(path))
    assert saved == file_hashes(ckpts.path(4)) and len(saved) > 2
    assert ckpts.verify(4) is None


def data_file(ckpts, step):
    """The largest file of a saved step: array bytes."""
    return max(checkpoint.files_below(ckpts.path(step)), key=lambda item: os.path.getsize(item[1]))


def test_verify_names_what_differs(ckpts):
    ckpts.save(state_at(3), meta={})
    name, path = data_file(ckpts, 3)
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 1
    open(path, "wb").write(bytes(data))
    assert ckpts.verify(3) == f"{name} does not match the sha256 saved with it"
    os.remove(path)
    assert ckpts.verify(3) == f"{name} is missing"
    open(ckpts.checksum_path(3), "w").write("{broken")
    damage = ckpts.verify(3)
    assert damage.startswith(f"its checksum file {ckpts.checksum_path(3)} is unreadable (")
    os.remove(ckpts.checksum_path(3))
    assert ckpts.verify(3) is None  # a step from before checksums


def test_verify_reports_the_first_file_by_name(ckpts):
    ckpts.save(state_at(3), meta={})
    saved = json.load(open(ckpts.checksum_path(3)))
    names = sorted(saved)
    for name in names[1:]:
        saved[name] = "0" * 64
    json.dump(saved, open(ckpts.checksum_path(3), "w"))
    assert ckpts.verify(3) == f"{names[1]} does not match the sha256 saved with it"


def damage(ckpts, step):
    _, path = data_file(ckpts, step)
    open(path, "ab").write(b"x")


def test_a_damaged_checkpoint_is_refused_naming_the_newest_earlier_one_that_verifies(tmp_path):
    manager = Checkpoints(str(tmp_path / "w"), keep=5)
    for step in (1, 2, 3, 4):
        manager.save(state_at(step), meta={})
    damage(manager, 3)
    with pytest.raises(CheckpointError, match="that verifies is step 2: move"):
        manager.restore(state_at(0), step=3)
    damage(manager, 2)
    with pytest.raises(CheckpointError) as error:
        manager.restore(state_at(0), step=3)
    message = str(error.value)
    assert message.startswith(f"checkpoint {manager.path(3)} is damaged: ")
    assert "does not match the sha256 saved with it" in message
    assert f"Nothing was changed in {manager.directory}." in message
    assert (
        f"The newest earlier checkpoint that verifies is step 1: move {manager.path(3)}" in message
    )
    assert manager.all_steps() == [1, 2, 3, 4]  # nothing deleted
    damage(manager, 1)
    with pytest.raises(CheckpointError, match="No earlier checkpoint verifies; start a new"):
        manager.restore(state_at(0), step=3)
    restored, _ = manager.restore(state_at(0))  # the latest, 4, is whole
    assert int(restored.step) == 4
    manager.close()


def test_restore_without_a_checkpoint_names_the_directory(ckpts):
    with pytest.raises(CheckpointError, match=f"no checkpoint in {ckpts.directory}$"):
        ckpts.restore(state_at(0))


def test_a_checkpoint_orbax_cannot_read_is_refused_naming_the_others(tmp_path):
    manager = Checkpoints(str(tmp_path / "w"), keep=5)
    for step in (1, 2, 3):
        manager.save(state_at(step), meta={})
    os.remove(manager.checksum_path(2))  # no checksums: orbax itself finds the damage
    os.remove(data_file(manager, 2)[1])
    with pytest.raises(CheckpointError) as error:
        manager.restore(state_at(0), step=2)
    message = str(error.value)
    assert message.startswith(f"checkpoint {manager.path(2)} could not be restored (")
    assert f"Nothing was changed in {manager.directory}; move that step directory" in message
    assert "resume from an earlier one ([1, 3]), or use a new workdir." in message
    assert isinstance(error.value.__cause__, Exception)
    manager.close()
    alone = Checkpoints(str(tmp_path / "v"), keep=5)
    alone.save(state_at(1), meta={})
    os.remove(alone.checksum_path(1))
    os.remove(data_file(alone, 1)[1])
    with pytest.raises(CheckpointError, match=r"\(none left\)"):
        alone.restore(state_at(0))
    alone.close()


def test_the_others_named_are_every_step_but_the_one_refused(tmp_path):
    manager = Checkpoints(str(tmp_path / "w"), keep=5)
    for step in (300, 1000):  # past the small ints Python keeps one object of
        manager.save(state_at(step), meta={})
    os.remove(manager.checksum_path(1000))
    os.remove(data_file(manager, 1000)[1])
    with pytest.raises(CheckpointError, match=r"resume from an earlier one \(\[300\]\)"):
        manager.restore(state_at(0), step=int("1000"))
    manager.close()


def test_the_cause_is_the_first_line_of_orbax_s_error(ckpts, monkeypatch):
    ckpts.save(state_at(1), meta={})

    def restore(*args, **kwargs):
        raise ValueError("  the first line\nthe second line  ")

    monkeypatch.setattr(ckpts.manager, "restore", restore)
    cause = r"could not be restored \(ValueError: the first line\)"
    with pytest.raises(CheckpointError, match=cause):
        ckpts.restore(state_at(0))

    # A first line of any length is cut at 300 characters.
    def long_restore(*args, **kwargs):
        raise ValueError("a" * 299 + "bc" + "d" * 100 + "\nsecond")

    monkeypatch.setattr(ckpts.manager, "restore", long_restore)
    with pytest.raises(CheckpointError) as error:
        ckpts.restore(state_at(0))
    assert f"(ValueError: {'a' * 299}b). Nothing" in str(error.value)


def test_save_takes_its_meta_and_metrics_by_keyword(ckpts):
    with pytest.raises(TypeError):
        ckpts.save(state_at(1), {})
    assert ckpts.all_steps() == []


def test_the_number_kept_is_given_by_keyword(tmp_path):
    with pytest.raises(TypeError):
        Checkpoints(str(tmp_path / "w"), 5)
    assert not os.path.exists(tmp_path / "w")


def test_a_template_of_another_shape_is_refused(ckpts):
    ckpts.save(state_at(1), meta={})
    wrong = state_at(0).replace(params={"b": jnp.zeros(5), "w": jnp.ones((2, 3))})
    with pytest.raises(CheckpointError, match="could not be restored"):
        ckpts.restore(wrong)


def test_placeholder_leaves_are_neither_read_nor_built(ckpts):
    state = state_at(8, scale=2.0)
    ckpts.save(state, meta={"m": 1})
    template = state_at(0).replace(
        opt_state=jax.tree.map(lambda _: ocp.PLACEHOLDER, state.opt_state)
    )
    reader = Checkpoints(ckpts.workdir)  # a manager of its own: one handler per item
    restored, meta = reader.restore(template)
    reader.close()
    assert meta == {"m": 1} and int(restored.step) == 8
    jax.tree.map(np.testing.assert_array_equal, restored.params, state.params)
    leaves = jax.tree.leaves(restored.opt_state)
    assert leaves and all(x is ocp.PLACEHOLDER for x in leaves)


def test_unranked_saves_are_not_warned_of_and_other_records_are(tmp_path):
    quiet = checkpoint._QUIET_UNRANKED_SAVES
    record = lambda msg: logging.LogRecord("absl", logging.WARNING, "", 0, msg, (), None)  # noqa: E731
    assert quiet.filter(record("Save step 3 did not provide metrics; skipped")) is False
    assert quiet.filter(record("something else")) is True
    logger = logging.getLogger("absl")
    Checkpoints(str(tmp_path / "a")).close()
    Checkpoints(str(tmp_path / "b")).close()
    assert logger.filters.count(quiet) == 1


def as_process(index, monkeypatch):
    """checkpoint.py (and only it: orbax would wait for a process 0) sees another process
    index."""
    proxy = types.SimpleNamespace(
        process_index=lambda: index, device_get=jax.device_get, tree=jax.tree
    )
    monkeypatch.setattr(checkpoint, "jax", proxy)


def test_only_process_0_writes_checksums(ckpts, monkeypatch):
    as_process(1, monkeypatch)
    ckpts.save(state_at(1), meta={})
    assert ckpts.all_steps() == [1] and not os.path.exists(ckpts.checksum_path(1))


# ----------------------------------------------------------------------------- run config
def test_the_run_config_is_written_by_process_0_and_read_back(tmp_path, monkeypatch):
    w = str(tmp_path / "w")
    assert checkpoint.load_run_config(w) is None
    config = {"b": 1, "a": {"y": [1, 2], "x": None}}
    checkpoint.save_run_config(w, config)
    assert os.listdir(w) == ["config.json"]  # no .tmp left
    text = open(os.path.join(w, "config.json")).read()
    assert text == json.dumps(config, indent=2, sort_keys=True)
    assert checkpoint.load_run_config(w) == config
    as_process(1, monkeypatch)
    checkpoint.save_run_config(str(tmp_path / "v"), config)
    assert not os.path.exists(tmp_path / "v")


@pytest.mark.parametrize(
    "content, says",
    [
        (b"{nope", "is unreadable"),
        (b"\xff\xfe{}", "is unreadable"),
        (b"[1, 2]", "is not a JSON object (it holds a list)"),
        (b'"text"', "is not a JSON object (it holds a str)"),
    ],
)
def test_an_unreadable_run_config_is_an_error_naming_it(tmp_path, content, says):
    (tmp_path / "config.json").write_bytes(content)
    with pytest.raises(CheckpointError) as error:
        checkpoint.load_run_config(str(tmp_path))
    message = str(error.value)
    assert message.startswith(f"run config {tmp_path / 'config.json'} {says}")
    assert message.endswith("; restore it, or start a new --workdir")


def test_mismatches_are_dotted_fields_with_both_values_in_order():
    saved = {"a": 1, "m": {"x": 1, "y": {"z": 2}}, "steps": 10, "gone": True}
    given = {"a": 1, "m": {"x": 2, "y": {"z": 3}}, "steps": 20, "new": "v"}
    assert config_mismatches(saved, given) == [
        "gone: saved True, given '<absent>'",
        "m.x: saved 1, given 2",
        "m.y.z: saved 2, given 3",
        "new: saved '<absent>', given 'v'",
        "steps: saved 10, given 20",
    ]
    assert config_mismatches(saved, given, may_change=("steps", "gone", "new")) == [
        "m.x: saved 1, given 2",
        "m.y.z: saved 2, given 3",
    ]
    # may_change is of the top level only: a nested field of that name still counts.
    assert config_mismatches({"m": {"steps": 1}}, {"m": {"steps": 2}}, may_change=("steps",)) == [
        "m.steps: saved 1, given 2"
    ]
    assert config_mismatches({"m": {"a": 1}}, {"m": 5}) == ["m: saved {'a': 1}, given 5"]
    assert config_mismatches(saved, saved) == []
    with pytest.raises(TypeError):  # the options by keyword
        config_mismatches(saved, given, ("steps",))


def test_check_run_config_refuses_a_different_run_and_reports_what_may_change(tmp_path):
    w = str(tmp_path)
    assert checkpoint.check_run_config(w, {"a": 1}, may_change=("steps",)) == []
    checkpoint.save_run_config(w, {"a": 1, "steps": 10, "minutes": 5})
    given = {"a": 1, "steps": 20, "minutes": 5}
    assert checkpoint.check_run_config(w, given, may_change=("steps", "minutes")) == [
        "steps: 10 -> 20"
    ]
    with pytest.raises(ValueError) as error:
        checkpoint.check_run_config(w, {**given, "a": 2}, may_change=("steps", "minutes"))
    assert str(error.value) == (
        f"{w} holds a run with a different config:\n  a: saved 1, given 2\n  "
        "steps: saved 10, given 20\nResume it with --workdir alone (changing at most "
        "steps, minutes), or pick a new --workdir."
    ).replace("\n  steps: saved 10, given 20", "")
    # normalize maps the saved file to today's form before comparing.
    upgraded = checkpoint.check_run_config(
        w, {**given, "added": 0}, may_change=("steps",), normalize=lambda c: {**c, "added": 0}
    )
    assert upgraded == ["steps: 10 -> 20"]
    with pytest.raises(ValueError, match="added: saved '<absent>', given 0"):
        checkpoint.check_run_config(w, {**given, "added": 0}, may_change=("steps", "minutes"))
    assert json.load(open(os.path.join(w, "config.json")))["steps"] == 10  # nothing written
    with pytest.raises(TypeError):  # the options by keyword
        checkpoint.check_run_config(w, given, ("steps", "minutes"))
