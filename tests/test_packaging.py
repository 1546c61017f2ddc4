"""The package installs like one: a wheel built from the repository, installed into a fresh
virtual environment, runs the main job from another directory with the data it ships, and its
console scripts exist. The model libraries import without the training extra's packages."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import zipfile

import pytest
from helpers import subprocess_xla_flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Every test here builds a wheel or starts a Python of its own.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheel")
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), REPO],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert built.returncode == 0, built.stdout + built.stderr
    (path,) = out.glob("attention_jax-*.whl")
    return path


def test_the_wheel_ships_code_data_and_licenses_but_no_tests(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert "train/translate/__main__.py" in names and "xl_jax/model.py" in names
    shipped = [n for n in names if n.startswith("train/data/datasets/data/")]
    assert sum(n.endswith(".gz") for n in shipped) == 18  # 12 Multi30k + 6 PTB files
    assert any(n.endswith("licenses/LICENSE") for n in names)
    assert any(n.endswith("licenses/NOTICE") for n in names)
    assert not any(n.startswith("tests/") for n in names)


def test_a_fresh_venv_runs_the_main_job_from_another_directory(wheel, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120
    )
    python = venv / "bin" / "python"
    # The dependencies come from this interpreter's site-packages (a plain path entry: the
    # editable install's finder there is not loaded), the package itself only from the wheel.
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    with open(os.path.join(site, "deps.pth"), "w") as f:
        f.write(sysconfig.get_paths()["purelib"] + "\n")
    installed = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(python),
            "install",
            "-q",
            "--no-deps",
            "--ignore-installed",
            "--no-compile",
            str(wheel),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert installed.returncode == 0, installed.stdout + installed.stderr
    for script in ("attention-jax-translate", "attention-jax-lm"):
        assert (venv / "bin" / script).exists()

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    # The suite's compile settings (not what is under test here), one device.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(
        JAX_PLATFORMS="cpu", TFDS_DATA_DIR=str(tmp_path / "tfds"), XLA_FLAGS=subprocess_xla_flags()
    )
    where = subprocess.run(
        [str(python), "-c", "import train; print(train.__file__)"],
        cwd=elsewhere,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert where.stdout.startswith(str(venv)), where.stdout + where.stderr
    done = subprocess.run(
        [
            str(venv / "bin" / "attention-jax-translate"),
            "--preset",
            "tiny",
            "--workdir",
            "run",
            "--steps",
            "2",
            "--log_every",
            "1",
            "--eval_sentences",
            "8",
            "--beam_size",
            "1",
            "--plots",
            "false",
        ],
        cwd=elsewhere,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "final: step 2, test BLEU" in done.stdout
    # Not a terminal: one plain line per logging interval, no progress-bar stream.
    assert "step 1/2: loss" in done.stdout and "\r" not in done.stdout + done.stderr
    assert (elsewhere / "run" / "config.json").exists()


def test_the_model_libraries_need_only_jax_flax_optax_and_numpy():
    """Importing transformer_jax and xl_jax loads none of the training extra's packages."""
    code = (
        "import sys, transformer_jax, xl_jax; "
        "heavy = {'tensorflow_datasets', 'orbax', 'sacrebleu', 'matplotlib', 'tqdm', "
        "'tensorboardX', 'sentencepiece', 'safetensors', 'torch', 'ctranslate2'}; "
        "print(sorted(heavy & set(sys.modules)))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_the_model_core_imports_nothing_above_it():
    """The layers stand below the searches: the model core, the attention core and int8 import
    nothing from transformer_jax.decoding, the interchange formats or the training library."""
    import ast

    above = ("transformer_jax.decoding", "transformer_jax.interchange", "train")
    core = ["model", "layers", "attention", "int8", "losses", "positional", "config", "platform"]
    for name in core:
        path = os.path.join(REPO, "transformer_jax", f"{name}.py")
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
        imported = [
            node.module
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.module
        ] + [a.name for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names]
        bad = [m for m in imported if m == above[2] or m.startswith(tuple(a + "." for a in above))]
        assert bad == [], (name, bad)


def test_only_the_model_origin_asks_whether_a_run_fine_tunes():
    """Whether a translation run starts from a Marian folder is decided once
    (`train.translate.origin.model_origin`): no other module of the training library reads a
    config's `pretrained` field (the command line's `args.pretrained` picks a mode, not a
    run's behaviour)."""
    import ast
    import glob

    readers = []
    for path in glob.glob(os.path.join(REPO, "train", "**", "*.py"), recursive=True):
        if path.endswith(os.path.join("translate", "origin.py")):
            continue
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and node.attr == "pretrained"
                and not (isinstance(node.value, ast.Name) and node.value.id == "args")
            ):
                readers.append(f"{os.path.relpath(path, REPO)}:{node.lineno}")
    # The config's own property hands the field to the origin.
    assert len(readers) == 1 and readers[0].startswith("train/translate/config.py:"), readers


def test_the_training_library_keeps_its_size_rules():
    """The training library's rule (docs/contributing.md): no module of train/ over 600 lines
    and no function over 100, so that one job reads in one sitting."""
    import ast
    import glob

    too_long = []
    for path in glob.glob(os.path.join(REPO, "train", "**", "*.py"), recursive=True):
        with open(path, encoding="utf-8") as f:
            text = f.read()
        name = os.path.relpath(path, REPO)
        if len(text.splitlines()) > 600:
            too_long.append(f"{name}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > 100:
                    too_long.append(f"{name}:{node.lineno} {node.name}: {length} lines")
    assert too_long == [], too_long
