"""Reserved storage: an unsized FlexiCache on the compiled / CUDA-graph path.

A cache made without ``max_cache_len`` whose storage can be reserved (no ``kernels=`` override, no observer, its
layers on the CPU or on a CUDA device with virtual memory management, :func:`~flexicache_hf.vmm.vmm_supported`) is
laid out for the model's whole context (``max_position_embeddings``): every tensor has its final shape and address,
so ``generate`` compiles (and on CUDA graphs) its decode step once.  Each buffer that scales with the capacity — the
MinMax cache, the K/V pools (null page, the slot region at its final size, the full region) and the host tier — is a
view over a reserved range (:class:`~flexicache_hf.vmm.DeviceRange` on CUDA, a page-locked
:class:`~flexicache_hf.vmm.HostRange` for the host tier; a pageable ``HostRange`` on the CPU, so the CPU runs the same
code) of which only a prefix is committed: the pages the held tokens need plus :data:`CHUNK_TOKENS` of headroom.  The
page table and the small buffers are ordinary tensors of the reserved width.

When: from the first forward where the context is known at layer 0's update (a cache made with ``model_config``,
one whose profile records its model's context, as every shipped profile does -- the README's call -- or one that
learned it at an earlier forward): :func:`plan_first` checks the host cap on every layer's committed bytes
(a layer not yet initialised predicted from layer 0's states) and each layer is laid out reserved at its own update,
before it stores, so the prompt is written once into committed reserved storage (no growing allocation, no move).
A cache made without ``model_config`` whose profile records no context learns it only at its first attention, after layer 0's update has
stored the prompt (transformers hands ``update`` no config), so that first prompt is stored the growing way and moved
once into reserved storage before the next forward: at ``get_mask_sizes`` (which ``generate`` calls eagerly before
each step) or at that forward's first update (:func:`make_room`).  Growth: at layer 0's update of an eager
forward (after the length and host checks, before any write) and, for compiled steps, at ``get_mask_sizes``, one
chunk ahead of the host's upper bound of the length (``DecodeState.announce``; no synchronisation on the common
path), so a captured step never writes uncommitted memory.  ``host_memory_limit`` and the machine's room
(:mod:`~flexicache_hf.host_room`) are checked on every layer's committed host bytes before any layer commits.
Committed memory is never given back while the cache lives (``reset`` keeps it, as a sized cache keeps its
buffers); a dropped cache's reserved storage, committed memory and all, serves the next cache of its shape and
context (:mod:`~flexicache_hf.recycling`: same addresses, so its first decode step replays the recorded graphs and
its host tier is already page-locked), or is freed.
"""

from __future__ import annotations

import functools
import math
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from .pages import PoolLayout, num_pages, room_pages
from .host_room import check_host_growth
from .tiers import tier_block
from .host_memory import PAGE
from .vmm import DeviceRange, HostRange, round_up, vmm_supported

CHUNK_TOKENS = 256
"""Tokens of headroom committed at each growth (rounded up to whole pages; a device range rounds up to its granule,
2 MiB on Hopper, anyway).  Module-level: tests set it small to cross many chunk boundaries."""


@functools.lru_cache(maxsize=None)
def _vmm(index: int) -> bool:
    return vmm_supported(index)


def supported(device: torch.device) -> bool:
    """Whether storage on ``device`` can be reserved: the CPU (pageable ranges) or a CUDA device with VMM."""
    device = torch.device(device)
    if device.type == "cpu":
        return True
    return device.type == "cuda" and _vmm(torch.cuda.current_device() if device.index is None else device.index)


def compileable_unsized() -> bool:
    """Whether an unsized cache may be compiled, decided before its device is known: no CUDA (the CPU path), or the
    current CUDA device supports virtual memory management."""
    return not torch.cuda.is_available() or _vmm(torch.cuda.current_device())


