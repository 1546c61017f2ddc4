"""Mutation testing of the numerical and state-keeping core (issue 67): how many plausible
one-line bugs the tests that claim a module would miss.

Cosmic Ray (https://github.com/sixty-north/cosmic-ray) mutates one module at a time (operators
swapped, constants changed, comparisons flipped, statements removed) and runs the tests that
cover it against each mutant: a mutant the tests fail on is killed, one they pass survives.
It edits files in place, so this script runs it in a git worktree of HEAD in a temporary
folder: the checkout you work in is never touched. Not part of CI: each mutant is one pytest
process (about 10-15 s on a 2-core machine, JAX's import and compiles included), so a module
takes from minutes to an hour.

    pip install "attention-jax[mutation]"      # cosmic-ray
    python benchmarks/mutation/run.py transformer_jax/positional.py --out benchmarks/mutation/DATE
    python benchmarks/mutation/run.py --list   # the modules and the tests each is run with
    python benchmarks/mutation/run.py --recheck benchmarks/mutation/DATE/scores.json

`--recheck` applies each survivor of a run (its diff, from scores.json) to a worktree of HEAD
and runs the module's tests again: which survivors the tests added since kill, which still
survive, which no longer apply. Killed mutants stay killed when tests are only added, so this
answers for the whole module in minutes. It writes recheck.json and recheck.md beside
scores.json.

Cosmic Ray's sessions stay in OUT/sessions/ (git ignores them): a run that was stopped goes
on from the mutants it had not judged when started again with the same --out, at today's HEAD
(scores.md names each start's commit; `--recheck` then judges every survivor at one commit).
`--report` with that --out writes the scores as they stand, the mutants not judged yet counted
as pending, and runs nothing.

Writes OUT/scores.json (per module: killed, survived, timed out, incompetent, the score) and
OUT/scores.md with each surviving mutant's diff, to be killed by a test or listed as
equivalent with its reason (benchmarks/mutation/README.md, by hand).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CACHE_VARIABLE = "ATTENTION_JAX_TEST_CACHE"  # tests/conftest.py: a compilation cache to share

# Each module with the tests that claim its behaviour (pytest arguments).
MODULES: dict[str, list[str]] = {
    "transformer_jax/positional.py": [
        "tests/test_positional.py",
        "tests/test_transformer.py",
        "-k",
        "sinusoid or positional or pad_positions or offset",  # every test of test_positional.py
    ],
    "transformer_jax/losses.py": [
        "tests/test_losses_optim.py",
        "tests/test_accelerator_paths.py",
        # The REINFORCE surrogate's two tests (the rest of the file trains a model).
        "tests/test_hard_attention.py::test_reinforce_gradient_is_unbiased_exactly_and_by_sampling",
        "tests/test_hard_attention.py::test_surrogate_matches_a_hand_computation",
    ],
    "transformer_jax/optim.py": [
        "tests/test_optim.py",
        "tests/test_losses_optim.py",
        "tests/test_schedule_fit.py",
    ],
    "transformer_jax/attention.py": ["tests/test_attention.py"],
    "transformer_jax/decoding/search.py": [
        "tests/test_decode.py",
        "tests/test_transformer_decode.py",
        "tests/test_properties.py",
    ],
    "xl_jax/attention.py": [
        "tests/test_xl_attention.py",
        # The forms of a program compiled for a GPU, and which calls take the Pallas kernels.
        "tests/test_accelerator_paths.py::test_position_bias_for_the_fused_kernel_equals_the_float32_one",
        "tests/test_accelerator_paths.py::test_xl_attention_gpu_forms_equal_the_cpu_form",
        "tests/test_xl_fused_attention.py::test_only_pallas_takes_the_kernels_and_only_where_shapes_allow",
        "tests/test_xl_fused_attention.py::test_a_model_over_segments_gives_the_same_losses_and_gradients",
        # Its training path through the fused LayerNorm kernel (a GPU's, here interpreted).
        "tests/test_fused_norm.py::test_xl_fused_path_equals_its_xla_path",
    ],
    "xl_jax/memory.py": ["tests/test_xl_model.py", "tests/test_xl_attention.py"],
    "xl_jax/adaptive.py": ["tests/test_xl_adaptive.py"],
    "xl_jax/fused_attention.py": ["tests/test_xl_fused_attention.py"],
    "train/core/checkpoint.py": [
        "tests/test_checkpoint.py",
        "tests/test_train_loop.py",
        "tests/test_faults.py",
    ],
    "train/core/loop.py": ["tests/test_loop_units.py", "tests/test_train_loop.py"],
    "train/core/workdir_checks.py": ["tests/test_workdir_errors.py"],
    "train/data/batching.py": ["tests/test_data_batching.py"],
    "train/data/token_cache.py": [
        "tests/test_token_cache_units.py",
        "tests/test_token_cache.py",
    ],
}

OUTCOMES = ("killed", "survived", "timeout", "incompetent", "annotation")
NOW = ("killed", "survived", "timeout", "does not apply")  # a survivor rechecked


def annotation_spans(source: str) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """The (line, column) spans of a module's annotations, where it never evaluates them
    (`from __future__ import annotations`; else none): a mutant inside one (`Array | None`
    -> `Array + None`) changes nothing a caller can reach, so it is not run."""
    tree = ast.parse(source)
    lazy = any(
        isinstance(node, ast.ImportFrom)
        and node.module == "__future__"
        and any(alias.name == "annotations" for alias in node.names)
        for node in tree.body
    )
    if not lazy:
        return []
    spans = []
    for node in ast.walk(tree):
        for annotation in (
            getattr(node, "returns", None)
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            else None,
            node.annotation if isinstance(node, ast.arg | ast.AnnAssign) else None,
        ):
            if annotation is not None:
                spans.append(
                    (
                        (annotation.lineno, annotation.col_offset),
                        (annotation.end_lineno, annotation.end_col_offset),
                    )
                )
    return spans


def _skip_annotations(session: Path, source: str) -> int:
    """Marks the session's mutants that lie inside an annotation as skipped; their count."""
    from cosmic_ray.work_db import use_db
    from cosmic_ray.work_item import WorkerOutcome, WorkResult

    spans = annotation_spans(source)
    with use_db(str(session)) as db:
        jobs = [
            item.job_id
            for item in db.pending_work_items
            if all(
                any(start <= tuple(m.start_pos) and tuple(m.end_pos) <= end for start, end in spans)
                for m in item.mutations
            )
        ]
        if jobs:
            db.set_multiple_results(
                jobs,
                WorkResult(
                    output="inside an annotation, never evaluated",
                    worker_outcome=WorkerOutcome.SKIPPED,
                ),
            )
    return len(jobs)


