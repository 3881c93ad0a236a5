"""flexicache_hf: FlexiCache's stability-aware hierarchical KV cache for HuggingFace transformers.

Importing the package registers ``attn_implementation="flexicache"`` (attention and mask functions)
with transformers' public ``AttentionInterface`` / ``AttentionMaskInterface``, and, on a machine with an NVIDIA
driver, starts loading the CUDA kernels on a daemon thread while the user loads a model (CUDA itself is not
initialised: :func:`flexicache_hf.kernels.table.build_ahead`).
"""

from .attention import register as _register
from .cache import CacheStats, FlexiCache
from .chunked_prefill import prefill_in_chunks
from .handle import CacheStateError, ConcurrentUseError, PagedKV, UnsupportedModelError
from .layer import FlexiCacheLayer
from .config import ConfigError, FlexiCacheConfig
from .head_profile import HeadProfile, ModelIdentity, ProfileError, resolve_profile
from .recycling import kept_storage_bytes, release_storage
from .rerank import RerankEvent, SelectionObserver
from .host_memory import HostMemoryError
from .kernels import table as _table

_register()
if _table.cuda_host():  # a first cache's prefill then neither makes nor waits for them (run 33j)
    _table.build_ahead(driver=False)

__all__ = [
    "CacheStateError",
    "CacheStats",
    "ConcurrentUseError",
    "ConfigError",
    "FlexiCache",
    "FlexiCacheConfig",
    "FlexiCacheLayer",
    "HeadProfile",
    "HostMemoryError",
    "ModelIdentity",
    "PagedKV",
    "ProfileError",
    "RerankEvent",
    "SelectionObserver",
    "UnsupportedModelError",
    "kept_storage_bytes",
    "prefill_in_chunks",
    "release_storage",
    "resolve_profile",
]
__version__ = "0.1.0"