def context_for(cache, device: torch.device) -> int | None:
    """The tokens ``cache``'s layers on ``device`` are reserved for, or None: sized, not compileable, context not
    known yet, or a CUDA device without VMM (today's growing eager path, warned once).  The context: the model's
    (``max_position_embeddings``, once the cache saw its config), else the profile's record of it
    (:attr:`~flexicache_hf.model_identity.ModelIdentity.max_positions`: the README's call, which hands the cache no
    config, is reserved from its first forward)."""
    context = cache.max_positions if cache.max_positions is not None else cache.profile.model.max_positions
    if cache.max_tokens is not None or cache.kernels is not None or cache.observer is not None or context is None:
        return None
    if supported(device):
        return context
    if not getattr(cache, "_warned_unreserved", False):
        cache._warned_unreserved = True
        warnings.warn(f"FlexiCache: {device} has no virtual memory management, so this unsized cache grows by "
                      "re-allocation and decodes eagerly; make it with max_cache_len (prompt + max_new_tokens) for the "
                      "compiled / CUDA-graph decode step")
    return None


def fit_reserved(cache, context: int | None) -> int | None:
    """The context ``cache`` serves once it saw the model's config (``context``: its ``max_position_embeddings``).
    Layers already reserved for fewer tokens (the profile's record of the context, where the model allows more) keep
    their reservation and the cache refuses past it (warned once); the schedules' capacity follows a smaller one."""
    reserved = [layer.storage.reserved.tokens for layer in cache.layers
                if layer.is_initialized and layer.storage.reserved is not None]
    if not reserved:
        return context
    limit = min(reserved)
    if context is None or context > limit:
        warnings.warn(f"FlexiCache: this cache's storage was reserved for {limit} positions (its profile's record of "
                      f"the model's context) before it saw the model's config ({context}); longer sequences are "
                      "refused: make the cache with model_config=model.config to reserve the model's context")
        context = limit
    for state in cache.states.values():
        if state.capacity is not None:
            state.capacity = min(state.capacity, context)
    return context


def target_pages(need: int, committed: int, pages: int, page_size: int) -> int:
    """Pages committed after making room for ``need`` pages: unchanged when they fit, else ``need`` plus a chunk
    (:data:`CHUNK_TOKENS` in whole pages), at most the reserved ``pages``."""
    if need <= committed:
        return committed
    return min(pages, need + max(1, num_pages(CHUNK_TOKENS, page_size)))


def host_commit_bytes(batch: int, heads: int, page_size: int, head_dim: int, dtype: torch.dtype, pages: int) -> int:
    """Host bytes (K and V) a reserved host tier commits for ``pages`` pages: each range rounds up to whole OS pages
    and page runs (:class:`~flexicache_hf.vmm.HostRange`'s unit), what ``host_memory_limit`` is checked against."""
    if not heads:
        return 0
    n, run = tier_block(batch, heads, page_size, head_dim, dtype, pages)
    return 2 * round_up(n, math.lcm(PAGE, run))


def _range(nbytes: int, device: torch.device, host: bool, align: int = 1):
    """A range of ``nbytes``: a pinned (CUDA) or pageable (CPU) host range for the host tier and for anything on the
    CPU, a device range for a CUDA buffer."""
    if device.type == "cuda" and not host:
        return DeviceRange(nbytes, device)
    return HostRange(nbytes, device if device.type == "cuda" else None, chunk_bytes=0, align=align)


def host_ranges(batch: int, heads: int, page_size: int, head_dim: int, dtype: torch.dtype, pages: int,
                device: torch.device) -> dict:
    """A host tier's ``host_k`` / ``host_v`` ranges for ``pages`` pages of ``heads`` heads (:func:`tier_block`'s bytes,
    aligned to its run): made by :class:`Reservation`, or ahead of it by :func:`host_ahead`."""
    total, run = tier_block(batch, heads, page_size, head_dim, dtype, pages)
    return {name: _range(total, device, True, run) for name in ("host_k", "host_v")}


