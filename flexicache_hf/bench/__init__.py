"""GPU micro-benchmarks (paper §4.4): ``python -m flexicache_hf.bench.decode`` and ``...bench.rerank``."""
