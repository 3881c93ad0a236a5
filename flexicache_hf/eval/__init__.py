"""Accuracy-retention harness: ``python -m flexicache_hf.eval --config tiny|full --out DIR``.

Modules: ``tasks`` (RULER-style synthetic tasks from the corpus), ``scorers``, ``fidelity`` (long
generation against the dense model), ``policies`` (dense / FlexiCache / Quest-like / eviction baselines),
``eviction`` (StreamingLLM, SnapKV-style and LServe-like caches), ``query_capture``, ``decoding``,
``grids`` (the run configurations: canonical ones in code, archived ones as JSON beside their results),
``runner`` and ``report``.
"""
