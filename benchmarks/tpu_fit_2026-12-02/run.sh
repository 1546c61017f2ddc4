#!/usr/bin/env bash
# The papers' recipes compiled for TPU slices on a CPU host (issue 65): does each fit?
# Needs libtpu aside (as .ci/run installs it):
#   pip install --target DIR --no-deps "libtpu==0.0.42.*"; export TPU_DIR=DIR
# Usage: bash benchmarks/tpu_fit_2026-12-02/run.sh [SHARDING ...]   (default: fsdp)
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
export JAX_PLATFORMS=cpu PYTHONPATH="${TPU_DIR:?set TPU_DIR to the folder holding libtpu}:$PWD"
unset XLA_FLAGS
for sharding in "${@:-fsdp}"; do
  for target in v5e:2x4 v5p:2x2x1 v6e:2x4; do
    for preset in wmt14_base wmt14_big wt103_base enwik8_base; do
      out="$here/$sharding/${target/:/_}/$preset"
      mkdir -p "$out"
      timeout 900 python -m train.bench --target "$target" --preset "$preset" \
        --sharding "$sharding" --out "$out" > "$out/log.txt" 2>&1
      echo "$sharding $target $preset: exit $?"
    done
  done
done
