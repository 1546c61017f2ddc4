#!/bin/bash
# The second round of this folder (2026-11-29, 06:20-07:02 UTC): T3 again, then 640, 896 and
# 1,024-token batches at 1.5e-3, each at about B's training time by the step times of
# step_times/; then their validation BLEU at three length penalties, and the step times.
# Run from the repository root: bash benchmarks/translate_cpu_batch_2026-11-29/arms2.sh [OUT]
out=${1:-runs/translate_cpu_batch2}
mkdir -p "$out"
run() {
  n=$1; shift
  python -m train.translate --workdir "$out/$n" --minutes 0 --progress false --plots false "$@" > "$out/$n.log" 2>&1
}
lr=(--learning_rate 1.5e-3 --adam_warmup_steps 200)
run T3_b768 --steps 2080 --tokens_per_batch 768 "${lr[@]}"
run T5_b640 --steps 2630 --tokens_per_batch 640 "${lr[@]}"
run T6_b896 --steps 1815 --tokens_per_batch 896 "${lr[@]}"
run T7_b1024 --steps 1660 --tokens_per_batch 1024 "${lr[@]}"
python benchmarks/translate_cpu_recipe_2026-11-29/validation_bleu.py \
  "$out"/T3_b768 "$out"/T5_b640 "$out"/T6_b896 "$out"/T7_b1024 --length_penalty 1.0 1.3 1.6
# Step times: 500 steps of each batch size one after another on the idle machine; the
# seconds a step from the metrics' elapsed between steps 100 and 500.
for tpb in 512 768 896 1024; do
  run "steps_$tpb" --steps 500 --log_every 100 --tokens_per_batch "$tpb" --eval_sentences 16
done
