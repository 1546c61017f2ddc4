#!/bin/bash
# The third round of this folder (2026-11-29, fourth session): arms T7 (1,024 tokens, 1,660
# steps, about family 25's count) and T6 (896 tokens, 1,815 steps) again with seed 1, to see
# how far one seed moves an arm's BLEU; then their validation BLEU at the preset's length
# penalty. Run from the repository root: bash benchmarks/translate_cpu_batch_2026-11-29/seeds.sh [OUT]
out=${1:-runs/translate_cpu_seeds}
mkdir -p "$out"
run() {
  n=$1; shift
  python -m train.translate --workdir "$out/$n" --minutes 0 --progress false --plots false "$@" > "$out/$n.log" 2>&1
}
lr=(--learning_rate 1.5e-3 --adam_warmup_steps 200 --seed 1)
run T7_b1024_seed1 --steps 1660 --tokens_per_batch 1024 "${lr[@]}"
run T6_b896_seed1 --steps 1815 --tokens_per_batch 896 "${lr[@]}"
python benchmarks/translate_cpu_recipe_2026-11-29/validation_bleu.py \
  "$out"/T7_b1024_seed1 "$out"/T6_b896_seed1 --length_penalty 1.3
