"""The commands' persistent compilation cache: a program compiled once on a machine loads from
disk in later runs instead of compiling again.

Compiling is much of a short command's time, on a CPU and on a GPU
(`benchmarks/decode_2026-11-26/`, `benchmarks/h100_2026-11-26/`). Training programs are
cached the same way, so a
time-budgeted run on a machine that compiled them before gets more steps.

The commands (`train.translate`, `train.lm`) turn it on in `train.core.cli.start`; importing
the library changes nothing. The cache lives in ~/.cache/attention-jax/xla, or wherever
$ATTENTION_JAX_COMPILATION_CACHE points; that variable set to `off` turns it off. A cache that
JAX's own configuration already names ($JAX_COMPILATION_CACHE_DIR, or `jax.config.update` before
the command starts) is left as it is.

JAX keys each entry by the program, the compile options and the backend's version. An entry
that cannot be read, or that was compiled for another processor, is a miss: JAX compiles the
program again, so the cache never changes what a run computes. It has no size limit; delete the
folder to empty it.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping

import jax

CACHE_ENV = "ATTENTION_JAX_COMPILATION_CACHE"
OFF = ("", "0", "off", "false", "no", "none")
# Programs that compile faster than this are not written. Reading an entry back costs a file
# read and a deserialisation (milliseconds), so a program that takes a fifth of a second to
# compile is worth keeping; JAX's default threshold is 1 s.
MIN_COMPILE_SECONDS = 0.2


def default_cache_dir() -> str:
    """~/.cache/attention-jax/xla (under $XDG_CACHE_HOME when set)."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "attention-jax", "xla")


def enable_compilation_cache(environ: Mapping[str, str] | None = None) -> str | None:
    """Turns on JAX's persistent compilation cache for this process -> its directory, or None
    when it is off ($ATTENTION_JAX_COMPILATION_CACHE=off, or a folder that cannot be made:
    then a warning says why, and the run compiles as without it).

    Call it before the first compilation. JAX's own setting ($JAX_COMPILATION_CACHE_DIR or an
    earlier `jax.config.update("jax_compilation_cache_dir", ...)`) wins: that cache is kept,
    with its thresholds; so does $JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS."""
    environ = os.environ if environ is None else environ
    current = jax.config.jax_compilation_cache_dir
    if current:
        return current
    wanted = environ.get(CACHE_ENV)
    if wanted is not None and wanted.strip().lower() in OFF:
        return None
    path = os.path.expanduser(wanted.strip()) if wanted else default_cache_dir()
    if "://" not in path:  # a bucket (gs://...) needs no folder made
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as e:
            warnings.warn(
                f"no persistent compilation cache: cannot make {path} ({e}); set "
                f"${CACHE_ENV} to a writable folder, or to 'off'",
                stacklevel=2,
            )
            return None
    jax.config.update("jax_compilation_cache_dir", path)
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in environ:  # else JAX's, as given
        jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS)
    return path


_HITS = "/jax/compilation_cache/cache_hits"
_MISSES = "/jax/compilation_cache/cache_misses"
_SAVED = "/jax/compilation_cache/compile_time_saved_sec"


class CacheTally:
    """What the persistent cache did for the compilations inside a `with` block: its hits,
    its misses and the compile time the hits saved (JAX's own figure: the entry's recorded
    compile time less the time to read it back), from JAX's monitoring events.

    Compilations in other threads count too (the train step compiles its batch shapes in a
    thread pool); programs JAX does not cache (under its time threshold, or with the cache
    off) are neither hits nor misses.
    """

    def __init__(self):
        self.hits = self.misses = 0
        self.saved_s = 0.0

    def _event(self, event: str, **_metadata) -> None:
        if event == _HITS:
            self.hits += 1
        elif event == _MISSES:
            self.misses += 1

    def _duration(self, event: str, seconds: float, **_metadata) -> None:
        if event == _SAVED:
            self.saved_s += seconds

    def __enter__(self) -> CacheTally:
        jax.monitoring.register_event_listener(self._event)
        jax.monitoring.register_event_duration_secs_listener(self._duration)
        return self

    def __exit__(self, *exc) -> None:
        jax.monitoring.unregister_event_listener(self._event)
        jax.monitoring.unregister_event_duration_listener(self._duration)

    def describe(self) -> str:
        """'; 2 of 3 programs from the persistent compilation cache (42.0 s of compiling
        saved)', or '' when no program went through the cache. A hit that cost more time than
        its compilation had is said as such."""
        looked_up = self.hits + self.misses
        if not looked_up:
            return ""
        # JAX's saving is negative when reading the entries back took longer than compiling
        # them had (small programs, fast compiles): said so, not as a negative saving.
        saved = (
            f"{self.saved_s:.1f}s of compiling saved"
            if self.saved_s >= 0
            else f"reading them took {-self.saved_s:.1f}s more than compiling them had"
        )
        return (
            f"; {self.hits} of {looked_up} program(s) from the persistent compilation cache "
            f"({saved})"
        )
