"""``FlexiCache(Cache)`` and its per-layer storage, the HF-facing side of FlexiCache.

``update`` owns *storage*: it appends a layer's new keys/values to paged per-(layer, KV head) storage —
device pages for unstable heads, pinned host pages plus top-K device slots for stable heads — and returns
a :class:`PagedKV` handle.  transformers passes that handle, as the "key" and "value" arguments, straight to
the registered ``"flexicache"`` attention function (:mod:`flexicache_hf.attention`), which calls
:meth:`FlexiCacheLayer.attend`: the *compute* side (dense causal attention for prompt chunks, top-K
selection + sparse paged decode for single-token steps).  The handle is the only channel between the
two: no globals, no thread-locals, no patched model code, so any number of caches and models can be alive
in any number of threads.

A decode step's schedule is planned once, by layer 0, in the cache's :class:`~flexicache_hf.state.DecodeState`
(device scalars), and every layer runs the same body against it (``append_token`` / ``attend_token``), eagerly
or inside the CUDA graph ``torch.compile`` captures (``graph_update`` / ``graph_attend``).
"""

from __future__ import annotations

import copy
import os
import weakref
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .config import FlexiCacheConfig
from .dense import dense_attention
from .kernels import MAX_SELECT_PAGES, KernelOps, ops_for
from .pages import PagePool, PoolLayout, grown_capacity, num_pages
from .head_profile import HeadProfile, resolve_profile
from .recycling import KEEPER
from .rerank import RerankEvent, Reranker, SelectionObserver
from .sharding import TensorParallel, kv_head_shard, tp_size_of
from .state import GRAPH_PLAN, DecodeState, DeviceCounters, StepPlan
from .tiers import CopyStream, HostTier, SlotTable, copy_context, load_promoted, offload_page, seat_from_chunk


class UnsupportedModelError(ValueError):
    """The model's attention layout cannot be served by FlexiCache (e.g. sliding-window layers)."""


class CacheStateError(RuntimeError):
    """The cache cannot serve this call: an earlier forward stopped part-way, or layers were driven out of order."""


class ForwardGuard:
    """One forward's progress through the cache: ``update(0), attend(0), update(1), ..., attend(L-1)``.

    A forward that raised (or was interrupted) part-way leaves some layers holding its tokens and others not;
    reusing such a cache would be silently wrong.  The guard knows: a forward is *open* from the moment layer 0's
    update starts changing storage until the last layer's attention returns, and validation errors raised before
    that leave it closed (the cache unchanged).  :meth:`FlexiCache.ensure_usable` acts on an open forward.
    """

    def __init__(self, num_layers: int):
        self.num_layers = num_layers
        self.clear()

    def clear(self) -> None:
        self.next = (0, "update")
        self.open = False
        self.began_empty = True  # the open forward started on an empty cache (nothing of value to lose)
        self.failure: str | None = None  # the first error FlexiCache saw in the open forward

    def begin(self, layer: int, phase: str, empty: bool = False) -> None:
        if (layer, phase) != self.next:
            raise CacheStateError(
                f"FlexiCache layer {layer}'s {phase} came when layer {self.next[0]}'s {self.next[1]} was due: a "
                "FlexiCache serves one forward at a time, through every layer in order"
            )
        if (layer, phase) == (0, "update"):
            self.open, self.began_empty, self.failure = True, empty, None

    def end(self, layer: int, phase: str) -> None:
        if phase == "update":
            self.next = (layer, "attend")
        elif layer + 1 < self.num_layers:
            self.next = (layer + 1, "update")
        else:
            self.clear()

    def note(self, error: BaseException) -> None:
        """Remember the first error of the open forward, to name it when the cache is next used."""
        if self.open and self.failure is None:
            text = f"{type(error).__name__}: {error}"
            self.failure = text if len(text) <= 300 else text[:297] + "..."


