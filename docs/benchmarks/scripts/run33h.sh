#!/bin/bash
# Run 33h (NOTES, "Runs 33g and 32e"): is a first cache's extra prefill time its host tier's? The first cache after a
# dense row, sized and eager (`flexicache`), without a host tier (--no-offload), then with one; 1 x 16k, ~4 minutes.
#   run: bash docs/benchmarks/scripts/run33h.sh   (from the checkout root on the GPU machine; writes to $OUT)
nvidia-smi --query-gpu=name --format=csv,noheader
export PYTHONPATH=$PWD
for mode in no-offload offload; do
    timeout 150 python3 -m flexicache_hf.bench.generate --model llama8b --cases 1x16384 --rows dynamic,flexicache \
        --$mode --new-tokens 16 --out $OUT --tag run33h-$mode > /dev/null 2>&1
    python3 - "$OUT/generate-run33h-$mode.json" $mode <<'P'
import json, sys
for r in json.load(open(sys.argv[1]))["results"]:
    print(sys.argv[2], r["row"], r.get("warmup_ttft_s"), r.get("ttft_s"), r.get("warmup_host_commit_s"),
          r.get("pinned_bytes"), r.get("error"))
P
done
