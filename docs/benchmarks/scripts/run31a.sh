#!/bin/bash
# Run 31a, the next GPU session's first call (NOTES, "Next GPU session (after run 30)", item 1, first half):
#   run: bash docs/benchmarks/scripts/run31a.sh   (from the checkout root on the GPU machine; writes to $OUT)
# The launch probe with host memory registered the host tier's way, then the README call beside overlap_loads and
# StaticCache at 8 x 16k with profiled steps (launch_api_ms, api_calls, concurrent_ms_per_step).
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
export PYTHONPATH=$PWD
timeout 100 python3 docs/benchmarks/probes/launch_probe.py --registered 2>&1 | tail -8 | tee $OUT/launch_probe.txt
timeout 400 python3 -m flexicache_hf.bench.generate --model llama8b --cases 8x16384 \
    --rows flexicache-unsized,flexicache-overlap,static --static-variants sdpa_grouped --new-tokens 128 \
    --profile-steps 12 --out $OUT --tag run31a 2>&1 | tail -8
python3 - <<'P'
import json, os
d = json.load(open(os.environ["OUT"] + "/generate-run31a.json"))
keys = ("median_step_ms", "p99_step_ms", "host_to_launch_ms", "launch_api_ms", "launch_to_device_ms",
        "concurrent_ms_per_step", "gpu_busy_fraction")
for r in d["results"]:
    print(r["row"], {k: round(r[k], 3) for k in keys if isinstance(r.get(k), float)}, r.get("api_calls", [])[:3])
P
