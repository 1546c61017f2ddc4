"""Write each tutorial's Colab notebook (`tutorials/NAME.ipynb`) from its source (`NAME.md`).

The `.md` (MyST Markdown, jupytext) is the source that is reviewed and that the site executes;
the `.ipynb` beside it exists only so that Colab can open the tutorial from the repository, and
carries no outputs. `python docs/sync_notebooks.py` rewrites them; `--check` fails, naming the
files, when one is missing or differs from its source (tests/test_docs.py runs it).
"""

import argparse
import sys
from pathlib import Path

import jupytext
import nbformat

TUTORIALS = Path(__file__).resolve().parent / "tutorials"


def notebook_sources(folder: Path = TUTORIALS) -> list[Path]:
    """The tutorial notebooks' sources in `folder`: the `.md` files with jupytext front matter
    (a plain page, such as the index or the commands of past_one_machine, has none)."""
    return [p for p in sorted(folder.glob("*.md")) if p.read_text().startswith("---\njupytext:")]


def notebook_text(source: Path) -> str:
    """The `.ipynb` text for one MyST source: its cells, no outputs, no execution counts."""
    nb = jupytext.read(source)
    nb.metadata.pop("jupytext", None)
    nb.metadata["colab"] = {"provenance": []}
    for i, cell in enumerate(nb.cells):  # nbformat draws random ids: fixed ones keep diffs quiet
        cell.id = f"cell-{i}"
    return nbformat.writes(nb) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only report stale notebooks")
    parser.add_argument("--tutorials", type=Path, default=TUTORIALS, help="the sources' folder")
    args = parser.parse_args(argv)
    stale = []
    for source in notebook_sources(args.tutorials):
        target = source.with_suffix(".ipynb")
        text = notebook_text(source)
        if target.exists() and target.read_text() == text:
            continue
        stale.append(target.name)
        if not args.check:
            target.write_text(text)
    if args.check and stale:
        print(
            f"stale Colab notebooks (run python docs/sync_notebooks.py): {', '.join(stale)}",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
