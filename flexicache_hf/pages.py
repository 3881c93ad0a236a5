"""Page geometry and the device page pool of one layer.

The pool is one tensor per K and V, ``[num_physical_pages, page_size, head_dim]``, split in three regions:

* physical page 0: the **null page**.  Page-table entries of pages that are not on the device point here,
  so the table stays dense (no ragged lists); kernels never dereference it.
* the **slot region**: ``resident_slots`` fixed slots per (sequence, offloaded KV head).  An offloaded
  (stable) head only ever holds its top-K pages plus the pages created since its last re-rank, so its
  device footprint is constant however long the context grows.
* the **full region**: every logical page of every device-resident head (unstable heads, and stable heads
  when offloading is off), **page-major**: logical page ``p`` of (row ``b``, resident head ``h``) is
  ``full_base + (p * B + b) * num_full_heads + h``, so the region grows at its end (a larger capacity appends
  pages; the pages held keep their place relative to ``full_base``).

All placement is index arithmetic on integers (:class:`PoolLayout`); the tensors only hold data and the
page table.  Every buffer of a layer that grows with the context grows in its outermost dimension (the full
region here, the MinMax cache and the host tier in theirs), so that its used part is always a prefix.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

NULL_PAGE = 0


def index_tensor(values, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """``values`` (ints or bools) as a tensor on ``device``, without waiting for the work queued there:
    ``torch.tensor(values, device=...)`` synchronises (a blocking copy), which in a layer's first forward made the
    host wait for every layer before it and so idle the device while the host did that layer's setup (the page-locking
    of its host tier among it; run 25).  From pageable memory CUDA stages the bytes and returns at once."""
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


def num_pages(num_tokens: int, page_size: int) -> int:
    """Logical pages covering ``num_tokens`` tokens."""
    return -(-num_tokens // page_size)


def room_pages(num_tokens: int, page_size: int) -> int:
    """Pages that hold ``num_tokens`` tokens stored from any position of a page: a layer's storage positions lead
    the model's by up to ``page_size - 1`` (the schedule's ``origin``), so room is made for that many more."""
    return num_pages(num_tokens + page_size - 1, page_size)


def grown_capacity(needed_pages: int, current: int) -> int:
    """Capacity (in pages) once ``needed_pages`` do not fit in ``current``.

    1/16 headroom: every growth copies the held pages into larger buffers (an O(n) copy), and with this slack
    the next one comes ~n/16 pages later, so decode pays O(1) amortised while the slack wastes little memory.
    """
    if needed_pages <= current:
        return current
    return needed_pages + max(needed_pages // 16, 8)


def room_capacity(end: int, max_tokens: int | None, page_size: int, current: int) -> int | None:
    """The page capacity a layer holding ``current`` pages takes to make room for ``end`` tokens
    (:func:`room_pages`), or None where there is room: ``max_tokens``' (``max_cache_len``) when given, else grown
    with headroom (:func:`grown_capacity`, amortised O(1) per token).  The one rule for a layer's pages: its storage
    grows by it, and the host tiers' bytes are planned by it before any layer grows."""
    need = room_pages(end, page_size)
    if need <= current:
        return None
    return room_pages(max_tokens, page_size) if max_tokens is not None else grown_capacity(need, current)


