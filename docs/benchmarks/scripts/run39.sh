#!/bin/bash
# Run 39 (NOTES, "Next GPU session (after the session of 2026-12-07 15:20)"): the first README-call cache at 1 x 16k
# with its prefill's calling thread sampled (bench.generate --prefill-profile: a stack sampler of that thread alone,
# where Python 3.12's cProfile mixed in the page-locking threads), after a warm-up process; any card, ~2 minutes.
#   run: bash docs/benchmarks/scripts/run39.sh   (from the checkout root on the GPU machine; writes to $OUT)
nvidia-smi --query-gpu=name --format=csv,noheader
export PYTHONPATH=$PWD
for tag in run39-warm run39-sampled; do
    timeout 110 python3 docs/benchmarks/host/first_cache.py --build-first -- --model llama8b --cases 1x16384 \
        --rows dynamic,flexicache-unsized --new-tokens 16 --prefill-profile --out $OUT --tag $tag 2>&1 | grep -E "joined|Error"
    python3 - "$OUT/generate-$tag.json" <<'P'
import json, sys
for r in json.load(open(sys.argv[1]))["results"]:
    print(r["row"], r.get("warmup_ttft_s"), r.get("ttft_s"), r.get("host_commit_s"), r.get("triton_compiles"))
    for key in ("warmup_prefill_profile", "warmup_prefill_lines"):
        for row in (r.get(key) or [])[-40:]:
            print("   ", key[15:], row)
P
done
