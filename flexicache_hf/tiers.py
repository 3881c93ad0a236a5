"""GPU <-> host residency of the offloaded (stable) heads of one layer.

The host tier holds every written token of every offloaded head, page-major (pinned memory when the cache lives
on CUDA, so copies are asynchronous and kernels can read it through UVA).  The device holds, per
(sequence, offloaded head), a fixed set of slots in the page pool (:mod:`flexicache_hf.pages`):

* ``offload_*`` — device -> host: a prompt chunk once (all of it), then each decode page once, when it fills
  (the paper's one big offload after prefill and small incremental ones).
* ``reseat`` — after a re-rank, pages that left the top-K give their slots to newly promoted pages, which
  are loaded from the host tier (the paper's physical block reuse); nothing else moves.

Copies run on a low-priority side stream on CUDA; the compute stream waits on an event before it reads,
never on the host.  The pinned memory itself comes from :mod:`flexicache_hf.block_keeper` (exact sizes, pinned by
several threads, kept for the next tier of the same size).
"""

from __future__ import annotations

import contextlib
import weakref

import torch

from .block_keeper import BLOCKS
from .host_memory import HostMemoryError, format_bytes  # noqa: F401  (HostMemoryError: re-exported)
from .host_room import check_host_limit
from .load_stream import synchronize_load_streams, synchronize_stream
from .kernels import KernelOps
from .kernels.reference import set_table_entries
from .pages import NULL_PAGE, PagePool, host_capacity, token_spans


def cuda_alias(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CUDA tensor on ``device`` viewing the pinned host tensor ``t`` in place (UVA: the same address).

    Built through ``__cuda_array_interface__``, which carries no bfloat16 type code: the bytes are viewed as a
    same-width integer type and re-typed after.  The alias does not own the memory: keep ``t`` alive.
    """
    width, typestr = {1: (torch.uint8, "|u1"), 2: (torch.int16, "<i2"), 4: (torch.int32, "<i4"),
                      8: (torch.int64, "<i8")}[t.element_size()]
    raw = t.view(width)

    class _Interface:
        __cuda_array_interface__ = {"shape": tuple(raw.shape), "typestr": typestr, "data": (raw.data_ptr(), False),
                                    "version": 3, "strides": None}

    with torch.cuda.device(device):
        alias = torch.as_tensor(_Interface(), device=device)
    return alias.view(t.dtype)


def tier_pages(pages: int, pinned: bool, headroom: bool) -> int:
    """Pages a host tier takes for a layer of ``pages``: exactly those, or, pinned and growing (``headroom``: no
    ``max_cache_len``), rounded up to a coarser step (:func:`~flexicache_hf.pages.host_capacity`)."""
    return host_capacity(pages) if pinned and headroom else pages


def tier_block(batch: int, heads: int, page_size: int, head_dim: int, dtype: torch.dtype, pages: int
               ) -> tuple[int, int]:
    """``(bytes, run)`` of one of K / V of a host tier of ``pages`` pages per (row, head): its size, and the bytes of
    one page of one (row, head), the unit the page-major tier is laid out in (flat page ``(p * B + b) * heads + h``):
    every row of the tier's 2D copies and every page a copy kernel moves lies within one, and page-locking never
    splits one across registrations."""
    run = page_size * head_dim * dtype.itemsize
    return pages * batch * heads * run, run


class CopyStream:
    """A low-priority CUDA stream for tier copies, with event-based hand-off to the compute stream."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        # Priority 0 is the lowest CUDA priority; compute kernels on higher-priority streams overtake copies.
        self.stream = torch.cuda.Stream(device=device, priority=0) if self.cuda else None

    def __enter__(self):
        if self.cuda:
            self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
            self._ctx = torch.cuda.stream(self.stream)
            self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            self._ctx.__exit__(*exc)
        return False

    def __reduce__(self):  # a stream belongs to its process: a copy or an unpickled cache gets a new one
        return (type(self), (self.device,))

    def hand_off(self) -> None:
        """Make the compute stream wait for every copy issued so far (no host synchronisation)."""
        if self.cuda and not in_graph():
            torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)

    def keep_alive(self, *tensors: torch.Tensor) -> None:
        """Device tensors made on the compute stream and read by copies queued here: the caching allocator
        must not hand their memory out again before those copies ran."""
        if self.cuda:
            for t in tensors:
                t.record_stream(self.stream)

    def synchronize(self) -> None:
        """Wait on the host for every copy issued so far, page loads behind the compute included (before the CPU
        itself touches the host tier, or its page-locked memory is let go)."""
        if self.cuda and torch.cuda.is_initialized():
            synchronize_stream(self.stream)
            synchronize_load_streams()


