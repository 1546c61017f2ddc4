"""Names in the text link to the objects they name.

Docstrings: their single backticks are the `py:obj` role (conf.py's `default_role`). Sphinx
resolves a name from the module it is written in; a name written elsewhere, or short
(`TransformerConfig`, `DataParallel.compile_train_step`), is left as code. This resolves
those: a name that ends exactly one documented full name (after a dot) links there; one that
ends none, or several, stays code, as before.

Pages (the tutorials, guides and the rest, written in MyST Markdown): their inline code is
plain code. An inline code span that is a bare name (`greedy_decode`, `tj.beam_search`,
`xl_jax.generate`) becomes the same kind of reference, so the tutorials link what they call;
the module alias `tj.` of the tutorials is read as `transformer_jax.`. Anything else (a call,
an expression, a shape) stays code.
"""

from __future__ import annotations

import re

from docutils import nodes
from sphinx.addnodes import pending_xref
from sphinx.util.nodes import make_refnode

_NAME = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*$")
_ALIASES = {"tj": "transformer_jax"}


# A bare word names a module-level class or function; an attribute or a method is named with
# its class (`Transformer.attention_maps`), so `config` or `step` in a sentence links nowhere.
_BARE = ("class", "function", "exception")


def _unique_suffix(env, target: str):
    suffix = "." + target
    found = [
        (name, entry)
        for name, entry in env.get_domain("py").objects.items()
        if (name == target or name.endswith(suffix))
        and not entry.aliased
        and ("." in target or entry.objtype in _BARE)
    ]
    return found[0] if len(found) == 1 else None


def _resolve(app, env, node, contnode):
    if node.get("refdomain") != "py":
        return None
    target = node.get("reftarget", "")
    if not _NAME.match(target):
        return None  # a shape, an expression, a path: code, not a name
    head, _, rest = target.partition(".")
    found = _unique_suffix(env, target)
    if found is None and rest and head in _ALIASES:
        found = _unique_suffix(env, f"{_ALIASES[head]}.{rest}")
    if found is None:
        return None
    name, entry = found
    return make_refnode(app.builder, node["refdoc"], entry.docname, entry.node_id, contnode, name)


def _link_inline_code(app, doctree):
    """Wraps each inline code span of a page that is a bare name in a `py:obj` reference
    (resolved, or left as the code it was, at the end of the build)."""
    docname = app.env.docname
    if docname.startswith("api/"):
        return  # the API pages are docstrings: their names are roles already
    for literal in list(doctree.findall(nodes.literal)):
        text = literal.astext()
        if not _NAME.match(text) or "." not in text and len(text) < 4:
            continue
        if isinstance(literal.parent, (nodes.reference, pending_xref, nodes.title)):
            continue
        ref = pending_xref(
            "", refdomain="py", reftype="obj", reftarget=text, refdoc=docname,
            refexplicit=False, refwarn=False,
        )  # fmt: skip
        literal.replace_self(ref)
        ref += literal


def setup(app):
    app.connect("missing-reference", _resolve)
    app.connect("doctree-read", _link_inline_code)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
