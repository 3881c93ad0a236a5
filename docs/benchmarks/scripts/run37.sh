#!/bin/bash
# Run 37 (NOTES, "Next GPU session (after the session of 2026-12-07 13:22)"): the block copies and the host-room
# check, GPU-tested, then the chunked-prefill probe; ~4 minutes, one call.
#   run: bash docs/benchmarks/scripts/run37.sh   (from the checkout root on the GPU machine; writes to $OUT)
# Then, one call each: ROW=flexicache-unsized SEARCH="--prefill-chunk 4096 --probe-start 34 --probe-step 2 \
#   --max-probes 4" bash docs/benchmarks/scripts/run33.sh   (and ROW=static with run 36's search, if time allows)
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
export PYTHONPATH=$PWD
timeout 240 python3 -m pytest -q -m gpu tests/gpu/test_page_major_gpu.py tests/gpu/test_vmm_gpu.py \
    tests/gpu/test_host_pinning_gpu.py tests/gpu/test_reserve_gpu.py tests/gpu/test_dense_gpu.py 2>&1 | tail -15
timeout 240 python3 docs/benchmarks/probes/chunked_prefill.py --batch 4 2>&1 | tee $OUT/run37-chunked-prefill.jsonl | tail -4