class HostTier:
    """Every token of the offloaded heads of one layer, page-major: ``[page_capacity, B, heads, page_size, D]``
    (a grown tier holds the old one as its prefix, copied as is; flat page ``(p * B + b) * heads + h``, see
    :meth:`page_index`, whatever the capacity).

    On CUDA K and V are each one page-locked block of exactly their size (:data:`~flexicache_hf.block_keeper.BLOCKS`):
    a later cache of the same shape in the process takes the blocks this one gives back (no new page-locking, the
    dominant cost of a first long prefill).  A growing cache's pinned tier grows in coarse steps
    (:func:`tier_pages`); a sized one, and every tier off CUDA (pageable torch memory), holds exactly what it needs.
    What the tier holds is what :meth:`nbytes` counts against ``host_memory_limit``.  Nothing is zeroed: positions
    never written are never read (the kernels mask every token by position, and exact-attention reads stop at the
    sequence length).
    """

    def __init__(self, batch: int, heads: int, page_size: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, limit_bytes: int | None, copies: CopyStream, ops: KernelOps):
        self.heads, self.page_size, self.head_dim = heads, page_size, head_dim
        self.dtype, self.compute_device = dtype, device
        self.batch = batch  # (with the row index page_index adds)
        self.limit_bytes = limit_bytes  # the cache's host_memory_limit, over every layer's tier
        self.copies, self.ops = copies, ops  # the layer's copy stream (every tier copy runs there)
        self.pinned = device.type == "cuda"
        self.page_capacity = 0
        self.k = self.v = None
        self.k_dev = self.v_dev = None  # CUDA aliases of the pinned k / v (see device_pages)
        # The pinned blocks go back to their keeper when the last view of them dies, to be lent to the next tier;
        # cuda-python copies queued here are invisible to torch, so they finish first (this runs before the tier's
        # tensors are released).
        weakref.finalize(self, copies.synchronize)

    def nbytes(self) -> int:
        return 0 if self.k is None else self.k.nbytes + self.v.nbytes

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["k_dev"] = state["v_dev"] = None  # views of this process's pinned pages: made again where loaded
        return state

    def __setstate__(self, state: dict) -> None:
        # Deep copies and unpickled tensors come back in pageable memory; the UVA copy kernels need pinned memory.
        self.__dict__.update(state)
        weakref.finalize(self, self.copies.synchronize)  # as in __init__ (a copy is made without it)
        if self.pinned and self.k is not None:
            k, v = self._alloc(*self.k.shape[:2]), self._alloc(*self.v.shape[:2])  # [pages, B, ...]
            k.copy_(self.k)
            v.copy_(self.v)
            self._set(k, v)

    def _block(self, page_capacity: int, batch: int | None = None) -> tuple[int, int]:
        """``(bytes, run)`` of one of K / V at ``page_capacity`` pages (:func:`tier_block`)."""
        batch = self.batch if batch is None else batch
        return tier_block(batch, self.heads, self.page_size, self.head_dim, self.dtype, page_capacity)

    def capacity_for(self, page_capacity: int, headroom: bool = False) -> int:
        """Pages to allocate for a need of ``page_capacity`` (``headroom``: the cache grows; see :func:`tier_pages`)."""
        return tier_pages(page_capacity, self.pinned, headroom)

    def _alloc(self, page_capacity: int, batch: int | None = None) -> torch.Tensor:
        """An uninitialised ``[page_capacity, batch, heads, page_size, D]`` tier tensor: a page-locked block lent by
        :data:`~flexicache_hf.block_keeper.BLOCKS` on CUDA, pageable memory elsewhere (HostMemoryError on failure)."""
        batch = self.batch if batch is None else batch
        shape = (page_capacity, batch, self.heads, self.page_size, self.head_dim)
        n, run = self._block(page_capacity, batch)
        if self.pinned:  # an exact-size page-locked block (HostMemoryError when it cannot be had)
            return BLOCKS.acquire(n, run, self.compute_device).view(self.dtype).view(shape)
        try:
            return torch.empty(shape, dtype=self.dtype)
        except (RuntimeError, MemoryError) as e:
            raise HostMemoryError(f"allocating {format_bytes(n)} of host memory failed: {e}") from e

    def blocks_for(self, page_capacity: int, headroom: bool = False) -> list[tuple[int, int]]:
        """The ``(bytes, run)`` of the K and V blocks ``grow(page_capacity, headroom=headroom)`` would allocate
        (``[]``: it holds enough, or it has no heads)."""
        if page_capacity <= self.page_capacity or self.heads == 0:
            return []
        return [self._block(self.capacity_for(page_capacity, headroom))] * 2

    def bytes_for(self, page_capacity: int, headroom: bool = False) -> int:
        """Host bytes (K and V) this tier holds once grown to ``page_capacity`` pages."""
        blocks = self.blocks_for(page_capacity, headroom)
        return sum(n for n, _ in blocks) if blocks else self.nbytes()

    def check_grow(self, page_capacity: int, other: int = 0, headroom: bool = False) -> int:
        """The capacity ``grow(page_capacity)`` would allocate; raises HostMemoryError, changing nothing,
        when it would exceed ``host_memory_limit`` beside the ``other`` host bytes the cache's other layers hold."""
        if page_capacity <= self.page_capacity or self.heads == 0:
            return self.page_capacity
        check_host_limit(self.bytes_for(page_capacity, headroom) + other, self.limit_bytes)
        return self.capacity_for(page_capacity, headroom)

    def grow(self, page_capacity: int, other: int = 0, headroom: bool = False) -> None:
        """Hold at least ``page_capacity`` pages, keeping every stored token (one copy of the old tier); ``other``:
        the host bytes the cache's other layers hold (the cap is the cache's); ``headroom``: the cache grows."""
        cap = self.check_grow(page_capacity, other, headroom)
        if cap <= self.page_capacity:
            return
        k = self._alloc(cap)
        v = self._alloc(cap)
        if self.k is not None:
            self.copies.synchronize()  # queued offloads still write the old tier
            k[: self.page_capacity].copy_(self.k)  # page-major: the old tier is the new one's prefix
            v[: self.page_capacity].copy_(self.v)
        self._set(k, v)  # the old blocks go back to their keeper (nothing else views them)
        self.page_capacity = cap

    def adopt(self, k: torch.Tensor, v: torch.Tensor, k_dev: torch.Tensor | None, v_dev: torch.Tensor | None) -> None:
        """Hold the reserved-storage views ``k`` / ``v`` (``[pages, B, heads, page_size, D]``; ``*_dev``: their CUDA
        views), the tokens held copied into their prefix (:mod:`~flexicache_hf.reserve`)."""
        cap = k.shape[0]
        if self.k is not None:
            self.copies.synchronize()
            n = min(self.page_capacity, cap)
            k[:n].copy_(self.k[:n])
            v[:n].copy_(self.v[:n])
        self.k, self.v, self.k_dev, self.v_dev = k, v, k_dev, v_dev
        self.page_capacity = cap

    def _set(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k, self.v = k, v
        if self.pinned:
            self.k_dev, self.v_dev = cuda_alias(k, self.compute_device), cuda_alias(v, self.compute_device)

    def pages(self, which: str) -> torch.Tensor:
        """Flat page view ``[page_capacity * B * heads, page_size, D]`` (indexed by :meth:`page_index`)."""
        t = self.k if which == "k" else self.v
        return t.view(-1, self.page_size, self.head_dim)

    def device_pages(self, which: str) -> torch.Tensor:
        """:meth:`pages` as the copy kernels address it: on CUDA a *CUDA* tensor aliasing the pinned pages
        (UVA, at a fixed address), else the host tensor itself."""
        if not self.pinned or self.k is None:
            return self.pages(which)
        t = self.k_dev if which == "k" else self.v_dev
        return t.view(-1, self.page_size, self.head_dim)

    def page_index(self, pages: torch.Tensor | int) -> torch.Tensor:
        """Flat host page index ``(p * B + b) * heads + h`` of logical ``pages`` ``[B, heads, n]`` (int64), or of
        one page of every row and head (an int or a ``[1]`` tensor; then ``[B, heads, 1]``)."""
        return pages * (self.batch * self.heads) + self._rows

    @property
    def batch(self) -> int:
        return self._batch

    @batch.setter
    def batch(self, rows: int) -> None:
        """Rows held; with them ``b * heads + h`` ``[B, heads, 1]``, :meth:`page_index`'s part that never changes."""
        self._batch = rows
        self._rows = torch.arange(rows * self.heads, device=self.compute_device).view(rows, self.heads, 1)

    def write_tokens(self, keys: torch.Tensor, values: torch.Tensor, start: int) -> None:
        """Queue the copy of a prompt chunk ``[B, heads, T, D]`` (positions ``start..``) to the host tier, span by
        span (:func:`~flexicache_hf.pages.token_spans`: a partial page, whole pages, a partial page).  From a device,
        the whole pages are laid out page-major in a staging buffer there and written as one block (``copy_block``:
        a few copies whatever the batch); a partial page is one ``copy_rows`` (one 2D copy).

        Runs on the copy stream (call inside ``copy_context``); the compute stream never waits for it.
        """
        spans = token_spans(start, start + keys.shape[2], self.page_size)
        for src, tier in ((keys, self.k), (values, self.v)):
            src = src.contiguous()
            self.copies.keep_alive(src)
            for span in spans:
                if src.device != tier.device and span.hi - span.lo == self.page_size:
                    self.ops.copy_block(tier[span.p0:span.p1], page_major(span, src))  # (staged on the copy stream)
                else:
                    self.ops.copy_rows(span.pages(tier), span.rows(src))

    def read_tokens(self, keys: torch.Tensor, values: torch.Tensor, first: int = 0) -> None:
        """Queue the copy of the ``T`` stored tokens from position ``first`` into ``keys`` / ``values``
        ``[B, heads, T, D]`` (device buffers made on the compute stream; exact attention over a cached prefix).

        The pages holding them are contiguous in the page-major tier: on a device they are read whole into one
        staging buffer (``copy_block``: a few large copies whatever the batch), then laid out token by token on the
        device, K then V through the same buffer.  Runs on the copy stream (call inside ``copy_context``, then hand
        the stream off before reading).
        """
        spans = token_spans(first, first + keys.shape[2], self.page_size)
        if not spans:
            return
        p0, p1 = spans[0].p0, spans[-1].p1
        stage = None
        for dst, tier in ((keys, self.k), (values, self.v)):
            self.copies.keep_alive(dst)
            pages = tier[p0:p1]
            if pages.device != dst.device:  # (the stage is made on the copy stream: reused only behind its copies)
                stage = torch.empty(pages.shape, dtype=pages.dtype, device=dst.device) if stage is None else stage
                self.ops.copy_block(stage, pages)
                pages = stage
            for span in spans:
                span.rows(dst).copy_(span.pages(pages, first_page=p0))

    def select_rows(self, index: torch.Tensor) -> None:
        """Keep rows ``index`` (beam reorder / batch expansion), in fresh host blocks."""
        self.copies.synchronize()
        index = index.cpu()
        k, v = self._alloc(self.page_capacity, index.numel()), self._alloc(self.page_capacity, index.numel())
        torch.index_select(self.k, 1, index, out=k)
        torch.index_select(self.v, 1, index, out=v)
        self._set(k, v)
        self.batch = index.numel()


def page_major(span, rows: torch.Tensor) -> torch.Tensor:
    """The whole pages ``span`` covers of token rows ``[B, heads, T, D]``, laid out as the page-major tier holds them,
    ``[p1 - p0, B, heads, page_size, D]`` (a new tensor on ``rows``' device: one block to copy)."""
    B, H, _, D = rows.shape
    out = torch.empty((span.p1 - span.p0, B, H, span.hi - span.lo, D), dtype=rows.dtype, device=rows.device)
    span.pages(out, first_page=span.p0).copy_(span.rows(rows))
    return out


class SlotTable:
    """Which logical page each device slot of each (sequence, offloaded head) holds; ``-1`` = free."""

    def __init__(self, pool: PagePool, device: torch.device):
        lay = pool.layout
        self.pool = pool
        self.slot_page = torch.full((lay.batch, lay.num_slot_heads, lay.slots), -1, dtype=torch.long, device=device)
        self.slot_phys = lay.slot_ids(device)  # [B, heads, slots]

    def relayout(self, pool: PagePool) -> None:
        """Follow a re-laid pool (more slots per head): same pages in the same slot numbers."""
        self.pool = pool
        lay = pool.layout
        grow = lay.slots - self.slot_page.shape[-1]
        if grow:
            self.slot_page = torch.cat([self.slot_page, self.slot_page.new_full((*self.slot_page.shape[:2], grow), -1)], -1)
        self.slot_phys = lay.slot_ids(self.slot_page.device)
        self._set_table(self.slot_page, self.slot_phys)

    def _set_table(self, pages: torch.Tensor, phys: torch.Tensor) -> None:
        """page_table[b, slot_heads[t], pages[b, t, i]] = phys[b, t, i] where pages >= 0."""
        set_table_entries(self.pool.table_buffer, self.pool.slot_heads, self.pool.table_shape[1], pages, phys)

    def set_pages(self, slot_page: torch.Tensor) -> None:
        """Hold ``slot_page [B, heads, slots]`` (logical page per slot, -1 = free) in this table's slots (a pool
        whose rows were selected: the same pages, slot for slot)."""
        self._set_table(slot_page, self.slot_phys)
        self.slot_page = slot_page

    def clear(self) -> None:
        """Forget every slot (their table entries go back to the null page)."""
        self._set_table(self.slot_page, torch.full_like(self.slot_page, NULL_PAGE))
        self.slot_page.fill_(-1)

    def place_new_page(self, ops: KernelOps, page, tail: torch.Tensor, when: torch.Tensor | None = None) -> None:
        """Give logical ``page`` (an int, or a ``[1]`` device tensor) a free slot in every row/head and write
        its physical page into ``tail [B, heads]``; only where ``when`` (a ``[1]`` bool tensor) holds, if given.
        A free slot always exists (``FlexiCacheConfig.resident_slots``).  One kernel (``ops.place_page``)."""
        if not isinstance(page, torch.Tensor):
            page = torch.full((1,), page, dtype=torch.long, device=self.slot_page.device)
        ops.place_page(self.slot_page, self.slot_phys, self.pool.table_buffer, self.pool.slot_heads,
                       self.pool.table_shape[1], page, tail, when)

    def phys_of(self, page: int) -> torch.Tensor:
        """Physical pages ``[B, heads]`` holding logical ``page`` (which must be resident)."""
        hit = (self.slot_page == page).int().argmax(-1, keepdim=True)
        return self.slot_phys.gather(-1, hit)[..., 0]

    def reseat(self, ops: KernelOps, wanted: torch.Tensor, when: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Make exactly the pages ``wanted [B, heads, K]`` (-1 padded) resident (only where ``when``, a ``[1]``
        bool tensor, holds, if given: otherwise nothing changes).

        Evicted pages free their slots, which the promoted (wanted but absent) pages take.  Returns
        ``(pages, phys)`` ``[B, heads, K]`` of the promoted pages and their slots (-1 where nothing loads),
        for the caller to fill from the host tier.  One kernel (``ops.reseat_slots``; the reference's ~10
        operations), fixed shapes, no host synchronisation: runs in a graph.
        """
        return ops.reseat_slots(self.slot_page, wanted, self.slot_phys, self.pool.table_buffer, self.pool.slot_heads,
                                self.pool.table_shape[1], NULL_PAGE, when)


def in_graph() -> bool:
    """Whether a CUDA step is being captured in a CUDA graph (a compiled step's op runs its body eagerly then; no
    tier copy is ever traced): its copies then stay on the capturing stream, ordered with its kernels."""
    return torch.cuda.is_current_stream_capturing()


def copy_context(stream: CopyStream):
    """``with`` block running tier copies on the side stream (a no-op context on CPU, and inside a graph: a graph's
    copies are ordered on its own stream)."""
    return stream if stream.cuda and not in_graph() else contextlib.nullcontext()


def load_promoted(ops: KernelOps, pool: PagePool, host: HostTier, pages: torch.Tensor, phys: torch.Tensor,
                  behind: bool = False) -> None:
    """Fill the slots ``phys`` with host pages ``pages`` (both ``[B, heads, K]``, -1 = none); ``behind``: on the
    device's load stream, behind the compute that follows (``KernelOps.load_pages_behind``)."""
    src = host.page_index(pages).reshape(-1)
    dst = phys.reshape(-1)
    args = (pool.k, pool.v, dst, host.device_pages("k"), host.device_pages("v"), src)
    (ops.load_pages_behind if behind else ops.copy_kv_pages)(*args)


def seat_from_chunk(pool: PagePool, pages: torch.Tensor, phys: torch.Tensor, keys: torch.Tensor,
                    values: torch.Tensor, page_size: int, first: int = 0) -> None:
    """Fill the slots ``phys`` with logical ``pages`` (both ``[B, heads, K]``, -1 = none) of the offloaded heads,
    taken from a prompt chunk of those heads stored from position ``first`` (its first token's; the first chunk)
    and still on the device (``keys`` / ``values`` ``[B, heads, T, D]``): device-to-device, instead of
    :func:`load_promoted` from the host tier.  Only the seated pages' token rows are read (a row before the chunk or
    past its end repeats its first or last token: never attended)."""
    B, nT, K = pages.shape
    T = keys.shape[2]
    tok = pages.clamp_min(0)[..., None] * page_size + torch.arange(page_size, device=pages.device)  # [B, nT, K, ps]
    tok = (tok - first).clamp(0, T - 1)
    b = torch.arange(B, device=pages.device)[:, None, None, None]
    h = torch.arange(nT, device=pages.device)[None, :, None, None]
    dst = torch.where(pages >= 0, phys, NULL_PAGE).reshape(-1)  # nothing to seat: the null page, never read
    for src, buf in ((keys, pool.k), (values, pool.v)):
        rows = src[b, h, tok]  # [B, nT, K, ps, D]
        buf.index_copy_(0, dst, rows.reshape(-1, page_size, src.shape[3]).to(buf.dtype))


def offload_page(ops: KernelOps, pool: PagePool, host: HostTier, page, phys: torch.Tensor,
                 when: torch.Tensor | None = None) -> None:
    """Copy logical ``page`` (an int or a ``[1]`` device tensor) of every row/head, held in slots
    ``phys [B, heads]``, to the host; only where ``when`` (a ``[1]`` bool tensor) holds, if given."""
    dst = host.page_index(page).reshape(-1)
    if when is not None:
        dst = torch.where(when, dst, -1)  # the copy kernel skips -1 entries
    ops.copy_kv_pages(host.device_pages("k"), host.device_pages("v"), dst, pool.k, pool.v, phys.reshape(-1))
