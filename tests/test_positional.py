"""Positional encodings (transformer_jax/positional.py): the tables, their layouts, and the
module that picks one from the config.

The mutants these kill survived the model-level tests (benchmarks/mutation/): a layout chosen
by a comparison that only the config's spelling exercises, batched positions, an even width
that is not a multiple of four, the learned table's initial scale.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax import TransformerConfig
from transformer_jax.positional import PositionalEncoding, sinusoidal_positions, sinusoids_at


def _formula(positions: np.ndarray, d: int) -> np.ndarray:
    """The paper's interleaved table, PE[pos, 2i] = sin, PE[pos, 2i + 1] = cos."""
    i = np.arange(d // 2)
    angle = positions[..., None] / 10000.0 ** (2 * i / d)
    out = np.zeros((*positions.shape, d))
    out[..., 0::2], out[..., 1::2] = np.sin(angle), np.cos(angle)
    return out


def _spelled(*parts: str) -> str:
    """A string built at run time, as a flag's value is: equal to a literal, not the same
    object (so `is` in place of `==` fails here as it would for a user)."""
    return "".join(parts)


@pytest.mark.parametrize("d", [6, 10])  # even, not multiples of four
def test_widths_that_are_even_but_not_multiples_of_four_work(d):
    np.testing.assert_allclose(
        sinusoidal_positions(5, d), _formula(np.arange(5), d), rtol=1e-5, atol=1e-6
    )


@pytest.mark.parametrize("d", [7, 1])
def test_odd_widths_are_refused(d):
    with pytest.raises(ValueError, match="even"):
        sinusoids_at(jnp.arange(3), d)


def test_batched_positions_give_each_row_its_table_in_both_layouts():
    positions = np.array([[0, 1, 2, 3], [5, 6, 7, 8], [2, 2, 9, 1]])  # [B, T]
    d = 8
    interleaved = np.asarray(sinusoids_at(jnp.asarray(positions), d))
    np.testing.assert_allclose(interleaved, _formula(positions, d), rtol=1e-5, atol=1e-6)
    concat = np.asarray(sinusoids_at(jnp.asarray(positions), d, layout=_spelled("con", "cat")))
    assert concat.shape == (3, 4, d)
    want = _formula(positions, d)
    np.testing.assert_allclose(concat[..., : d // 2], want[..., 0::2], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(concat[..., d // 2 :], want[..., 1::2], rtol=1e-5, atol=1e-6)


def test_tables_take_their_arguments_by_name():
    np.testing.assert_array_equal(
        sinusoids_at(positions=jnp.arange(4), d_model=8), sinusoidal_positions(4, 8)
    )
    np.testing.assert_array_equal(
        sinusoidal_positions(length=4, d_model=8, layout="concat"),
        sinusoids_at(jnp.arange(4), 8, layout="concat"),
    )


@pytest.mark.parametrize(
    "positional, layout",
    [
        (_spelled("sinus", "oidal"), "interleaved"),
        (_spelled("sinusoidal", "_concat"), "concat"),
    ],
)
def test_the_module_takes_the_layout_the_config_names(positional, layout):
    cfg = TransformerConfig.tiny(d_model=8, n_heads=2, positional=positional)
    positions = jnp.array([[0, 3, 1], [4, 4, 2]])
    module = PositionalEncoding(cfg)
    variables = module.init(jax.random.PRNGKey(0), positions)
    assert not variables  # sinusoids: no parameters
    np.testing.assert_array_equal(
        module.apply(variables, positions), sinusoids_at(positions, 8, layout=layout)
    )


def test_the_learned_table_starts_small_and_is_looked_up_by_position():
    cfg = TransformerConfig.tiny(
        d_model=64, n_heads=4, max_len=512, positional=_spelled("lear", "ned")
    )
    module = PositionalEncoding(cfg)
    positions = jnp.array([[0, 5, 511]])
    variables = module.init(jax.random.PRNGKey(0), positions)
    table = np.asarray(variables["params"]["table"])
    assert table.shape == (512, 64)
    assert abs(table.std() - 0.02) < 0.002 and abs(table.mean()) < 0.002
    np.testing.assert_array_equal(module.apply(variables, positions)[0], table[[0, 5, 511]])
