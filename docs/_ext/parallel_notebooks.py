"""Run the notebooks that jupyter-cache does not hold yet over a process pool, before Sphinx
reads them.

In myst-nb's "cache" mode a notebook runs when Sphinx reads it. Sphinx's parallel reading
hands each process a run of documents in name order, so the tutorials (and the results page)
fall into one run and execute one after another. They spend most of their time compiling,
one program at a time, so one of the machine's cores sat idle for most of the build.

At `builder-inited` this extension finds the notebooks whose code has no cached execution,
executes them with jupyter-cache's parallel executor (one process per core), and caches each
that succeeds. Reading then takes their outputs from the cache. A notebook that fails here is
not cached: it runs again when Sphinx reads it, and its error fails the build there, with
myst-nb's traceback, as before. With any other `nb_execution_mode` this does nothing.
"""

from __future__ import annotations

import logging
from pathlib import Path

# The name under which myst-nb registers its MyST Markdown reader with jupyter-cache.
_READER = {"name": "myst_nb_md", "type": "plugin"}


def _notebooks(srcdir: Path) -> list[Path]:
    """The MyST notebooks below `srcdir`: the `.md` files with jupytext front matter (as
    `sync_notebooks.notebook_sources` finds the tutorials), outside the `_`-folders."""
    return [
        path
        for path in sorted(srcdir.rglob("*.md"))
        if not path.relative_to(srcdir).as_posix().startswith("_")
        and path.read_text(encoding="utf-8").startswith("---\njupytext:")
    ]


def _execute_stale(app) -> None:
    config = app.config
    if config.nb_execution_mode != "cache":
        return
    from jupyter_cache import get_cache
    from jupyter_cache.executors import load_executor
    from myst_nb.core.read import myst_nb_reader_plugin

    cache = get_cache(config.nb_execution_cache_path or ".jupyter_cache")
    stale = []
    for path in _notebooks(Path(app.srcdir)):
        try:
            cache.match_cache_notebook(myst_nb_reader_plugin(str(path)))
        except KeyError:
            stale.append(str(path))
    if len(stale) < 2:  # nothing to run side by side: myst-nb runs it when reading
        return
    for uri in stale:
        cache.add_nb_to_project(uri, read_data=_READER)
    # jupyter-cache and nbclient log each notebook at INFO, which a theme's import may have
    # made the root logger print; the build's own messages say what ran.
    logger = logging.getLogger(__name__)
    logger.setLevel(logging.WARNING)
    kernel_log = logging.getLogger("traitlets")
    level = kernel_log.level
    kernel_log.setLevel(logging.WARNING)
    try:
        executor = load_executor("local-parallel", cache, logger=logger)
        executor.run_and_cache(
            filter_uris=stale, timeout=config.nb_execution_timeout, allow_errors=False
        )
    finally:
        kernel_log.setLevel(level)


def setup(app):
    app.connect("builder-inited", _execute_stale)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