def host_capacity(pages: int) -> int:
    """Pages the pinned host tier of a growing cache takes for a layer of ``pages``: rounded up to a step of four per
    doubling (``m * 2**e`` with ``m`` in 4..7; at most 25 % more, ~12 % on average).

    Page-locking costs far more than allocating device memory, and each growth pins the whole tier anew and copies it,
    so the host tier grows in coarser steps than the device pool (:func:`grown_capacity`'s 1/16); and caches of nearby
    lengths take the same size, which the keeper of page-locked blocks hands on (:mod:`flexicache_hf.host_memory`).
    A sized cache (``max_cache_len``) takes exactly what it needs."""
    if pages <= 4:
        return pages
    step = 1 << ((pages - 1).bit_length() - 3)  # 4 * step < pages <= 8 * step
    return -(-pages // step) * step


@dataclass(frozen=True)
class PoolLayout:
    """Where each (sequence, KV head, page) lives in the pool.  Integers only."""

    batch: int
    num_slot_heads: int  # offloaded heads (top-K slots)
    slots: int  # slots per offloaded head
    num_full_heads: int  # device-resident heads (every page)
    page_capacity: int  # logical pages per resident head

    @property
    def full_base(self) -> int:
        return 1 + self.batch * self.num_slot_heads * self.slots

    @property
    def num_physical(self) -> int:
        return self.full_base + self.batch * self.num_full_heads * self.page_capacity

    def slot_ids(self, device: torch.device) -> torch.Tensor:
        """[B, slot_heads, slots] physical page of each slot."""
        n = self.batch * self.num_slot_heads * self.slots
        return (1 + torch.arange(n, device=device)).view(self.batch, self.num_slot_heads, self.slots)

    def full_ids(self, device: torch.device) -> torch.Tensor:
        """[B, full_heads, page_capacity] physical page of each logical page of the resident heads (page-major:
        ``full_base + (p * B + b) * num_full_heads + h``)."""
        n = self.batch * self.num_full_heads * self.page_capacity
        ids = self.full_base + torch.arange(n, device=device)
        return ids.view(self.page_capacity, self.batch, self.num_full_heads).permute(1, 2, 0)


@dataclass(frozen=True)
class Span:
    """Part of a range of storage positions that covers the same offsets ``[lo, hi)`` of pages ``[p0, p1)``; its
    first position is row ``t0`` of the range.  A range is at most three spans (:func:`token_spans`)."""

    p0: int
    p1: int
    lo: int
    hi: int
    t0: int

    def pages(self, t: torch.Tensor, first_page: int = 0) -> torch.Tensor:
        """The span in a page-major tensor ``[pages, B, H, page_size, D]`` whose first page is page ``first_page``
        (e.g. a copy of some of a tier's pages), as ``[B, H, p1 - p0, hi - lo, D]`` (a view)."""
        return t[self.p0 - first_page : self.p1 - first_page, :, :, self.lo : self.hi].permute(1, 2, 0, 3, 4)

    def rows(self, t: torch.Tensor) -> torch.Tensor:
        """The span in the range's token rows ``[B, H, T, D]``, as ``[B, H, p1 - p0, hi - lo, D]`` (a view)."""
        n, w = self.p1 - self.p0, self.hi - self.lo
        return t[:, :, self.t0 : self.t0 + n * w].unflatten(2, (n, w))


def token_spans(first: int, end: int, page_size: int) -> list[Span]:
    """Storage positions ``[first, end)`` as spans of page-major storage: a partial first page, the whole pages,
    a partial last page (each only where there is one), in order."""
    if end <= first:
        return []
    ps = page_size
    if first // ps == (end - 1) // ps:  # within one page
        return [Span(first // ps, first // ps + 1, first % ps, (end - 1) % ps + 1, 0)]
    out, p0, p1 = [], -(-first // ps), end // ps  # whole pages [p0, p1)
    if first % ps:
        out.append(Span(first // ps, p0, first % ps, ps, 0))
    if p1 > p0:
        out.append(Span(p0, p1, 0, ps, p0 * ps - first))
    if end % ps:
        out.append(Span(p1, p1 + 1, 0, end % ps, p1 * ps - first))
    return out


class PagePool:
    """The K and V page pools of one layer and their per-head page table.

    ``page_table[b, h, p]`` is the physical page of logical page ``p`` of KV head ``h`` of row ``b``;
    :data:`NULL_PAGE` where that page is not on the device.  The table is ``[B, H, page_capacity]``, sized for
    the capacity (not page-major: 4 bytes per page per (row, head), growth lays it out anew).
    """

    def __init__(
        self,
        layout: PoolLayout,
        full_heads: torch.Tensor,  # [num_full_heads] int64 KV head ids kept whole on the device
        slot_heads: torch.Tensor,  # [num_slot_heads] int64 KV head ids kept as top-K slots
        num_kv_heads: int,
        page_size: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        into: dict | None = None,  # the k / v tensors to use (reserved storage, zeros where committed)
    ):
        self.layout = layout
        self.full_heads, self.slot_heads = full_heads, slot_heads
        self.page_size, self.head_dim = page_size, head_dim
        shape = (layout.num_physical, page_size, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device) if into is None else into["k"]
        self.v = torch.zeros(shape, dtype=dtype, device=device) if into is None else into["v"]
        self._set_table_buffer(torch.zeros((layout.batch, num_kv_heads, layout.page_capacity), dtype=torch.int32,
                                           device=device))
        self.page_table[:, full_heads] = layout.full_ids(device).int()

    def _set_table_buffer(self, table: torch.Tensor) -> None:
        # One spare element after the table: scatters send their "no page" entries there, so updating the
        # table never needs a boolean-mask index (which would synchronise with the host on CUDA).
        self.table_buffer = torch.cat([table.reshape(-1), table.new_zeros(1)])
        self.table_shape = tuple(table.shape)

    @property
    def page_table(self) -> torch.Tensor:
        """``[B, H, page_capacity]`` int32 view of ``table_buffer`` (a view made on use, not a second stored
        tensor: a compiled decode step then takes one buffer, not two aliasing inputs)."""
        return self.table_buffer[:-1].view(self.table_shape)

    @property
    def device(self) -> torch.device:
        return self.k.device

    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes + self.table_buffer.nbytes

    def full_pages(self, which: str) -> torch.Tensor:
        """``[page_capacity, B, full_heads, page_size, D]`` page-major view of the resident heads' pages (K or V)."""
        lay = self.layout
        pool = self.k if which == "k" else self.v
        region = pool[lay.full_base : lay.num_physical]
        return region.view(lay.page_capacity, lay.batch, lay.num_full_heads, self.page_size, self.head_dim)

    def store_full(self, keys: torch.Tensor, values: torch.Tensor, first: int) -> None:
        """Store the resident heads' tokens ``[B, full_heads, T, D]`` at storage positions ``first..``."""
        end = first + keys.shape[2]
        for src, which in ((keys, "k"), (values, "v")):
            dst = self.full_pages(which)
            for span in token_spans(first, end, self.page_size):
                span.pages(dst).copy_(span.rows(src))

    def read_full(self, which: str, first: int, end: int) -> torch.Tensor:
        """The resident heads' tokens at storage positions ``[first, end)``, ``[B, full_heads, end - first, D]``
        (a copy)."""
        lay = self.layout
        out = self.k.new_empty((lay.batch, lay.num_full_heads, end - first, self.head_dim))
        src = self.full_pages(which)
        for span in token_spans(first, end, self.page_size):
            span.rows(out).copy_(span.pages(src))
        return out

    def grow(self, page_capacity: int, slots: int, into: dict | None = None, keep: int | None = None) -> None:
        """Larger buffers for a larger logical capacity (and up to ``slots`` slots per offloaded head), keeping every
        stored page: slot ``j`` of a head stays slot ``j``, and the full region (page-major) is copied whole to the
        same place relative to its base, the new pages appended after it.  Without new slots the old pool is the
        new one's prefix (the null page aside: zeros, never read).  ``into``: the new ``k`` / ``v`` tensors (reserved
        storage, laid out for exactly ``page_capacity`` pages, zeros where committed); only the pages that fit are
        copied, and only those are touched."""
        old = self.layout
        if into is None and page_capacity <= old.page_capacity and slots <= old.slots:
            return
        cap = page_capacity if into is not None else max(page_capacity, old.page_capacity)
        new = PoolLayout(old.batch, old.num_slot_heads, max(slots, old.slots), old.num_full_heads, cap)
        dev, page = self.device, (self.page_size, self.head_dim)
        n_slots = old.batch * old.num_slot_heads
        keep = min(old.page_capacity, cap, old.page_capacity if keep is None else keep)  # logical pages copied
        full = keep * old.batch * old.num_full_heads
        for name in ("k", "v"):
            pool = getattr(self, name)
            grown = torch.zeros((new.num_physical, *page), dtype=pool.dtype, device=dev) if into is None else into[name]
            if old.slots == new.slots:
                grown[1 : old.full_base] = pool[1 : old.full_base]
            elif old.slots:
                src = pool[1 : old.full_base].view(n_slots, old.slots, *page)
                grown[1 : new.full_base].view(n_slots, new.slots, *page)[:, : old.slots] = src
            grown[new.full_base : new.full_base + full] = pool[old.full_base : old.full_base + full]
            setattr(self, name, grown)
        table = torch.zeros((new.batch, self.page_table.shape[1], new.page_capacity), dtype=torch.int32, device=dev)
        table[:, :, :keep] = self.page_table[:, :, :keep]
        table[:, self.full_heads] = new.full_ids(dev).int()
        self._set_table_buffer(table)
        self.layout = new
