#!/bin/bash
# Run 32c (NOTES, "Before run 32c"): where the H200 host's step goes at 16 x 16k without a profiler, and whether the
# NUMA node the host tier lives on moves it (one call, ~9 minutes; 8 x 16k on an 80 GB card).
#   run: bash docs/benchmarks/scripts/run32c.sh   (from the checkout root on the GPU machine; writes to $OUT)
nvidia-smi --query-gpu=name,pci.bus_id --format=csv,noheader
lscpu | grep -E "Model name|^CPU\(s\)|NUMA"
nvidia-smi topo -m 2>&1 | head -3
export PYTHONPATH=$PWD
# 16 x 16k needs an H200's memory for StaticCache's prefill (run 32b); on an 80 GB card, 8 x 16k
CASE=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | awk '{print ($1 > 100000) ? "16x16384" : "8x16384"}')
echo "case $CASE"
timeout 40 python3 -m pytest -q tests/test_host_memory.py -k "prefers" 2>&1 | tail -2
S="docs/benchmarks/host/step_split.py --case $CASE"
F="grep -E ^(flexicache|static|bound|GPU)|Error"
# 1. as before this change (first touch), both rows; 2. the library's placement; 3. (BOUND=1) first touch, the
# process on the GPU's node
timeout 270 python3 $S --rows flexicache-unsized,static-sdpa_grouped --numa off --json $OUT/split-off.json 2>&1 \
    | $F | cut -c1-190
timeout 140 python3 $S --rows flexicache-unsized --json $OUT/split-on.json 2>&1 | $F | cut -c1-190
[ "${BOUND:-0}" = 1 ] && timeout 120 python3 $S --rows flexicache-unsized --numa off --affinity gpu-node \
    --json $OUT/split-bound.json 2>&1 | $F | cut -c1-190
