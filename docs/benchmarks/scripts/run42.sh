#!/bin/bash
# Run 42 (NOTES, "Session of 2026-12-07 20:24"): whether a process's first README-call cache at 1 x 16k waits on
# CUDA's lazy loading of the kernels it is the first to launch: the same first-cache probe as run 39 (after a
# warm-up process, so Triton's disk cache is warm), with CUDA_MODULE_LOADING=LAZY (CUDA's default) and EAGER
# (every kernel of every library loaded when the context is made, before anything is timed); any card, ~4 minutes.
#   run: bash docs/benchmarks/scripts/run42.sh   (from the checkout root on the GPU machine; writes to $OUT)
nvidia-smi --query-gpu=name --format=csv,noheader
export PYTHONPATH=$PWD
i=0
for loading in LAZY LAZY EAGER EAGER; do
    i=$((i + 1)); tag=run42-$i-$(echo $loading | tr A-Z a-z)
    CUDA_MODULE_LOADING=$loading timeout 140 python3 docs/benchmarks/host/first_cache.py --build-first -- \
        --model llama8b --cases 1x16384 --rows dynamic,flexicache-unsized --new-tokens 16 --out $OUT --tag $tag \
        2>&1 | grep -E "joined|Error"
    python3 - "$OUT/generate-$tag.json" $loading <<'P'
import json, sys
rows = json.load(open(sys.argv[1]))["results"]
print(sys.argv[2], [(r["row"], round(r.get("warmup_ttft_s") or 0, 3), round(r["ttft_s"], 3)) for r in rows])
P
done
