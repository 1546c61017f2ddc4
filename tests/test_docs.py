"""The documentation site's sources: the tutorials, their Colab notebooks, the table of contents.

The site itself (every tutorial executed, warnings as errors) is built by `.ci/run` with the
README's command; these tests check, in seconds, what a build does not: that each Colab
notebook is its source's, that each notebook installs the library from the repository the
site links to, and what the build's notebook runner does with a notebook that fails.
"""

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

jupytext = pytest.importorskip("jupytext")  # the 'docs' extra (part of 'test')

DOCS = Path(__file__).resolve().parents[1] / "docs"
TUTORIALS = DOCS / "tutorials"


def _sync_notebooks():
    spec = importlib.util.spec_from_file_location("sync_notebooks", DOCS / "sync_notebooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _notebook_sources():
    return _sync_notebooks().notebook_sources(TUTORIALS)


def _repository():
    match = re.search(r'^REPOSITORY = "([^"]+)"$', (DOCS / "conf.py").read_text(), re.M)
    assert match, "docs/conf.py sets REPOSITORY"
    return match.group(1)


def test_each_colab_notebook_is_written_from_its_source():
    assert _notebook_sources(), "no tutorial notebooks found"
    assert _sync_notebooks().main(["--check"]) == 0
    for source in _notebook_sources():
        notebook = jupytext.read(source.with_suffix(".ipynb"))
        cells = [c for c in notebook.cells if c.cell_type == "code"]
        assert all(not c.get("outputs") for c in cells), f"{source.stem}.ipynb carries outputs"
        expected = [c.source for c in jupytext.read(source).cells if c.cell_type == "code"]
        assert [c.source for c in cells] == expected


def test_a_stale_or_missing_colab_notebook_is_named_and_rewritten(tmp_path, capsys):
    sync = _sync_notebooks()
    source = _notebook_sources()[0]
    (tmp_path / source.name).write_text(source.read_text())
    (tmp_path / "plain.md").write_text("# A page without code\n")  # not a notebook: no twin
    assert sync.main(["--check", "--tutorials", str(tmp_path)]) == 1
    assert f"{source.stem}.ipynb" in capsys.readouterr().err
    assert sync.main(["--tutorials", str(tmp_path)]) == 0
    assert sync.main(["--check", "--tutorials", str(tmp_path)]) == 0
    assert not (tmp_path / "plain.ipynb").exists()
    # An edit to the source makes its notebook stale again.
    (tmp_path / source.name).write_text(source.read_text() + "\n```{code-cell} ipython3\n1\n```\n")
    assert sync.main(["--check", "--tutorials", str(tmp_path)]) == 1


def test_each_notebook_first_installs_the_library_from_the_sites_repository():
    repository = _repository()
    for source in _notebook_sources():
        first = next(c for c in jupytext.read(source).cells if c.cell_type == "code")
        assert 'find_spec("transformer_jax") is None' in first.source, source.name
        assert f"@ git+{repository}" in first.source, source.name


def test_the_table_of_contents_lists_every_tutorial_and_only_existing_ones():
    toc = (TUTORIALS / "index.md").read_text().split("```{toctree}")[1].split("```")[0]
    listed = {line.strip() for line in toc.splitlines()[1:] if line.strip() and ":" not in line}
    pages = {p.stem for p in TUTORIALS.glob("*.md")} - {"index"}
    assert listed == pages


def _notebook_md(code: str) -> str:
    head = _notebook_sources()[0].read_text().split("\n---\n", 1)[0]  # a tutorial's front matter
    return f"{head}\n---\n\n# A page\n\n```{{code-cell}} ipython3\n{code}\n```\n"


def test_the_notebooks_not_yet_cached_run_side_by_side_before_reading(tmp_path):
    """docs/_ext/parallel_notebooks.py: each notebook jupyter-cache lacks runs before Sphinx
    reads it; one that fails is left uncached (reading runs it again and fails the build with
    myst-nb's traceback); another execution mode runs nothing. The extension runs in a fresh
    interpreter, as in a build: its process pool forks, which a test process holding JAX's
    and tensorboardX's threads must not do."""
    from jupyter_cache import get_cache
    from myst_nb.core.read import myst_nb_reader_plugin

    extension_path = DOCS / "_ext" / "parallel_notebooks.py"
    spec = importlib.util.spec_from_file_location("parallel_notebooks", extension_path)
    extension = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(extension)

    src = tmp_path / "src"
    (src / "tutorials").mkdir(parents=True)
    (src / "_build").mkdir()
    pages = {
        "one": src / "results.md",
        "two": src / "tutorials" / "two.md",
        "fails": src / "tutorials" / "fails.md",
    }
    pages["one"].write_text(_notebook_md("print(6 * 7)"))
    pages["two"].write_text(_notebook_md("print('two')"))
    pages["fails"].write_text(_notebook_md("raise ValueError('planted')"))
    (src / "plain.md").write_text("# Not a notebook\n")
    (src / "_build" / "old.md").write_text(_notebook_md("raise SystemExit"))  # never a source
    assert extension._notebooks(src) == sorted(pages.values())
    cache_path = tmp_path / "jupyter_cache"

    def build(mode):
        script = f"""
import importlib.util
from types import SimpleNamespace
spec = importlib.util.spec_from_file_location("parallel_notebooks", {str(extension_path)!r})
extension = importlib.util.module_from_spec(spec)
spec.loader.exec_module(extension)
config = SimpleNamespace(
    nb_execution_mode={mode!r}, nb_execution_cache_path={str(cache_path)!r},
    nb_execution_timeout=120,
)
extension._execute_stale(SimpleNamespace(config=config, srcdir={str(src)!r}))
"""
        subprocess.run([sys.executable, "-c", script], check=True, timeout=300)

    def cached(path):
        try:
            return get_cache(str(cache_path)).match_cache_notebook(myst_nb_reader_plugin(str(path)))
        except KeyError:
            return None

    build("force")
    assert all(cached(p) is None for p in pages.values())

    build("cache")
    assert cached(pages["fails"]) is None
    for name in ("one", "two"):
        record = cached(pages[name])
        assert record is not None, name
        bundle = get_cache(str(cache_path)).get_cache_bundle(record.pk)
        text = "".join(o.get("text", "") for o in bundle.nb.cells[0].outputs)
        assert text == ("42\n" if name == "one" else "two\n")


def test_the_readme_s_transformer_code_runs_and_its_step_trains_with_dropout():
    import jax
    import numpy as np

    with open(DOCS.parent / "README.md", encoding="utf-8") as f:
        section = f.read().split("## The Transformer\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) >= 2
    namespace: dict = {}
    exec(compile("\n".join(blocks[:1]), "README.md", "exec"), namespace)
    before = namespace["params"]
    exec(compile("\n".join(blocks[1:]), "README.md", "exec"), namespace)
    assert np.isfinite(float(namespace["loss"]))
    changed = jax.tree.map(lambda a, b: bool(np.any(a != b)), before, namespace["params"])
    assert all(jax.tree.leaves(changed))
    # The step's dropout is on: the same parameters and batch give another loss with
    # another key.
    ns = namespace
    loss = lambda key: ns["train_step"](  # noqa: E731
        ns["params"], ns["opt_state"], ns["src"], ns["tgt"], ns["jnp"].array([[8, 9, 2]]), key
    )[2]
    assert float(loss(jax.random.PRNGKey(5))) != float(loss(jax.random.PRNGKey(6)))


def test_the_command_reference_lists_every_flag_mode_and_preset():
    spec = importlib.util.spec_from_file_location("commands", DOCS / "_ext" / "commands.py")
    commands = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(commands)
    page = commands.command_reference()
    for command in commands.COMMANDS:
        assert f"## `python -m {command}`" in page
        for action in commands._parser(command)._actions:
            for flag in action.option_strings:
                assert flag in page, (command, flag)
        for mode in commands._modes(command):
            assert f"| `{mode}` |" in page, (command, mode)
        for preset in commands._presets(command):
            assert f"- `{preset}`: " in page, (command, preset)
    # The wmt14_base recipe's settings as its preset table says them.
    assert "`tokens_per_batch` 25000" in page
    # The --help blocks are wrapped at a fixed width, whatever the building machine's terminal.
    blocks = re.findall(r"```text\n(.*?)```", page, re.S)
    assert len(blocks) == len(commands.COMMANDS)
    assert max(len(line) for block in blocks for line in block.splitlines()) <= 100


# What fits a code block of the site at 1280 px without scrolling sideways (furo's text column).
CODE_COLUMNS = 88
_FIGURE = re.compile(r"\bplt\.(show|subplots|figure)\(")


def _code_cells(source: Path):
    return [c for c in jupytext.read(source).cells if c.cell_type == "code"]


def test_tutorial_code_fits_the_page_without_scrolling():
    long = [
        f"{source.name}: {line}"
        for source in _notebook_sources()
        for cell in _code_cells(source)
        for line in cell.source.splitlines()
        if len(line) > CODE_COLUMNS
    ]
    assert not long, f"lines over {CODE_COLUMNS} columns:\n" + "\n".join(long)


def test_every_figure_of_a_tutorial_has_alt_text():
    """A figure's alt text is its cell's `mystnb.image.alt`: without it, the page gives the
    image's hashed file name to a screen reader. The tutorials and the site's executed pages
    (the results page)."""
    missing = []
    pages = _sync_notebooks().notebook_sources(DOCS)
    for source in [*_notebook_sources(), *pages]:
        for cell in _code_cells(source):
            if not _FIGURE.search(cell.source):
                continue
            alt = cell.metadata.get("mystnb", {}).get("image", {}).get("alt", "")
            if len(alt.split()) < 5:  # a sentence, not a placeholder
                missing.append(f"{source.name}: {cell.source.splitlines()[0]}")
    assert not missing, "figures without alt text:\n" + "\n".join(missing)
