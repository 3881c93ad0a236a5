#!/bin/bash
# The session's last device minutes (run 31g): the GPU tests of this session's changes (the attention kernels'
# launches, the copy kernel's program cache), then 1 x 16k in a process later than one that built the copy kernel.
#   run: bash docs/benchmarks/scripts/run31g.sh   (from the checkout root on the GPU machine; writes to $OUT)
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader
python3 -c "import cuda.core; print('cuda.core', cuda.core.__version__)"
timeout 100 python3 -m pytest -q -m gpu tests/gpu/test_kernels_gpu.py -x -rs \
    -k "built_once or page_lse or copy_pages_uses" 2>&1 | tail -4
timeout 100 python3 -m flexicache_hf.bench.generate --model llama8b --cases 1x16384 --rows flexicache-unsized \
    --new-tokens 32 --out $OUT --tag run31g > /dev/null 2>&1
python3 -c "
import json, os
for r in json.load(open(os.environ['OUT'] + '/generate-run31g.json'))['results']:
    print(r['row'], r.get('warmup_ttft_s'), r.get('ttft_s'), r.get('median_step_ms'))"
