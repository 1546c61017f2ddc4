"""Command-line flags generated from config dataclasses.

Every field of a config becomes `--field VALUE` (`add_dataclass_flags`), parsed by its type
hint (int, float, bool, str, Optional, tuple, Literal; other types take a Python literal or
fall back to the string), with its help from the class docstring's `Attributes:` entry, its
type and default (`flag_help`). A boolean field is also a bare flag (`--name`, `--no-name`).
`split_given` sorts what was given into run and model fields. `ArgumentParser` is argparse's
parser with the project's error contract (two lines, exit 2, the nearest flags named).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import functools
import inspect
import re
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal

from train.core.config import field_hints
from train.core.errors import EXIT_USAGE

MODEL_PREFIX = "model."


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser with the project's error contract: a bad flag or value is two lines
    on stderr, what is wrong and where the flags are listed, and exit code 2 (EXIT_USAGE), not
    the whole usage text; an unknown flag names the nearest ones."""

    def error(self, message: str):
        hints = []
        unknown = re.match(r"unrecognized arguments: (.*)", message)
        for token in unknown.group(1).split() if unknown else ():
            flag = token.split("=", 1)[0]
            if flag.startswith("--"):
                options = self._option_string_actions
                near = difflib.get_close_matches(flag, options, n=2, cutoff=0.75)
                if near:
                    hints.append(f"{flag}: did you mean {' or '.join(near)}?")
        hints.append(f"({self.prog} --help lists every flag)")
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n" + "\n".join(hints) + "\n")


class BoolFlag(argparse.Action):
    """A boolean flag: `--name` alone is true, `--no-name` false, and `--name VALUE` takes
    true/false, yes/no, on/off or 1/0."""

    def __init__(self, option_strings, dest, **kwargs):
        name = option_strings[0].removeprefix("--")
        kwargs.pop("type", None)
        super().__init__(
            [*option_strings, f"--no-{name}"], dest, nargs="?", type=parse_bool, **kwargs
        )

    def __call__(self, parser, namespace, values, option_string=None):
        negated = option_string is not None and option_string.startswith("--no-")
        if negated and values is not None:
            parser.error(f"{option_string} takes no value")
        setattr(namespace, self.dest, not negated if values is None else values)


@functools.cache
def attribute_docs(cls: type) -> dict[str, str]:
    """{field: the first sentence of its entry} from the `Attributes:` sections of `cls`'s
    docstring and its bases' (Google style; `a, b: text` documents both)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        text = inspect.getdoc(klass) if "__doc__" in vars(klass) else None
        lines = (text or "").splitlines()
        if "Attributes:" not in lines:
            continue
        entries: list[tuple[list[str], list[str]]] = []
        for line in lines[lines.index("Attributes:") + 1 :]:
            if line and not line.startswith(" "):
                break  # the section ends at the next unindented line
            entry = re.match(r"^  ([A-Za-z_][\w]*(?:, [A-Za-z_][\w]*)*): ?(.*)$", line)
            if entry:
                entries.append(([n.strip() for n in entry.group(1).split(",")], [entry.group(2)]))
            elif entries and line.strip():
                entries[-1][1].append(line.strip())
        for names, words in entries:
            sentence = re.split(r"(?<=[a-z0-9)'\"])\.(?:\s|$)", " ".join(words), maxsplit=1)[0]
            for name in names:
                docs[name] = sentence.rstrip(".")
    return docs


def default_text(value: Any) -> str:
    if isinstance(value, (tuple, list)):
        return ",".join(str(v) for v in value) or "(empty)"
    if isinstance(value, float) and value.is_integer():
        return str(value)
    return getattr(value, "__name__", None) or str(value)


def flag_help(cls: type, name: str, hint: Any, extra: str | None = None) -> str:
    """A flag's help: its one-line description, its type (a choice's allowed values), its
    default, and `extra`."""
    field = next(f for f in dataclasses.fields(cls) if f.name == name)
    if field.default is not dataclasses.MISSING:
        default = f"default {default_text(field.default)}"
    elif field.default_factory is not dataclasses.MISSING:
        default = f"default {default_text(field.default_factory())}"
    else:
        default = None
    what = "; ".join(filter(None, [attribute_docs(cls).get(name), extra]))
    kind = "; ".join(filter(None, [hint_name(hint), default]))
    return f"{what} ({kind})" if what else f"({kind})"


def parse_bool(text: str) -> bool:
    low = text.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean (true/false), got {text!r}")


def _literal_or_text(text: str) -> Any:
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def converter(hint: Any) -> Callable[[str], Any]:
    """str -> value for a type hint."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is bool:
        return parse_bool
    if hint in (int, float, str):
        return hint
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        convert = converter(inner[0]) if len(inner) == 1 else _literal_or_text

        def optional(text: str):
            return None if text.strip().lower() in ("none", "null") else convert(text)

        return optional
    if origin is tuple:
        convert = converter(args[0]) if args else _literal_or_text

        def as_tuple(text: str):
            text = text.strip().strip("()[]")
            return tuple(convert(p.strip()) for p in text.split(",") if p.strip())

        return as_tuple
    if origin is Literal:

        def choice(text: str):
            for a in args:
                if str(a) == text:
                    return a
            raise argparse.ArgumentTypeError(f"expected one of {list(args)}, got {text!r}")

        return choice
    return _literal_or_text


