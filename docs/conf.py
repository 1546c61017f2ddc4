"""Sphinx configuration of the documentation site.

Build it with `sphinx-build -W -b html docs docs/_build/html` (after `pip install -e ".[docs]"`).
The tutorials are MyST Markdown notebooks (`tutorials/*.md`) that myst-nb executes during the
build, so every figure on the site is drawn by the code above it. Each has a paired `.ipynb`
beside it, without outputs, for Colab (`python docs/sync_notebooks.py` rewrites them).
"""

import os
import re
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
sys.path.insert(0, str(ROOT))  # the packages, when the docs are built from a checkout
sys.path.insert(0, str(DOCS / "_ext"))
# The notebooks run in subprocess kernels, which inherit the environment, not sys.path.
os.environ["PYTHONPATH"] = os.pathsep.join(
    [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
)

# The notebooks compile many small programs and run each a few times: the test suite's cheap
# XLA:CPU compile settings (tests/fast_compile.py) take a good part off that. A notebook may
# ask for more per program (`jax.jit(..., compiler_options=...)`), as the seq2seq tutorial
# does for ConvS2S.
sys.path.insert(0, str(ROOT / "tests"))
from fast_compile import xla_flags  # noqa: E402

os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), xla_flags()]).strip()

# The shape glossary page includes the alphabet from its one source, transformer_jax/shapes.py.
_generated = DOCS / "_generated"
_generated.mkdir(exist_ok=True)
_glossary = (ROOT / "transformer_jax" / "shapes.py").read_text().split('"""')[1]
(_generated / "shapes.txt").write_text(_glossary.split("\n\n", 1)[1].strip("\n") + "\n")

project = "attention-jax"
author = "the attention-jax authors"
copyright = "2026, the attention-jax authors"

# The repository the "Open in Colab" links and the notebooks' install cells point at: one place.
REPOSITORY = "https://github.com/attention-jax/attention-jax"

extensions = [
    "myst_nb",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinx.ext.mathjax",
    # MathJax 3 served with the site (copied into _static/mathjax/), not from a CDN, so the
    # formulas render offline: sphinx-mathjax-offline (MathJax's files and a 10-line
    # extension), through _ext/mathjax_offline.py.
    "mathjax_offline",
    "sphinx.ext.viewcode",
    # A copy button on every code block and cell (prompts and outputs left out of the copy).
    "sphinx_copybutton",
    "colab",
    # The notebooks not yet in jupyter-cache run side by side before reading (one per core),
    # not one after another as Sphinx reads them.
    "parallel_notebooks",
    # The command reference, written from the commands' own parsers at each build.
    "commands",
    # A short name in a docstring (`TransformerConfig`) links to the object it names.
    "short_names",
]

exclude_patterns = [
    "_build",
    "_generated",
    "_templates",
    "**.ipynb",
    "**.ipynb_checkpoints",
    "README.md",
    "sync_notebooks.py",
]

# Our docstrings write names and code in single backticks (Markdown habit): a name that is a
# documented object links to it (the `py:obj` role, and _ext/short_names.py for short names);
# anything else shows as code, not italics.
default_role = "py:obj"
autodoc_member_order = "bysource"
# Defaults as the source writes them (`dtype=jnp.float32`, not "<class 'jax.numpy.float32'>").
autodoc_preserve_defaults = True
autodoc_typehints = "none"  # the shapes in the docstrings say more than the annotations
autodoc_default_options = {"members": True, "show-inheritance": True}
# One page per module: the API pages list their modules in `autosummary` tables, and
# autosummary writes each module's page (api/generated/, from _templates/autosummary/module.rst).
autosummary_generate = True
templates_path = ["_templates"]
napoleon_google_docstring = True
napoleon_numpy_docstring = False

myst_enable_extensions = ["dollarmath", "amsmath", "colon_fence", "deflist"]
myst_heading_anchors = 3

# Notebooks: run at build time; a cell that raises fails the build. jupyter-cache keeps
# rebuilds short (a notebook reruns only when its code changed).
nb_execution_mode = os.environ.get("ATTENTION_JAX_DOCS_EXECUTE", "cache")
nb_execution_cache_path = str(DOCS / "_build" / ".jupyter_cache")
nb_execution_timeout = 600
nb_execution_raise_on_error = True
nb_execution_show_tb = True
nb_merge_streams = True
# Markdown that a cell displays (the results tables) is parsed as MyST, so tables render.
nb_render_markdown_format = "myst"

