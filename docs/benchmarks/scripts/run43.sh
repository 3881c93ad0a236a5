#!/bin/bash
# Run 43 (NOTES, "Session of 2026-12-07 20:24"): a fresh machine's first call. The README call beside StaticCache's
# sdpa_grouped row at 16 x 16k (8 x 16k on an 80 GB card), 128 new tokens, with Triton's and inductor's disk caches
# empty (as on a machine's first run): warm-up, the Triton variants built and their compile time
# (warmup_triton_kernels), step, tokens. Then the GPU tests (all but SmolLM2's).
#   run: bash docs/benchmarks/scripts/run43.sh   (from the checkout root on the GPU machine; writes to $OUT)
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
export PYTHONPATH=$PWD PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
CASE=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | awk '{print ($1 > 100000) ? "16x16384" : "8x16384"}')
cold=$(mktemp -d)
TRITON_CACHE_DIR=$cold/triton TORCHINDUCTOR_CACHE_DIR=$cold/inductor timeout 260 python3 -m flexicache_hf.bench.generate \
    --model llama8b --cases $CASE --new-tokens 128 --rows flexicache-unsized,static --static-variants sdpa_grouped \
    --out $OUT --tag run43-cold 2>&1 | grep -E "Error" | cut -c1-200
python3 - $OUT/generate-run43-cold.json <<'P'
import json, sys
for r in json.load(open(sys.argv[1]))["results"]:
    keep = ("ttft_s", "median_step_ms", "p99_step_ms", "warmup_s", "warmup_triton_compile_s", "tokens_sha1", "error")
    kernels = r.get("warmup_triton_kernels") or {}
    print(r.get("case"), r.get("row"), {k: r.get(k) for k in keep}, "variants", sum(v[0] for v in kernels.values()),
          round(r.get("warmup_compile_phases", {}).get("_compile.compile_inner", 0), 1))
    print("   ", kernels)
P
# TESTS / TEST_LIMIT: the GPU tests run (the kernels' and the graph op's first) and their limit; SIGINT at the limit, so
# pytest still prints its summary of what ran.
TESTS=${TESTS:-"tests/gpu/test_kernels_gpu.py tests/gpu/test_graph_decode_gpu.py tests/gpu/test_reserve_gpu.py tests/gpu"}
timeout -s INT ${TEST_LIMIT:-300} python3 -m pytest -q -rf $TESTS -k "not smollm2" -p no:cacheprovider 2>&1 | tail -8
