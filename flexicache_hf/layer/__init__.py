"""One decoder layer of a FlexiCache: the HF-facing face, its storage, and the prompt and decode bodies it runs.

``face.py`` (``FlexiCacheLayer``, ``LayerSpec``) -> ``prefill.py`` / ``decode.py`` -> ``storage.py``; the step
schedule the cache plans for every layer is ``schedule.py``.
"""

from .face import FlexiCacheLayer, LayerSpec

__all__ = ["FlexiCacheLayer", "LayerSpec"]
