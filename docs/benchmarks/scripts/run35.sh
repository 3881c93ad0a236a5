#!/bin/bash
# Run 35 (NOTES, "Before run 35"): where a first cache's remaining ~0.5 s at 1 x 16k goes (run 34: 1.08 s against
# 0.59 s with the kernels on disk and loaded first). (1) The register-stall probe: a prefill-like pass alone and
# beside populating / page-locking 1.6 GB on another thread (first: it needs no warm-up, and a call cut short keeps
# it); (2) a warm-up process, so Triton's disk cache holds every kernel; (3) the README call's storage without its
# host tier (unsized, --no-offload) and (4) with it, each the first cache after a dense row with the build joined
# first. Any card, ~4 minutes.
# As run (2026-12-07), (3) was the README call again: the flexicache-unsized row ignores --no-offload (NOTES,
# "Run 35"); a first cache without a host tier is the sized row's (flexicache-graph --no-offload, run33j.sh).
#   run: bash docs/benchmarks/scripts/run35.sh   (from the checkout root on the GPU machine; writes to $OUT)
nvidia-smi --query-gpu=name --format=csv,noheader
export PYTHONPATH=$PWD
gen="--model llama8b --new-tokens 16 --cases 1x16384 --out $OUT"
timeout 120 python3 docs/benchmarks/probes/register_stall.py --gb 1.6 --repeat 2 | tee $OUT/run35-register-stall.jsonl
timeout 150 python3 -m flexicache_hf.bench.generate $gen --rows flexicache-unsized --tag run35-warm > /dev/null 2>&1
echo "warm-up rc $?"
for rows in "flexicache-unsized --no-offload" "flexicache-unsized"; do
    tag=run35-$(echo $rows | tr -d ' ' | sed 's/--/-/')
    timeout 120 python3 docs/benchmarks/host/first_cache.py --build-first -- $gen --rows dynamic,$rows \
        --tag $tag 2>&1 | grep "joined"
    python3 - "$OUT/generate-$tag.json" <<'P'
import json, sys
for r in json.load(open(sys.argv[1]))["results"]:  # the unsized row's first cache is its warm-up call
    print(sys.argv[1].split("/")[-1], r["row"], "first", r.get("warmup_ttft_s"), "later", r.get("ttft_s"),
          "commit", r.get("warmup_host_commit_s"), "wait", r.get("warmup_host_wait_s"), "builds",
          r.get("warmup_triton_kernels"), r.get("error"))
P
done
