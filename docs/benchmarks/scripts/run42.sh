#!/bin/bash
# Run 42 (NOTES, "Before run 42"): what a process's first README-call cache at 1 x 16k waits on that a later one
# does not. The first-cache probe of run 39 (after a warm-up process, so Triton's disk cache is warm), four ways:
# CUDA_MODULE_LOADING=LAZY (CUDA's default), EAGER (every kernel of every library loaded when the context is made,
# before anything is timed), and LAZY after a throwaway 2-layer cache of the same settings generated 3 tokens from a
# 4k prompt (--shadow 4096: the kernels a prompt launches loaded, but not the measured cache's storage); any card,
# ~6 minutes.
#   run: bash docs/benchmarks/scripts/run42.sh   (from the checkout root on the GPU machine; writes to $OUT)
nvidia-smi --query-gpu=name --format=csv,noheader
export PYTHONPATH=$PWD
i=0
for way in lazy lazy eager shadow lazy; do
    i=$((i + 1)); tag=run42-$i-$way
    loading=LAZY; shadow=0
    [ $way = eager ] && loading=EAGER
    [ $way = shadow ] && shadow=4096
    CUDA_MODULE_LOADING=$loading timeout 140 python3 docs/benchmarks/host/first_cache.py --build-first \
        --shadow $shadow -- --model llama8b --cases 1x16384 --rows dynamic,flexicache-unsized --new-tokens 16 \
        --out $OUT --tag $tag 2>&1 | grep -E "joined|shadow|Error"
    python3 - "$OUT/generate-$tag.json" $way <<'P'
import json, sys
rows = json.load(open(sys.argv[1]))["results"]
print(sys.argv[2], [(r["row"], round(r.get("warmup_ttft_s") or 0, 3), round(r["ttft_s"], 3)) for r in rows])
P
done
