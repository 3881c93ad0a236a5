"""Page geometry and the device page pool of one layer.

The pool is one tensor per K and V, ``[num_physical_pages, page_size, head_dim]``, split in three regions:

* physical page 0: the **null page**.  Page-table entries of pages that are not on the device point here,
  so the table stays dense (no ragged lists); kernels never dereference it.
* the **slot region**: ``resident_slots`` fixed slots per (sequence, offloaded KV head).  An offloaded
  (stable) head only ever holds its top-K pages plus the pages created since its last re-rank, so its
  device footprint is constant however long the context grows.
* the **full region**: every logical page of every device-resident head (unstable heads, and stable heads
  when offloading is off), ``page_capacity`` pages per (sequence, head) in logical order.

All placement is index arithmetic on integers (:class:`PoolLayout`); the tensors only hold data and the
page table.  Growing the context re-lays the full region, like ``DynamicCache``'s concatenation does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

NULL_PAGE = 0


def num_pages(num_tokens: int, page_size: int) -> int:
    """Logical pages covering ``num_tokens`` tokens."""
    return -(-num_tokens // page_size)


def room_pages(num_tokens: int, page_size: int) -> int:
    """Pages that hold ``num_tokens`` tokens stored from any position of a page: a layer's storage positions lead
    the model's by up to ``page_size - 1`` (the schedule's ``origin``), so room is made for that many more."""
    return num_pages(num_tokens + page_size - 1, page_size)


def grown_capacity(needed_pages: int, current: int) -> int:
    """Capacity (in pages) once ``needed_pages`` do not fit in ``current``.

    1/16 headroom: every growth re-lays the device-resident pages (an O(n) copy), and with this slack the
    next one comes ~n/16 pages later, so decode pays O(1) amortised while the slack wastes little memory.
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
        """[B, full_heads, page_capacity] physical page of each logical page of the resident heads."""
        n = self.batch * self.num_full_heads * self.page_capacity
        ids = self.full_base + torch.arange(n, device=device)
        return ids.view(self.batch, self.num_full_heads, self.page_capacity)


class PagePool:
    """The K and V page pools of one layer and their per-head page table.

    ``page_table[b, h, p]`` is the physical page of logical page ``p`` of KV head ``h`` of row ``b``;
    :data:`NULL_PAGE` where that page is not on the device.
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
    ):
        self.layout = layout
        self.full_heads, self.slot_heads = full_heads, slot_heads
        self.page_size, self.head_dim = page_size, head_dim
        shape = (layout.num_physical, page_size, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
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

    def full_tokens(self, which: str) -> torch.Tensor:
        """[B, full_heads, page_capacity * page_size, D] token view of the resident heads (K or V)."""
        lay = self.layout
        pool = self.k if which == "k" else self.v
        region = pool[lay.full_base :]
        return region.view(lay.batch, lay.num_full_heads, lay.page_capacity * self.page_size, self.head_dim)

    def grow(self, page_capacity: int, slots: int) -> None:
        """Re-lay the pool for a larger logical capacity (and up to ``slots`` slots per offloaded head),
        keeping every stored page; slot ``j`` of a head stays slot ``j``."""
        old = self.layout
        if page_capacity <= old.page_capacity and slots <= old.slots:
            return
        new = PoolLayout(old.batch, old.num_slot_heads, max(slots, old.slots), old.num_full_heads,
                         max(page_capacity, old.page_capacity))
        dev, page = self.device, (self.page_size, self.head_dim)
        for name in ("k", "v"):
            pool = getattr(self, name)
            grown = torch.zeros((new.num_physical, *page), dtype=pool.dtype, device=dev)
            for base_o, base_n, inner_o, inner_n, heads in (
                (1, 1, old.slots, new.slots, old.num_slot_heads),
                (old.full_base, new.full_base, old.page_capacity, new.page_capacity, old.num_full_heads),
            ):
                n_o = old.batch * heads * inner_o
                src = pool[base_o : base_o + n_o].view(old.batch, heads, inner_o, *page)
                dst = grown[base_n : base_n + new.batch * heads * inner_n].view(new.batch, heads, inner_n, *page)
                dst[:, :, :inner_o] = src
            setattr(self, name, grown)
        table = torch.zeros((new.batch, self.page_table.shape[1], new.page_capacity), dtype=torch.int32, device=dev)
        table[:, :, : old.page_capacity] = self.page_table
        table[:, self.full_heads] = new.full_ids(dev).int()
        self._set_table_buffer(table)
        self.layout = new
