"""Test-wide JAX set-up: 8 fake CPU devices, so data parallelism is tested on any machine.

This must run before JAX initialises its backends, which is why it lives in conftest.py and
touches only configuration (importing jax is fine; creating an array is not).
"""

import os
import tempfile

import fast_compile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# With JAX_PLATFORMS=cuda,cpu (the GPU-only tests), each of the two pytest-xdist workers would
# otherwise take 75% of the GPU's memory up front: the second one's autotuner then failed with
# CUDA_ERROR_OUT_OF_MEMORY (one H100, 2026-11-26). Allocating on demand lets both share it.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
# XLA:CPU settings that compile the suite's hundreds of tiny programs fast (fast_compile.py,
# shared with the docs build). Runs the tests start as subprocesses get them too
# (helpers.subprocess_xla_flags).
TEST_XLA_FLAGS = fast_compile.xla_flags()
# Older jax versions read the flag; newer ones the config option. Setting both is harmless.
os.environ["XLA_FLAGS"] = " ".join(
    [os.environ.get("XLA_FLAGS", ""), TEST_XLA_FLAGS, "--xla_force_host_platform_device_count=8"]
).strip()

import jax  # noqa: E402

try:
    jax.config.update("jax_num_cpu_devices", 8)
except AttributeError:  # pragma: no cover - jax without the option: the XLA flag applies.
    pass

