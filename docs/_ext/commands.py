"""The command reference, generated from the commands' own parsers, so it cannot drift.

At the start of a build, `_generated/commands.md` is written from `make_parser()` of
`train.translate`, `train.lm` and `train.bench` (their `--help`), each command's table of modes
and the flags each takes (`modes()`), and the presets' settings (`PRESETS`). `commands.md`
includes it.
"""

from __future__ import annotations

import os
from pathlib import Path

# The commands, in the order the page lists them.
COMMANDS = ("train.translate", "train.lm", "train.bench")


def _parser(command: str):
    if command == "train.bench":
        from train.bench.options import build_parser

        return build_parser()
    module = __import__(f"{command}.cli", fromlist=["make_parser"])
    return module.make_parser()


def _modes(command: str) -> dict[str, frozenset[str]]:
    if command == "train.bench":
        return {}
    module = __import__(f"{command}.cli", fromlist=["modes"])
    return module.modes()


def _presets(command: str) -> dict[str, dict]:
    if command == "train.bench":
        return {}
    module = __import__(f"{command}.config", fromlist=["PRESETS"])
    return module.PRESETS


def _value(value) -> str:
    if isinstance(value, (tuple, list)):
        return ",".join(str(v) for v in value)
    return str(value)


def command_reference() -> str:
    """The reference page's generated body (MyST Markdown)."""
    from train.core.cli import PER_PROCESS

    # argparse wraps at the terminal's width (COLUMNS): fixed, so the page is the same on any
    # machine.
    columns, os.environ["COLUMNS"] = os.environ.get("COLUMNS"), "90"
    try:
        return _reference(PER_PROCESS)
    finally:
        if columns is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = columns


def _reference(per_process) -> str:
    out = []
    for command in COMMANDS:
        parser = _parser(command)
        out += [f"## `python -m {command}`", ""]
        modes = _modes(command)
        if modes:
            out += [
                "Which mode takes which flag (any other flag given is an error, exit 2; every "
                f"mode takes {', '.join('`--' + f + '`' for f in sorted(per_process))}):",
                "",
                "| mode | flags it takes |",
                "|---|---|",
            ]
            for mode, flags in modes.items():
                shown = sorted(f for f in flags if not f.startswith("model."))
                models = len(flags) - len(shown)
                extra = f", and every `--model.FIELD` ({models})" if models else ""
                listed = ", ".join(f"`--{f}`" for f in shown)
                out.append(f"| `{mode}` | {listed}{extra} |")
            out.append("")
        presets = _presets(command)
        if presets:
            out += ["Presets (`--preset`) and what each sets:", ""]
            for name, fields in presets.items():
                items = ", ".join(f"`{k}` {_value(v)}" for k, v in fields.items())
                out.append(f"- `{name}`: {items or 'the defaults'}")
            out.append("")
        out += [f"Every flag (`python -m {command} --help`):", "", "```text"]
        out += [parser.format_help().rstrip(), "```", ""]
    return "\n".join(out)


def _write(app) -> None:
    generated = Path(app.srcdir) / "_generated"
    generated.mkdir(exist_ok=True)
    path = generated / "commands.md"
    text = command_reference()
    if not path.exists() or path.read_text() != text:  # unchanged: no rebuild of the page
        path.write_text(text)


def setup(app):
    app.connect("builder-inited", _write)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
