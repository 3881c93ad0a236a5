#!/bin/bash
# Run 41 (NOTES, session of 2026-12-07 18:09): a compiled decode step's cache work as one opaque op a layer
# (flexicache_hf/graph_step.py), on a GPU.  PART=a: the cold compile against StaticCache's (bench.compile_time);
# PART=b (the default): its GPU tests (graphs equal eager, unsized growth without re-capture), then the README call
# at 16 x 16k (8 x 16k on an 80 GB card) with this code, with the code before it (.ab/main, carried), and
# StaticCache's sdpa_grouped row, 128 new tokens, one call: tokens, step, warm-up.
#   run: bash docs/benchmarks/scripts/run41.sh   (from the checkout root on the GPU machine; writes to $OUT)
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
export PYTHONPATH=$PWD PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
if [ "${PART:-b}" = a ]; then
    timeout 330 python3 -m flexicache_hf.bench.compile_time --device cuda --json $OUT/compile.json 2>&1 | \
        grep -E "generate|Error" | cut -c1-200
    exit 0
fi
timeout 150 python3 -m pytest -q -x tests/gpu/test_graph_decode_gpu.py tests/gpu/test_reserve_gpu.py \
    -k "not smollm2" 2>&1 | tail -3
CASE=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | awk '{print ($1 > 100000) ? "16x16384" : "8x16384"}')
gen="-m flexicache_hf.bench.generate --model llama8b --cases $CASE --new-tokens 128 --out $OUT"
timeout 240 python3 $gen --rows flexicache-unsized,static --static-variants sdpa_grouped --tag run41-new 2>&1 | \
    grep -E "Error" | cut -c1-200
PYTHONPATH=$PWD/.ab/main timeout 170 python3 $gen --rows flexicache-unsized --tag run41-old 2>&1 | grep -E "Error" | cut -c1-200
python3 - $OUT/generate-run41-new.json $OUT/generate-run41-old.json <<'P'
import json, sys
for f in sys.argv[1:]:
    for r in json.load(open(f))["results"]:
        keep = ("ttft_s", "median_step_ms", "p99_step_ms", "warmup_s", "tokens_sha1", "dynamo_graphs_added", "error")
        print(f.split("-")[-1][:-5], r.get("case"), r.get("row"), {k: r.get(k) for k in keep},
              round(r.get("warmup_compile_phases", {}).get("_compile.compile_inner", 0), 1))
P
