"""benchmarks/mutation/run.py's choice of the mutants it does not run: those inside an
annotation that the module never evaluates."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

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


def _diff(old: str, new: str) -> str:
    """A one-line mutation of mod.py as Cosmic Ray records it (its title line, then the
    unified diff)."""
    return (
        "--- mutation diff ---\n--- a/mod.py\n+++ b/mod.py\n@@ -1,3 +1,3 @@\n"
        f" def f(a, b):\n-{old}\n+{new}\n def g():"
    )


def test_recheck_judges_each_survivor_again_with_today_s_tests(tmp_path):
    import subprocess

    run = _run_module()
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "mod.py").write_text("def f(a, b):\n    return a + b\ndef g():\n    return 0\n")
    # Today's test pins f(2, 2) and f(1, 3) but says nothing of a * b at (2, 2), where + agrees.
    (tree / "test_mod.py").write_text(
        "from mod import f, g\n\ndef test_f():\n    assert f(2, 2) == 4 and f(1, 3) == 4\n"
        "\ndef test_g():\n    assert g() == 0\n"
    )
    for command in (["init", "-q"], ["add", "."], ["commit", "-qm", "x"]):
        subprocess.run(
            ["git", "-c", "user.name=t", "-c", "user.email=t@t", *command], cwd=tree, check=True
        )
    survivors = [
        {"line": 2, "operator": "Add_Sub", "diff": _diff("    return a + b", "    return a - b")},
        {"line": 2, "operator": "Add_Mul", "diff": _diff("    return a + b", "    return a * b")},
        {"line": 2, "operator": "gone", "diff": _diff("    return a + c", "    return a - c")},
        # At the module's end Cosmic Ray's hunk counts one line more than the file holds.
        {
            "line": 4,
            "operator": "NumberReplacer",
            "diff": "--- mutation diff ---\n--- a/mod.py\n+++ b/mod.py\n@@ -2,4 +2,4 @@\n"
            "     return a + b\n def g():\n-    return 0\n+    return 1\n ",
        },
    ]
    result = {"module": "mod.py", "tests": ["test_mod.py"], "survivors": survivors}
    rechecked = run.recheck_module(result, tree, timeout=120)
    # f(1, 3) == -2 kills -; * gives 4 and 3: killed too; the third no longer applies.
    assert [s["now"] for s in rechecked] == ["killed", "killed", "does not apply", "killed"]
    (tree / "test_mod.py").write_text(
        "from mod import f\n\ndef test_f():\n    assert f(2, 2) == 4\n"
    )
    rechecked = run.recheck_module({**result, "survivors": survivors[1:2]}, tree, timeout=120)
    assert [(s["operator"], s["now"]) for s in rechecked] == [("Add_Mul", "survived")]
    # Each mutant is taken back: the module is as committed.
    assert "return a + b" in (tree / "mod.py").read_text()


def test_a_mutant_s_tests_run_in_the_order_the_module_lists_them():
    """One pytest process keeps the command line's order (conftest.py reorders modules only in
    pytest-xdist's workers): with -x, the quick tests a module lists first stop most mutants
    before its slow ones start."""
    import subprocess

    run = _run_module()
    for files in (
        ["tests/test_optim.py", "tests/test_schedule_fit.py"],
        ["tests/test_token_cache_units.py", "tests/test_token_cache.py"],
    ):
        done = subprocess.run(
            [*run._test_command(files), "--collect-only", "-v"],
            cwd=run.REPO,
            capture_output=True,
            text=True,
        )
        assert done.returncode == 0, done.stdout[-2000:]
        modules = [line.split("::")[0] for line in done.stdout.splitlines() if "::" in line]
        assert list(dict.fromkeys(modules)) == files


def test_every_mutant_s_tests_share_one_compilation_cache_removed_with_the_run(monkeypatch):
    """run.py names one cache for the pytest processes it starts; conftest.py compiles into
    it and leaves it for the next mutant; it goes with the run's temporary folder."""
    import os
    import subprocess

    run = _run_module()
    monkeypatch.delenv(run.CACHE_VARIABLE, raising=False)
    with run._worktree() as (tree, work):
        cache = Path(os.environ[run.CACHE_VARIABLE])
        assert cache.parent == work
        for _ in range(2):  # the second pytest finds the first one's programs and keeps them
            done = subprocess.run(
                [*run._test_command(["tests/test_accelerator_paths.py"]), "-k", "extreme_rows"],
                cwd=run.REPO,  # this checkout's conftest.py; the worktree holds HEAD's
                capture_output=True,
                text=True,
            )
            assert done.returncode == 0, done.stdout[-2000:]
            assert any(cache.iterdir()), "nothing was compiled into the shared cache"
    assert run.CACHE_VARIABLE not in os.environ
    assert not cache.exists() and not tree.exists()


