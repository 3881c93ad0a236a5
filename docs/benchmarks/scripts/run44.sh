#!/bin/bash
# Run 44 (NOTES, "Run 43"): why the README call's compile rose from 26.2 s (run 41) to 33.2 s (run 43) on CUDA while
# StaticCache's stayed at ~27.5 s. The compile benchmark's narrow 32-layer shape, each row a fresh interpreter with
# empty inductor and Triton caches, compiled as generate does on CUDA (reduce-overhead: CUDA graphs): StaticCache,
# the README call (unsized) and a sized cache, on main and on the code before the K pool became a static graph
# input (37e5d73^, carried as .ab44 with today's compile_time.py). Any card, ~5 minutes.
#   prepare (here): rm -rf .ab44 && mkdir .ab44 && git archive 37e5d73^ flexicache_hf | tar -x -C .ab44 &&
#                   cp flexicache_hf/bench/compile_time.py .ab44/flexicache_hf/bench/
#   run: bash docs/benchmarks/scripts/run44.sh   (carry [".ab44"]; writes to $OUT)
nvidia-smi --query-gpu=name --format=csv,noheader
for code in main before; do
    root=$PWD; [ $code = before ] && root=$PWD/.ab44
    rows=static,flexicache-unsized,flexicache; [ $code = before ] && rows=flexicache-unsized,flexicache
    PYTHONPATH=$root timeout 280 python3 -m flexicache_hf.bench.compile_time --device cuda --rows $rows \
        --mode reduce-overhead --json $OUT/compile-run44-$code.json 2>&1 | grep -vE "^JSON" | tail -4
done
python3 - $OUT/compile-run44-main.json $OUT/compile-run44-before.json <<'P'
import json, sys
for path in sys.argv[1:]:
    for r in json.load(open(path))["rows"]:
        p = r["phases"]
        print(path.rsplit("-", 1)[-1][:-5], r["row"], r["generate_s"], {k: p.get(k) for k in
              ("_compile.compile_inner", "bytecode_tracing", "create_aot_dispatcher_function", "GraphLowering.codegen")})
P
