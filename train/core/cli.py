"""The flow of every entry point, and its parser (the flags themselves: `train.core.flags`).

Every field of a run config becomes `--field VALUE`; every field of the model configs becomes
`--model.field VALUE`; `--set field=VALUE` (or `--set model.field=VALUE`) reaches either one.
Flags default to "not given", so the entry points know exactly which fields the user set: a
resumed run compares only those with the saved config.

An entry point runs in two phases. Parsing (`task_parser(...).parse_args`) reads argv only: it
touches no file and no JAX backend, and a bad flag exits with EXIT_USAGE. Then, inside
`run_command` (so a damaged work directory is one line, not a traceback), the run starts:
`start(args)` reads W/config.json and starts JAX's distributed runtime when asked, and
`resolve(...)` makes the run config from the saved one, the preset and the given flags.
Model flags are parsed as text and typed by the chosen (or saved) model's config there: which
model a resumed run trains is known only from its config.json.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import re
import sys
import time
import traceback
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import jax

from train.core.checkpoint import CONFIG_FILE, load_run_config
from train.core.compile_cache import enable_compilation_cache
from train.core.config import RunConfig, field_hints, replace
from train.core.errors import (  # noqa: F401 - the exit codes are the commands' API here too
    EXIT_DIVERGED,
    EXIT_ERROR,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_PEER_LOST,
    EXIT_USAGE,
    RunError,
    UsageError,
)
from train.core.flags import (  # noqa: F401 - the flags' API, importable from here too
    MODEL_PREFIX,
    ArgumentParser,
    BoolFlag,
    add_dataclass_flags,
    converter,
    default_text,
    flag_help,
    parse_bool,
    split_given,
)
from train.core.host_memory import keep_host_memory
from train.core.parallel import maybe_initialize_distributed
from train.core.peers import claim_stop, exit_now, farewell, lost_peer, start_liveness
from train.core.task import Task, config_from_saved, default_workdir
from train.core.workdir import local_dir


# ------------------------------------------------------------------- entry-point flow
def task_parser(
    task: Task, *, description: str, helps: Mapping[str, str] | None = None
) -> argparse.ArgumentParser:
    """The parser of `task`'s entry point: --workdir, --<choice_flag> (model or dataset),
    --preset, --dtype, --set, one flag per run field (`helps`: the help of some), `--model.FIELD`
    for every field of any of the task's model configs (text, typed by `resolve`), and the
    per-process flags (`training_flags` names them all but the last)."""
    parser = ArgumentParser(
        prog=f"python -m train.{task.name}",
        usage=f"%(prog)s [--workdir W] [--{task.choice_flag} NAME] [--preset NAME] [FLAG ...]",
        description=description,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--workdir",
        default=None,
        help="run directory (default: a new one under runs/); an existing one "
        "is resumed with its saved config",
    )
    choices = list(task.choices())
    parser.add_argument(
        f"--{task.choice_flag}",
        default=argparse.SUPPRESS,
        type=choice_type(choices),
        metavar="NAME",
        help=f"one of {', '.join(c + 'NAME' if c.endswith(':') else c for c in choices)} "
        f"(default {task.default_choice})",
    )
    parser.add_argument(
        "--preset",
        default=argparse.SUPPRESS,
        choices=list(task.presets),
        help="the recipe every run and model field starts from (default: gpu where JAX sees a "
        "GPU or TPU, else cpu); a field's help names the cpu and gpu presets' values",
    )
    parser.add_argument(
        "--dtype",
        default=argparse.SUPPRESS,
        choices=["float32", "bfloat16", "float16"],
        help="compute dtype (params, softmax and loss stay float32); the same as --model.dtype",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="set any run field, or a model field (model.FIELD=VALUE)",
    )
    presets = getattr(task, "preset_fields", {})
    preset_notes = {
        name: ", ".join(
            f"{p} preset {default_text(presets[p][name])}"
            for p in ("cpu", "gpu")
            if name in presets.get(p, {})
        )
        for name in field_hints(task.config_cls)
    }
    add_dataclass_flags(
        parser,
        task.config_cls,
        exclude=(task.choice_flag, "preset", "model_config"),
        group_title="run",
        helps={
            name: " ".join(filter(None, [(helps or {}).get(name), preset_notes.get(name)]))
            for name in field_hints(task.config_cls)
        },
    )
    _add_model_flags(parser, task)
    add_distributed_flags(parser)
    return parser


def _add_model_flags(parser: argparse.ArgumentParser, task: Task) -> None:
    """`--model.FIELD` for every field of any of the task's model configs, grouped by the
    choices whose config has it; each flag's help from the first such config. Values stay
    text, typed by `resolve` once the (chosen or saved) model is known; a boolean field of
    every config that has it is a `BoolFlag`."""
    owners: dict[str, list[str]] = {}
    for choice in task.choices():
        for name in field_hints(task.model_config_cls(choice)):
            owners.setdefault(name, []).append(choice)
    every = list(task.choices())
    groups: dict[tuple[str, ...], argparse._ArgumentGroup] = {}
    for name, choices in owners.items():
        key = tuple(choices)
        if key not in groups:
            which = f"every --{task.choice_flag}" if choices == every else ", ".join(choices)
            groups[key] = parser.add_argument_group(f"model fields of {which}")
        cls = task.model_config_cls(choices[0])
        hints = {field_hints(task.model_config_cls(c))[name] for c in choices}
        boolean = hints == {bool}
        groups[key].add_argument(
            f"--{MODEL_PREFIX}{name}",
            dest=f"{MODEL_PREFIX}{name}",
            default=argparse.SUPPRESS,
            metavar="BOOL" if boolean else name.upper(),
            help=flag_help(cls, name, field_hints(cls)[name]),
            **({"action": BoolFlag} if boolean else {}),
        )


def _model_fields(task: Task) -> dict[str, Any]:
    """Every field of any of the task's model configs -> its type hint (the first seen)."""
    fields: dict[str, Any] = {}
    for choice in task.choices():
        for name, hint in field_hints(task.model_config_cls(choice)).items():
            fields.setdefault(name, hint)
    return fields


