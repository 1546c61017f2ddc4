"""The Annotated Transformer's figures: each PNG is read back and must show what was drawn."""

from __future__ import annotations

import numpy as np
import pytest

from train import plots
from transformer_jax import label_smoothed_cross_entropy, noam_schedule
from transformer_jax.losses import smoothed_target_distribution

matplotlib_image = pytest.importorskip("matplotlib.image")

SRC = np.array([[5, 6, 7, 2, 0, 0], [8, 9, 10, 11, 12, 2]], np.int32)
TGT_IN = np.array([[1, 5, 6, 7, 0, 0, 0], [1, 8, 9, 10, 11, 12, 0]], np.int32)


def _read(drawn: plots.Drawn, name: str) -> np.ndarray:
    """The RGB values [..., 3] of the PNG at the pixels where `name`'s values were drawn."""
    image = matplotlib_image.imread(drawn.path)[..., :3]
    rows, cols = drawn.pixels[name][..., 0], drawn.pixels[name][..., 1]
    assert rows.min() >= 0 and cols.min() >= 0
    assert rows.max() < image.shape[0] and cols.max() < image.shape[1]
    return image[rows, cols]


def test_masks_png_shows_the_causal_padding_and_decoder_masks(tmp_path):
    masks = plots.decoder_masks(SRC, TGT_IN, pad_id=0)
    np.testing.assert_array_equal(masks["subsequent"], np.tril(np.ones((7, 7), bool)))
    np.testing.assert_array_equal(masks["padding"], SRC != 0)
    # Row 0 has the most padding: causal, and no key past its 4 real tokens.
    np.testing.assert_array_equal(
        masks["decoder"], np.tril(np.ones((7, 7), bool)) & (np.arange(7) < 4)
    )
    drawn = plots.plot_masks(masks, str(tmp_path / "masks.png"))
    for name, mask in masks.items():
        brightness = _read(drawn, name).mean(-1)  # white = attend
        np.testing.assert_array_equal(brightness > 0.5, mask)
        assert np.all((brightness > 0.95) | (brightness < 0.05))


def test_lr_schedule_png_draws_each_schedule_at_its_values(tmp_path):
    # (512, 8000) of the Annotated Transformer's figure would coincide with (512, 4000) past
    # step 8000, hiding one colour; these two stay apart but at the very start.
    schedules = {
        "512:4000": noam_schedule(512, warmup_steps=4000),
        "256:4000": noam_schedule(256, warmup_steps=4000),
    }
    drawn = plots.plot_lr_schedule(schedules, 20000, str(tmp_path / "lr_schedule.png"))
    for name, fn in schedules.items():
        np.testing.assert_allclose(drawn.data[name], np.asarray(fn(np.arange(20000))), rtol=1e-6)
    # The curves' colours, in order (matplotlib's cycle C0, C1).
    import matplotlib.colors as mcolors

    for i, name in enumerate(schedules):
        colour = np.asarray(mcolors.to_rgb(f"C{i}"))
        points = _read(drawn, name)[::200]  # 100 points along the curve
        close = np.abs(points - colour).max(-1) < 0.2
        # Near step 0 a later curve covers an earlier one; elsewhere every point shows its own
        # colour.
        assert close.mean() > 0.9, (name, close.mean())
    # The peak is at the warmup step: the pixel row there is the curve's highest (smallest).
    rows = drawn.pixels["512:4000"][:, 0]
    assert abs(int(np.argmin(rows)) - 4000) < 200


def test_lr_schedule_png_draws_a_constant_rate_flat(tmp_path):
    # Adam at a constant rate without a warm-up (the CPU preset's before its cosine): optax's
    # constant schedule returns one scalar for an array of steps, which must still draw as a
    # line over every step.
    from train.translate.config import make_config
    from transformer_jax.optim import make_schedule

    config = make_config(preset="cpu", optimizer="adam", adam_warmup_steps=0, fit_to_budget=False)
    fn = make_schedule(config.optimizer_config())
    drawn = plots.plot_lr_schedule({config.optimizer: fn}, 300, str(tmp_path / "lr.png"))
    np.testing.assert_allclose(
        drawn.data[config.optimizer], np.full(300, config.learning_rate), rtol=1e-6
    )
    rows = drawn.pixels[config.optimizer][:, 0]
    assert rows.min() == rows.max()  # one horizontal line


def test_label_smoothing_png_shows_the_loss_distribution(tmp_path):
    drawn = plots.plot_label_smoothing(
        str(tmp_path / "label_smoothing.png"),
        smoothing=0.4,
        vocab_size=5,
        targets=[2, 1, 0, 3, 3],
        pad_id=0,
    )
    q = drawn.data["target_distribution"]
    # The Annotated Transformer's example: 0.6 on the target, 0.4 / 3 on the others, pad 0.
    want = np.full((5, 5), 0.4 / 3)
    want[:, 0] = 0.0
    want[np.arange(5), [2, 1, 0, 3, 3]] = 0.6
    want[2] = 0.0  # a pad target: no row
    np.testing.assert_allclose(q, want, rtol=1e-6)
    np.testing.assert_allclose(_read(drawn, "target_distribution").mean(-1), q, atol=0.02)


def test_smoothed_distribution_is_the_one_the_loss_uses():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, 3, 7)).astype(np.float32)
    targets = np.array([[3, 4, 0], [5, 1, 6]])
    loss, _ = label_smoothed_cross_entropy(logits, targets, smoothing=0.2, pad_id=0)
    q = np.asarray(smoothed_target_distribution(targets, 7, smoothing=0.2, pad_id=0))
    log_p = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    np.testing.assert_allclose(float(loss), -(q * log_p).sum(), rtol=1e-5)


def test_make_annotated_transformer_plots_writes_the_three_files(tmp_path):
    drawn = plots.make_annotated_transformer_plots(
        str(tmp_path),
        src=SRC,
        tgt_in=TGT_IN,
        pad_id=0,
        schedules={"noam": noam_schedule(64, warmup_steps=100)},
        steps=400,
        smoothing=0.1,
    )
    assert [d.path.rsplit("/", 1)[-1] for d in drawn] == [
        "masks.png",
        "lr_schedule.png",
        "label_smoothing.png",
    ]
    masks, lr, smoothing = drawn
    # Each file shows what it was given: this batch's masks, white where a query attends...
    want = plots.decoder_masks(SRC, TGT_IN, pad_id=0)
    assert set(masks.data) == set(want)
    for name, mask in want.items():
        np.testing.assert_array_equal(masks.data[name], mask)
        np.testing.assert_array_equal(_read(masks, name).mean(-1) > 0.5, mask)
    # ... the schedule at every one of the 400 steps...
    np.testing.assert_allclose(
        lr.data["noam"], np.asarray(noam_schedule(64, warmup_steps=100)(np.arange(400))), rtol=1e-6
    )
    # ... and the Annotated Transformer's targets smoothed by 0.1: 0.9 on the target, 0.1 / 3
    # on the other non-pad ids, nothing for the pad target 0.
    q = np.full((5, 5), 0.1 / 3)
    q[:, 0] = 0.0
    q[np.arange(5), [2, 1, 0, 3, 3]] = 0.9
    q[2] = 0.0
    np.testing.assert_allclose(smoothing.data["target_distribution"], q, rtol=1e-6)
    np.testing.assert_allclose(_read(smoothing, "target_distribution").mean(-1), q, atol=0.02)
