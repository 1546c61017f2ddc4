"""Seconds from launch to the first training step of `python -m train.translate` (or lm) on a
fresh machine's state: an empty TFDS data dir and an empty compilation cache."""
import os, subprocess, sys, tempfile, time
cwd, job = sys.argv[1], sys.argv[2]
extra = sys.argv[3:]
tmp = tempfile.mkdtemp()
env = dict(os.environ, TFDS_DATA_DIR=f"{tmp}/tfds", ATTENTION_JAX_COMPILATION_CACHE=os.environ.get("CC", f"{tmp}/cc"),
           PYTHONUNBUFFERED="1")
start = time.monotonic()
p = subprocess.Popen([sys.executable, "-m", f"train.{job}", "--workdir", f"{tmp}/w", *extra],
                     cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
for line in p.stdout:
    t = time.monotonic() - start
    if any(k in line for k in ("prepared in", "compiled the train step", "training from step", "batch shapes")):
        print(f"{t:7.1f}s  {line.rstrip()[:200]}", flush=True)
    if "training from step" in line:
        p.kill(); break
p.wait()
print(f"first step at {time.monotonic() - start:.1f}s")
