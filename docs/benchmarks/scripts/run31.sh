#!/bin/bash
# This session's first call (NOTES, "Predictions for the session of 2026-12-06 (evening)"): on an H200 issue 31's
# case (run31c.sh: 16 x 16k, 256 new tokens, dense rows included); on an H100 the 8 x 16k overlap check planned after run 30
# without its launch probe; then the attention kernels' launch sweep at the case's batch.
#   run: bash docs/benchmarks/scripts/run31.sh   (from the checkout root on the GPU machine; writes to $OUT)
export PYTHONPATH=$PWD
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
    bash docs/benchmarks/scripts/run31c.sh; B=16
else
    nvidia-smi --query-gpu=name --format=csv,noheader
    timeout 330 python3 -m flexicache_hf.bench.generate --model llama8b --cases 8x16384 \
        --rows flexicache-unsized,flexicache-overlap,static --static-variants sdpa_grouped --new-tokens 128 \
        --profile-steps 12 --out $OUT --tag run31a 2>&1 | tail -8
    python3 - <<'P'
import json, os
d = json.load(open(os.environ["OUT"] + "/generate-run31a.json"))
keys = ("median_step_ms", "p99_step_ms", "profile_median_step_ms", "gpu_busy_ms_per_step", "concurrent_ms_per_step")
for r in d["results"]:
    print(r["row"], {k: round(r[k], 3) for k in keys if isinstance(r.get(k), float)})
P
    B=8
fi
timeout 110 python3 docs/benchmarks/kernels/scripts/decode_tiles.py $OUT/decode-tiles.json $B 2>&1 | tail -6
