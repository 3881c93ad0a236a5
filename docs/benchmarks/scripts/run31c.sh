#!/bin/bash
# Run 31c (NOTES, "Next GPU session (after run 30)", item 2; the plan after run 29, item 3): issue 31's acceptance case
# at 16 x 16k on an H200 (the dense rows need its memory), one call, the README call beside the sized cache and
# both dense caches (the rows the issue names; overlap_loads left out since run 31a measured it slower):
#   run: bash docs/benchmarks/scripts/run31c.sh   (from the checkout root on the GPU machine; writes to $OUT)
# 256 new tokens (p99 over 256 steps), profiled steps for the compiled rows.
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
export PYTHONPATH=$PWD
timeout 420 python3 -m flexicache_hf.bench.generate --model llama8b --cases 16x16384 \
    --rows flexicache-unsized,static,flexicache-graph,dynamic --static-variants sdpa_grouped --new-tokens 256 \
    --profile-steps 12 --out $OUT --tag run31c 2>&1 | tail -14
python3 - <<'P'
import json, os
d = json.load(open(os.environ["OUT"] + "/generate-run31c.json"))
keys = ("median_step_ms", "p99_step_ms", "ttft_s", "warmup_ttft_s", "profile_median_step_ms", "gpu_busy_ms_per_step",
        "concurrent_ms_per_step")
for r in d["results"]:
    print(r["row"], {k: round(r[k], 3) for k in keys if isinstance(r.get(k), float)})
P