def _config(module: str, tests: list[str], timeout: float) -> str:
    command = _test_command(tests)
    return "\n".join(
        [
            "[cosmic-ray]",
            f"module-path = {json.dumps(module)}",
            f"timeout = {timeout}",
            "excluded-modules = []",
            f"test-command = {json.dumps(shlex.join(command))}",
            "",
            "[cosmic-ray.distributor]",
            'name = "local"',
            "",
        ]
    )


def _cosmic_ray(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "cosmic_ray.cli", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        check=False,
    )


def _summarize(dump: str) -> tuple[dict[str, int], list[dict]]:
    """`cosmic-ray dump` lines -> (counts by outcome, the survivors with their diffs)."""
    counts = dict.fromkeys((*OUTCOMES, "pending"), 0)
    survivors = []
    for line in dump.splitlines():
        if not line.strip():
            continue
        item, result = json.loads(line)
        if result is None:  # not judged yet: a run stopped part way
            counts["pending"] += 1
            continue
        if result.get("worker_outcome") == "timeout":
            outcome = "timeout"
        elif result.get("worker_outcome") == "skipped":
            outcome = "annotation"
        elif result.get("worker_outcome") != "normal":
            outcome = "incompetent"
        else:
            outcome = result.get("test_outcome")
        counts[outcome] = counts.get(outcome, 0) + 1
        if outcome == "survived":
            mutation = item["mutations"][0]
            survivors.append(
                {
                    "operator": mutation["operator_name"],
                    "occurrence": mutation["occurrence"],
                    "line": mutation["start_pos"][0],
                    "diff": result.get("diff", ""),
                }
            )
    return counts, survivors