class Reservation:
    """The ranges behind one layer's capacity-scaled buffers, laid out for ``layout.page_capacity`` pages, and the
    pages committed (integers; the storage holds the tensors, views over the ranges' starts)."""

    def __init__(self, layout: PoolLayout, heads: int, page_size: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, tokens: int, ranges: dict | None = None):
        self.tokens = tokens  # the context reserved for (a decode step's mask spans it)
        self.layout, self.heads, self.page_size, self.head_dim = layout, heads, page_size, head_dim
        self.dtype, self.device = dtype, device
        self.committed = 0
        # name -> range; made by tensors(), but for the host tier's when a first forward made them ahead (host_ahead)
        self.ranges = dict(ranges or {})
        # seconds this layer's own commits (its forwards' thread) spent on the host tier's ranges: committing, or
        # waiting for a commit running in the background (host_ahead) to finish
        self.host_wait_s = 0.0
        self.device_commit_s = 0.0  # seconds its device ranges spent mapping memory (cuMemCreate / Map / SetAccess)

    @property
    def pages(self) -> int:
        return self.layout.page_capacity

    def _bytes(self, name: str, pages: int) -> int:
        lay, ps, D, size = self.layout, self.page_size, self.head_dim, self.dtype.itemsize
        if name in ("k", "v"):  # null page + slot region + the full region's first `pages` pages (page-major)
            return (lay.full_base + lay.batch * lay.num_full_heads * pages) * ps * D * size
        if name in ("min", "max"):
            return pages * lay.batch * self.heads * D * size
        return tier_block(lay.batch, lay.num_slot_heads, ps, D, self.dtype, pages)[0]  # host k / v

    def tensors(self, pages: int) -> dict[str, torch.Tensor]:
        """Reserve the ranges (once), commit their first ``pages`` pages (:meth:`commit`), and return the
        reserved-shape views: ``k``, ``v`` (pools), ``min``, ``max`` (MinMax, page-major) and, with offloaded heads,
        ``host_k``, ``host_v`` (+ ``host_k_dev`` / ``host_v_dev`` on CUDA: the pinned tier's device views).  The
        ranges are committed before any view is made (a view of an empty range would commit a first sliver on its
        own, and a pinned host range registered as a sliver and then the rest is two registrations, which one 2D
        row copy may not cross)."""
        lay, ps, D, P = self.layout, self.page_size, self.head_dim, self.pages
        shapes = {"k": (lay.num_physical, ps, D), "v": (lay.num_physical, ps, D),
                  "min": (P, lay.batch, self.heads, D), "max": (P, lay.batch, self.heads, D)}
        if lay.num_slot_heads:
            shapes["host_k"] = shapes["host_v"] = (P, lay.batch, lay.num_slot_heads, ps, D)
        run = tier_block(lay.batch, lay.num_slot_heads, ps, D, self.dtype, 1)[1]  # chunks end on page runs
        # (ranges made ahead serve only where they are what this layout needs: else they are dropped, and freed)
        self.ranges = {n: r for n, r in self.ranges.items() if n in shapes and r.reserved_bytes >= self._bytes(n, P)
                       and (not n.startswith("host") or r.align == run)}
        missing = [n for n in ("host_k", "host_v") if n in shapes and n not in self.ranges]
        if missing:
            made = host_ranges(lay.batch, lay.num_slot_heads, ps, D, self.dtype, P, self.device)
            self.ranges.update((n, made[n]) for n in missing)
        for name in shapes:
            if name not in self.ranges:
                self.ranges[name] = _range(self._bytes(name, P), self.device, False)
        self._grow(pages)
        out = {}
        for name, shape in shapes.items():
            rng = self.ranges[name]
            out[name] = rng.tensor(shape, self.dtype)
            if name.startswith("host") and self.device.type == "cuda":
                out[name + "_dev"] = rng.cuda_tensor(shape, self.dtype)
        self.commit(pages, out["min"], out["max"])
        return out

    def host_bytes_at(self, pages: int) -> int:
        """Host-tier bytes (K and V) committed at ``pages`` pages (before a range's rounding to whole OS pages)."""
        lay = self.layout
        return host_commit_bytes(lay.batch, lay.num_slot_heads, self.page_size, self.head_dim, self.dtype, pages)

    def device_bytes(self) -> int:
        return sum(r.committed_bytes for n, r in self.ranges.items() if not n.startswith("host"))

    def host_bytes(self) -> int:
        return sum(r.committed_bytes for n, r in self.ranges.items() if n.startswith("host"))

    def commit(self, pages: int, mins: torch.Tensor, maxs: torch.Tensor) -> None:
        """Commit the first ``pages`` pages of every range (nothing when they are); the MinMax entries of the new
        pages start empty (+inf / -inf).  A device out of memory raises before the MinMax is touched."""
        old = self.committed
        if pages <= old:
            return
        self._grow(pages)
        mins[old:pages].fill_(float("inf"))
        maxs[old:pages].fill_(float("-inf"))
        self.committed = pages

    def _grow(self, pages: int) -> None:
        for name, rng in self.ranges.items():
            t0 = time.perf_counter()
            rng.grow_to(self._bytes(name, pages))
            if name.startswith("host"):
                self.host_wait_s += time.perf_counter() - t0
            else:
                self.device_commit_s += time.perf_counter() - t0

    def commit_seconds(self) -> tuple[float, float, float]:
        """(seconds this layer's forwards spent in host-tier commits or waiting for them, seconds spent committing
        its host ranges on any thread, seconds spent mapping its device ranges) over the storage's life."""
        host = sum(r.commit_s for n, r in self.ranges.items() if n.startswith("host"))
        return self.host_wait_s, host, self.device_commit_s

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["ranges"], state["committed"] = {}, 0  # made again where loaded (storage.__setstate__)
        return state