def test_a_stopped_run_goes_on_from_the_mutants_it_had_not_judged(tmp_path, monkeypatch):
    """run_module keeps Cosmic Ray's session in the run's folder: started again, it judges
    only what the first start left pending, and records each start's commit."""
    import sqlite3
    import subprocess

    pytest.importorskip("cosmic_ray")  # the `mutation` extra, not in CI's install
    run = _run_module()
    monkeypatch.chdir(tmp_path)  # the folder named as --out is, relative to where run.py started
    tree, sessions = tmp_path / "tree", Path("sessions")
    tree.mkdir()
    sessions.mkdir()
    (tree / "mod.py").write_text("def f(a):\n    return -a\n")
    # Kills all four unary mutants (+a, ~a, not a, a).
    (tree / "test_mod.py").write_text("from mod import f\n\ndef test_f():\n    assert f(2) == -2\n")
    for command in (["init", "-q"], ["add", "."], ["commit", "-qm", "x"]):
        subprocess.run(
            ["git", "-c", "user.name=t", "-c", "user.email=t@t", *command], cwd=tree, check=True
        )
    first = run.run_module("mod.py", ["test_mod.py"], tree, sessions, timeout=120)
    assert (first["killed"], first["survived"]) == (4, 0)
    # A weaker test that +a and the deleted minus pass: a second start judges nothing again.
    (tree / "test_mod.py").write_text("from mod import f\n\ndef test_f():\n    assert f(0) == 0\n")
    again = run.run_module("mod.py", ["test_mod.py"], tree, sessions, timeout=120)
    assert (again["killed"], again["survived"]) == (4, 0)
    # As if stopped before two of them: only those two are judged, by today's test.
    with sqlite3.connect(tmp_path / "sessions" / "mod.py.sqlite") as db:
        pending = [
            job
            for (job,) in db.execute(
                "select job_id from mutation_specs where operator_name like '%UAdd' "
                "or operator_name like '%Invert'"
            )
        ]
        assert len(pending) == 2
        db.executemany("delete from work_results where job_id = ?", [(j,) for j in pending])
    # --report: the counts as they stand, judging nothing.
    stopped = run.run_module("mod.py", ["test_mod.py"], tree, sessions, 120, judge=False)
    assert (stopped["killed"], stopped["survived"], stopped["pending"]) == (2, 0, 2)
    assert "2 mutants not judged yet" in run._report([stopped], _meta())
    resumed = run.run_module("mod.py", ["test_mod.py"], tree, sessions, timeout=120)
    assert (resumed["killed"], resumed["survived"]) == (3, 1)  # +a survives, ~a does not
    assert resumed["pending"] == 0
    assert [s["operator"].rsplit("_", 1)[-1] for s in resumed["survivors"]] == ["UAdd"]
    assert resumed["commits"] == [run._head(tree)]


def _meta():
    return {"command": "run.py", "machine": "m", "date": "d", "cosmic_ray": "v", "commit": "c"}