def training_flags(task: Task) -> frozenset[str]:
    """The flags (argparse dests) of `task_parser` that make or resume a run: --workdir, the
    choice flag, --preset, --dtype, --set, every run field and `model.FIELD`; the per-process
    flags aside (PER_PROCESS, which every mode takes)."""
    run = set(field_hints(task.config_cls)) - {"model_config"}
    model = {f"{MODEL_PREFIX}{name}" for name in _model_fields(task)}
    return frozenset({"workdir", task.choice_flag, "preset", "dtype", "set", *run, *model})


def choice_type(choices: Sequence[str]) -> Callable[[str], str]:
    """The argparse type of --model / --dataset: one of `choices`, where a choice ending in
    ':' ('tfds:') stands for any name after it ('tfds:lm1b')."""

    def choice(text: str) -> str:
        def names(c: str) -> bool:
            return text.startswith(c) and text != c if c.endswith(":") else text == c

        if any(names(c) for c in choices):
            return text
        raise argparse.ArgumentTypeError(
            f"invalid choice: {text!r} (choose from {', '.join(choices)})"
        )

    return choice


def add_distributed_flags(parser: argparse.ArgumentParser) -> None:
    """The per-process flags of a multi-process run. They are not run-config fields: every
    process has its own id, and none of them is part of what the run is."""
    group = parser.add_argument_group("several processes (with --distributed true)")
    group.add_argument(
        "--coordinator_address",
        default=None,
        metavar="HOST:PORT",
        help="process 0's address (default: $JAX_COORDINATOR_ADDRESS, or the "
        "cluster's: TPU, SLURM, Open MPI)",
    )
    group.add_argument(
        "--num_processes",
        type=int,
        default=None,
        help="default: $JAX_NUM_PROCESSES or the cluster's",
    )
    group.add_argument(
        "--process_id",
        type=int,
        default=None,
        help="this process's id, 0..N-1 (default: $JAX_PROCESS_ID or the cluster's)",
    )