# ---- the cache's side: when to reserve and to commit -----------------------------------------------------------
def make_room(cache, need: int, device: torch.device) -> None:
    """Reserved storage for every layer of ``cache`` with room for ``need`` pages (eager: before any write of the
    forward; compiled: before the step).  Layers still growing (after the first prompt) are moved into reserved
    storage first.  Refuses (HostMemoryError), before anything changes, when the layers' committed host bytes would
    pass ``host_memory_limit`` or their growth the machine's room (:mod:`~flexicache_hf.host_room`).  Nothing happens
    unless every layer is initialised and the cache reserves (a forward that initialises a layer is laid out by
    :func:`plan_first` instead)."""
    context = context_for(cache, device)
    layers = cache.layers
    if context is None or not all(layer.is_initialized for layer in layers):
        return
    first = layers[0].storage
    if any((s.batch, s.dtype, s.device) != (first.batch, first.dtype, first.device)
           for s in (layer.storage for layer in layers)):
        return  # layers kept by reset() for another batch: each is made anew at its update
    plans = [layer.storage.reserve_plan(context, need, layer.stored_end) for layer in layers]
    if all(plan is None for plan in plans):
        return
    need_bytes = sum(layer.host_bytes() if plan is None else plan for layer, plan in zip(layers, plans))
    check_host_growth(need_bytes, cache.config.host_memory_limit, new=need_bytes - cache.host_bytes())
    for layer in layers:
        layer.reserve(context, need)
    for state in cache.states.values():
        state.capacity = context  # the schedule refuses (and clamps) past the context, as for max_cache_len


def plan_first(cache, need: int, key_states: torch.Tensor) -> FirstPlan | None:
    """At layer 0's update of a forward that some layer serves for the first time (a new cache, or a layer made anew
    for another batch or dtype) when the context is known then (``model_config``, or learned at an earlier forward):
    a :class:`FirstPlan`, after which each layer is laid out reserved at its own update, before it stores anything
    (:meth:`~flexicache_hf.layer.face.FlexiCacheLayer.reserve`), so the prompt is written once into committed
    reserved storage; else None (:func:`make_room` and the growing path serve).  Refuses (HostMemoryError), before
    anything changes, when the layers' committed host bytes would pass ``host_memory_limit`` or their growth the
    machine's room (a layer before its first forward: predicted from these states)."""
    layers = cache.layers
    context = context_for(cache, key_states.device)
    if context is None or all(layer.is_initialized and (layer.seq_len or layer.storage.fits(key_states))
                              for layer in layers):
        return None
    if need > room_pages(context, cache.config.page_size):
        return None  # past the profile's record of the context: the growing path, refused once the model is seen
    if any(layer.is_initialized and layer.seq_len and layer.storage.reserved is None for layer in layers):
        return None  # (a growing layer holding tokens: moved by make_room once every layer is initialised)
    need_bytes = sum(layer.reserve_host_plan(context, need, key_states, cache.tp_size) for layer in layers)
    check_host_growth(need_bytes, cache.config.host_memory_limit, new=need_bytes - cache.host_bytes())
    for state in cache.states.values():
        state.capacity = context  # as make_room: the schedule refuses (and clamps) past the context
    return FirstPlan(context, need, host_ahead(cache, context, need, key_states))