# A persistent compilation cache for the session: each run jits fresh closures, so JAX's
# in-memory caches never share a program between two runs of the same model (and
# jax.clear_caches() empties them after every module), while this one does, keyed by the
# program itself. Every threshold at 0: the tiny test models compile in well under a second.
# One cache for the whole test run: a pytest-xdist worker shares its controller's (its parent
# process's), so a program one worker compiled is a hit on the other. Entries are written
# whole or read as a miss (JAX warns and compiles), so the workers need no lock.
# A caller that runs the suite many times over (benchmarks/mutation/run.py, a pytest process
# per mutant) names a cache of its own to share between the runs, and removes it itself.
_XDIST_WORKER = "PYTEST_XDIST_WORKER" in os.environ
_SHARED_CACHE = os.environ.get("ATTENTION_JAX_TEST_CACHE")
_COMPILATION_CACHE = _SHARED_CACHE or os.path.join(
    tempfile.gettempdir(), f"jax_cache_{os.getppid() if _XDIST_WORKER else os.getpid()}"
)
os.makedirs(_COMPILATION_CACHE, exist_ok=True)
jax.config.update("jax_compilation_cache_dir", _COMPILATION_CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
# The same cache for the runs tests start as subprocesses (they inherit the environment; JAX
# reads these at import): the CLI tests repeat the same tiny programs run after run, and each
# would otherwise compile them again.
os.environ.update(
    JAX_COMPILATION_CACHE_DIR=_COMPILATION_CACHE,
    JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
    JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
)

import collections  # noqa: E402
import copy  # noqa: E402
import gc  # noqa: E402
import shutil  # noqa: E402

import orbax.checkpoint as ocp  # noqa: E402
import pytest  # noqa: E402

# Checkpoints saved in the test processes on their 8 fake CPU devices are written by one
# replica, as orbax writes them on GPUs. Its default elsewhere (replica-parallel: each device
# writes a slice of every replicated array) splits every array of a save 8 ways in this one
# process, each slice an eager op compiled per shape: half of the suite's time in orbax's
# writes (benchmarks/ci_time_2026-11-29/). A user's CPU run has one device and never takes
# that path; the runs tests start as subprocesses keep orbax's default, so both are run.
# (orbax has no public switch for it but the handler's constructor, whose default handler
# also holds an array metadata store built privately: hence the copy.)
_ARRAY_HANDLER = copy.copy(ocp.type_handlers.get_type_handler(jax.Array))
_ARRAY_HANDLER._use_replica_parallel = False
ocp.type_handlers.register_type_handler(jax.Array, _ARRAY_HANDLER, override=True)

# Python's full (oldest-generation) collections made rare: tracing and lowering allocate many
# objects that live until their module ends, and every automatic full collection scanned them
# all, again and again (what it cost: benchmarks/ci_time_2026-11-29/). The younger
# generations are collected as usual, and the fixture below collects everything after each
# module, so garbage never outlives its module.
gc.set_threshold(700, 10, 1000)


# The modules that take 5 s or more, longest first (worker-seconds in a fresh clone's CI,
# benchmarks/ci_time_2026-11-29/): the two pytest-xdist workers are handed these before the
# rest, and the short modules fill in at the end, so that a long module never starts while the
# other worker runs out of work. pytest-xdist's own order (pyproject.toml turns it off:
# --no-loadscope-reorder) hands out modules by their number of tests, which put
# test_multiprocess (7 tests, about 100 s) and test_finetune (5, 40 s) among the last. A
# module missing here goes with the short ones: the order changes only when the tests end.
LONGEST_FIRST = (
    "test_train_translate.py",
    "test_multiprocess.py",
    "test_transformer_decode.py",
    "test_bench.py",
    "test_target.py",
    "test_faults.py",
    "test_decode_golden.py",
    "test_recipes.py",
    "test_finetune.py",
    "test_xl_adaptive.py",
    "test_seq2seq.py",
    "test_tfds_data.py",
    "test_efficiency.py",
    "test_train_lm.py",
    "test_token_cache.py",
    "test_translate_files.py",
    "test_xl_fused_attention.py",
    "test_transformer.py",
    "test_train_compare.py",
    "test_xl_model.py",
    "test_data_builders.py",
    "test_quantize.py",
    "test_ct2_export.py",
    "test_packaging.py",
    "test_translate_pretrained.py",
    "test_inference_restore.py",
    "test_xl_generate.py",
    "test_train_parallel.py",
    "test_nnx.py",
    "test_workdir_errors.py",
    "test_lm_text.py",
    "test_marian_export.py",
    "test_xl_remat.py",
    "test_marian.py",
    "test_remote_workdir.py",
    "test_decode.py",
    "test_transformer_copy_task.py",
    "test_schedule_fit.py",
    "test_host_memory.py",
    "test_xl_pytorch.py",
    "test_run_layer.py",
    "test_fsdp.py",
    "test_hard_attention.py",
    "test_convs2s.py",
)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """Modules in LONGEST_FIRST's order, then the others by number of tests, most first (as
    pytest-xdist orders them); each module's tests keep their order (the sort is stable).

    Only in pytest-xdist's workers, where the order balances the two workers' loads. One
    process keeps the command line's order: a mutation run (benchmarks/mutation/run.py) names
    a module's quickest, sharpest tests first, so that with -x most mutants stop there."""
    if not hasattr(config, "workerinput"):  # set in pytest-xdist's workers alone (not in an
        return  # environment variable, which a pytest started by a test would inherit)
    module = {item: item.nodeid.split("::")[0] for item in items}
    tests = collections.Counter(module.values())
    longest = {name: i for i, name in enumerate(LONGEST_FIRST)}

    def rank(item):
        name = os.path.basename(module[item])
        return (0, longest[name]) if name in longest else (1, -tests[module[item]])

    items.sort(key=rank)


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs():
    """Drop JAX's compiled programs after each test module: every XLA:CPU executable holds
    memory mappings of its own code until it is freed, and over the whole suite one process
    would hold more than Linux's vm.max_map_count allows, crashing the next compilation. No
    test needs another module's programs in memory (the persistent cache keeps them on disk)."""
    yield
    jax.clear_caches()
    gc.collect()


@pytest.fixture
def scratch_tempdir(tmp_path, monkeypatch):
    """An empty folder that Python's `tempfile` uses for this test (its `tempdir`), so that the
    test can assert that nothing was left in it."""
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    return scratch


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory):
    """One TFDS data directory for the whole session, with PTB (word and character level) and
    Multi30k prepared once, before any run reads it: runs only read it, so subprocesses never
    build a dataset concurrently. A test that damages a dataset copies it first."""
    # Lazy: importing TFDS takes seconds, and most test modules never need it.
    from train.data.datasets import Multi30k, Ptb

    path = tmp_path_factory.mktemp("tfds")
    for level in ("word", "char"):
        Ptb(config=level, data_dir=path).download_and_prepare()
    Multi30k(data_dir=path).download_and_prepare()
    return path


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory, data_dir):
    """The Multi30k SentencePiece tokenizer of the tiny translation preset, trained once for
    the session (a run's `tokenizer_dir`) instead of once a run. Runs only read it."""
    # Lazy, as in data_dir.
    from train import translate
    from train.data.tokenizers import multi30k_tokenizer

    path = tmp_path_factory.mktemp("tokenizer")
    multi30k_tokenizer(
        path, vocab_size=translate.make_config("transformer", "tiny").vocab_size, data_dir=data_dir
    )
    return path


@pytest.fixture(scope="session")
def lm_straight(tmp_path_factory, data_dir):
    """One uninterrupted 6-step run of the tiny Transformer-XL on PTB, for every module that
    compares a resumed, remote or logged run with it: (config, workdir, final metrics).
    Read-only: a test that trains on from it copies it or uses the config in a workdir of
    its own."""
    from helpers import tiny_lm_config  # lazy, as in data_dir

    from train import lm

    config = tiny_lm_config(data_dir)
    workdir = tmp_path_factory.mktemp("lm_straight")
    return config, workdir, lm.train_and_evaluate(config, str(workdir))


def pytest_unconfigure(config):
    """The test run's cache goes when it ends: removed by the controller (the process that
    started any workers), after every worker has stopped."""
    if not _XDIST_WORKER and not _SHARED_CACHE:
        shutil.rmtree(_COMPILATION_CACHE, ignore_errors=True)
