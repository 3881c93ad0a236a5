"""``FlexiCacheLayer``: one decoder layer's part of a FlexiCache, behind transformers' ``CacheLayerMixin`` face.

A layer is told everything at construction (:class:`LayerSpec`) and at its first forward (the shared step
schedule, the tensor-parallel size); it never refers to its cache.  The cache drives it: it plans each step, checks
lengths and the forward order, and does the cross-layer work (prefetching the next layer's prefix, joining copies
after the last layer, the host-memory cap over every layer).  The layer stores (:mod:`.storage`) and executes
(:mod:`.prefill`, :mod:`.decode`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import CacheLayerMixin

from ..config import FlexiCacheConfig
from ..head_profile import ModelIdentity
from ..kernels import ops_for
from ..pages import room_capacity, room_pages
from ..reserve import host_commit_bytes, target_pages
from ..rerank import Reranker, SelectionObserver
from ..sharding import TensorParallel, kv_head_shard
from ..tiers import tier_block, tier_pages
from . import decode, prefill, rewind
from .schedule import GRAPH_PLAN, DecodeState
from .storage import LayerStorage


@dataclass(frozen=True)
class LayerSpec:
    """What a layer knows of its cache, fixed when the cache is made."""

    layer_idx: int
    unstable: tuple[int, ...]  # the profile's unstable (global) KV heads of this layer
    config: FlexiCacheConfig
    model: ModelIdentity  # the profile's model shape (checked against the states at the first forward)
    max_tokens: int | None  # max_cache_len: storage sized once (fixed addresses), else grown
    compileable: bool  # generate may capture decode steps (the mask then spans max_tokens)
    kernels: str | None  # "reference" forces the PyTorch kernels
    count_pages: bool  # count attended pages per step (a device counter)
    observer: SelectionObserver | None  # told of every eager re-rank


class FlexiCacheLayer(CacheLayerMixin):
    """Paged KV of one decoder layer (see the module docstring); driven by its :class:`~flexicache_hf.FlexiCache`."""

    is_croppable = True  # through FlexiCache.crop
    is_sliding = False

    def __init__(self, spec: LayerSpec):
        super().__init__()
        self.spec = spec
        self.layer_idx, self.config = spec.layer_idx, spec.config
        self.seq_len = 0

    # ---- storage ----------------------------------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor,
                            state: DecodeState | None = None, tp_size: int | None = None) -> None:
        """Allocate for the states' batch, heads, dtype and device, reading the step schedule ``state`` (shared
        by every layer on this device); ``tp_size``: the model's tensor-parallel size, if known."""
        if state is None:
            raise TypeError("a FlexiCacheLayer is initialised by its FlexiCache, which hands it the step schedule")
        B, H, _, D = key_states.shape
        # The profile's global KV heads this layer holds here (all, or this rank's tensor-parallel block), and
        # its unstable heads among them as local indices; a profile of another shape is refused.
        self.shard = kv_head_shard(self.spec.model, self.layer_idx, H, D, TensorParallel.of_process(tp_size))
        unstable = self.shard.to_local(self.spec.unstable)
        cfg = self.config
        self.storage = LayerStorage(key_states, unstable, cfg, ops_for(key_states.device, prefer=self.spec.kernels))
        self.reranker = Reranker(B, H, unstable, cfg.budget_pages, cfg.max_recent_pages, key_states.device,
                                 cfg.sink_pages, cfg.recent_pages, stable_scoring=cfg.stable_scoring,
                                 unstable_scoring=cfg.unstable_scoring, pages=0,  # widened as the layer grows
                                 exact_candidates=cfg.exact_candidates * cfg.budget_pages,
                                 keep_margin=cfg.keep_margin)
        self.state = state
        self.seq_len = 0
        self.is_initialized = True

    @property
    def page_capacity(self) -> int:
        return self.storage.page_capacity if self.is_initialized else 0

    @property
    def origin(self) -> int:
        """The storage position of model position 0 (the schedule's; see :mod:`.schedule`)."""
        return self.state.host_origin

    @property
    def stored_end(self) -> int:
        """The storage position after the newest token (0: no token)."""
        return self.origin + self.seq_len if self.seq_len else 0

    def grows(self, end: int) -> bool:
        """Whether room for ``end`` tokens takes more pages than the layer holds (:meth:`grow` then re-lays it)."""
        return self.storage.pages_for(end, self.spec.max_tokens) is not None

    def grow(self, end: int, host_elsewhere: int) -> None:
        """Room for ``end`` tokens (``host_elsewhere``: host bytes the cache's other layers hold)."""
        self.storage.join_copies()  # before growth re-lays the pool, and before a decode token enters a slot
        before = self.storage.page_capacity
        self.storage.ensure_capacity(end, self.stored_end, self.spec.max_tokens, host_elsewhere)
        self.reranker.fit(self.storage.page_capacity)
        if self.spec.max_tokens is not None and self.storage.page_capacity != before:
            self.mark_static()  # allocated once, at a fixed address: a captured decode step may use them

    def reserve(self, context: int, need: int, host_ranges: dict | None = None) -> None:
        """Room for ``need`` pages in storage reserved for ``context`` tokens (:mod:`~flexicache_hf.reserve`): fixed
        addresses from the first call, so a captured decode step may use the buffers (``host_ranges``: the host
        tier's, made ahead)."""
        first = self.storage.reserved is None
        self.storage.reserve(context, need, self.stored_end, host_ranges)
        if first:
            self.reranker.fit(self.storage.page_capacity)
            self.mark_static()

    def buffers(self) -> list[torch.Tensor]:
        """Every device tensor a decode step reads or writes (fixed addresses once allocated for max_cache_len)."""
        return self.storage.buffers() + self.reranker.buffers()

    def mark_static(self) -> None:
        """Tell torch.compile the buffers keep their addresses (as StaticCache does), so its CUDA graphs
        update them in place instead of copying them in and out on every replay."""
        if self.storage.device.type != "cuda" or torch.compiler.is_compiling():
            return
        for t in self.buffers() + self.state.buffers():
            torch._dynamo.mark_static_address(t)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        raise TypeError("a FlexiCacheLayer is driven by its FlexiCache: call cache.update(keys, values, layer_idx)")

    def store(self, key_states: torch.Tensor, value_states: torch.Tensor):
        """Store ``[B, H, T, D]`` states (the cache planned the step); returns the offloaded heads' part of a prompt
        chunk for the handle (``None`` for a decode token or without offloaded heads)."""
        start, T = self.seq_len, key_states.shape[2]
        key_states, value_states = key_states.detach(), value_states.detach()  # stored data, no autograd history
        offloaded = None
        if T == 1 and start > 0:
            decode.append_token(self, key_states, value_states, self.state.plan)
        else:
            offloaded = prefill.store_chunk(self, key_states, value_states, start)
        self.seq_len = start + T
        return offloaded

    def graph_store(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """A decode token's :meth:`store` inside a compiled step (device state only)."""
        decode.append_token(self, key_states, value_states, GRAPH_PLAN)

    def catch_up(self) -> None:
        """Take the length graph replays reached (the schedule's host mirror was just synchronised)."""
        length = self.state.host_length - self.origin
        if length != self.seq_len:
            self.seq_len = length
            self.storage.host_current = False  # the replays wrote the newest page to its slot only

    # ---- compute ------------------------------------------------------------------------------------------
    def attend_token(self, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """A decode step's attention ``[B, 1, Hq, D]`` for ``query [B, Hq, 1, D]`` (eager)."""
        self.storage.open_padding = False  # (its token is real: the forward's first layer checked)
        return decode.attend_token(self, query[:, :, 0], scaling, self.state.plan)[:, None]

    def graph_attend(self, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """:meth:`attend_token` inside a compiled step (the step planned on the device only): ``query [B, Hq, D]``
        -> ``[B, Hq, D]``."""
        return decode.attend_token(self, query, scaling, GRAPH_PLAN)

    def left_padding(self) -> list[int]:
        """Each row's left padding (model positions), read on the host (one device read)."""
        return (self.storage.valid_lo - self.origin).tolist()

    def check_padding(self, handle, mask2d: torch.Tensor | None, decode: bool = False, first: bool = True):
        """A chunk: each row's left padding from its 2D mask; refuses right padding or a changed padding.  A decode
        step (None): at the forward's ``first`` layer, refuses a token that would add left padding
        (:func:`~.prefill.check_token_padding`)."""
        if decode:
            return prefill.check_token_padding(self, mask2d) if first else None
        return prefill.check_padding(self, handle.start, mask2d)

    def observe_chunk(self, handle, lead) -> None:
        prefill.observe_chunk(self, handle.keys.detach(), handle.start, lead)

    def attend_chunk(self, handle, query: torch.Tensor, scaling: float) -> torch.Tensor:
        return prefill.attend_chunk(self, handle, query, scaling)

    def prefetch_prefix(self, end: int) -> None:
        prefill.prefetch_prefix(self, end)

    def gather_tokens(self, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Every stored token ``[B, H, end, D]`` of every head (keys, values), wherever it lives."""
        return prefill.gather_tokens(self, end)

    # ---- HF cache API -------------------------------------------------------------------------------------
    def get_seq_length(self):
        """Tokens held: an int, or (after captured decode steps, until the host next needs it) the device count,
        as StaticCache returns it, so that generate's per-step bookkeeping never waits for the GPU."""
        if self.is_initialized and self.state.stale:
            return self.device_length()
        return self.seq_len

    def device_length(self) -> torch.Tensor:
        """Tokens held, read on the device (a 0-d tensor: graph replays advance it)."""
        return self.state.device_length()

    def get_mask_sizes(self, query_length) -> tuple[int, int]:
        if isinstance(query_length, torch.Tensor):  # older transformers pass cache_position
            query_length = query_length.shape[0]
        reserved = self.storage.reserved if self.is_initialized else None
        if query_length == 1 and self.spec.compileable and (self.spec.max_tokens or reserved) is not None:
            # A decode step of a cache that may be graphed: the mask spans the whole fixed capacity (as
            # StaticCache's; reserved storage: the context), so its shape never changes.  Decode reads padding
            # from the prompt, not this mask.
            return self.spec.max_tokens or reserved.tokens, 0
        if self.is_initialized:
            self.state.sync()
            self.catch_up()
        return self.seq_len + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        """Empty the layer.  Sized once for ``max_cache_len``, it keeps its buffers and clears them in place (as
        StaticCache's reset does): the next prompt of the same batch and dtype reuses them at the same addresses,
        so a compiled decode step replays its CUDA graphs instead of recording new ones (the pinned host tier
        stays held too).  A growing layer drops everything."""
        if self.is_initialized:
            self.storage.copies.synchronize()  # queued copies must not land in host blocks handed to another cache
            if (self.spec.max_tokens is not None or self.storage.reserved is not None) and self.storage.page_capacity:
                self.storage.clear()
                self.reranker.clear()
                self.seq_len = 0
                return
        self.drop()

    def drop(self) -> None:
        """Free everything; the next forward allocates anew."""
        for name in ("storage", "reranker", "state", "shard"):
            self.__dict__.pop(name, None)
        self.seq_len = 0
        self.is_initialized = False

    def offload(self):  # transformers' whole-layer offloading does not apply: FlexiCache tiers per head
        pass

    def prefetch(self):
        pass

    def crop(self, tokens_to_remove: int) -> None:
        raise TypeError("a FlexiCacheLayer is cropped by its FlexiCache (which sets the step schedule back first): "
                        "call cache.crop(...)")

    def rewind(self, end: int) -> None:
        """Keep the first ``end`` (> 0) tokens (the cache set the step schedule back first; see :mod:`.rewind`)."""
        rewind.rewind(self, end)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.select_rows(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.select_rows(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self.select_rows(torch.arange(self.storage.batch, device=self.storage.device).repeat_interleave(repeats))

    def select_rows(self, index: torch.Tensor) -> None:
        """Keep rows ``index`` of every per-row structure (copies pages; beam search / expansion)."""
        if not self.is_initialized:
            return
        index = index.to(self.storage.device).long()
        s = self.storage
        s.select_rows(index, self.stored_end)
        if s.padded:  # the rows kept may have no padding, or none that holds only padding: as a prompt of them
            lead = self.left_padding()
            s.padded = any(lead)
            s.open_padding = s.padded and max(lead) >= self.seq_len
        self.reranker.select_rows(index)
        if self.spec.max_tokens is not None or self.storage.reserved is not None:
            self.mark_static()  # new buffers: a recorded decode graph records anew rather than replay onto the old

    # ---- accounting -----------------------------------------------------------------------------------------
    def device_bytes(self) -> int:
        """Bytes this layer holds on its device: pages (null page and slack included), tables, MinMax, selection."""
        if not self.is_initialized:
            return 0
        return self.storage.nbytes() + self.reranker.selected.nbytes

    def host_bytes(self) -> int:
        return self.storage.host_bytes() if self.is_initialized else 0

    def commit_seconds(self) -> tuple[float, float, float]:
        return self.storage.commit_seconds() if self.is_initialized else (0.0, 0.0, 0.0)

    def host_plan(self, end: int, key_states: torch.Tensor, tp_size: int | None = None) -> list[tuple[int, int]]:
        """The ``(bytes, run)`` of the host blocks this layer allocates to make room for ``end`` tokens (``[]``: none):
        sizes only, nothing is allocated.  Before the layer's first forward they are predicted from ``key_states``
        (the first layer's: every layer of a served model has its shape) and the profile (``[]`` for states the layer
        will refuse)."""
        B, H, _, D = key_states.shape
        if self.is_initialized:
            s = self.storage  # an emptied layer of another batch or dtype is made anew at its update: predicted
            if self.seq_len or (s.batch, s.num_kv_heads, s.head_dim, s.dtype) == (B, H, D, key_states.dtype):
                return s.host_blocks_for(end, self.spec.max_tokens)
        heads = self.predicted_slot_heads(key_states, tp_size)
        ps, sized = self.config.page_size, self.spec.max_tokens is not None
        pages = room_capacity(end, self.spec.max_tokens, ps, 0)
        if not heads or pages is None:
            return []
        pages = tier_pages(pages, key_states.device.type == "cuda", headroom=not sized)
        return [tier_block(B, heads, ps, D, key_states.dtype, pages)] * 2

    def reserve_host_plan(self, context: int, need: int, key_states: torch.Tensor, tp_size: int | None = None) -> int:
        """Host bytes this layer's tier holds once :meth:`reserve` made room for ``need`` pages in storage reserved for
        ``context`` tokens (integers only).  Before the layer's first forward (or for a kept layer of another batch or
        dtype, made anew at its update) they are predicted from ``key_states`` and the profile, as in
        :meth:`host_plan` (0 for states the layer will refuse)."""
        B, _, _, D = key_states.shape
        if self.is_initialized and (self.seq_len or self.storage.fits(key_states)):
            plan = self.storage.reserve_plan(context, need, self.stored_end)
            return self.host_bytes() if plan is None else plan
        ps = self.config.page_size
        pages = target_pages(need, 0, room_pages(context, ps), ps)
        return host_commit_bytes(B, self.predicted_slot_heads(key_states, tp_size), ps, D, key_states.dtype, pages)

    def predicted_slot_heads(self, key_states: torch.Tensor, tp_size: int | None = None) -> int:
        """The KV heads this layer will keep in a host tier when its first forward stores ``key_states`` (its stable
        heads; 0 without offload, or for states the layer will refuse), from the profile (integers only)."""
        if not self.config.offload:
            return 0
        H, D = key_states.shape[1], key_states.shape[3]
        try:
            shard = kv_head_shard(self.spec.model, self.layer_idx, H, D, TensorParallel.of_process(tp_size))
        except ValueError:  # ProfileError too: the layer refuses these states itself at its first forward
            return 0
        return H - len(shard.to_local(self.spec.unstable))

    def dense_bytes(self) -> int:
        """Bytes ``DynamicCache`` would hold for the same tokens."""
        if not self.is_initialized:
            return 0
        s = self.storage
        return 2 * s.batch * s.num_kv_heads * self.seq_len * s.head_dim * (torch.finfo(s.dtype).bits // 8)
