#!/bin/bash
# The arms of this folder, one after another, then their validation BLEU. Run from the
# repository root: bash benchmarks/translate_cpu_batch_2026-11-29/arms.sh [OUT]
out=${1:-runs/translate_cpu_batch}
mkdir -p "$out"
run() {
  n=$1; shift
  python -m train.translate --workdir "$out/$n" --minutes 0 --progress false --plots false "$@" > "$out/$n.log" 2>&1
}
run B_b512 --steps 3400
run T1_b1024_lr2e3 --steps 1700 --tokens_per_batch 1024 --learning_rate 2e-3 --adam_warmup_steps 200
run T2_b768_lr15e4 --steps 2267 --tokens_per_batch 768 --learning_rate 1.5e-3 --adam_warmup_steps 200
run T3_b768_lr15e4_timematched --steps 2080 --tokens_per_batch 768 --learning_rate 1.5e-3 --adam_warmup_steps 200
run T4_b768_lr1e3 --steps 2267 --tokens_per_batch 768
python benchmarks/translate_cpu_recipe_2026-11-29/validation_bleu.py \
  "$out"/B_b512 "$out"/T1_b1024_lr2e3 "$out"/T2_b768_lr15e4 "$out"/T3_b768_lr15e4_timematched \
  "$out"/T4_b768_lr1e3 --length_penalty 1.3
