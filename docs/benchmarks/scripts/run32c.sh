#!/bin/bash
# Run 32c (NOTES, "Before run 32c"): where the H200 host's step goes at 16 x 16k without a profiler, and whether the
# NUMA node the host tier lives on moves it (one call on an H200, ~8 minutes).
#   run: bash docs/benchmarks/scripts/run32c.sh   (from the checkout root on the GPU machine; writes to $OUT)
nvidia-smi --query-gpu=name,pci.bus_id --format=csv,noheader
lscpu | grep -E "Model name|^CPU\(s\)|NUMA"
nvidia-smi topo -m 2>&1 | head -4
export PYTHONPATH=$PWD
S=docs/benchmarks/host/step_split.py
timeout 300 python3 $S --case 16x16384 --rows flexicache-unsized,static-sdpa_grouped --json $OUT/split.json 2>&1 \
    | grep -E "^(flexicache|static|bound)|Error" | cut -c1-200
timeout 200 python3 $S --case 16x16384 --rows flexicache-unsized --affinity gpu-node --json $OUT/split-node.json 2>&1 \
    | grep -E "^(flexicache|static|bound)|Error" | cut -c1-200
