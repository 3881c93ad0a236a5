#!/bin/bash
# Run 33j (NOTES, "Run 33i"): the first cache after a dense row with the backend's build joined before anything runs
# (docs/benchmarks/host/first_cache.py --build-first): sized without a host tier, then the README call; 1 x 16k, ~2 minutes.
#   run: bash docs/benchmarks/scripts/run33j.sh   (from the checkout root on the GPU machine; writes to $OUT)
nvidia-smi --query-gpu=name --format=csv,noheader
export PYTHONPATH=$PWD
for rows in "flexicache --no-offload" "flexicache-unsized"; do
    tag=run33j-${rows%% *}
    timeout 120 python3 docs/benchmarks/host/first_cache.py --build-first -- --model llama8b --cases 1x16384 \
        --rows dynamic,$rows --new-tokens 16 --out $OUT --tag $tag 2>&1 | grep "joined"
    python3 - "$OUT/generate-$tag.json" <<'P'
import json, sys
for r in json.load(open(sys.argv[1]))["results"]:
    # the unsized row's first cache is its warm-up call (warmup_ttft_s); the sized row has none (ttft_s is the first)
    print(r["row"], r.get("warmup_ttft_s"), r.get("ttft_s"), r.get("triton_compiles"), r.get("error"))
P
done
