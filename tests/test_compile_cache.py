"""train.core.compile_cache: where the commands' persistent compilation cache goes, JAX's own
setting winning, and a folder that cannot be made costing a warning, not the run. (That a
command fills the cache and a second run reads it back is in test_train_translate.py.)"""

from __future__ import annotations

import jax
import pytest

from train.core import compile_cache
from train.core.compile_cache import CACHE_ENV, enable_compilation_cache


@pytest.fixture
def no_cache_set():
    """JAX's cache settings cleared for one test (conftest.py set the suite's), then put back
    as they were: no program compiles in between."""
    names = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs")
    saved = {name: getattr(jax.config, name) for name in names}
    jax.config.update("jax_compilation_cache_dir", None)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
    yield
    for name, value in saved.items():
        jax.config.update(name, value)


def test_jax_own_setting_wins():
    # The suite's cache (conftest.py) is JAX's own setting: it stays, thresholds and all.
    before = jax.config.jax_compilation_cache_dir
    assert before
    assert enable_compilation_cache({CACHE_ENV: "/elsewhere"}) == before
    assert jax.config.jax_compilation_cache_dir == before


def test_the_variable_names_the_folder_and_sets_the_threshold(no_cache_set, tmp_path):
    folder = tmp_path / "a" / "xla"
    assert enable_compilation_cache({CACHE_ENV: str(folder)}) == str(folder)
    assert folder.is_dir()
    assert jax.config.jax_compilation_cache_dir == str(folder)
    minimum = jax.config.jax_persistent_cache_min_compile_time_secs
    assert minimum == compile_cache.MIN_COMPILE_SECONDS


def test_jax_threshold_variable_is_kept(no_cache_set, tmp_path):
    env = {CACHE_ENV: str(tmp_path), "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "1.0"}
    assert enable_compilation_cache(env) == str(tmp_path)
    assert jax.config.jax_persistent_cache_min_compile_time_secs == 1.0


def test_the_default_folder_is_under_the_user_cache(no_cache_set, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert enable_compilation_cache({}) == str(tmp_path / "attention-jax" / "xla")
    assert (tmp_path / "attention-jax" / "xla").is_dir()


@pytest.mark.parametrize("value", ["off", "OFF", "0", "false", ""])
def test_off_turns_it_off(no_cache_set, value):
    assert enable_compilation_cache({CACHE_ENV: value}) is None
    assert jax.config.jax_compilation_cache_dir is None


def test_a_folder_that_cannot_be_made_is_a_warning_naming_it(no_cache_set, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.warns(UserWarning, match=f"cannot make {blocker}/xla.*{CACHE_ENV}"):
        assert enable_compilation_cache({CACHE_ENV: str(blocker / "xla")}) is None
    assert jax.config.jax_compilation_cache_dir is None


def test_the_tally_counts_what_the_persistent_cache_saved():
    """A program new to the suite's cache is a miss; compiled again after JAX's in-memory
    caches are emptied, it is read back: a hit. Outside the block nothing is counted."""
    import os

    salt = int.from_bytes(os.urandom(3), "little")  # a program no earlier run has cached
    x = jax.numpy.arange(4.0)

    def compile_once():
        return jax.jit(lambda v: v * 3.0 + salt).lower(x).compile()

    with compile_cache.CacheTally() as first:
        compile_once()
    assert (first.hits, first.misses) == (0, 1)
    assert first.describe().startswith("; 0 of 1 program(s) from the persistent")
    jax.clear_caches()
    with compile_cache.CacheTally() as second:
        compile_once()
    assert (second.hits, second.misses) == (1, 0)
    assert "1 of 1 program(s) from the persistent compilation cache" in second.describe()
    jax.clear_caches()
    compile_once()  # after the block: not counted
    assert (second.hits, second.misses) == (1, 0)
    assert compile_cache.CacheTally().describe() == ""


def test_a_cache_slower_than_compiling_is_said_so_not_as_a_negative_saving():
    # JAX's figure is the entry's compile time less the time to read it back: negative
    # when the program compiled faster than it reads.
    tally = compile_cache.CacheTally()
    tally._event("/jax/compilation_cache/cache_hits")
    tally._duration("/jax/compilation_cache/compile_time_saved_sec", -0.34)
    assert tally.describe() == (
        "; 1 of 1 program(s) from the persistent compilation cache "
        "(reading them took 0.3s more than compiling them had)"
    )
    tally._duration("/jax/compilation_cache/compile_time_saved_sec", 2.0)
    assert tally.describe().endswith("(1.7s of compiling saved)")
