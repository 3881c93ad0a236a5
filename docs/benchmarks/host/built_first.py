"""Is a first cache's extra prefill time the kernel backend's build thread? (CUDA; a probe, not a product path.)

Run 33h: after a dense row, a first sized cache without a host tier still took 1.25 s to its first token against
0.59 s for later ones. A first cache starts :func:`~flexicache_hf.kernels.build_ahead` (Triton imported, its cache
key hashed, its driver made) on a thread beside its prefill. This joins that build before ``bench.generate`` runs
(its arguments after ``--``), so the first prefill has the process to itself.

    python docs/benchmarks/host/built_first.py -- --model llama8b --cases 1x16384 --rows dynamic,flexicache \
        --no-offload --new-tokens 16 --tag run33j
"""
import sys
import time

from flexicache_hf.bench.generate import main as generate_main
from flexicache_hf.kernels import build_ahead

if __name__ == "__main__":
    t = time.perf_counter()
    thread = build_ahead()
    if thread is not None:
        thread.join()
    print(f"build_ahead joined in {time.perf_counter() - t:.2f} s", file=sys.stderr)
    rest = sys.argv[1:]
    generate_main(rest[1:] if rest[:1] == ["--"] else rest)
