"""``model.generate`` end to end, FlexiCache against the dense caches a transformers user has (CUDA):
``python -m flexicache_hf.bench.generate --help``; the manual is ``docs/benchmarks/bench-generate.md``.

Modules: ``cli`` (flags, model, ``main``), ``rows`` (row names), ``clock`` (the step clock and its summary),
``sampler`` (a stack sampler of the prefill's thread), ``run`` (one row's calls; a prompt's chunks through
:func:`flexicache_hf.prefill_in_chunks`), ``device`` (memory, counters and clean-up between rows), ``trace``
(profiler traces), ``search`` (the largest batch) and ``report`` (ratios, table, figure).
"""

from .cli import main
from .device import cudagraph_recordings

__all__ = ["cudagraph_recordings", "main"]
