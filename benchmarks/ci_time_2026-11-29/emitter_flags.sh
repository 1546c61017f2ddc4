#!/usr/bin/env bash
# XLA:CPU flags against the suite's compile time: two compile-heavy test files, one process,
# a fresh persistent cache each (conftest.py makes one per run), the flag added to the suite's.
# Run from the repository root on an idle machine; prints one line per arm.
set -u
out=$(mktemp -d)
run() {
  name=$1; shift
  rm -f "$out/mon_main.jsonl"
  s=$(date +%s.%N)
  XLA_FLAGS="$*" OUT_DIR=$out PYTHONPATH=benchmarks/ci_time_2026-11-29 python -m pytest -n 0 \
    -p no:randomly -p compile_monitor tests/test_decode_golden.py tests/test_xl_model.py -q \
    > "$out/$name.log" 2>&1
  e=$(date +%s.%N)
  python - "$name" "$s" "$e" "$out/mon_main.jsonl" <<'PY'
import json, sys
name, s, e, path = sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
rows = [json.loads(line) for line in open(path)]
compile_s = sum(r.get("/jax/core/compile/backend_compile_duration", 0) for r in rows)
print(f"{name}: {e - s:.1f}s in all, backend compile {compile_s:.1f}s, {len(rows)} tests")
PY
}
run A ""
run B "--xla_llvm_disable_expensive_passes=true"
run C "--xla_cpu_use_fusion_emitters=false"
run E "--xla_cpu_parallel_codegen_split_count=1"
