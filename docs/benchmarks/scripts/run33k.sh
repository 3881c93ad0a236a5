#!/bin/bash
# Run 33k (NOTES, "Runs 33h-33j"): the README call's first cache after a dense row, with the kernels loaded while the
# model is built (the package starts it on import since run 33j); 1 x 16k, one process, ~1 minute.
#   run: bash docs/benchmarks/scripts/run33k.sh   (from the checkout root on the GPU machine; writes to $OUT)
nvidia-smi --query-gpu=name --format=csv,noheader
export PYTHONPATH=$PWD
timeout 100 python3 -m flexicache_hf.bench.generate --model llama8b --cases 1x16384 --rows dynamic,flexicache-unsized \
    --new-tokens 16 --out $OUT --tag run33k > /dev/null 2>&1
python3 - "$OUT/generate-run33k.json" <<'P'
import json, sys
for r in json.load(open(sys.argv[1]))["results"]:
    print(r["row"], "first cache", r.get("warmup_ttft_s"), "later", r.get("ttft_s"), "host commit",
          r.get("warmup_host_commit_s"), r.get("error"))
P
