"""A pytest plugin: each test's start and end time and its pytest-xdist worker, one JSON line
each in $TL_OUT, to see where a worker's time went and how the two workers' loads balance.
Load it with `PYTHONPATH=benchmarks/ci_time_2026-11-29 TL_OUT=tl.jsonl python -m pytest -p
timeline`. (The controller writes lines too, with no start time: skip worker "main".)"""

import json
import os
import time

_start: dict[str, float] = {}


def pytest_runtest_setup(item):
    _start[item.nodeid] = time.time()


def pytest_runtest_logfinish(nodeid, location):
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    line = {"w": worker, "id": nodeid, "s": _start.get(nodeid, 0), "e": time.time()}
    with open(os.environ.get("TL_OUT", "timeline.jsonl"), "a") as f:
        f.write(json.dumps(line) + "\n")