# The flags that say how one process joins a multi-process command: every mode takes them.
PER_PROCESS = frozenset({"distributed", "coordinator_address", "num_processes", "process_id"})


def given_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """The dests of the flags given on the command line: those that are in `args` with a value
    other than their default (a flag whose default is argparse.SUPPRESS: any value). A flag
    whose default is a real value cannot be told from its absence when given that value, so
    the flags `refuse_unused` checks default to None, False, [] or SUPPRESS."""
    return [dest for dest, value in vars(args).items() if value != parser.get_default(dest)]


def refuse_unused(
    parser: argparse.ArgumentParser,
    args: argparse.Namespace,
    mode: str,
    modes: Mapping[str, Iterable[str]],
) -> None:
    """A usage error (exit 2) naming the first given flag that `mode` does not take, so no
    flag is silently ignored. `modes` maps each mode's name, as a message says it ('training',
    '--translate'), to the dests of the flags it takes; every mode takes PER_PROCESS."""
    for dest in given_flags(parser, args):
        if dest in PER_PROCESS or dest in modes[mode]:
            continue
        others = [name for name, takes in modes.items() if dest in takes] or ["no mode"]
        where = " or ".join(filter(None, (", ".join(others[:-1]), others[-1])))
        parser.error(f"--{dest} goes with {where}, not with {mode}")


def start(args: argparse.Namespace) -> dict[str, Any] | None:
    """The start of a command's run -> the saved config of --workdir (None: a new run).

    First, on a CPU, has the process keep the host memory of its steps
    (`train.core.host_memory`), while no JAX backend runs yet. Then reads W/config.json (an
    unreadable one is a CheckpointError naming it), then starts JAX's distributed runtime,
    before anything touches a backend, when --distributed true, $TRAIN_DISTRIBUTED or the
    resumed run's saved config asks for it; then turns on the persistent compilation cache
    (`train.core.compile_cache`)."""
    keep_host_memory()
    saved = load_run_config(args.workdir) if args.workdir else None
    wanted = getattr(args, "distributed", None)
    if wanted is None:
        wanted = bool((saved or {}).get("distributed", False))
    try:
        maybe_initialize_distributed(
            wanted,
            coordinator_address=args.coordinator_address,
            num_processes=args.num_processes,
            process_id=args.process_id,
        )
    except ValueError as e:  # the per-process flags or their environment variables
        raise UsageError(str(e)) from None
    # A process that dies from here on stops the others at once (`train.core.peers`).
    start_liveness()
    # After the distributed start-up (JAX's cache asks it which process writes), before the
    # first compilation.
    enable_compilation_cache()
    return saved


def default_preset() -> str:
    """The preset a run without --preset gets: 'gpu' where JAX's default backend is an
    accelerator (a GPU or a TPU: the bf16 ten-minute recipe), else 'cpu' (ten minutes on a
    small CPU). Past one process, call it after `start`."""
    return "gpu" if jax.default_backend() in ("gpu", "tpu") else "cpu"


def resolve(
    task: Task,
    parser: argparse.ArgumentParser,
    args: argparse.Namespace,
    saved: Mapping[str, Any] | None,
) -> tuple[RunConfig, str]:
    """-> (the run config, the work directory). The config is the saved one of --workdir with
    the given fields changed, else task.make_config(choice, preset or default_preset(), ...);
    the work directory is --workdir or a new one under runs/. A bad value is a usage error
    (exit 2) naming the field, raised before anything is written."""
    flag = task.choice_flag
    model_cls = None
    try:
        choice = getattr(args, flag, None)
        model_cls = task.model_config_cls(choice or (saved or {}).get(flag, task.default_choice))
        run, model = split_given(args, run_cls=task.config_cls, model_cls=model_cls, sets=args.set)
        for key in (flag, "preset", "model_config"):
            run.pop(key, None)  # chosen by their own flags, not overridden as fields
        if "dtype" in args:
            model["dtype"] = args.dtype
        preset = getattr(args, "preset", None)
        if saved is None:
            config = task.make_config(
                choice or task.default_choice,
                preset or default_preset(),
                model_overrides=model,
                **run,
            )
        else:
            config = config_from_saved(task, saved, path=os.path.join(args.workdir, CONFIG_FILE))
            if choice not in (None, getattr(config, flag)) or preset not in (None, config.preset):
                raise ValueError(
                    f"{args.workdir} holds a {getattr(config, flag)} "
                    f"({config.preset}) run; use a new --workdir for another "
                    f"{flag} or preset"
                )
            config = replace(config, model_overrides=model, **run)
    except (ValueError, TypeError) as e:
        parser.error(_as_flags(str(e), task, model_cls))
    return config, args.workdir or default_workdir(task, config)


