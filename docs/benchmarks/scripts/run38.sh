#!/bin/bash
# Run 38 (NOTES, "Session of 2026-12-07 15:20"): run 37 (the block copies and the host-room check GPU-tested, the
# chunked-prefill probe), then the first README-call cache at 1 x 16k twice, with the build joined first: populating
# threads as shipped, and none (the registration faults the pages in itself); ~6 minutes, one call.
#   run: bash docs/benchmarks/scripts/run38.sh   (from the checkout root on the GPU machine; writes to $OUT)
bash docs/benchmarks/scripts/run37.sh
export PYTHONPATH=$PWD
for threads in default 0; do
    flag=$([ $threads = 0 ] && echo "--pin-threads 0")
    tag=run38-first-threads-$threads
    timeout 100 python3 docs/benchmarks/host/first_cache.py --build-first $flag -- --model llama8b --cases 1x16384 \
        --rows dynamic,flexicache-unsized --new-tokens 16 --out $OUT --tag $tag 2>&1 | grep -E "joined|Error"
    python3 - "$OUT/generate-$tag.json" <<'P'
import json, sys
for r in json.load(open(sys.argv[1]))["results"]:
    print(r["row"], r.get("warmup_ttft_s"), r.get("ttft_s"), r.get("host_commit_s"), r.get("host_wait_s"),
          r.get("triton_compiles"), r.get("error"))
P
done
