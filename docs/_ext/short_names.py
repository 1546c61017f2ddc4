"""Docstrings name objects the short way (`TransformerConfig`, `train_step`,
`DataParallel.compile_train_step`): each such name becomes a link to the one documented object
whose full name ends with it.

The docstrings' single backticks are the `py:obj` role (conf.py's `default_role`). Sphinx
resolves a name from the module it is written in; a name written elsewhere, or short, is left
as code. This resolves those: a name that ends exactly one documented full name (after a dot)
links there; one that ends none, or several, stays code, as before.
"""

from __future__ import annotations

from sphinx.util.nodes import make_refnode


def _resolve(app, env, node, contnode):
    if node.get("refdomain") != "py":
        return None
    target = node.get("reftarget", "")
    if not target or " " in target or not target.replace(".", "").replace("_", "").isalnum():
        return None  # a shape, an expression, a path: code, not a name
    domain = env.get_domain("py")
    suffix = "." + target
    found = {
        name: entry
        for name, entry in domain.objects.items()
        if name.endswith(suffix) and not entry.aliased
    }
    if len(found) != 1:
        return None
    name, entry = next(iter(found.items()))
    return make_refnode(
        app.builder, node["refdoc"], entry.docname, entry.node_id, contnode, name
    )


def setup(app):
    app.connect("missing-reference", _resolve)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
