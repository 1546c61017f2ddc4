"""A Sphinx extension that puts an "Open in Colab" link at the top of every tutorial.

The tutorials' sources stay plain notebooks (no directive that Colab would show as text); the
link points at the paired `.ipynb` beside each `tutorials/*.md` on the configured repository's
branch (`colab_repository`, `colab_branch` in conf.py).
"""

from docutils import nodes


def _add_link(app, doctree):
    docname = app.env.docname
    # Only a notebook has a Colab twin (sync_notebooks.py writes one for each).
    if not (app.srcdir / f"{docname}.ipynb").exists():
        return
    repo = app.config.colab_repository.removeprefix("https://github.com/").rstrip("/")
    url = (
        f"https://colab.research.google.com/github/{repo}/blob/"
        f"{app.config.colab_branch}/docs/{docname}.ipynb"
    )
    link = nodes.reference("", "Open in Colab", refuri=url, classes=["colab-link"])
    para = nodes.paragraph("", "", link)
    sections = list(doctree.findall(nodes.section))
    if sections:  # after the page's title
        title = sections[0][0]
        sections[0].insert(sections[0].index(title) + 1, para)
    else:
        doctree.insert(0, para)


def setup(app):
    app.add_config_value("colab_repository", "", "env")
    app.add_config_value("colab_branch", "main", "env")
    app.connect("doctree-read", _add_link)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