def add_dataclass_flags(
    parser: argparse.ArgumentParser,
    cls: type,
    *,
    prefix: str = "",
    exclude: Iterable[str] = (),
    group_title: str | None = None,
    helps: Mapping[str, str] | None = None,
) -> None:
    """Adds `--{prefix}{field}` for each field of `cls` (not given -> absent from the args),
    each with its help (`flag_help`: the docstring's description, type, default); `helps`
    adds a sentence to some. A boolean field is a `BoolFlag` (`--name`, `--no-name`)."""
    target = parser.add_argument_group(group_title) if group_title else parser
    exclude = set(exclude)
    helps = helps or {}
    for name, hint in field_hints(cls).items():
        if name in exclude:
            continue
        boolean = hint is bool
        target.add_argument(
            f"--{prefix}{name}",
            dest=f"{prefix}{name}",
            type=converter(hint),
            default=argparse.SUPPRESS,
            metavar="BOOL" if boolean else name.upper(),
            help=flag_help(cls, name, hint, helps.get(name)),
            **({"action": BoolFlag} if boolean else {}),
        )


def hint_name(hint: Any) -> str:
    """A type hint as help text: `int`, `int | None`, a choice's allowed values."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Literal:
        return "one of " + ", ".join(str(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(hint_name(a) for a in args)
    if origin is tuple:
        return f"comma-separated {hint_name(args[0]) if args else 'values'}"
    if hint is Any:
        return "a value"
    if hint is type(None):
        return "None"
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")


def split_given(
    args: argparse.Namespace, *, run_cls: type, model_cls: type | None, sets: Iterable[str] = ()
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The explicitly given (run fields, model fields), from flags and `--set k=v` items.

    A bare `--set name=v` goes to the run config if it has that field, else to the model
    config; `--set model.name=v` always to the model config. Unknown names are errors.
    """
    run_fields = field_hints(run_cls)
    model_fields = field_hints(model_cls) if model_cls is not None else {}
    run, model = {}, {}
    for key, value in vars(args).items():
        if key.startswith(MODEL_PREFIX):
            name = key[len(MODEL_PREFIX) :]
            if name not in model_fields:
                raise ValueError(f"--{key}: the model config has no field {name!r}")
            # Model flags arrive as text (see the module docstring); typed here.
            model[name] = (
                _convert(model_fields[name], value, f"--{key}") if isinstance(value, str) else value
            )
        elif key in run_fields:
            run[key] = value
    for item in sets:
        if "=" not in item:
            raise ValueError(f"--set expects name=value, got {item!r}")
        key, text = item.split("=", 1)
        key = key.strip()
        if key.startswith(MODEL_PREFIX) or (key not in run_fields and key in model_fields):
            name = key[len(MODEL_PREFIX) :] if key.startswith(MODEL_PREFIX) else key
            if name not in model_fields:
                raise ValueError(f"--set {key}: the model config has no field {name!r}")
            model[name] = _convert(model_fields[name], text, f"--set {key}")
        elif key in run_fields:
            run[key] = _convert(run_fields[key], text, f"--set {key}")
        else:
            raise ValueError(f"--set {key}: no run or model config field of that name")
    return run, model


def _convert(hint: Any, text: str, flag: str) -> Any:
    try:
        return converter(hint)(text)
    except (ValueError, argparse.ArgumentTypeError) as e:
        raise ValueError(f"{flag}: expected {hint_name(hint)}, got {text!r} ({e})") from e
