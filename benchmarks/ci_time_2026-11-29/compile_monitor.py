"""A pytest plugin: per test, its wall time and the compile-time durations JAX reports
(jax.monitoring), one JSON line each, in $OUT_DIR/mon_<worker>.jsonl. Load it with
`PYTHONPATH=benchmarks/ci_time_2026-11-29 python -m pytest -p compile_monitor ...`."""

import collections
import json
import os
import time

_acc: collections.Counter = collections.Counter()
_start = [0.0]
_out = [None]


def _listen(event, duration_secs, **_):
    _acc[event] += duration_secs


def pytest_configure(config):
    import jax.monitoring

    jax.monitoring.register_event_duration_secs_listener(_listen)


def pytest_runtest_logstart(nodeid, location):
    _acc.clear()
    _start[0] = time.time()


def pytest_runtest_logfinish(nodeid, location):
    if _out[0] is None:
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        _out[0] = open(os.path.join(os.environ.get("OUT_DIR", "."), f"mon_{worker}.jsonl"), "a")
    _out[0].write(json.dumps({"id": nodeid, "wall": time.time() - _start[0], **_acc}) + "\n")
    _out[0].flush()
