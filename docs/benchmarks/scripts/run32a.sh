#!/bin/bash
# Run 32a (NOTES, "Next GPU session (after run 31i)", items 1 and 3): the graph-launch probe, then the sized row at
# 16 x 30k that ran out of memory in run 31h, in a process of its own with PyTorch's expandable segments, beside the
# README call (one call on an H200, ~8 minutes).
#   run: bash docs/benchmarks/scripts/run32a.sh   (from the checkout root on the GPU machine; writes to $OUT)
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
export PYTHONPATH=$PWD
timeout 120 python3 docs/benchmarks/kernels/scripts/graph_launch.py --json $OUT/graph-launch.json 2>&1 | tail -12
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout 420 python3 -m flexicache_hf.bench.generate --model llama8b \
    --cases 16x30720 --rows flexicache-graph,flexicache-unsized --new-tokens 256 --out $OUT --tag run32a 2>&1 | tail -8
