"""A compiled decode step's cache work, one opaque op a layer: ``flexicache::graph_step``.

Traced, a layer's part of a decode step (its token appended, the layer's re-rank flags, the re-rank, the slots
reseated and their pages loaded, the sparse attention) is ~8 mutating kernel ops and ~190 graph nodes, about twice
a StaticCache layer's, and Dynamo, AOT and inductor spent about twice StaticCache's time compiling the forward.
As one op, the compiled forward holds a layer's projections, norms and this op, and compiles about as fast as
StaticCache's.

The op's body is the eager decode step with nothing known on the host (``GRAPH_PLAN``: every launch predicated on
the device's schedule, no host synchronisation), run each time the compiled code calls the op: at the CUDA graph's
warm-up and capture, where every kernel and copy it launches is recorded; replays then run the recorded kernels and
no Python.  Its copies go on the capturing stream (:func:`~flexicache_hf.tiers.in_graph`), as a traced step's did.

What the op reads and writes it reaches through its cache, not its arguments, and it declares no mutation: nothing
in the compiled graph copies, clones or reorders the cache's tensors, and the ops of a forward are ordered by what
flows between them (a layer's query comes from the layer before).  Of the layer's storage the graph takes only the K
pool (see :func:`graph_step`).  Traced code reads one cache tensor, the schedule's ``length`` (``get_seq_length``,
for positions when a caller gives none), through an op too (``DecodeState.device_length``): inductor would otherwise
inline the read into every layer's rotary embedding, after the first layer's op advanced it (a test caught that).
The op is handed ``length``, read only, to find its cache in the one table here, which each cache's eager
forward fills (a cache's prompt always runs eagerly, before any compiled step): an address book of live
schedules, nothing configurable.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch.library import custom_op

from .handle import CacheStateError

_CACHES: dict[int, weakref.ref] = {}  # a schedule's `length` address -> its cache (register)


def register(cache) -> None:
    """Make ``cache`` the owner of its schedules' ``length`` tensors (at its eager forwards; a new entry first drops
    those of caches gone since)."""
    for state in cache.states.values():
        key = state.length.data_ptr()
        ref = _CACHES.get(key)
        if ref is None or ref() is not cache:
            for gone in [k for k, r in _CACHES.items() if r() is None]:
                del _CACHES[gone]
            _CACHES[key] = weakref.ref(cache)


@dataclass(frozen=True)
class GraphStep:
    """What a traced decode step's ``update`` hands the attention function (as both key and value): the layer's
    index, its new states ``[B, H, 1, D]``, its schedule's ``length`` and its K pool (``pool``: the layer's storage
    as a graph input, see :func:`graph_step`)."""

    layer_idx: int
    key: torch.Tensor
    value: torch.Tensor
    length: torch.Tensor
    pool: torch.Tensor

    def attend(self, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """The layer's decode step: ``query [B, Hq, 1, D]`` -> ``[B, 1, Hq, D]``."""
        out = graph_step(query[:, :, 0], self.key, self.value, self.length, self.pool, self.layer_idx,
                         float(scaling))
        return out[:, None]


@custom_op("flexicache::graph_step", mutates_args=())
def graph_step(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, length: torch.Tensor, pool: torch.Tensor,
               layer_idx: int, scaling: float) -> torch.Tensor:
    """Layer ``layer_idx``'s decode step (layer 0 first plans it for every layer): ``query [B, Hq, D]`` ->
    ``[B, Hq, D]``.

    ``pool`` (the layer's K pool, not read here) makes the layer's storage an input of the compiled graph: a
    recorded CUDA graph holds the addresses the body used, and cudagraph trees record anew when a static input's
    address changes.  Every change of a layer's buffers after its first forward (row selection, a new batch) makes
    a new pool, marked static as the old one was, so a graph never replays onto buffers that are gone."""
    ref = _CACHES.get(length.data_ptr())
    cache = ref() if ref is not None else None
    layer = cache.layers[layer_idx] if cache is not None else None
    if (layer is None or layer.state.length.data_ptr() != length.data_ptr()
            or layer.storage.pool.k.data_ptr() != pool.data_ptr()):
        raise CacheStateError(
            "a compiled FlexiCache step was handed a schedule or storage it does not know (a copy of the cache's "
            "`length` or pool, or a cache that never ran a forward eagerly); run the prompt eagerly first (generate "
            "does), or decode with generate(..., disable_compile=True)")
    if layer_idx == 0:
        for state in cache.states.values():
            state.advance()
    layer.graph_store(key, value)
    return layer.graph_attend(query, scaling)


@graph_step.register_fake
def _(query, key, value, length, pool, layer_idx, scaling):
    return torch.empty_like(query)