html_theme = "furo"
html_title = "attention-jax"
# Every page's header links the repository (furo's view-source and edit buttons).
html_theme_options = {
    "source_repository": REPOSITORY + "/",
    "source_branch": "main",
    "source_directory": "docs/",
}
colab_repository = REPOSITORY
colab_branch = "main"


def _skip_class_aliases(app, what, name, obj, skip, options):
    """Leave out a class attribute that holds another class: the configs' `dtype = jnp.float32`
    default, which autodoc would list as a member "alias of float32" beside the field that the
    class docstring's Attributes describe (Sphinx: "duplicate object description")."""
    if what == "class" and isinstance(obj, type) and obj.__name__ != name:
        return True
    return None


def _skip_flax_module_members(app, what, name, obj, skip, options):
    """Leave out what every Flax module has and none documents: `setup` without a docstring of
    its own (autodoc would repeat `nn.Module.setup`'s on each), and the `parent` and `name`
    fields that Flax adds to every module's dataclass."""
    if what != "class" and what != "module":
        return None
    if name == "setup" and callable(obj) and not (obj.__doc__ or "").strip():
        return True
    if name == "setup" and (obj.__doc__ or "") == _flax_setup_doc():
        return True
    if name in ("parent", "name") and type(obj).__name__ in ("_Sentinel", "NoneType", "Field"):
        return True
    return None


def _flax_setup_doc():
    import flax.linen as nn

    return nn.Module.setup.__doc__


# Flax's dataclass transform appends `parent` and `name` to every module's constructor; they are
# how Flax nests modules, not arguments a user passes, so the signatures leave them out.
_FLAX_FIELDS = re.compile(
    r"(,\s*)?parent(: [^=]*)?=\s*<flax\.linen\.module\._Sentinel object[^>]*>"
    r"(,\s*name(: [^=]*)?\s*=\s*None)?"
)


# A dataclass's generated __init__ has no source to preserve its defaults from: a class held as
# a default (`dtype: Any = jnp.float32`) would print as "<class 'jax.numpy.float32'>".
_CLASS_REPR = re.compile(r"<class '([\w.]+)'>")


def _class_default(match: re.Match) -> str:
    path = match.group(1)
    return "jnp." + path.rsplit(".", 1)[1] if path.startswith("jax.numpy.") else path


def _tidy_signature(app, what, name, obj, options, signature, return_annotation):
    if signature and "_Sentinel" in signature:
        signature = _FLAX_FIELDS.sub("", signature)
    if signature:
        signature = _CLASS_REPR.sub(_class_default, signature)
    return signature, return_annotation


_NOT_PROSE = re.compile(r"^\s*([-*+] |\d+[.)] |:|\.\. |>>>)")


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _indented_blocks_as_literal(app, what, name, obj, options, lines):
    """Our docstrings indent what is laid out by hand (a shape legend, a usage example, a
    table of files) under a paragraph, Markdown-style. reStructuredText reads that as a block
    quote and runs its lines together; here the paragraph ends with "::", which makes the
    block literal, as written. Lists, fields, directives and blocks already literal are left
    alone."""
    for i in range(2, len(lines)):
        line, prev = lines[i], lines[i - 2]
        if not line.strip() or lines[i - 1].strip() or not prev.strip():
            continue
        if _indent(line) <= _indent(prev) or prev.rstrip().endswith("::"):
            continue
        start = i - 2  # the first line of the paragraph above
        while start > 0 and lines[start - 1].strip() and _indent(lines[start - 1]) == _indent(prev):
            start -= 1
        if start > 0 and lines[start - 1].strip():
            continue  # the paragraph continues something (a list item's or a field's body)
        if _NOT_PROSE.match(lines[start]):
            continue
        lines[i - 2] = prev.rstrip() + (":" if prev.rstrip().endswith(":") else " ::")


def _drop_object_base(app, name, obj, options, bases):
    """A class's bases, without `object`: "Bases: object" says nothing."""
    bases[:] = [b for b in bases if b is not object]


def setup(app):
    app.connect("autodoc-process-bases", _drop_object_base)
    app.connect("autodoc-process-docstring", _indented_blocks_as_literal)
    app.connect("autodoc-skip-member", _skip_class_aliases)
    app.connect("autodoc-skip-member", _skip_flax_module_members)
    app.connect("autodoc-process-signature", _tidy_signature)
