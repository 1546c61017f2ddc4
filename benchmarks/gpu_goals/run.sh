#!/usr/bin/env bash
# One of issue 50's GPU goals, each the job's own ten-minute command, in one `run` call of the
# device tool (the main jobs fit one a session: a session has 15 device-minutes, starts
# included, and a command at most 10):
#
#   cp -r ../shared/gpu-wheels .whl     # once; /.whl/ and /.site/ in .git/info/exclude
#   pip download -d .whl --no-deps tensorboardX   # (or copy its wheel there)
#   run(command="bash benchmarks/gpu_goals/run.sh lm_ptb", carry=[".whl"], timeout_s=600)
#
# GOAL: lm_ptb (goal: test ppl <= 60), lm_ptb_char (<= 1.20 bpc), translate (BLEU >= 42), or
# smoke (a tiny LM run: checks this script on any machine). What comes back in $OUT: the
# job's log (its first line is the command), metrics.jsonl, config.json, the device's facts.
set -euo pipefail
goal=${1:?"usage: run.sh lm_ptb|lm_ptb_char|translate|smoke"}
out=${OUT:-runs/gpu_goals_out}
work=runs/gpu_goals/$goal
mkdir -p "$out"
rm -rf "$work"
# The GPU image lacks tensorflow-datasets and tensorboardX: their wheels travel in .whl.
if ! python3 -c "import tensorflow_datasets, tensorboardX" 2>/dev/null && compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target .site .whl/*.whl
  export PYTHONPATH="$PWD/.site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}"
{
  date -u +%FT%TZ
  git log -1 --format='main %h' 2>/dev/null || true
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || lscpu | grep "Model name"
  python3 -c "import jax, tensorflow_datasets; print('jax', jax.__version__, jax.devices())"
} > "$out/device.txt" 2>&1
cat "$out/device.txt"
case "$goal" in
  lm_ptb) cmd=(python3 -m train.lm --dataset ptb --workdir "$work") ;;
  lm_ptb_char) cmd=(python3 -m train.lm --dataset ptb_char --workdir "$work") ;;
  translate) cmd=(python3 -m train.translate --workdir "$work") ;;
  smoke) cmd=(python3 -m train.lm --preset tiny --steps 3 --eval_tokens 300 --plots false --workdir "$work") ;;
  *) echo "unknown goal: $goal" >&2; exit 2 ;;
esac
echo "${cmd[*]}" > "$out/$goal.log"
start=$(date +%s)
set +e
"${cmd[@]}" >> "$out/$goal.log" 2>&1
rc=$?
set -e
echo "exit $rc after $(( $(date +%s) - start )) s" >> "$out/$goal.log"
cp "$work"/metrics.jsonl "$work"/config.json "$out/" 2>/dev/null || true
tail -5 "$out/$goal.log"
exit "$rc"