@dataclass
class FirstPlan:
    """A first forward laid out reserved (:func:`plan_first`): the context, the pages to commit, and per layer the
    host-tier ranges made at layer 0's update and committed in the background since (:func:`host_ahead`)."""

    context: int
    need: int
    host: dict  # layer index -> {"host_k": HostRange, "host_v": HostRange}


def host_ahead(cache, context: int, need: int, key_states: torch.Tensor) -> dict:
    """At layer 0's update of a first forward: the host-tier ranges of every layer still to be laid out, made now and
    committed (populated, and page-locked on CUDA) in the background in layer order while the layers before them
    compute, as a sized cache's pinned blocks are (``block_keeper.BlockKeeper.prefetch``).  A layer's own commit then
    finds its range committed (or waits on the range's lock for it); a background failure leaves the range as it was,
    and that layer's own commit tries again and raises.  Sizes come from the layer's prediction of its slot heads."""
    ps = cache.config.page_size
    P = room_pages(context, ps)
    target = target_pages(need, 0, P, ps)
    out, jobs = {}, []
    B, _, _, D = key_states.shape
    for layer in cache.layers:
        if layer.is_initialized and layer.storage.reserved is not None:
            continue
        heads = layer.predicted_slot_heads(key_states, cache.tp_size)
        if not heads:
            continue
        commit = tier_block(B, heads, ps, D, key_states.dtype, target)[0]
        ranges = out[layer.layer_idx] = host_ranges(B, heads, ps, D, key_states.dtype, P, key_states.device)
        jobs += [(rng, commit) for rng in ranges.values()]
    if jobs:
        pool = ThreadPoolExecutor(2, thread_name_prefix="flexicache-reserve")
        for rng, commit in jobs:
            pool.submit(rng.grow_to, commit)
        pool.shutdown(wait=False)  # the jobs run on; each layer's commit meets its own
    return out


def plan_forward(cache, end: int, key_states: torch.Tensor, plan_host) -> FirstPlan | None:
    """At layer 0's update, before any layer grows or commits: a forward laid out reserved layer by layer
    (:func:`plan_first`'s plan, returned), else the growing layers' host check (``plan_host``) and room in reserved
    storage (:func:`make_room`) for ``end`` tokens."""
    need = room_pages(end, cache.config.page_size)
    cache.first_reserve = None  # an earlier plan's unused ranges (a forward that stopped) go before new ones are made
    plan = plan_first(cache, need, key_states)
    if plan is None:
        plan_host(cache.layers, end, key_states, cache.tp_size, cache.config.host_memory_limit)
        make_room(cache, need, key_states.device)
    return plan


def reserve_first(cache, layer) -> None:
    """At each layer's update of a forward :func:`plan_forward` planned reserved: lay the layer out for the context
    (or commit its room) before it stores, so the prompt is written once into committed reserved storage (its host
    tier's ranges the ones :func:`host_ahead` made)."""
    plan = cache.first_reserve
    if plan is not None:
        layer.reserve(plan.context, plan.need, plan.host.pop(layer.layer_idx, None))


def before_step(cache, tokens: int, check_room) -> None:
    """Before a step ``generate`` runs (eagerly, even for a compiled one): move a growing cache into reserved
    storage, refuse a step past the context (``check_room``, which announces it), then commit one chunk ahead of
    the host's upper bound of the length (announced forwards counted as run: no synchronisation)."""
    if cache.states and not cache.guard.open:
        state = next(iter(cache.states.values()))
        make_room(cache, 0, state.device)  # a growing cache moved (nothing committed beyond what it holds)
    check_room(cache, tokens)
    if cache.states and not cache.guard.open and all(s.capacity is not None for s in cache.states.values()):
        state = next(iter(cache.states.values()))
        if cache.layers[0].is_initialized and cache.layers[0].storage.reserved is not None:
            bound = state.host_length + state.announced  # storage positions, an upper bound
            make_room(cache, num_pages(bound, cache.config.page_size), state.device)
