#!/bin/bash
# Run 33g (NOTES, "Before run 33g"): the decode step with fewer graph inputs a layer (the reranker's head sets in
# two tensors, the host tier's row index made in the step), on a GPU: its GPU tests, then the step split of the
# README call beside StaticCache (8 x 16k on an 80 GB card, 16 x 16k on an H200); one call, ~7 minutes.
#   run: bash docs/benchmarks/scripts/run33g.sh   (from the checkout root on the GPU machine; writes to $OUT)
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
export PYTHONPATH=$PWD
timeout 300 python3 -m pytest -q -x tests/gpu/test_graph_decode_gpu.py tests/gpu/test_kernels_gpu.py \
    -k "graph or rerank or select or decode" 2>&1 | tail -2
CASE=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | awk '{print ($1 > 100000) ? "16x16384" : "8x16384"}')
timeout 270 python3 docs/benchmarks/host/step_split.py --case $CASE --rows flexicache-unsized,static-sdpa_grouped \
    --json $OUT/split.json 2>&1 | grep -E "^(flexicache|static|GPU)|Error" | cut -c1-190
