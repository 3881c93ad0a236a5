"""``model.generate`` end to end, FlexiCache against the dense caches a transformers user has (CUDA):
``python -m flexicache_hf.bench.generate --help``; the manual is ``docs/benchmarks/bench-generate.md``.

Modules: ``cli`` (flags, model, ``main``), ``rows`` (row names), ``clock`` (the step clock and its summary),
``run`` (one row's calls), ``device`` (memory, counters and clean-up between rows), ``trace`` (profiler traces),
``search`` (the largest batch) and ``report`` (ratios, table, figure).
"""

from .cli import main
from .device import cudagraph_recordings
from .run import prefill_in_chunks

__all__ = ["cudagraph_recordings", "main", "prefill_in_chunks"]
