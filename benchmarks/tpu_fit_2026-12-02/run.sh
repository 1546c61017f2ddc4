#!/usr/bin/env bash
# The papers' recipes compiled for TPU slices on a CPU host (issue 65): does each fit?
# Needs libtpu aside (as .ci/run installs it):
#   pip install --target DIR --no-deps "libtpu==0.0.42.*"; export TPU_DIR=DIR
# Usage: bash benchmarks/tpu_fit_2026-12-02/run.sh [SHARDING]   (default: fsdp; CELL_TIMEOUT=S
# bounds each compile, default 1200 s)
# Each cell: slice, recipe, rows (empty: the recipe's own batch; the LM recipes' 60 and 22
# rows do not split over 8 or 16 chips, and enwik8's not over 4), folder.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
export JAX_PLATFORMS=cpu PYTHONPATH="${TPU_DIR:?set TPU_DIR to the folder holding libtpu}:$PWD"
unset XLA_FLAGS
sharding=${1:-fsdp}
cells=(
  "v5p:2x2x1 wmt14_base - wmt14_base"
  "v5p:2x2x1 wmt14_big - wmt14_big"
  "v6e:2x4 wmt14_base - wmt14_base"
  "v6e:2x4 wmt14_big - wmt14_big"
  "v6e:2x4 enwik8_base 24 enwik8_base"
  "v5e:4x4 wmt14_big - wmt14_big"
  "v5e:4x4 wt103_base 64 wt103_base"
  "v5e:2x4 wt103_base 64 wt103_base"
  "v6e:2x4 wt103_base 64 wt103_base"
  "v5p:2x2x1 wt103_base - wt103_base"
  "v5e:2x4 wt103_base 32 wt103_base_32"
  "v5e:2x4 wmt14_base - wmt14_base"
  "v5e:2x4 wmt14_big - wmt14_big"
  "v5e:2x4 enwik8_base 24 enwik8_base"
  "v5p:2x2x1 enwik8_base 24 enwik8_base"
)
for cell in "${cells[@]}"; do
  read -r target preset rows folder <<< "$cell"
  # ONLY="SLICE/FOLDER ...": just those cells.
  [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $target/$folder "* ]] && continue
  out="benchmarks/tpu_fit_2026-12-02/$sharding/${target/:/_}/$folder"
  mkdir -p "$out"
  extra=()
  [ "$rows" != "-" ] && extra=(--preset_batch_size "$rows")
  timeout "${CELL_TIMEOUT:-1200}" python -m train.bench --target "$target" --preset "$preset" \
    --sharding "$sharding" --out "$out" "${extra[@]}" > "$out/log.txt" 2>&1
  echo "$sharding $target $folder: exit $?"
done
