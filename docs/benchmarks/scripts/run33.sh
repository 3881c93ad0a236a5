#!/bin/bash
# Run 33 (NOTES, "Before run 33"): issue 35's throughput table at 30k, one row per call (each fits 10 minutes):
# the row's largest batch (eager probes of 16 tokens), then that batch measured with 256 new tokens.
#   run: ROW=flexicache-unsized bash docs/benchmarks/scripts/run33.sh   (also ROW=static, ROW=dynamic; an H200)
#   LIMIT: the bench's time limit (s, default 560); SEARCH: the row's search options in place of the H200's
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
free -g | head -2
export PYTHONPATH=$PWD PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
ROW=${ROW:-flexicache-unsized}
case $ROW in
    flexicache-unsized) search="--prefill-chunk 4096 --probe-start 28 --probe-step 4 --max-probes 4" ;;
    static) search="--static-variants sdpa_grouped --static-prefill-chunk 4096 --probe-start 24 --probe-step 4 --max-probes 4" ;;
    dynamic) search="--probe-start 8 --probe-step 2 --max-probes 4" ;;
esac
search=${SEARCH:-$search}  # another card: another start (e.g. an H100's 80 GB)
timeout ${LIMIT:-560} python3 -m flexicache_hf.bench.generate --model llama8b --largest-batch 30720 --rows $ROW $search \
    --new-tokens 256 --out $OUT --tag run33-$ROW 2>&1 | grep -E "^probe|Error|error" | cut -c1-200
python3 - "$OUT/generate-run33-$ROW.json" <<'P'
import json, sys
for r in json.load(open(sys.argv[1]))["results"]:
    keep = ("largest_batch", "tried", "largest_batch_row", "batch", "median_step_ms", "p99_step_ms", "ttft_s",
            "tokens_per_s", "decode_tokens_per_s", "peak_gpu_bytes", "pinned_bytes", "error")
    seqs = r.get("batch", 0) * r.get("decode_tokens_per_s", 0)
    print(r.get("case"), r.get("row"), {k: r[k] for k in keep if k in r}, "decode tokens/s (all rows)", round(seqs))
P
