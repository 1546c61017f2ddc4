"""benchmarks/mutation/run.py's choice of the mutants it does not run: those inside an
annotation that the module never evaluates."""

from __future__ import annotations

import importlib.util
from pathlib import Path

RUN = Path(__file__).resolve().parents[1] / "benchmarks" / "mutation" / "run.py"


def _run_module():
    spec = importlib.util.spec_from_file_location("mutation_run", RUN)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SOURCE = """from __future__ import annotations

x: int | None = 1 | 2


def f(a: int | None = 3 | 4, *rest: str | bytes) -> int | None:
    b: list[int] = [a | 5]
    return b
"""


def _inside(spans, line, column):
    return any(start <= (line, column) and (line, column + 1) <= end for start, end in spans)


def test_annotation_spans_cover_annotations_and_nothing_else():
    spans = _run_module().annotation_spans(SOURCE)
    lines = SOURCE.splitlines()

    def at(line, text, nth=0):  # the (line, column) of the nth `text` on a 1-based line
        column = -1
        for _ in range(nth + 1):
            column = lines[line - 1].index(text, column + 1)
        return line, column

    # Annotations: the module variable's, each argument's, the return's, a local's.
    for line, text, nth in [(3, "|", 0), (6, "|", 0), (6, "|", 2), (6, "|", 3), (6, "list", 0)]:
        line, column = at(line if text != "list" else 7, text, nth)
        assert _inside(spans, line, column), (line, text, nth)
    # Evaluated code on the same lines: the default values and the expressions.
    for line, text, nth in [(3, "|", 1), (6, "|", 1), (7, "|", 0), (6, "3", 0)]:
        assert not _inside(spans, *at(line, text, nth)), (line, text, nth)


def test_a_module_that_evaluates_its_annotations_has_no_spans():
    eager = SOURCE.replace("from __future__ import annotations\n", "")
    assert _run_module().annotation_spans(eager) == []