def _as_flags(message: str, task: Task, model_cls: type | None) -> str:
    """A config error as the user typed it: 'steps: ...' -> '--steps: ...', 'd_model: ...'
    -> '--model.d_model: ...' (a message about anything else is left as it is)."""
    name, sep, rest = message.partition(": ")
    if not sep or not re.fullmatch(r"\w+", name):
        return message
    if name in field_hints(task.config_cls):
        return f"--{name}: {rest}"
    if model_cls is not None and name in field_hints(model_cls):
        return f"--{MODEL_PREFIX}{name}: {rest}"
    return message


def config_from_args(
    task: Task, parser: argparse.ArgumentParser, argv: Sequence[str] | None
) -> tuple[RunConfig, str, argparse.Namespace]:
    """What a command line asks for, made as the command makes it (parse, `start`,
    `resolve`) -> (config, workdir, args); for notebooks and tests."""
    args = parser.parse_args(argv)
    config, workdir = resolve(task, parser, args, start(args))
    return config, workdir, args


# ------------------------------------------------------------------- exit codes and errors
ERROR_LOG = "error.log"
INFERENCE_ERROR_LOG = "inference_error.log"  # --translate, --eval, --export_*, --generate
# Raised by the libraries a run uses, with a message that says what went wrong and where (a
# file that cannot be read, a value out of range): one line and exit 1, as a RunError.
EXPECTED_ERRORS = (ValueError, OSError, RuntimeError)


def finished(final: Mapping[str, Any], figure: str) -> int:
    """The exit code of a run that returned `final`: EXIT_INTERRUPTED after a signal,
    EXIT_DIVERGED when the test `figure` is not finite (a loss that blew up without a NaN)."""
    if final["reason"] in ("sigterm", "sigint"):
        return EXIT_INTERRUPTED
    value = final.get(f"test_{figure}")
    if value is not None and not math.isfinite(value):
        print(
            f"training diverged: test {figure} is {value} (final training loss "
            "too large); lower the learning rate",
            file=sys.stderr,
        )
        return EXIT_DIVERGED
    return EXIT_OK


def main_of(
    parser: argparse.ArgumentParser,
    run: Callable[[argparse.Namespace], int],
    argv: Sequence[str] | None,
    *,
    is_inference: Callable[[argparse.Namespace], bool] = lambda args: False,
) -> int:
    """An entry point's main: parse argv (a bad flag exits with EXIT_USAGE), then `run(args)`
    under `run_command` -> the exit code (0 done, 1 error, 2 bad flags, values or input files,
    3 diverged, 75 stopped by a signal after saving). A mode that only reads the run
    (`is_inference`) writes its tracebacks to W/inference_error.log, never into the training
    run's W/error.log."""
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    log_name = INFERENCE_ERROR_LOG if is_inference(args) else ERROR_LOG
    return run_command(lambda: run(args), workdir=args.workdir, log_name=log_name)


def run_command(body: Callable[[], int], *, workdir: str | None, log_name: str = ERROR_LOG) -> int:
    """Runs an entry point's body -> its exit code. An expected error prints one message
    (the cause and the path it names) to stderr and its traceback to W/`log_name`
    (W/error.log), instead of a page of library internals. The project's errors
    (`train.core.errors.RunError`) carry their exit code, their label and whether they are
    logged; a library's ValueError, OSError or RuntimeError exits 1."""
    _quiet_orbax_leftovers(workdir)
    try:
        return _run_body(body, workdir=workdir, log_name=log_name)
    finally:
        farewell()  # the other processes of a multi-process run: this one ended on purpose