@dataclass(frozen=True, eq=False)
class PagedKV:
    """What ``FlexiCache.update`` hands to the attention function in place of key/value tensors.

    ``keys``/``values`` are this forward's new states ``[B, H, T, D]`` at positions ``start .. start+T-1``;
    everything older lives in ``layer``'s pages.  Any torch operation on a handle (i.e. a non-FlexiCache
    attention function receiving it) fails with an explanation instead of computing garbage.
    """

    layer: "FlexiCacheLayer"
    keys: torch.Tensor
    values: torch.Tensor
    start: int
    # A prompt chunk's offloaded heads, gathered once ``[B, len(slot_heads), T, D]``: the host copy reads them and
    # so does the prompt's top-K seat, so the copy stream never holds the whole chunk (all heads) alive.
    offloaded: tuple[torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        error = TypeError(_WRONG_ATTENTION)
        for arg in (*args, *(kwargs or {}).values()):
            if isinstance(arg, PagedKV):
                arg.layer.owner.guard.note(error)
        raise error

    def __getattr__(self, name):  # only reached for attributes a handle lacks (e.g. `.shape`)
        if name.startswith("__") or name == "layer":  # protocol probes (copy, pickle) and unset fields
            raise AttributeError(name)
        error = TypeError(f"{_WRONG_ATTENTION} (an attention function asked the handle for `{name}`)")
        self.layer.owner.guard.note(error)
        raise error


_WRONG_ATTENTION = (
    "FlexiCache stores paged KV that only the 'flexicache' attention can read: load the model with "
    "attn_implementation='flexicache' (after `import flexicache_hf`) or pass a DynamicCache instead"
)


@dataclass(frozen=True)
class CacheStats:
    """What one cache did so far (``cache.stats``: a snapshot; reading it synchronises with the device)."""

    decode_steps: int = 0
    prompt_tokens: int = 0
    pages_attended: int = 0  # sum over decode steps, layers, rows and KV heads of listed pages (count_pages=True)
    head_reranks: int = 0  # (layer, KV head) re-rank events
    head_steps: int = 0  # (layer, KV head) decode steps
    promoted: int = 0  # pages loaded from the host tier into device slots
    offloaded_pages: int = 0  # pages written to the host tier during decode (per row/head)

    def promoted_pages(self) -> int:
        return self.promoted


class _HostBytesOf:
    """``cache.host_bytes()`` for the host tier's cap, without the tier keeping its cache alive."""

    def __init__(self, cache: "FlexiCache"):
        self.cache = weakref.ref(cache)

    def __call__(self) -> int:
        cache = self.cache()
        return 0 if cache is None else cache.host_bytes()

    def __getstate__(self) -> dict:
        return {"cache": self.cache()}

    def __setstate__(self, state: dict) -> None:
        self.cache = weakref.ref(state["cache"])


class FlexiCacheLayer(CacheLayerMixin):
    """Paged KV of one decoder layer (see the module docstring for the life of a step)."""

    is_croppable = False
    is_sliding = False

    def __init__(self, layer_idx: int, unstable: tuple[int, ...], config: FlexiCacheConfig, owner: "FlexiCache"):
        super().__init__()
        self.layer_idx, self.unstable, self.config = layer_idx, unstable, config
        # Weak: a cache and its layers form no reference cycle, so a dropped cache frees its device and host
        # memory at once instead of waiting for the cyclic garbage collector.
        self._owner = weakref.ref(owner)
        self.seq_len = 0

    @property
    def owner(self) -> "FlexiCache":
        owner = self._owner()
        if owner is None:
            raise CacheStateError(f"the FlexiCache of layer {self.layer_idx} no longer exists (keep the cache, not a layer)")
        return owner

    def __getstate__(self) -> dict:  # copies and pickles hold the owner strongly; a weak link again once loaded
        state = dict(self.__dict__)
        state["_owner"] = self.owner
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _owner=weakref.ref(state["_owner"]))

    # ---- storage -------------------------------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        B, H, _, D = key_states.shape
        # The profile's global KV heads this layer holds here (all, or this rank's tensor-parallel block), and
        # its unstable heads among them as local indices; a profile of another shape is refused.
        self.shard = kv_head_shard(self.owner.profile.model, self.layer_idx, H, D,
                                   TensorParallel.of_process(self.owner.tp_size))
        unstable = self.shard.to_local(self.unstable)
        cfg = self.config
        self.device, self.dtype = key_states.device, key_states.dtype
        self.batch, self.num_kv_heads, self.head_dim = B, H, D
        self.ops: KernelOps = ops_for(self.device, prefer=self.owner.kernels)
        stable = tuple(h for h in range(H) if h not in set(unstable))
        slot_heads = stable if cfg.offload else ()
        full_heads = tuple(h for h in range(H) if h not in set(slot_heads))
        as_index = lambda hs: torch.tensor(hs, dtype=torch.long, device=self.device)  # noqa: E731
        self.slot_heads, self.full_heads = as_index(slot_heads), as_index(full_heads)
        layout = PoolLayout(B, len(slot_heads), 0, len(full_heads), 0)  # sized by the first update
        self.pool = PagePool(layout, self.full_heads, self.slot_heads, H, cfg.page_size, D, self.dtype, self.device)
        self.copies = CopyStream(self.device)
        self.host = HostTier(B, len(slot_heads), cfg.page_size, D, self.dtype, self.device,
                             cfg.host_memory_limit, _HostBytesOf(self.owner), self.copies, self.ops)
        self.slots = SlotTable(self.pool, self.device)
        self.reranker = Reranker(B, H, unstable, cfg.budget_pages, cfg.max_recent_pages, self.device,
                                 cfg.sink_pages, cfg.recent_pages, stable_scoring=cfg.stable_scoring,
                                 unstable_scoring=cfg.unstable_scoring)
        self.state = self.owner.decode_state(self.device)  # shared by every layer on this device (the schedule)
        self.states = self.owner.states  # every device's (layer 0 advances them all; a dict: no reference cycle)
        self.count_pages = self.owner.count_pages
        self.kmin = torch.empty((B, H, 0, D), dtype=self.dtype, device=self.device)
        self.kmax = torch.empty_like(self.kmin)
        self.valid_lo = torch.zeros(B, dtype=torch.long, device=self.device)
        self.padded = False  # whether any row has left padding (valid_lo > 0), known on the host
        # [B, slot_heads] physical page of the newest page of the offloaded heads (valid once a token is in)
        self.tail_phys = torch.zeros((B, len(slot_heads)), dtype=torch.long, device=self.device)
        # A prompt chunk's offload runs on the copy stream while the next layers compute; the compute stream
        # joins it only before it next touches this layer's slots (the following decode step).
        self.copies_pending = False
        self.prefetched = None  # (end, keys, values) of a prefix read started by prefetch_prefix
        self.host_current = True  # the host tier holds every token of the offloaded heads (nothing to flush)
        self.seq_len = 0
        self.is_initialized = True

    @property
    def page_capacity(self) -> int:
        return self.pool.layout.page_capacity

    def _ensure_capacity(self, end: int) -> None:
        """Room for ``end`` tokens: everything sized once for ``max_cache_len`` when the cache has one, else
        grown with headroom (amortised O(1) per token)."""
        need = num_pages(end, self.config.page_size)
        if need <= self.page_capacity:
            return
        max_len = self.owner.max_tokens
        cap = num_pages(max_len, self.config.page_size) if max_len is not None else grown_capacity(need, self.page_capacity)
        self.host.grow(cap)  # first: it is the one that may refuse (host memory), before anything changes
        # Offloaded heads never need more slots than pages exist, so short contexts do not pay for the budget.
        slots = min(self.config.resident_slots, cap) if self.slot_heads.numel() else 0
        self.pool.grow(cap, slots)
        self.slots.relayout(self.pool)
        self._find_tail()
        B, H, old, D = self.kmin.shape
        pad = (B, H, cap - old, D)
        self.kmin = torch.cat([self.kmin, self.kmin.new_full(pad, float("inf"))], dim=2)
        self.kmax = torch.cat([self.kmax, self.kmax.new_full(pad, float("-inf"))], dim=2)
        if max_len is not None:  # allocated once, at a fixed address: a captured decode step may use them
            self.mark_static()

    def buffers(self) -> list[torch.Tensor]:
        """Every device tensor a decode step reads or writes (fixed addresses once allocated for max_cache_len)."""
        bufs = [self.pool.k, self.pool.v, self.pool.table_buffer, self.kmin, self.kmax, self.valid_lo,
                self.tail_phys, self.slot_heads, self.full_heads, self.slots.slot_page, self.slots.slot_phys,
                *self.reranker.buffers()]
        if self.host.k_dev is not None:
            bufs += [self.host.k_dev, self.host.v_dev]
        return bufs

    def mark_static(self) -> None:
        """Tell torch.compile the buffers keep their addresses (as StaticCache does), so its CUDA graphs
        update them in place instead of copying them in and out on every replay."""
        if self.device.type != "cuda" or torch.compiler.is_compiling():
            return
        for t in self.buffers() + self.state.buffers():
            torch._dynamo.mark_static_address(t)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append ``[B, H, T, D]`` states; returns ``(handle, handle)`` for the attention function."""
        owner = self.owner
        if self.layer_idx == 0:
            owner.ensure_usable()  # a forward left part-way: start over (if it began empty) or refuse
        if self.is_initialized and self.seq_len == 0 and not self._fits(key_states):
            self._drop()  # buffers kept by reset() for another batch or dtype: allocate anew
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if key_states.shape[0] != self.batch:
            raise ValueError(
                f"FlexiCache was filled with batch size {self.batch} and now receives {key_states.shape[0]}; "
                "use a fresh FlexiCache per batch (or batch_select_indices / batch_repeat_interleave)"
            )
        if self.layer_idx == 0:
            owner.sync()  # after graph replays: the host learns the length (and refuses an overflow)
        start, T = self.seq_len, key_states.shape[2]
        end = start + T
        owner.check_length(end)
        owner.guard.begin(self.layer_idx, "update", empty=start == 0)  # validated: from here on storage changes
        self._join_copies()  # before growth re-lays the pool, and before a decode token enters a slot
        self._ensure_capacity(end)
        offloaded = None
        if T == 1 and start > 0:
            if self.layer_idx == 0:
                for state in self.states.values():
                    state.begin_eager_step()
            plan = self.state.plan
            self.append_token(key_states, value_states, plan)
        else:
            if self.layer_idx == 0:
                for state in self.states.values():
                    state.add_chunk(T)
            if self.full_heads.numel():
                self.pool.full_tokens("k")[:, :, start:end] = key_states[:, self.full_heads]
                self.pool.full_tokens("v")[:, :, start:end] = value_states[:, self.full_heads]
            if self.slot_heads.numel():
                offloaded = (key_states[:, self.slot_heads].contiguous(),
                             value_states[:, self.slot_heads].contiguous())
                self._append_chunk(*offloaded, start)
        self.seq_len = end
        owner.guard.end(self.layer_idx, "update")
        handle = PagedKV(self, key_states, value_states, start, offloaded)
        return handle, handle

    def catch_up(self) -> None:
        """Take the length graph replays reached (the host mirror was just synchronised)."""
        length = self.state.host_length
        if length != self.seq_len:
            self.seq_len = length
            self.host_current = False  # the replays wrote the newest page to its slot only

    def graph_update(self, key_states: torch.Tensor, value_states: torch.Tensor):
        """A decode step's update as ``torch.compile`` traces it: device state only, nothing on the host.

        The prompt (and any later chunk) runs eagerly through :meth:`update`, which allocates everything at its
        final address; here layer 0 advances the shared schedule and every layer appends its token.
        """
        if not self.is_initialized or key_states.shape[2] != 1:
            raise CacheStateError(
                "a compiled FlexiCache forward serves single-token decode steps of a cache filled by an eager prompt "
                "forward (generate does exactly this); run prompts eagerly"
            )
        if self.layer_idx == 0:
            for state in self.states.values():
                state.advance()
                state.stale = True  # the host mirror is behind from here on (applied after each compiled call)
        self.append_token(key_states, value_states, GRAPH_PLAN)
        return self, self  # the attention function recognises the layer itself (see flexicache_attention)

    # ---- the decode step's body (eager and captured alike) --------------------------------------------------
    def append_token(self, key_states: torch.Tensor, value_states: torch.Tensor, plan: StepPlan) -> None:
        """Store one token ``[B, H, 1, D]`` at the shared state's position and fold its keys into the MinMax
        cache (one kernel for every head); a page it fills goes to the host.  Device scalars only; ``plan``
        merely lets an eager step skip predicated-away launches."""
        st, ps = self.state, self.config.page_size
        st.begin_layer(self.layer_idx)  # this layer's re-rank schedule for the step
        offloaded = self.slot_heads.numel() > 0
        if offloaded and plan.may(plan.new_page):
            self.slots.place_new_page(self.ops, st.page, self.tail_phys, None if plan.new_page else st.new_page)
        # Each head's physical row: resident heads' page from the page table, offloaded heads' newest slot.
        phys = self.pool.page_table.index_select(2, st.page)[..., 0].long()  # [B, H]
        if offloaded:
            phys = phys.index_copy(1, self.slot_heads, self.tail_phys)
        rows = phys * ps + st.offset
        self.ops.append_token(self.pool.k, self.pool.v, self.kmin, self.kmax, key_states[:, :, 0],
                              value_states[:, :, 0], rows, st.page)
        if offloaded:
            self.host_current = bool(plan.page_full)  # a filled page goes to the host now; else only its slot has it
            if plan.may(plan.page_full):
                with copy_context(self.copies):
                    offload_page(self.ops, self.pool, self.host, st.page, self.tail_phys,
                                 None if plan.page_full else st.page_full)
                pages = self.batch * self.slot_heads.numel()
                st.counters.add("offloaded", pages if plan.page_full else st.page_full * pages)

    def _append_chunk(self, k: torch.Tensor, v: torch.Tensor, start: int) -> None:
        """A prompt chunk of the offloaded heads goes whole to the host; the device keeps the newest page.

        A first chunk's attention then seats the top-K from the chunk itself; after a follow-up chunk the next
        decode step re-ranks every head, which loads the top-K back from the host.
        """
        ps = self.config.page_size
        end = start + k.shape[2]
        self._flush_newest_page()
        with copy_context(self.copies):
            self.host.write_tokens(k, v, start)
            self.slots.clear()
            newest = (end - 1) // ps
            self.slots.place_new_page(self.ops, newest, self.tail_phys)
            pages = torch.full_like(self.tail_phys, newest)[..., None]
            load_promoted(self.ops, self.pool, self.host, pages, self.tail_phys[..., None])
        self.copies_pending = True  # joined by the next decode step, not now: later layers overlap the copy
        self.host_current = True  # the chunk went to the host whole, its partial newest page included

    def _join_copies(self) -> None:
        """Make the compute stream wait for this layer's queued tier copies (no host synchronisation)."""
        if self.copies_pending:
            self.copies.hand_off()
            self.copies_pending = False

    def _flush_newest_page(self) -> None:
        """Copy the newest page of the offloaded heads to the host while it is partly filled: decode tokens
        go to its device slot only (a page is offloaded once, when it fills), so until then the host lacks them."""
        ps = self.config.page_size
        if not self.host_current and self.seq_len % ps and self.slot_heads.numel():
            with copy_context(self.copies):
                offload_page(self.ops, self.pool, self.host, (self.seq_len - 1) // ps, self.tail_phys)
        self.host_current = True

    # ---- compute -------------------------------------------------------------------------------------
    def attend(self, handle: PagedKV, query: torch.Tensor, mask2d: torch.Tensor | None, scaling: float) -> torch.Tensor:
        """Attention output ``[B, T, Hq, D]`` for ``query [B, Hq, T, D]`` (called by the attention function)."""
        if handle.layer is not self or handle.start + handle.keys.shape[2] != self.seq_len:
            raise CacheStateError(f"a stale FlexiCache handle reached layer {self.layer_idx}'s attention")
        self.owner.guard.begin(self.layer_idx, "attend")
        out = self._attend(handle, query, mask2d, scaling)
        self.owner.guard.end(self.layer_idx, "attend")
        return out

    def _attend(self, handle: PagedKV, query: torch.Tensor, mask2d: torch.Tensor | None, scaling: float) -> torch.Tensor:
        T = query.shape[2]
        if T == 1 and handle.start > 0:
            return self.attend_token(query[:, :, 0], scaling, self.state.plan)[:, None]
        self._observe_padding(mask2d, handle.start)
        self.ops.minmax_update(self.kmin, self.kmax, handle.keys, handle.start, self.valid_lo, self.config.page_size)
        if handle.start == 0:
            keys, values = handle.keys, handle.values
        else:
            nxt = self.layer_idx + 1
            if nxt < len(self.owner.layers):  # its host read overlaps this layer's attention
                self.owner.layers[nxt].prefetch_prefix(handle.start)
            keys, values = self.gather_tokens(handle.start, then=(handle.keys, handle.values))
        self.owner.prompt_tokens += T if self.layer_idx == 0 else 0
        key_valid = None
        if self.padded:
            key_valid = torch.arange(keys.shape[2], device=self.device)[None, :] >= self.valid_lo[:, None]
        out = dense_attention(query, keys, values, key_valid, scaling)
        if handle.start == 0 and self.reranker.num_stable:
            self._seat_prompt_top_k(query[:, :, -1], handle.offloaded, scaling)
        if self.layer_idx == len(self.owner.layers) - 1 and self.owner.is_compileable:
            # The next step may be a graph replay, which cannot wait on the copy streams itself: the compute
            # stream waits here for the chunk's offload (on the device; the host goes on).
            for layer in self.owner.layers:
                layer._join_copies()
        return out

    def _seat_prompt_top_k(self, q: torch.Tensor, offloaded: tuple[torch.Tensor, torch.Tensor] | None,
                           scaling: float) -> None:
        """After a first prompt chunk: the stable heads' first top-K, from the prompt's last query ``q [B, Hq, D]``
        (the paper keeps a stable head's top-K pages on the device once the prompt is offloaded).  Offloaded heads
        get those pages from the chunk still on the device (``offloaded``: the chunk's keys and values of those
        heads, ``[B, len(slot_heads), T, D]``, which the host copy holds anyway; ``None`` without offload), so no
        decode step loads them from the host; the schedule re-ranks them next R steps later (or on their staggered
        phase), not at step 0.  On the copy stream, behind the chunk's offload."""
        ps = self.config.page_size
        n = num_pages(self.seq_len, ps)
        with copy_context(self.copies):
            self.copies.keep_alive(q)
            wanted = self.reranker.seat_prompt(self.ops, q, self.kmin, self.kmax, n, scaling)
            if offloaded is not None:  # the offloaded heads are the stable ones, in the same order
                pages, phys = self.slots.reseat(self.ops, wanted)
                seat_from_chunk(self.pool, pages, phys, *offloaded, ps)
        self.state.anchor_of(self.layer_idx).fill_(n - 1)  # the newest page when they were ranked
        self.copies_pending = True

    def _observe_padding(self, mask2d: torch.Tensor | None, start: int) -> None:
        """Learn each row's left-padding length from the 2D mask of a prompt chunk."""
        if mask2d is None:
            lead = torch.zeros(self.batch, dtype=torch.long, device=self.device)
        else:
            m = mask2d.to(self.device, torch.bool)
            lead = (m.long().cumsum(-1) == 0).sum(-1)
            if not bool((m.sum(-1) == m.shape[-1] - lead).all()):
                raise ValueError(
                    "FlexiCache supports left padding only (padding tokens first, as with "
                    "tokenizer.padding_side='left'); got an attention mask with gaps or right padding"
                )
        # Without a mask nothing is padded: decided on the host, so an unpadded chunk costs no host sync.
        padded = mask2d is not None and bool(lead.any())
        if start and (padded != self.padded or (padded and not torch.equal(lead, self.valid_lo))):
            raise ValueError("a later prompt chunk changed the left padding of rows already in the cache")
        self.valid_lo.copy_(lead)  # in place: a decode graph reads it at its address
        self.padded = padded

    def graph_attend(self, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """:meth:`attend_token` as ``torch.compile`` traces it (the step planned on the device only)."""
        return self.attend_token(query[:, :, 0], scaling, GRAPH_PLAN)[:, None]

    def attend_token(self, q: torch.Tensor, scaling: float, plan: StepPlan) -> torch.Tensor:
        """Top-K selection + sparse paged decode for one token per row; ``q [B, Hq, D]`` -> ``[B, Hq, D]``.

        Unstable heads re-rank every step, stable heads when the shared schedule says so (their promoted
        pages then come from the host tier into the slots evicted pages free); every head attends its top-K
        (plus, for stable heads between re-ranks, the pages created since).
        """
        st, rr = self.state, self.reranker
        due, stable_due = st.due_of(self.layer_idx), plan.due(self.layer_idx)
        if rr.num_stable < self.num_kv_heads or plan.may(stable_due):  # some head is due
            scores = rr.rerank(self.ops, q, self.kmin, self.kmax, st.num_pages, due, scaling,
                               keys=(self.pool.k, self.pool.page_table, self.valid_lo, st.length))
            observer = self.owner.observer if plan is not GRAPH_PLAN else None
            if observer is not None:
                heads, n = rr.scored_heads(stable_due), plan.num_pages
                observer.on_rerank(RerankEvent(self.layer_idx, self.state.host_step - 1, heads,
                                               rr.selected[:, heads], scores[:, heads, :n], n, q))
        if self.slot_heads.numel() and plan.may(stable_due):
            with copy_context(self.copies):
                pages, phys = self.slots.reseat(self.ops, rr.selected[:, self.slot_heads], None if stable_due else due)
                load_promoted(self.ops, self.pool, self.host, pages, phys)
            self.copies.hand_off()
            st.counters.add("promoted", (pages >= 0).sum())
        attend = rr.attend_list(st.page, st.anchor_of(self.layer_idx), due)
        if self.count_pages:
            st.counters.add("pages_attended", (attend >= 0).sum())
        if plan is not GRAPH_PLAN:
            self.last_attended = attend  # what this step attended (tests, debugging; eager steps only)
        return self.ops.sparse_decode(q, self.pool.k, self.pool.v, self.pool.page_table, attend,
                                      self.valid_lo, st.length, scaling)

    def gather_tokens(self, end: int, then: tuple[torch.Tensor, torch.Tensor] | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every stored token ``[B, H, end, D]`` of every head, wherever it lives (exact-attention path),
        followed by ``then`` (a chunk's new keys / values ``[B, H, T, D]``) in the same buffers when given."""
        B, H, D = self.batch, self.num_kv_heads, self.head_dim
        T = 0 if then is None else then[0].shape[2]
        keys = torch.empty((B, H, end + T, D), dtype=self.dtype, device=self.device)
        values = torch.empty_like(keys)
        if T:
            keys[:, :, end:], values[:, :, end:] = then
        if self.full_heads.numel():
            keys[:, self.full_heads, :end] = self.pool.full_tokens("k")[:, :, :end]
            values[:, self.full_heads, :end] = self.pool.full_tokens("v")[:, :, :end]
        if self.slot_heads.numel():
            prefetched, self.prefetched = self.prefetched, None
            hk, hv = prefetched[1:] if prefetched is not None and prefetched[0] == end else self._read_prefix(end)
            self.copies.hand_off()
            self.copies_pending = False
            keys[:, self.slot_heads, :end], values[:, self.slot_heads, :end] = hk, hv
        return keys, values

    def _read_prefix(self, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Queue the read of the offloaded heads' first ``end`` tokens ``[B, slot_heads, end, D]`` on the copy
        stream (the newest page flushed first); the caller hands the stream off before using them."""
        hk = torch.empty((self.batch, self.slot_heads.numel(), end, self.head_dim), dtype=self.dtype, device=self.device)
        hv = torch.empty_like(hk)
        self._flush_newest_page()
        with copy_context(self.copies):
            self.host.read_tokens(hk, hv)
        return hk, hv

    def prefetch_prefix(self, end: int) -> None:
        """Start reading this layer's cached prefix for a follow-up chunk at ``end`` while earlier layers run.

        Only before this layer has taken the chunk (its sequence still ends at ``end``); ``gather_tokens``
        then finds the read under way instead of issuing it.
        """
        if self.is_initialized and self.slot_heads.numel() and self.seq_len == end and self.prefetched is None:
            self.prefetched = (end, *self._read_prefix(end))

    # ---- HF cache API ----------------------------------------------------------------------------------
    def get_seq_length(self):
        """Tokens held: an int, or (after captured decode steps, until the host next needs it) the device count,
        as StaticCache returns it, so that generate's per-step bookkeeping never waits for the GPU."""
        if self.is_initialized and self.state.stale:
            return self.state.length[0]
        return self.seq_len

    def get_mask_sizes(self, query_length) -> tuple[int, int]:
        if isinstance(query_length, torch.Tensor):  # older transformers pass cache_position
            query_length = query_length.shape[0]
        if query_length == 1 and self.owner.is_compileable:
            # A decode step of a cache that may be graphed: the mask spans the whole fixed capacity (as
            # StaticCache's), so its shape never changes.  Decode reads padding from the prompt, not this mask.
            return self.owner.max_tokens, 0
        self.owner.sync()
        return self.seq_len + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        """Empty the layer.  Sized once for ``max_cache_len``, it keeps its buffers and clears them in place (as
        StaticCache's reset does): the next prompt of the same batch and dtype reuses them at the same addresses,
        so a compiled decode step replays its CUDA graphs instead of recording new ones (the pinned host tier
        stays held too).  A growing layer drops everything."""
        if self.is_initialized:
            self.copies.synchronize()  # queued copies must not land in host blocks handed to another cache
            if self.owner.max_tokens is not None and self.page_capacity:
                self._clear()
                return
        self._drop()

    def _drop(self) -> None:
        for name in ("pool", "host", "slots", "reranker", "kmin", "kmax", "valid_lo", "tail_phys", "prefetched",
                     "state", "last_attended"):
            self.__dict__.pop(name, None)
        self.seq_len = 0
        self.is_initialized = False

    def _clear(self) -> None:
        """As new, in place: the MinMax cache empty, no slot holds a page, no selection, no padding."""
        self.kmin.fill_(float("inf"))
        self.kmax.fill_(float("-inf"))
        if self.slot_heads.numel():
            self.slots.clear()
        self.tail_phys.zero_()
        self.valid_lo.zero_()
        self.reranker.clear()
        self.padded, self.host_current, self.copies_pending = False, True, False
        self.prefetched = None
        self.__dict__.pop("last_attended", None)
        self.seq_len = 0

    def _fits(self, key_states: torch.Tensor) -> bool:
        """Whether kept (reset) buffers serve these states: same batch, heads, head dim, dtype and device."""
        B, H, _, D = key_states.shape
        return ((B, H, D) == (self.batch, self.num_kv_heads, self.head_dim) and key_states.dtype == self.dtype
                and key_states.device == self.device)

    def offload(self):  # transformers' whole-layer offloading does not apply: FlexiCache tiers per head
        pass

    def prefetch(self):
        pass

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove == 0:
            return
        raise NotImplementedError(
            "FlexiCache cannot crop (assisted / speculative decoding rolls tokens back): offloaded pages and "
            "the MinMax cache are append-only. Use DynamicCache for assisted generation."
        )

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._select_rows(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._select_rows(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self._select_rows(torch.arange(self.batch, device=self.device).repeat_interleave(repeats))

    def _select_rows(self, index: torch.Tensor) -> None:
        """Rebuild every per-row structure for rows ``index`` (copies pages; beam search / expansion)."""
        if not self.is_initialized:
            return
        index = index.to(self.device).long()
        self._join_copies()
        old = self.pool.layout
        B = index.numel()
        new = PoolLayout(B, old.num_slot_heads, old.slots, old.num_full_heads, old.page_capacity)
        pool = PagePool(new, self.full_heads, self.slot_heads, self.num_kv_heads, self.config.page_size,
                        self.head_dim, self.dtype, self.device)
        for name in ("k", "v"):
            src, dst = getattr(self.pool, name), getattr(pool, name)
            n_slot = old.full_base - 1
            if n_slot:
                dst[1 : new.full_base] = src[1 : old.full_base].view(old.batch, -1, *src.shape[1:])[index].flatten(0, 1)
            dst[new.full_base :] = src[old.full_base :].view(old.batch, -1, *src.shape[1:])[index].flatten(0, 1)
        self.pool, self.batch = pool, B
        slot_page = self.slots.slot_page[index]
        self.slots = SlotTable(pool, self.device)
        self.slots._set_table(slot_page, self.slots.slot_phys)
        self.slots.slot_page = slot_page
        if self.host.k is not None:
            self.host.select_rows(index)
        self.host.batch = B
        self.kmin, self.kmax, self.valid_lo = self.kmin[index], self.kmax[index], self.valid_lo[index]
        self.reranker.select_rows(index)
        self.tail_phys = torch.zeros((B, self.slot_heads.numel()), dtype=torch.long, device=self.device)
        self._find_tail()

    def _find_tail(self) -> None:
        """Point ``tail_phys`` at the slots holding the newest page again (after the slots were re-laid)."""
        if self.seq_len and self.slot_heads.numel():
            self.tail_phys.copy_(self.slots.phys_of((self.seq_len - 1) // self.config.page_size))

    # ---- accounting ---------------------------------------------------------------------------------
    def device_bytes(self) -> int:
        """Bytes this layer holds on its device: pages (null page and slack included), tables, MinMax."""
        if not self.is_initialized:
            return 0
        return self.pool.nbytes() + self.kmin.nbytes + self.kmax.nbytes + self.reranker.selected.nbytes

    def dense_bytes(self) -> int:
        """Bytes ``DynamicCache`` would hold for the same tokens."""
        if not self.is_initialized:
            return 0
        elt = torch.finfo(self.dtype).bits // 8
        return 2 * self.batch * self.num_kv_heads * self.seq_len * self.head_dim * elt


class FlexiCache(Cache):
    """Stability-aware hierarchical KV cache (FlexiCache) for transformers' ``generate``.

    Example::

        import flexicache_hf
        model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="flexicache")
        out = model.generate(**inputs, past_key_values=flexicache_hf.FlexiCache("Llama-3.1-8B-Instruct"))

    Args:
        profile: a :class:`HeadProfile`, a path to a profile JSON, or a model name shipped in ``profiles/``.
        config: a :class:`FlexiCacheConfig`; or pass its fields as keyword arguments (``token_budget=1024``).
        model_config: the model's ``PretrainedConfig``; checks the profile and attention layout now instead
            of at the first forward.
        observer: a :class:`SelectionObserver` told of every re-rank (the stability profiler uses it).
        kernels: ``"reference"`` forces the PyTorch reference kernels on any device.
        count_pages: count attended pages per step in ``stats`` (a device counter: two small kernels per layer and step).
        max_cache_len: the most tokens this cache will hold (prompt + ``max_new_tokens``, as for
            ``StaticCache``).  Device pools, MinMax cache, tables and the pinned host tier are then allocated
            once, at the first forward, and a longer sequence is refused; without it they grow with headroom.
            With it, on CUDA, the cache is compileable: ``generate`` compiles and CUDA-graphs the decode step
            as it does for StaticCache (``disable_compile=True`` keeps it eager).  A dropped sized cache's
            storage is kept for the next cache of its shape, which takes it at its first forward
            (``storage_reused`` then becomes true; :func:`flexicache_hf.release_storage` frees it).
    """

    storage_reused = False  # (also for caches pickled before the attribute existed)

    def __init__(self, profile: HeadProfile | str | os.PathLike, config: FlexiCacheConfig | None = None, *,
                 model_config=None, observer: SelectionObserver | None = None, kernels: str | None = None,
                 count_pages: bool = False, max_cache_len: int | None = None, profiles_dir=None, **config_fields):
        if config is not None and config_fields:
            raise TypeError("pass either a FlexiCacheConfig or its fields as keywords, not both")
        self.config = config if config is not None else FlexiCacheConfig(**config_fields)
        self.profile = resolve_profile(profile, profiles_dir=profiles_dir)
        if kernels not in (None, "reference"):
            raise ValueError(f"kernels must be None or 'reference', got {kernels!r}")
        self.kernels, self.observer, self.count_pages = kernels, observer, count_pages
        if max_cache_len is not None and (isinstance(max_cache_len, bool) or not isinstance(max_cache_len, int)
                                          or max_cache_len < 1):
            raise ValueError(f"max_cache_len must be None or a positive number of tokens, got {max_cache_len!r}")
        self.max_tokens = max_cache_len  # not `max_cache_len`: transformers 5.17 has a property of that name
        self.prompt_tokens = 0
        self.storage_reused = False  # whether this cache's storage came from a dropped one (recycling.py)
        # The step schedule, one DecodeState per device a layer lives on (a model split by device_map has several;
        # they hold the same values), made by the first layer on each device.
        self.states: dict[str, DecodeState] = {}
        self.max_positions = None
        self.tp_size = None  # the model's tensor-parallel size, once check_model saw its config (see sharding.py)
        self._checked_config = None
        layers = [
            FlexiCacheLayer(i, self.profile.unstable_heads(i), self.config, self)
            for i in range(self.profile.model.num_layers)
        ]
        super().__init__(layers=layers)
        self.guard = ForwardGuard(len(layers))
        if self._recycles:  # dropped, its storage serves the next cache of its shape (recycling.py: same
            # buffers, so a compiled step replays the CUDA graphs already recorded)
            weakref.finalize(self, KEEPER.keep, self._storage_key(), self.layers, self.states).atexit = False
        if model_config is not None:
            self.check_model(model_config)

    @property
    def _recycles(self) -> bool:
        """Whether this cache's storage passes between caches (recycling.py): sized, and no observer."""
        return self.max_tokens is not None and self.observer is None

    def _storage_key(self) -> tuple:
        """What fixes the layers' storage before the first forward (batch, dtype and device are checked there)."""
        return (type(self), self.profile.model, self.profile.unstable, self.config, self.max_tokens, self.kernels,
                self.count_pages)

    def _take_kept_storage(self, key_states: torch.Tensor) -> None:
        """At the first forward of a new cache, before anything is allocated: take the storage of the last dropped
        cache when it has this cache's shape and fits these states; any other kept storage is freed now (so kept
        storage never stands beside a live cache's, and a loop that replaces its cache holds one at a time)."""
        kept = KEEPER.take(self._storage_key())
        if kept is None or not self._recycles:
            return
        if not kept.layers[0]._fits(key_states):  # another batch, dtype or device: freed here
            return
        for layer in kept.layers:  # emptied below, in place, as reset() empties a sized cache
            layer._owner = weakref.ref(self)
            layer.states = self.states
            layer.host._used_elsewhere = _HostBytesOf(self)
        self.layers[:] = kept.layers  # the same list and dict objects: this cache's finalizer holds them
        self.states.update(kept.states)
        self.reset()
        self.storage_reused = True

    # ---- one forward at a time, through every layer --------------------------------------------------------
    def ensure_usable(self) -> None:
        """Act on a forward that stopped part-way (some layers hold its tokens, others not).

        If it began on an empty cache nothing of value is lost: the cache is emptied and serves the next call as
        a new one.  Otherwise it raises :class:`CacheStateError` naming the earlier failure, until :meth:`reset`.
        """
        g = self.guard
        if not g.open:
            return
        if g.began_empty:
            self.reset()
            return
        layer, phase = g.next
        where = "attention" if phase == "attend" else "storage"
        raise CacheStateError(
            f"this FlexiCache cannot be used: a forward stopped part-way, at layer {layer} of {g.num_layers} ({where}; "
            f"{g.failure or 'the error was raised outside FlexiCache'}), so some layers hold its tokens and others "
            "do not. Call cache.reset() to empty it, or use a new FlexiCache"
        )

    def check_length(self, end: int) -> None:
        """Refuse ``end`` positions beyond the model's context (known from ``model_config`` or the first forward)
        or beyond ``max_cache_len``."""
        limit = self.max_positions
        if limit is not None and end > limit:
            raise ValueError(f"{end} tokens exceed the model's context of {limit} positions (max_position_embeddings)")
        if self.max_tokens is not None and end > self.max_tokens:
            raise ValueError(f"{end} tokens exceed this cache's max_cache_len={self.max_tokens}; make the cache with a "
                             "larger max_cache_len (prompt length + max_new_tokens), or without one to let it grow")

    @property
    def is_compileable(self) -> bool:
        """Whether ``generate`` may compile (and CUDA-graph) the decode step, as it does for StaticCache: with a
        ``max_cache_len`` (everything then has a fixed address), the GPU kernels and no observer (which is told
        of every re-rank on the host)."""
        return (self.max_tokens is not None and self.kernels is None and self.observer is None
                and -(-self.max_tokens // self.config.page_size) <= MAX_SELECT_PAGES)

    def decode_state(self, device: torch.device) -> DecodeState:
        """The step schedule all layers share (made by the first layer to initialise)."""
        key = str(device)
        if key not in self.states:
            first = not self.states
            c = self.config
            phases = tuple(c.rerank_phase(i) for i in range(len(self.layers)))
            state = DecodeState(device, c.page_size, c.rerank_interval, self.max_tokens, phases, counts_steps=first)
            if not first:  # a later device's first layer (the first prompt forward): catch up with layer 0's
                state.follow(self._state)
            self.states[key] = state
        return self.states[key]

    @property
    def _state(self) -> DecodeState | None:
        """The first device's schedule (the one that counts decode steps)."""
        return next(iter(self.states.values()), None)

    @property
    def stats(self) -> CacheStats:
        self.sync()
        if not self.states:
            return CacheStats(prompt_tokens=self.prompt_tokens)
        c = {name: 0 for name in DeviceCounters.NAMES}
        for state in self.states.values():  # decode steps are counted by the first device's only
            for name, value in state.counters.read().items():
                c[name] += value
        live = [layer for layer in self.layers if layer.is_initialized]
        return CacheStats(
            decode_steps=c["decode_steps"], prompt_tokens=self.prompt_tokens, pages_attended=c["pages_attended"],
            head_reranks=sum(int(layer.reranker.reranks.sum()) for layer in live),
            head_steps=c["decode_steps"] * sum(layer.num_kv_heads for layer in live),
            promoted=c["promoted"], offloaded_pages=c["offloaded"])

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        if torch.compiler.is_compiling():  # a decode step being captured: device state only (see graph_update)
            return self.layers[layer_idx].graph_update(key_states, value_states)
        try:
            if layer_idx == 0 and not self.states and not self.guard.open:  # a new (or dropped-to-empty) cache
                self._take_kept_storage(key_states)
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)
        except BaseException as e:
            self.guard.note(e)
            raise

    def get_seq_length(self, layer_idx: int = 0) -> int:
        if torch.compiler.is_compiling():  # the device count: reading the host flag would guard on it
            return self.layers[layer_idx].state.length[0]
        self.ensure_usable()
        return super().get_seq_length(layer_idx)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.ensure_usable()
        self.sync()  # the rows' newest pages are found from the host's length
        super().reorder_cache(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.ensure_usable()
        self.sync()  # the rows' newest pages are found from the host's length
        super().batch_repeat_interleave(repeats)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.ensure_usable()
        self.sync()  # the rows' newest pages are found from the host's length
        super().batch_select_indices(indices)

    # ---- copies and pickles -----------------------------------------------------------------------------
    def __getstate__(self) -> dict:
        """What ``pickle`` / ``torch.save`` store: every layer's pages, tiers and selection state.

        Pending tier copies finish first; CUDA streams and kernels are re-created (and the host tier re-pinned)
        where the cache is loaded.  The checked model config is not stored: the next forward checks again.
        """
        self.ensure_usable()
        for layer in self.layers:
            if layer.is_initialized:
                layer.copies.synchronize()
                if layer.device.type == "cuda":
                    torch.cuda.current_stream(layer.device).synchronize()
        state = dict(self.__dict__)
        state["_checked_config"] = None
        return state

    def __deepcopy__(self, memo: dict) -> "FlexiCache":
        """An independent cache holding the same tokens (transformers' prefix-reuse pattern).

        The profile (immutable) and the observer (a callback, e.g. the profiler) are shared with the original;
        everything else is copied.
        """
        state = self.__getstate__()
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        for shared in (self.profile, self.observer):
            memo[id(shared)] = shared
        new.__dict__.update(copy.deepcopy(state, memo))
        return new

    def reset(self) -> None:
        """Empty every layer (the cache is then as new: statistics too; the profile and config stay)."""
        super().reset()
        self.guard.clear()
        self.prompt_tokens = 0
        self.storage_reused = False
        if any(layer.is_initialized for layer in self.layers):  # buffers kept (max_cache_len): so is the schedule,
            for state in self.states.values():  # zeroed at its addresses (a captured step reads them)
                state.reset()
        else:
            self.states.clear()

    def check_model(self, model_config) -> None:
        """Refuse a model this cache cannot serve: another shape than the profile's, or non-full attention."""
        if model_config is self._checked_config:
            return
        self.profile.check_model(model_config)
        layer_types = getattr(model_config, "layer_types", None) or []
        odd = sorted({t for t in layer_types if t != "full_attention"})
        window = getattr(model_config, "sliding_window", None)
        uses_window = getattr(model_config, "use_sliding_window", True)
        if odd or (window is not None and uses_window and not layer_types):
            raise UnsupportedModelError(
                f"FlexiCache serves full-attention layers only; this model has {odd or ['sliding_window=' + str(window)]}. "
                "(For checkpoints trained with full attention, e.g. Mistral v0.2+, set config.sliding_window=None.)"
            )
        limit = getattr(model_config, "max_position_embeddings", None)
        if limit is not None and self.max_tokens is not None and self.max_tokens > limit:
            raise ValueError(f"max_cache_len={self.max_tokens} exceeds the model's context of {limit} positions "
                             "(max_position_embeddings): shorten the prompt or max_new_tokens")
        self.max_positions = limit
        self.tp_size = tp_size_of(model_config)
        self._checked_config = model_config

    def host_bytes(self) -> int:
        return sum(layer.host.nbytes() for layer in self.layers if layer.is_initialized)

    def device_bytes(self) -> int:
        return sum(layer.device_bytes() for layer in self.layers)

    def dense_bytes(self) -> int:
        self.sync()
        return sum(layer.dense_bytes() for layer in self.layers)

    def sync(self) -> None:
        """Bring every layer's host-side length up to date after captured decode steps (one synchronisation;
        raises if a captured step went past ``max_cache_len``)."""
        for state in self.states.values():
            state.sync()
        for layer in self.layers:
            if layer.is_initialized:
                layer.catch_up()

    def memory_report(self) -> dict:
        """Device / host bytes held now, against what ``DynamicCache`` would hold for the same tokens."""
        self.sync()
        dev, dense = self.device_bytes(), self.dense_bytes()
        return {
            "tokens": self.get_seq_length(),
            "device_bytes": dev,
            "host_bytes": self.host_bytes(),
            "dense_bytes": dense,
            "device_saving": 1 - dev / dense if dense else 0.0,
        }

    def __repr__(self) -> str:
        c = self.config
        return (f"FlexiCache({self.profile.model.name or self.profile.model.model_type}, page_size={c.page_size}, "
                f"token_budget={c.token_budget}, rerank_interval={c.rerank_interval}, offload={c.offload}, "
                f"unstable={len(self.profile.unstable)}/{self.profile.model.num_layers * self.profile.model.num_kv_heads})")
