"""MathJax served with the site, through sphinx-mathjax-offline's hook (it copies MathJax's
files into _static/mathjax after the build and points mathjax_path there), declared safe for
parallel builds: the package's own setup declares nothing, so Sphinx would read serially and
warn, which -W turns into an error. Neither of its two actions touches the environment."""

import importlib


def setup(app):
    importlib.import_module("sphinx-mathjax-offline").setup(app)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