def _run_body(body: Callable[[], int], *, workdir: str | None, log_name: str) -> int:
    try:
        return body()
    except KeyboardInterrupt:
        print(
            "interrupted (a second Ctrl-C: no checkpoint was saved after the first)",
            file=sys.stderr,
        )
        return 130
    except (RunError, *EXPECTED_ERRORS) as e:
        # A collective that failed because another process of the run died: named, and this
        # process ends now (below) instead of waiting in JAX's shutdown for the dead one.
        lost = None if isinstance(e, RunError) else lost_peer(e)
        if lost is not None:
            e = lost  # the failed collective's traceback is still the one logged
            claim_stop()  # this thread stops the process, not the liveness watch
        # The project's errors carry their exit code, label and whether to log; others are
        # a plain error (exit 1, logged).
        ours = isinstance(e, RunError)
        code = e.exit_code if ours else EXIT_ERROR
        where = None
        if not ours or e.logged:
            where = _append_error_log(workdir, traceback.format_exc(), name=log_name)
        label = e.label if ours else "error"
        print(
            f"{label}: {e}" + (f"\n(traceback in {where})" if where else ""),
            file=sys.stderr,
            flush=True,
        )
        if lost is not None:
            exit_now(code, lost.lost)
        return code


def _append_error_log(
    workdir: str | None, text: str, source: str = "", *, name: str = ERROR_LOG
) -> str | None:
    """Appends a dated section holding `text` to W/`name` -> its path, or None when there is
    no W to write to (none given, not a directory, a full or read-only disk)."""
    workdir = local_dir(workdir) if workdir else None  # a remote W: its local mirror
    if not workdir or not os.path.isdir(workdir):
        return None
    path = os.path.join(workdir, name)
    try:
        with open(path, "a") as f:
            f.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')}{source}\n{text}\n")
    except OSError:  # a full or read-only disk: the message on stderr is what is left
        return None
    return path


def _quiet_orbax_leftovers(workdir: str | None) -> None:
    """Keeps orbax's asyncio leftovers off stderr, where they would bury the one message that
    matters (`run_command`). Two kinds, both from its concurrent readers after one read failed:
    - callbacks that fire after their event loop closed: at exit each prints an 'Event loop
      is closed' traceback (a hundred after one failed restore); harmless, dropped;
    - sibling reads that failed too, whose exceptions nobody awaited: asyncio logs each as
      'Task exception was never retrieved' with a traceback when the task is collected, at a
      time that depends on the garbage collector (a CI run under load printed one after the
      restore error). Written to W/error.log beside the traceback of the error itself, and
      printed as before when there is no W/error.log to write.
    Idempotent: a process that runs several commands (tests) installs each once."""
    _ORPHANED_TASKS.workdir = workdir
    if getattr(sys.unraisablehook, "_drops_closed_loops", False):
        return
    previous = sys.unraisablehook

    def hook(unraisable):
        if isinstance(unraisable.exc_value, RuntimeError) and "Event loop is closed" in str(
            unraisable.exc_value
        ):
            return
        previous(unraisable)

    hook._drops_closed_loops = True
    sys.unraisablehook = hook
    logging.getLogger("asyncio").addFilter(_ORPHANED_TASKS)


class _OrphanedTaskErrors(logging.Filter):
    """The asyncio logger's 'exception was never retrieved' records -> W/error.log (see
    `_quiet_orbax_leftovers`); every other record passes."""

    workdir: str | None = None

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if not message.startswith(("Task exception was never", "Future exception was never")):
            return True
        try:
            if record.exc_info:
                message += "\n" + "".join(traceback.format_exception(*record.exc_info))
            written = _append_error_log(self.workdir, message, " (asyncio)")
        except Exception:  # late in interpreter shutdown: print it as before
            return True
        return written is None  # not written (no W/error.log): print it as before


_ORPHANED_TASKS = _OrphanedTaskErrors()
