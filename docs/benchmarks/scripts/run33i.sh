#!/bin/bash
# Run 33i (NOTES, "Run 33h"): a process's first causal GQA SDPA call at 1 x 16k, by backend, each in a fresh process.
#   run: bash docs/benchmarks/scripts/run33i.sh   (from the checkout root on the GPU machine; writes to $OUT)
nvidia-smi --query-gpu=name --format=csv,noheader
python3 -c "import torch; print(torch.__version__, torch.backends.cudnn.version())"
for b in default flash cudnn efficient; do
    timeout 60 python3 docs/benchmarks/probes/sdpa_first_call.py --backend $b 2>&1 | tail -1 | tee -a $OUT/sdpa-first-call.jsonl
done
timeout 60 python3 docs/benchmarks/probes/sdpa_first_call.py --backend default --mask-first 2>&1 | tail -1 | tee -a $OUT/sdpa-first-call.jsonl