def run_module(
    module: str, tests: list[str], tree: Path, sessions: Path, timeout: float, judge: bool = True
) -> dict:
    """Cosmic Ray over `module` in `tree`, its session kept in `sessions`: a run stopped part
    way (a killed process, a machine that went away) goes on from the mutants it had not
    judged when started again with the same folder, at whatever commit HEAD is then. With
    `judge` False, only the session's counts as they stand (those not judged: 'pending')."""
    name = module.replace("/", "_")
    sessions = sessions.resolve()  # Cosmic Ray runs in the tree, not where we were started
    config = sessions / f"{name}.toml"
    session = _session(sessions, module)
    commits = sessions / f"{name}.commits"
    if not judge:
        if not session.exists():
            raise FileNotFoundError(f"no session of {module} in {sessions} to report")
        return _result(module, tests, tree, session, commits)
    config.write_text(_config(module, tests, timeout))
    if not session.exists():
        # Made aside and renamed when whole: a stopped init leaves no session to resume.
        fresh = sessions / f"{name}.init.sqlite"
        fresh.unlink(missing_ok=True)
        done = _cosmic_ray("init", str(config), str(fresh), cwd=tree)
        if done.returncode != 0:
            raise RuntimeError(f"cosmic-ray init for {module}: {done.stderr[-2000:]}")
        _skip_annotations(fresh, (tree / module).read_text())
        fresh.rename(session)
    with commits.open("a") as log:
        log.write(_head(tree) + "\n")
    done = _cosmic_ray("exec", str(config), str(session), cwd=tree)
    if done.returncode != 0:
        raise RuntimeError(f"cosmic-ray exec for {module}: {done.stderr[-2000:]}")
    return _result(module, tests, tree, session, commits)


def _session(sessions: Path, module: str) -> Path:
    """Where a run keeps `module`'s Cosmic Ray session."""
    return sessions / f"{module.replace('/', '_')}.sqlite"


def _result(module: str, tests: list[str], tree: Path, session: Path, commits: Path) -> dict:
    counts, survivors = _summarize(_cosmic_ray("dump", str(session), cwd=tree).stdout)
    judged = counts["killed"] + counts["survived"] + counts["timeout"]
    score = (counts["killed"] + counts["timeout"]) / judged if judged else None
    return {
        "module": module,
        "tests": tests,
        **counts,
        "score": score,
        "survivors": survivors,
        "commits": list(dict.fromkeys(commits.read_text().split() if commits.exists() else [])),
    }


def _test_command(tests: list[str]) -> list[str]:
    """The pytest command a mutant is judged by: stop at the first failure, no cache, one
    process."""
    return [
        sys.executable,
        "-m",
        "pytest",
        "-x",
        "-q",
        "-p",
        "no:cacheprovider",
        "-n",
        "0",
        "--durations=0",
        *tests,
    ]


def _apply(diff: str, tree: Path) -> subprocess.CompletedProcess:
    """`git apply` of a Cosmic Ray diff in `tree`. Near a module's end its hunk carries one
    context line past the file's last (an empty line, from splitting the source on newlines),
    so git refuses it as it stands: then it is tried again without that line, the hunk's
    counts recomputed."""
    applied = subprocess.run(
        ["git", "apply", "-"], input=diff + "\n", cwd=tree, capture_output=True, text=True
    )
    if applied.returncode != 0 and diff.endswith("\n "):
        applied = subprocess.run(
            ["git", "apply", "--recount", "-"],
            input=diff.removesuffix(" ").rstrip("\n") + "\n",
            cwd=tree,
            capture_output=True,
            text=True,
        )
    return applied


def recheck_module(result: dict, tree: Path, timeout: float) -> list[dict]:
    """Each survivor of `result` (a module's entry of scores.json) applied to `tree` and judged
    by the module's tests: -> the survivors with their `now` ('killed', 'survived', 'timeout'
    or 'does not apply': the module changed where the mutant was)."""
    module, rechecked = result["module"], []
    for survivor in result["survivors"]:
        # Cosmic Ray's diff opens with a title line of its own before the unified diff.
        diff = survivor["diff"].removeprefix("--- mutation diff ---\n")
        applied = _apply(diff, tree)
        if applied.returncode != 0:
            rechecked.append({**survivor, "now": "does not apply"})
            continue
        try:
            done = subprocess.run(
                _test_command(result["tests"]), cwd=tree, capture_output=True, timeout=timeout
            )
            now = "survived" if done.returncode == 0 else "killed"
        except subprocess.TimeoutExpired:
            now = "timeout"
        finally:
            subprocess.run(["git", "checkout", "--", module], cwd=tree, check=True)
        rechecked.append({**survivor, "now": now})
        print(f"[recheck] {module}:{survivor['line']} {survivor['operator']}: {now}", flush=True)
    return rechecked


