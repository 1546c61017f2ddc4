"""Seconds from launch to the first training step's log line of `python -m train.translate`
(or lm) on a fresh machine's state: an empty TFDS data dir and an empty compilation cache.
The same as ../startup_2026-11-28/startup.py, but it stops at the "step 1/" line (run it with
`--log_every 1`): since the train step's shapes compile in the background, "training from
step 0" comes before the first step runs.

    python benchmarks/startup_2026-11-29/first_step.py CHECKOUT translate --log_every 1
"""

import os
import subprocess
import sys
import tempfile
import time

cwd, job, extra = sys.argv[1], sys.argv[2], sys.argv[3:]
tmp = tempfile.mkdtemp()
env = dict(
    os.environ,
    TFDS_DATA_DIR=f"{tmp}/tfds",
    ATTENTION_JAX_COMPILATION_CACHE=os.environ.get("CC", f"{tmp}/cc"),
    PYTHONUNBUFFERED="1",
)
start = time.monotonic()
p = subprocess.Popen(
    [sys.executable, "-m", f"train.{job}", "--workdir", f"{tmp}/w", *extra],
    cwd=cwd,
    env=env,
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
)
keys = ("prepared in", "compiled the train step", "training from step", "step 1/")
for line in p.stdout:
    if any(k in line for k in keys):
        print(f"{time.monotonic() - start:7.1f}s  {line.rstrip()[:200]}", flush=True)
    if line.startswith("step 1/"):
        p.kill()
        break
p.wait()
print(f"first step at {time.monotonic() - start:.1f}s")
