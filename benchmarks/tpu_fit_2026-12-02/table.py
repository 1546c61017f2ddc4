"""The fit table of run.sh's reports: python benchmarks/tpu_fit_2026-12-02/table.py"""

import glob
import json
import os
import re

here = os.path.dirname(os.path.abspath(__file__))
SLICES = {
    "v5e:2x4": "v5e-8 (8 chips)",
    "v5p:2x2x1": "v5p-8 (4 chips)",
    "v6e:2x4": "v6e-8 (8 chips)",
    "v5e:4x4": "v5e-16 (16 chips, 4 hosts)",
}
NO_ROOM = re.compile(r"HLO temporaries \(([\d.]+)G\) exceeds available HBM \(([\d.]+)G\)")

print("| recipe | slice | sharding | batch | memory per chip | fits | compile |")
print("|---|---|---|---|---:|---|---:|")
for path in sorted(glob.glob(os.path.join(here, "*", "*", "*", "target_*.json"))):
    with open(path) as f:
        results = json.load(f)
    command = results["meta"]["command"]
    rows = re.search(r"--preset_batch_size (\d+)", command)
    where = SLICES.get(results["target"], results["target"])
    for r in results["train"]:
        mem = r["memory"]
        print(
            f"| {r['name'].split(':')[1]} | {where} | {r['sharding']} | "
            f"{r['batch']} x {r['length']} | {mem['footprint'] / 1e9:.2f} GB of "
            f"{r['chip_memory_bytes'] / 1e9:.1f} | {'yes' if r['fits'] else '**no**'} | "
            f"{r['compile_s']:.0f} s |"
        )
    for e in results["errors"]:
        found = NO_ROOM.search(e["error"])
        why = f"temporaries {found[1]} GB > {found[2]} GB free" if found else e["error"][:80]
        sharding = re.search(r"--sharding (\w+)", command)
        print(
            f"| {e['section'].split(':')[-1]} | {where} | {sharding[1] if sharding else ''} | "
            f"{rows[1] + ' rows' if rows else ''} | {why} | "
            f"{'**no**' if found or e.get('fits') is False else 'failed'} | |"
        )