def _recheck_report(rechecked: dict[str, list[dict]], meta: dict) -> str:
    lines = [
        "# Survivors rechecked",
        "",
        f"`{meta['command']}`, {meta['machine']}, {meta['date']}, at commit {meta['commit']}: "
        f"the survivors of the run at {meta['run_commit']}, each applied again and judged by "
        "the module's tests as they are now.",
        "",
        "| module | survivors | killed now | still surviving | timed out | no longer apply |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for module, survivors in rechecked.items():
        count = {now: sum(s["now"] == now for s in survivors) for now in NOW}
        lines.append(
            f"| `{module}` | {len(survivors)} | {count['killed']} | {count['survived']} | "
            f"{count['timeout']} | {count['does not apply']} |"
        )
    for module, survivors in rechecked.items():
        left = [s for s in survivors if s["now"] in ("survived", "does not apply")]
        if left:
            lines += ["", f"## Still surviving or no longer applying in `{module}`", ""]
            for s in left:
                lines += [f"line {s['line']}, {s['operator']} ({s['now']}):", ""]
                lines += ["```diff", s["diff"], "```", ""]
    return "\n".join(lines) + "\n"


def _report(results: list[dict], meta: dict) -> str:
    lines = [
        "# Mutation scores",
        "",
        f"`{meta['command']}`, {meta['machine']}, {meta['date']}; cosmic-ray "
        f"{meta['cosmic_ray']}, at commit {meta['commit']}.",
        "",
        "A timed-out mutant counts as killed (the tests did not pass); an incompetent one (it "
        "does not import) counts neither way, nor does one inside an annotation the module never "
        "evaluates (not run).",
        "",
        "| module | killed | survived | timed out | incompetent | in annotations | score |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        score = "-" if r["score"] is None else f"{100 * r['score']:.1f}%"
        lines.append(
            f"| `{r['module']}` | {r['killed']} | {r['survived']} | {r['timeout']} | "
            f"{r['incompetent']} | {r['annotation']} | {score} |"
        )
    pending = [r for r in results if r.get("pending")]
    if pending:
        lines.append("")
    for r in pending:
        lines.append(
            f"`{r['module']}`: {r['pending']} mutants not judged yet (a run stopped part way; "
            "the same command with the same --out goes on)."
        )
    resumed = [r for r in results if len(r.get("commits", [])) > 1]
    if resumed:
        lines.append("")
    for r in resumed:
        lines.append(
            f"`{r['module']}` was judged over resumed runs at commits {', '.join(r['commits'])}."
        )
    for r in results:
        if r["survivors"]:
            lines += ["", f"## Survivors in `{r['module']}`", ""]
            for s in r["survivors"]:
                where = f"line {s['line']}, {s['operator']}:"
                lines += [where, "", "```diff", s["diff"], "```", ""]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("modules", nargs="*", help="modules to mutate (default: all listed)")
    parser.add_argument("--out", type=Path, default=None, help="folder for scores.json/.md")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds a mutant's tests")
    parser.add_argument("--list", action="store_true", help="print the modules and their tests")
    parser.add_argument(
        "--report",
        action="store_true",
        help="write the scores of the sessions in --out as they stand, running nothing",
    )
    parser.add_argument(
        "--recheck",
        type=Path,
        default=None,
        help="a run's scores.json: judge its survivors again with today's tests",
    )
    args = parser.parse_args(argv)
    if args.list:
        for module, tests in MODULES.items():
            print(module, "<-", shlex.join(tests))
        return 0
    if args.recheck is not None:
        if args.modules:
            parser.error("--recheck takes the modules of its scores.json, not a list")
        return _recheck(args.recheck, args.out or args.recheck.parent, args.timeout, argv)
    if args.report and args.out is None:
        parser.error("--report reads the sessions of a run: give its --out")
    modules = args.modules or list(MODULES)
    unknown = [m for m in modules if m not in MODULES]
    if unknown:
        parser.error(f"not in the list (--list): {', '.join(unknown)}")
    if args.report:
        missing = [m for m in modules if not _session(args.out / "sessions", m).exists()]
        if missing:
            parser.error(f"--report: no session in {args.out / 'sessions'} of {', '.join(missing)}")
    try:
        import cosmic_ray  # noqa: F401
    except ImportError:
        parser.error('cosmic-ray is not installed: pip install "attention-jax[mutation]"')
    commit = _head()
    out = args.out or REPO / "benchmarks" / "mutation" / datetime.date.today().isoformat()
    out.mkdir(parents=True, exist_ok=True)
    results = []
    sessions = out / "sessions"  # Cosmic Ray's sessions, to resume a stopped run (not committed)
    sessions.mkdir(exist_ok=True)
    with _worktree() as (tree, _):
        for module in modules:
            print(f"[mutation] {module} ...", flush=True)
            result = run_module(
                module, MODULES[module], tree, sessions, args.timeout, judge=not args.report
            )
            counts = {k: result[k] for k in (*OUTCOMES, "pending")}
            print(f"[mutation] {module}: {json.dumps(counts)}")
            results.append(result)
    meta = {**_meta(argv), "commit": commit, "cosmic_ray": _version("cosmic-ray")}
    (out / "scores.json").write_text(json.dumps({"meta": meta, "modules": results}, indent=1))
    (out / "scores.md").write_text(_report(results, meta))
    print(f"[mutation] {out / 'scores.md'}")
    return 0


def _head(tree: Path = REPO) -> str:
    return subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=tree, capture_output=True, text=True
    ).stdout.strip()


def _meta(argv: list[str] | None) -> dict:
    return {
        "command": "python benchmarks/mutation/run.py " + shlex.join(argv or sys.argv[1:]),
        "machine": _machine(),
        "date": datetime.date.today().isoformat(),
    }


@contextlib.contextmanager
def _worktree():
    """(a git worktree of HEAD, its parent folder for session files), removed after: the
    checkout you work in is never touched."""
    with tempfile.TemporaryDirectory(prefix="mutation-") as tmp:
        tree = Path(tmp) / "tree"
        subprocess.run(
            ["git", "worktree", "add", "--detach", str(tree), "HEAD"],
            cwd=REPO,
            check=True,
            capture_output=True,
        )
        # One persistent compilation cache for every mutant's pytest (tests/conftest.py reads
        # it): a program the mutant does not touch compiles once for the whole run, and one it
        # does is another program, hence another key.
        before = os.environ.get(CACHE_VARIABLE)
        os.environ[CACHE_VARIABLE] = str(Path(tmp) / "jax_cache")
        try:
            yield tree, Path(tmp)
        finally:
            if before is None:
                os.environ.pop(CACHE_VARIABLE, None)
            else:
                os.environ[CACHE_VARIABLE] = before
            subprocess.run(
                ["git", "worktree", "remove", "--force", str(tree)], cwd=REPO, check=False
            )


def _recheck(scores: Path, out: Path, timeout: float, argv: list[str] | None) -> int:
    """`--recheck`: every survivor of the run in `scores` judged again at HEAD; writes
    OUT/recheck.json and OUT/recheck.md."""
    run = json.loads(scores.read_text())
    rechecked, commit = {}, _head()  # the worktree's commit, whatever lands while it runs
    with _worktree() as (tree, _):
        for result in run["modules"]:
            rechecked[result["module"]] = recheck_module(result, tree, timeout)
    meta = {**_meta(argv), "commit": commit, "run_commit": run["meta"]["commit"]}
    out.mkdir(parents=True, exist_ok=True)
    (out / "recheck.json").write_text(json.dumps({"meta": meta, "modules": rechecked}, indent=1))
    (out / "recheck.md").write_text(_recheck_report(rechecked, meta))
    print(f"[recheck] {out / 'recheck.md'}")
    return 0


def _machine() -> str:
    """The CPU as `lscpu` names it (model name, family, model) and its core count."""
    fields = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    except OSError:
        return f"{platform.machine()}, {os.cpu_count()} cores"
    return (
        f"{fields.get('model name', platform.machine())} (cpu family {fields.get('cpu family')}, "
        f"model {fields.get('model')}), {os.cpu_count()} cores"
    )


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)


if __name__ == "__main__":
    sys.exit(main())
