"""What one decoder layer stores: page pools, the host tier, the slot table, the MinMax cache, the copy stream.

:class:`LayerStorage` is made for one batch, KV-head count, head dim, dtype and device (at the layer's first
forward) and only holds, grows, selects rows and clears; the prompt and decode bodies (:mod:`.prefill`,
:mod:`.decode`) write and read it.  Growth is told everything it needs by its caller (the cache's ``max_cache_len``,
the host bytes the other layers hold): storage never asks its cache.
"""

from __future__ import annotations

import copy

import torch

from ..config import FlexiCacheConfig
from ..kernels import KernelOps
from ..pages import PagePool, PoolLayout, index_tensor, num_pages, room_capacity, room_pages
from ..reserve import Reservation, host_commit_bytes, target_pages
from ..tiers import CopyStream, HostTier, SlotTable, copy_context, offload_page


class LayerStorage:
    """Paged KV of one layer: every page of the device-resident heads, every token of the offloaded (stable) heads
    on the host and their top-K in device slots, and the per-page key min/max of every head.  Every buffer that
    grows with the context is page-major (pages outermost): growth appends pages after the ones held."""

    def __init__(self, key_states: torch.Tensor, unstable: tuple[int, ...], config: FlexiCacheConfig,
                 ops: KernelOps):
        B, H, _, D = key_states.shape
        self.config, self.ops = config, ops
        self.device, self.dtype = key_states.device, key_states.dtype
        self.batch, self.num_kv_heads, self.head_dim = B, H, D
        slot_heads = tuple(h for h in range(H) if h not in set(unstable)) if config.offload else ()
        full_heads = tuple(h for h in range(H) if h not in set(slot_heads))
        self.slot_heads, self.full_heads = index_tensor(slot_heads, self.device), index_tensor(full_heads, self.device)
        layout = PoolLayout(B, len(slot_heads), 0, len(full_heads), 0)  # sized by the first grow
        self.pool = PagePool(layout, self.full_heads, self.slot_heads, H, config.page_size, D, self.dtype, self.device)
        self.copies = CopyStream(self.device)
        self.host = HostTier(B, len(slot_heads), config.page_size, D, self.dtype, self.device,
                             config.host_memory_limit, self.copies, ops)
        self.slots = SlotTable(self.pool, self.device)
        # The MinMax cache, page-major ``[pages, B, H, D]`` (it grows in its outermost dimension); the kernels see
        # it as ``kmin`` / ``kmax``, ``[B, H, pages, D]`` views.
        self.min_pages = torch.empty((0, B, H, D), dtype=self.dtype, device=self.device)
        self.max_pages = torch.empty_like(self.min_pages)
        self.valid_lo = torch.zeros(B, dtype=torch.long, device=self.device)
        self.padded = False  # whether any row has left padding (valid_lo > 0), known on the host
        self.open_padding = False  # whether a row holds only padding so far (prefill.check_token_padding)
        # [B, slot_heads] physical page of the newest page of the offloaded heads (valid once a token is in)
        self.tail_phys = torch.zeros((B, len(slot_heads)), dtype=torch.long, device=self.device)
        # A prompt chunk's offload runs on the copy stream while the next layers compute; the compute stream
        # joins it only before it next touches this layer's slots (the following decode step).
        self.copies_pending = False
        self.prefetched = None  # (end, keys, values) of a prefix read started ahead (prefill.prefetch_prefix)
        self.host_current = True  # the host tier holds every token of the offloaded heads (nothing to flush)
        self.reserved: Reservation | None = None  # reserved storage (reserve.py): the ranges behind the buffers

    @property
    def offloads(self) -> bool:
        """Whether this layer has offloaded heads (host tier and slots in use)."""
        return self.slot_heads.numel() > 0

    @property
    def page_capacity(self) -> int:
        return self.pool.layout.page_capacity

    @property
    def live_pages(self) -> int:
        """Pages that may be touched: the committed ones of reserved storage, else the capacity."""
        return self.page_capacity if self.reserved is None else self.reserved.committed

    @property
    def kmin(self) -> torch.Tensor:
        """``[B, H, pages, D]`` per-page per-channel key minimum (+inf: no valid token), a view of ``min_pages``."""
        return self.min_pages.permute(1, 2, 0, 3)

    @property
    def kmax(self) -> torch.Tensor:
        """``[B, H, pages, D]`` per-page per-channel key maximum (-inf: no valid token), a view of ``max_pages``."""
        return self.max_pages.permute(1, 2, 0, 3)

    def mismatch(self, key_states: torch.Tensor) -> str | None:
        """What of these states differs from the ones stored (batch, KV heads, head dim, dtype, device), or None."""
        B, H, _, D = key_states.shape
        for what, have, got in (("batch size", self.batch, B), ("KV heads", self.num_kv_heads, H),
                                ("head dim", self.head_dim, D), ("dtype", self.dtype, key_states.dtype),
                                ("device", self.device, key_states.device)):
            if have != got:
                return f"{what} {have} and now receives {got}".replace("torch.", "")
        return None

    def fits(self, key_states: torch.Tensor) -> bool:
        """Whether this storage serves these states: same batch, heads, head dim, dtype and device."""
        return self.mismatch(key_states) is None

    def check_states(self, key_states: torch.Tensor) -> None:
        """Refuse states this storage cannot take (a ValueError naming the difference; nothing is changed)."""
        differs = self.mismatch(key_states)
        if differs is None:
            return
        fix = ("use a fresh FlexiCache per batch (or batch_select_indices / batch_repeat_interleave)"
               if differs.startswith("batch") else
               "a cache holds one model's states: continue with the model (and dtype, device) that filled it, or "
               "reset() the cache")
        raise ValueError(f"FlexiCache was filled with {differs}; {fix}")

    # ---- room -------------------------------------------------------------------------------------------
    def pages_for(self, end: int, max_tokens: int | None) -> int | None:
        """The page capacity that room for ``end`` tokens takes, or None where there is room
        (:func:`~flexicache_hf.pages.room_capacity`: ``max_tokens``' when given, else grown with headroom)."""
        return room_capacity(end, max_tokens, self.config.page_size, self.page_capacity)

    def ensure_capacity(self, end: int, stored: int, max_tokens: int | None, host_elsewhere: int) -> None:
        """Room for ``end`` tokens (:meth:`pages_for`).  ``host_elsewhere``: host bytes the cache's other layers
        hold (the host cap is the cache's); ``stored``: the storage position after the tokens held now."""
        cap = self.pages_for(end, max_tokens)
        if cap is None:
            return
        # First: the host tier is the one that may refuse (host memory), before any change.
        self.host.grow(cap, host_elsewhere, headroom=max_tokens is None)
        # Offloaded heads never need more slots than pages exist, so short contexts do not pay for the budget.
        slots = min(self.config.resident_slots, cap) if self.offloads else 0
        self.pool.grow(cap, slots)
        self.slots.relayout(self.pool)
        self.find_tail(stored)
        old, B, H, D = self.min_pages.shape
        pad = (cap - old, B, H, D)  # new pages after the old ones (page-major: the old tensor is the prefix)
        self.min_pages = torch.cat([self.min_pages, self.min_pages.new_full(pad, float("inf"))])
        self.max_pages = torch.cat([self.max_pages, self.max_pages.new_full(pad, float("-inf"))])

    # ---- reserved storage (reserve.py) -------------------------------------------------------------------
    def reserve_plan(self, context: int, need: int, stored: int) -> int | None:
        """Host bytes this layer's tier holds once :meth:`reserve` made room for ``need`` pages in storage reserved
        for ``context`` tokens, or None where nothing would change (integers only)."""
        ps, P = self.config.page_size, room_pages(context, self.config.page_size)
        if self.reserved is not None:
            target = target_pages(need, self.reserved.committed, P, ps)
            return None if target == self.reserved.committed else self.reserved.host_bytes_at(target)
        target = target_pages(max(need, min(num_pages(stored, ps), P)), 0, P, ps)
        return host_commit_bytes(self.batch, self.slot_heads.numel(), ps, self.head_dim, self.dtype, target)

    def reserve(self, context: int, need: int, stored: int, host_ranges: dict | None = None) -> None:
        """Room for ``need`` pages in storage reserved for ``context`` tokens: a growing layer's buffers are moved
        into reserved ranges first (once; ``stored``: the storage position after the newest token), then the pages
        are committed (one chunk ahead, :func:`~flexicache_hf.reserve.target_pages`)."""
        ps, P = self.config.page_size, room_pages(context, self.config.page_size)
        if self.reserved is None:
            old = self.pool.layout
            # buffers to move: their copies done first (a layer laid out before its first tokens has none, and so
            # never waits here for the device: a first forward's host then runs ahead of it)
            if old.page_capacity or old.slots or self.host.k is not None:
                self.copies.synchronize()
            self.join_copies()
            slots = max(min(self.config.resident_slots, P) if self.offloads else 0, old.slots)
            res = Reservation(PoolLayout(self.batch, old.num_slot_heads, slots, old.num_full_heads, P),
                              self.num_kv_heads, ps, self.head_dim, self.dtype, self.device, context, host_ranges)
            keep = min(num_pages(stored, ps), old.page_capacity, P)  # the pages held
            views = res.tensors(target_pages(max(need, keep), 0, P, ps))
            views["min"][:keep] = self.min_pages[:keep]
            views["max"][:keep] = self.max_pages[:keep]
            self.min_pages, self.max_pages = views["min"], views["max"]
            self.pool.grow(P, slots, into=views, keep=keep)
            self.slots.relayout(self.pool)
            self.find_tail(stored)
            if self.offloads:
                self.host.adopt(views["host_k"], views["host_v"], views.get("host_k_dev"), views.get("host_v_dev"))
            self.reserved = res
        self.reserved.commit(target_pages(need, self.reserved.committed, P, ps), self.min_pages, self.max_pages)

    def host_bytes(self) -> int:
        """Host bytes held: the tier's (committed, for reserved storage)."""
        return self.host.nbytes() if self.reserved is None else self.reserved.host_bytes()

    def commit_seconds(self) -> tuple[float, float, float]:
        """Reserved storage's commit times (:meth:`~flexicache_hf.reserve.Reservation.commit_seconds`); zeros for
        sized or growing storage (their page-locking is the block keeper's, ``BLOCKS.stats()``)."""
        return (0.0, 0.0, 0.0) if self.reserved is None else self.reserved.commit_seconds()

    def __getstate__(self) -> dict:
        """Reserved storage travels as its committed prefix (ranges are this process's): made again on load."""
        state = dict(self.__dict__)
        if self.reserved is not None:
            n, pool, host, slots = (self.reserved.committed, copy.copy(self.pool), copy.copy(self.host),
                                    copy.copy(self.slots))
            slots.pool = pool
            pool.k, pool.v = (t[: self.reserved._bytes("k", n) // (t[0].numel() * t.element_size())].clone()
                              for t in (self.pool.k, self.pool.v))
            if host.k is not None:
                host.k, host.v, host.k_dev, host.v_dev = self.host.k[:n].clone(), self.host.v[:n].clone(), None, None
            state.update(pool=pool, host=host, slots=slots, min_pages=self.min_pages[:n].clone(),
                         max_pages=self.max_pages[:n].clone(), _committed=n)
        return state

    def __setstate__(self, state: dict) -> None:
        n = state.pop("_committed", None)
        self.__dict__.update(state)
        if n is None:
            return
        res, pool, host = self.reserved, self.pool, self.host
        views = res.tensors(n)
        views["min"][:n], views["max"][:n] = self.min_pages, self.max_pages
        views["k"][: pool.k.shape[0]], views["v"][: pool.v.shape[0]] = pool.k, pool.v
        pool.k, pool.v = views["k"], views["v"]
        self.min_pages, self.max_pages = views["min"], views["max"]
        if host.k is not None:
            old_k, old_v = host.k, host.v
            host.k = host.v = None
            host.adopt(views["host_k"], views["host_v"], views.get("host_k_dev"), views.get("host_v_dev"))
            host.k[:n], host.v[:n] = old_k, old_v

    def host_blocks_for(self, end: int, max_tokens: int | None) -> list[tuple[int, int]]:
        """The ``(bytes, run)`` of the host blocks :meth:`ensure_capacity` allocates to make room for ``end`` tokens
        (``[]``: none)."""
        cap = self.pages_for(end, max_tokens)
        return [] if cap is None else self.host.blocks_for(cap, headroom=max_tokens is None)

    def find_tail(self, stored: int) -> None:
        """Point ``tail_phys`` at the slots holding the newest page again (after the slots were re-laid); ``stored``:
        the storage position after the newest token (0: none)."""
        if stored and self.offloads:
            self.tail_phys.copy_(self.slots.phys_of((stored - 1) // self.config.page_size))

    def buffers(self) -> list[torch.Tensor]:
        """Every device tensor a decode step reads or writes here (fixed addresses once sized for max_cache_len)."""
        bufs = [self.pool.k, self.pool.v, self.pool.table_buffer, self.min_pages, self.max_pages, self.valid_lo,
                self.tail_phys, self.slot_heads, self.full_heads, self.slots.slot_page, self.slots.slot_phys]
        if self.host.k_dev is not None:
            bufs += [self.host.k_dev, self.host.v_dev]
        return bufs

    # ---- the copy stream --------------------------------------------------------------------------------
    def join_copies(self) -> None:
        """Make the compute stream wait for this layer's queued tier copies (no host synchronisation)."""
        if self.copies_pending:
            self.copies.hand_off()
            self.copies_pending = False

    def flush_newest_page(self, stored: int) -> None:
        """Copy the newest page of the offloaded heads (``stored``: the storage position after its last token) to the
        host while it is partly filled: decode tokens go to its device slot only (a page is offloaded once, when it
        fills), so until then the host lacks them."""
        ps = self.config.page_size
        if not self.host_current and stored % ps and self.offloads:
            with copy_context(self.copies):
                offload_page(self.ops, self.pool, self.host, (stored - 1) // ps, self.tail_phys)
        self.host_current = True

    # ---- rows and emptying ------------------------------------------------------------------------------
    def clear(self) -> None:
        """As new, in place: the MinMax cache empty, no slot holds a page, no padding, nothing queued."""
        self.min_pages[: self.live_pages].fill_(float("inf"))
        self.max_pages[: self.live_pages].fill_(float("-inf"))
        if self.offloads:
            self.slots.clear()
        self.tail_phys.zero_()
        self.valid_lo.zero_()
        self.padded, self.open_padding, self.host_current, self.copies_pending = False, False, True, False
        self.prefetched = None

    def select_rows(self, index: torch.Tensor, stored: int) -> None:
        """Keep rows ``index`` (device int64; beam reorder / batch expansion), copying their pages (reserved
        storage: into new ranges of the new batch, the committed pages only)."""
        self.join_copies()
        old = self.pool.layout
        B, n = index.numel(), self.live_pages
        new = PoolLayout(B, old.num_slot_heads, old.slots, old.num_full_heads, old.page_capacity)
        views = None
        if self.reserved is not None:
            res = Reservation(new, self.num_kv_heads, self.config.page_size, self.head_dim, self.dtype, self.device,
                              self.reserved.tokens)
            views = res.tensors(n)
        pool = PagePool(new, self.full_heads, self.slot_heads, self.num_kv_heads, self.config.page_size,
                        self.head_dim, self.dtype, self.device, into=views)
        for name in ("k", "v"):
            src, dst = getattr(self.pool, name), getattr(pool, name)
            if old.full_base > 1:  # the slot region, row-major
                dst[1 : new.full_base] = src[1 : old.full_base].view(old.batch, -1, *src.shape[1:])[index].flatten(0, 1)
            full = src[old.full_base : old.full_base + n * old.batch * old.num_full_heads]
            full = full.view(n, old.batch, old.num_full_heads, *src.shape[1:])
            dst[new.full_base : new.full_base + n * B * old.num_full_heads] = full[:, index].flatten(0, 2)
        self.pool, self.batch = pool, B
        slot_page = self.slots.slot_page[index]
        self.slots = SlotTable(pool, self.device)
        self.slots.set_pages(slot_page)
        if self.reserved is not None:
            self.copies.synchronize()
            cpu = index.cpu()
            if self.host.k is not None:
                views["host_k"][:n] = self.host.k[:n][:, cpu]
                views["host_v"][:n] = self.host.v[:n][:, cpu]
                self.host.k = self.host.v = None
                self.host.adopt(views["host_k"], views["host_v"], views.get("host_k_dev"), views.get("host_v_dev"))
            views["min"][:n], views["max"][:n] = self.min_pages[:n][:, index], self.max_pages[:n][:, index]
            self.min_pages, self.max_pages, self.reserved = views["min"], views["max"], res
        else:
            if self.host.k is not None:
                self.host.select_rows(index)
            self.min_pages, self.max_pages = self.min_pages[:, index], self.max_pages[:, index]
        self.host.batch = B
        self.valid_lo = self.valid_lo[index]
        self.tail_phys = torch.zeros((B, self.slot_heads.numel()), dtype=torch.long, device=self.device)
        self.find_tail(stored)

    def nbytes(self) -> int:
        """Device bytes held: pages (null page and slack included), page table, MinMax cache."""
        if self.reserved is not None:  # committed bytes, not reserved ones
            return self.reserved.device_bytes() + self.pool.table_buffer.nbytes
        return self.pool.nbytes() + self.min_pages.nbytes + self.max_pages.nbytes
