"""The storage of a dropped compileable cache, kept for the next cache of the same shape (one at a time, per process).

A compiled decode step's CUDA graphs read a sized cache's buffers at fixed addresses.  A fresh FlexiCache has new
buffers, so cudagraph trees record every graph again (150-195 ms on the 8B shape at 1 × 16k and 16 × 16k: 10-13
steps) and add a node to their tree each time.  transformers spares StaticCache this by keeping the cache on the
model and resetting it for the next ``generate``; a FlexiCache is made by the user, so the same happens from the
other side: when a sized cache (``max_cache_len``) or an unsized one on reserved storage (:mod:`flexicache_hf.reserve`:
the README's call) is dropped, its layers (device pools, MinMax cache, tables, pinned host tier; for reserved storage
its ranges, with the memory they committed) and its step schedule are kept here, and the next FlexiCache made with
the same profile, configuration and ``max_cache_len`` (reserved: for the same context) takes them at its first
forward, emptied in place as ``reset()`` empties a cache.  Its first decode step then replays the graphs already
recorded, and a reserved cache's host tier needs no page-locking.

At most one dropped cache's storage is held.  The first forward of any FlexiCache ends the hold, before that cache
allocates anything: the storage is taken when it matches (and fits the batch, dtype and device), else freed.  So
kept storage never stands beside a live cache's, and a loop that replaces its cache (``cache = FlexiCache(...)``
then ``generate``) holds one cache's storage at a time, as it did without recycling.  ``release_storage()``
frees it at once.  A cache with an observer (not compileable) or one that never ran a forward leaves nothing, and
kept storage is not handed on while anything outside still holds one of its layers (someone kept
``cache.layers[i]``).

Page-locked host blocks are kept one level down, by :data:`flexicache_hf.block_keeper.BLOCKS`: storage freed here
(another cache's first forward, ``release_storage()``), like any tier that grows or dies, gives its blocks back
there, and the next tier of a block's size takes it without page-locking anew.  ``release_storage()`` and
``kept_storage_bytes()`` cover both.
"""

from __future__ import annotations

import sys
import threading
from dataclasses import dataclass

import torch

from .block_keeper import BLOCKS
from .reserve import context_for


@dataclass(frozen=True)
class KeptStorage:
    key: tuple
    layers: list  # the dropped cache's FlexiCacheLayer objects, every one sized and initialised
    states: dict  # its DecodeState per device (the layers read them)

    def nbytes(self) -> int:
        """Device and host bytes held (what ``release_storage`` frees)."""
        return sum(layer.device_bytes() + layer.host_bytes() for layer in self.layers)


class StorageKeeper:
    """Holds at most one dropped cache's storage (thread-safe)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._kept: KeptStorage | None = None

    def keep(self, key: tuple, layers: list, states: dict) -> None:
        """Called when a cache is garbage: keep its layers if every one holds storage at fixed addresses."""
        if layers and all(_passes_on(layer) for layer in layers):
            with self._lock:
                self._kept = KeptStorage(key, layers, states)

    def take(self, key: tuple | None, key_states, context: int | None = None) -> KeptStorage | None:
        """The kept storage when it was made under ``key``, fits ``key_states`` (batch, heads, dtype, device), is
        reserved for ``context`` tokens where it is reserved storage, and nothing else holds its layers; the hold ends
        either way.  (Checked here, not when the cache died: a cache
        the cyclic collector frees is still referenced by the rest of its garbage cycle at that moment, e.g. the
        state torch.compile's tracing left.)"""
        kept = self._pop()
        if kept is None or key is None or kept.key != key or not _unshared(kept.layers):
            return None
        storage = kept.layers[0].storage
        if storage.reserved is not None and storage.reserved.tokens != context:
            return None
        if storage.min_pages.is_inference() and not torch.is_inference_mode_enabled():
            return None  # made under torch.inference_mode(): its tensors may not be updated in place outside it
        return kept if storage.fits(key_states) else None

    def release(self) -> int:
        """Free what is kept; returns the bytes it held."""
        kept = self._pop()
        return 0 if kept is None else kept.nbytes()

    def _pop(self) -> KeptStorage | None:
        with self._lock:
            kept, self._kept = self._kept, None
        return kept

    def held_layers(self) -> int:
        """Layers of the dropped cache held (0 or its layer count)."""
        with self._lock:
            kept = self._kept
        return 0 if kept is None else len(kept.layers)

    def held_bytes(self) -> int:
        with self._lock:
            kept = self._kept
        return 0 if kept is None else kept.nbytes()


def storage_key(cache) -> tuple | None:
    """What fixes a cache's storage before its first forward (batch, dtype and device are checked there, and for
    reserved storage the context); ``None`` for a cache whose storage never passes on: with an observer (never
    compiled), or unsized and not compileable (it grows)."""
    if cache.observer is not None or (cache.max_tokens is None and not cache.is_compileable):
        return None
    return (type(cache), cache.profile.model, cache.profile.unstable, cache.config, cache.max_tokens, cache.kernels,
            cache.count_pages)


def _passes_on(layer) -> bool:
    """Whether a layer's storage has fixed addresses: sized, or reserved (:mod:`~flexicache_hf.reserve`)."""
    return layer.is_initialized and bool(layer.page_capacity) and (
        layer.spec.max_tokens is not None or layer.storage.reserved is not None)


def _unshared(layers: list) -> bool:
    """Whether ``layers`` (a list) is the only holder of its layers.  Anything else still holding a layer of the dead
    cache (someone kept ``cache.layers[i]``) would see, and could change, the next cache's storage."""
    sole = max(sys.getrefcount(x) for x in [object()])  # a list's sole reference, counted the same way
    return all(sys.getrefcount(layer) <= sole for layer in layers)


KEEPER = StorageKeeper()  # one per process, like torch's caching allocators: kept storage is a resource


def take_kept_storage(cache, key_states: torch.Tensor) -> None:
    """At the first forward of a new ``cache``, before anything is allocated: take the storage of the last dropped
    cache when it has this cache's shape and fits these states (any other kept storage is freed now)."""
    kept = KEEPER.take(storage_key(cache), key_states, context_for(cache, key_states.device))
    if kept is not None:
        cache.layers[:] = kept.layers  # the same list and dict objects: this cache's finalizer holds them
        cache.states.update(kept.states)
        cache.reset()  # emptied in place, as reset() empties a sized cache
        cache.storage_reused = True


def release_storage() -> int:
    """Free the device and pinned host memory FlexiCache keeps for later caches: the last dropped sized cache's storage
    (for the next cache of the same shape, see :mod:`flexicache_hf.recycling`) and the page-locked blocks no cache
    holds (:mod:`flexicache_hf.block_keeper`); returns the bytes they held."""
    held = kept_storage_bytes()
    KEEPER.release()  # its host tiers give their blocks back to BLOCKS as they go
    BLOCKS.release()
    return held


def kept_storage_bytes() -> int:
    """Bytes of device and pinned host memory kept for later caches: the last dropped sized cache's storage and the
    page-locked blocks no cache holds."""
    return KEEPER.held_bytes() + BLOCKS.kept_bytes()
