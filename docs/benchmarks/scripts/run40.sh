#!/bin/bash
# Run 40 (NOTES, session of 2026-12-07 18:09): issue 35's "accuracy unchanged where storage changed": the Qwen 16k
# fidelity grid `keep-16k` (8 documents, the defaults' row R 8 keep 1), after the nine-call Qwen carry
# (../shared/gpu/README.md) has left /tmp/fc/qwen.gguf on the warm machine.
#   run: bash docs/benchmarks/scripts/run40.sh   (from the checkout root; writes $OUT/keep)
nvidia-smi --query-gpu=name --format=csv,noheader
export PYTHONPATH=/tmp/site:$PWD FLEXICACHE_QWEN_GGUF=/tmp/fc/qwen.gguf
timeout 420 python3 -m flexicache_hf.eval --config keep-16k --part fidelity --out $OUT/keep --max-minutes 6 \
    --no-progress 2>&1 | grep -vE "Warning|warn" | tail -30
