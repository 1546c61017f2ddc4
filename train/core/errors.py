"""The exit codes of every command, and the project's errors, each carrying its own.

A command (`train.core.cli.run_command`) catches `RunError` once: the error's message is the
one line it prints, `exit_code` its exit status, and `logged` whether its traceback goes to
the work directory's error log. A new error class needs no new `except`. Each class also keeps
the built-in base that library callers catch it by (ValueError, RuntimeError).
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_ERROR = 1  # what the run found cannot be used: a checkpoint, dataset, work directory, disk
EXIT_USAGE = 2  # fix the command: a flag, a value or an input file
EXIT_DIVERGED = 3  # the loss or gradient became NaN / infinite, or the result is infinite
EXIT_PEER_LOST = 69  # a process of a multi-process run was lost (EX_UNAVAILABLE): start all
EXIT_INTERRUPTED = 75  # stopped by SIGTERM / SIGINT after saving (EX_TEMPFAIL: run again)


class RunError(Exception):
    """An error of the project's, whose message says what went wrong and where.

    exit_code: the command's exit status. label: the word its message is printed after.
    logged: its traceback is written to the work directory's error log (an error in the
    command itself is not: the message is all there is to it).
    """

    exit_code = EXIT_ERROR
    label = "error"
    logged = True


class InputError(RunError):
    """Something a run was given or reads cannot be used as it is: a flag or value
    (`UsageError`), a data file (`train.data.text_files.DataError`), a dataset's source files
    (`train.data.datasets.DatasetSourceError`) or its prepared copy
    (`train.data.datasets.DatasetError`); the message names it."""


class UsageError(InputError, ValueError):
    """A bad flag, value or input file, found once the run has started (exit 2: fix the
    command)."""

    exit_code = EXIT_USAGE
    logged = False


class TrainingDiverged(RunError, RuntimeError):
    """The training loss or gradient became NaN or infinite (exit 3)."""

    exit_code = EXIT_DIVERGED
    label = "training diverged"


class CheckpointError(RunError, RuntimeError):
    """A checkpoint or saved run config exists but cannot be used."""


class WorkdirError(RunError, RuntimeError):
    """The work directory cannot be used: in use by another run, or not writable."""


class ProcessesDisagree(UsageError):
    """The processes of one run were given different flags (exit 2): the message names what
    differs, with each process's value; the traceback logged in W/error.log carries every
    process's whole setting (as a note), which the terminal does not."""

    logged = True


class PeerLost(RunError, RuntimeError):
    """A process of a multi-process run stopped (killed, its host lost): every other process
    stops too (exit 69), naming it; starting all of them again resumes the run from its last
    checkpoint (`train.core.peers`). lost: the indices of the lost processes ([]: unknown)."""

    exit_code = EXIT_PEER_LOST
    lost: list[int] = []  # noqa: RUF012 - set on each instance that knows
