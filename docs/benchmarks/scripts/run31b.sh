#!/bin/bash
# Run 31b (NOTES, "Next GPU session (after run 30)", item 1, second half): the launch bisect on the sized graph row at
# 1 x 4096, each variant in its own process beside StaticCache: the defaults, no host tier (--no-offload), and no
# exact mass with 16-token pages.  Compare launch_api_ms / launch_to_device_ms across the variants.
nvidia-smi --query-gpu=name --format=csv,noheader
export PYTHONPATH=$PWD
run() {
    timeout 170 python3 -m flexicache_hf.bench.generate --model llama8b --cases 1x4096 \
        --rows flexicache-graph,static --static-variants sdpa_grouped --new-tokens 32 --profile-steps 8 \
        --out $OUT --tag "run31b-$1" "${@:2}" > /dev/null 2>&1
    python3 - "$1" <<'P'
import json, os, sys
d = json.load(open(os.environ["OUT"] + f"/generate-run31b-{sys.argv[1]}.json"))
keys = ("median_step_ms", "host_to_launch_ms", "launch_api_ms", "launch_to_device_ms", "kernels_per_step")
for r in d["results"]:
    if "launch_api_ms" in r:
        print(sys.argv[1], r["row"], {k: round(r[k], 3) for k in keys if isinstance(r.get(k), float)})
P
}
run defaults
run no-offload --no-offload
run no-exact --unstable-group-score mass --page-size 16
