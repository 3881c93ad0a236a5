#!/bin/bash
# Run 32e (NOTES, runs 32c and 32d): a first cache's prefill with the host tier registered in 64 MiB pieces against
# one registration a mapping, each in a fresh process after a dense row at the full prompt, then (PROFILE=1, default)
# the default once more with the first cache's prefill under cProfile: where its calling thread spends the extra time
# (one call, ~7 minutes; BIG=1 adds 16 x 16k, ~6 minutes more, an H200's memory).
#   run: bash docs/benchmarks/scripts/run32e.sh   (from the checkout root on the GPU machine; writes to $OUT)
nvidia-smi --query-gpu=name --format=csv,noheader
export PYTHONPATH=$PWD
cases="1x16384"
[ "${BIG:-0}" = 1 ] && cases="1x16384 16x16384"
for case in $cases; do
    runs="0 64"
    [ "${PROFILE:-1}" = 1 ] && [ $case = 1x16384 ] && runs="0 64 0p"
    runs=${RUNS:-$runs}  # e.g. RUNS="64 0p": run 32d already timed the default on that host
    for mib in $runs; do
        extra=""
        [ $mib = 0p ] && extra="--prefill-profile"
        timeout 280 python3 docs/benchmarks/host/first_cache.py --piece-mib ${mib%p} -- --model llama8b \
            --cases $case --rows dynamic,flexicache-unsized --new-tokens 32 $extra --out $OUT \
            --tag run32e-$case-$mib > /dev/null 2>&1
        python3 - "$OUT/generate-run32e-$case-$mib.json" $case $mib <<'P'
import json, sys
for r in json.load(open(sys.argv[1]))["results"]:
    print(sys.argv[2], "pieces", sys.argv[3], r["row"], r.get("warmup_ttft_s"), r.get("ttft_s"), r.get("warmup_host_commit_s"),
          r.get("median_step_ms"))
    for row in (r.get("warmup_prefill_profile") or [])[:18]:
        print("   ", row)
P
    done
done
