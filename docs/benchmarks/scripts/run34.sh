#!/bin/bash
# Run 34 (NOTES, "Next GPU session (after run 33j)"): a first cache's time to its first token after a dense row, in
# fresh processes: (1) plain `bench.generate` (the kernels load on import, while the model is built); (2) the build
# joined first and no populating threads (the registration faults the pages in); (3) the build joined first, the
# first prefill under cProfile. 1 x 16k, ~3 minutes; BIG=1 adds (1) at 16 x 16k (an H200's memory, ~3 minutes more).
#   run: bash docs/benchmarks/scripts/run34.sh   (from the checkout root on the GPU machine; writes to $OUT)
nvidia-smi --query-gpu=name --format=csv,noheader
export PYTHONPATH=$PWD
show() {
    python3 - "$OUT/generate-$1.json" $1 <<'P'
import json, sys
for r in json.load(open(sys.argv[1]))["results"]:
    print(sys.argv[2], r["row"], "first", r.get("warmup_ttft_s"), "later", r.get("ttft_s"), "commit",
          r.get("warmup_host_commit_s"), "builds", r.get("warmup_triton_kernels"), r.get("error"))
    for row in (r.get("warmup_prefill_profile") or [])[:24]:
        print("   ", row)
P
}
gen="--model llama8b --rows dynamic,flexicache-unsized --new-tokens 16 --out $OUT"
timeout 150 python3 -m flexicache_hf.bench.generate $gen --cases 1x16384 --tag run34-import > /dev/null 2>&1; show run34-import
timeout 150 python3 docs/benchmarks/host/first_cache.py --build-first --pin-threads 0 -- $gen --cases 1x16384 \
    --tag run34-threads0 > /dev/null 2>&1; show run34-threads0
timeout 150 python3 docs/benchmarks/host/first_cache.py --build-first -- $gen --cases 1x16384 --prefill-profile \
    --tag run34-profile > /dev/null 2>&1; show run34-profile
if [ "${BIG:-0}" = 1 ]; then
    timeout 270 python3 -m flexicache_hf.bench.generate $gen --cases 16x16384 --tag run34-import-16x > /dev/null 2>&1
    show run34-import-16x
fi
