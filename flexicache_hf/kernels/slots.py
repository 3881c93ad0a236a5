"""Triton twins of :func:`flexicache_hf.kernels.reference.reseat_slots` and ``place_page``: a stable head's re-rank
seated, and a new page placed, in one launch each.

``reseat_slots``: one program per (row, slot head), ``O((S + K) log K)`` work for its slot row (``S`` logical pages)
and wanted top-K (``K`` pages), which may come in any order, -1 anywhere (a re-rank's are ascending and -1 padded
at the end, a rewind's have -1 holes).  It sorts the wanted pages (``tl.sort``, in registers) into a scratch row of
its own (int32, global memory, allocated per call); a branchless binary search of each slot's page in that sorted
copy (``log2 K`` gathers) gives the kept slots, and each kept slot marks its page's first place there.  After a
barrier a second search, of each wanted page, reads its mark: present, or else promoted.  Prefix sums rank the free
slots (in slot order) and the promoted pages (in wanted's order); the slot numbers in the reference's order (free
slots first, then the kept ones) go to the scratch row, and the r-th promoted page reads its slot from place r.
Evicted pages' table entries go to the null page and promoted ones' to their new slot, by masked stores into the
flat page table itself; the slot row is rewritten (kept pages, then, after the barrier, the promoted pages into
their slots).  A program whose predicate is off (a layer not re-ranking in a compiled step) only writes its
"nothing to load" outputs.  The result is the reference's, bit for bit, for rows holding no page twice (a page
wanted twice takes two slots in both, and which one its table entry then names is unspecified in both).  Rows of up
to ``MAX_PAGES`` slots and wanted pages run here; longer ones fall back to the reference's ~10 operations on
``[B, nT, S, K]`` tensors (a sort, scatters, broadcast comparisons), which the old all-against-all kernel (``[S, K]``
in registers, 2^15 cells at most) left to the product's defaults (K = 256, S = 259): ~0.18 ms a layer at every
compiled decode step (batch 16 x 6 heads, H200), against ~5 us for this kernel (~1.3 us predicated off).

``place_page``: one program per (row, slot head), its slot row in registers (a first-free-slot minimum), the warps
growing with the row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import reference
from ._util import pow2

# Longest slot row and wanted row the reseat kernel takes: each is one power-of-two block in registers (the wanted
# row sorted by ``tl.sort``), up to 32 warps (no spills at K = 4096, S = 8192; a few bytes at K = 8192).  Budget
# 32k tokens at 8-token pages is K = 4096, and S that plus R // page_size + 1.
MAX_PAGES = 8192
_BIG = tl.constexpr(2147483647)  # pads the sorted wanted row past K (pages are < 2**31: int32 math)


@triton.jit
def _slot_row(nT):
    """This program's (row, slot head): its flat index ``b * nT + t``, ``b`` and ``t``."""
    i = tl.program_id(0).to(tl.int64)
    return i, i // nT, i % nT


def _check_contiguous(fn: str, **tensors: torch.Tensor) -> None:
    for name, x in tensors.items():
        if not x.is_contiguous():
            raise ValueError(f"{fn} needs a contiguous {name}")


def _predicate(when: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """``when``, or a ``[1]`` True: the kernels read a predicate either way, so a prompt's call (none) and a
    compiled step's (the layer's re-rank flag) launch one compiled variant, not two (the reseat's sort made each
    variant ~1-2 s of a machine's first compile)."""
    return when if when is not None else torch.ones(1, dtype=torch.bool, device=device)


def _warps(block: int, per_warp: int) -> int:
    """Warps for a program holding ``block``-long vectors, about ``per_warp`` lanes each (1 to 32)."""
    return min(32, max(1, block // per_warp))


@triton.jit
def _lower_bound(base, v, LOG: tl.constexpr):
    """Per lane: where ``v`` first is in the ascending ``2**LOG`` int32 at ``base`` (``LOG`` gathers, branchless):
    the count of entries < v, at most ``2**LOG - 1`` (enough to find v: ``base[result] == v`` iff v is there)."""
    pos = tl.zeros_like(v)
    for j in tl.static_range(LOG):
        half = 1 << (LOG - 1 - j)
        pos = tl.where(tl.load(base + pos + (half - 1)) < v, pos + half, pos)
    return pos


@triton.jit(do_not_specialize_on_alignment=["when_ptr"])
def _reseat_kernel(
    slot_page_ptr,  # [B, nT, S] int64, contiguous (updated)
    wanted_ptr,  # [B, nT, K] int64, with strides
    slot_phys_ptr,  # [B, nT, S] int64, contiguous
    table_ptr,  # [B * H * cap (+ 1)] int32 flat page table (updated)
    heads_ptr,  # [nT] int64 KV head of each slot row
    when_ptr,  # [1] bool: the re-rank happens (a True of the wrapper's where the call has no predicate)
    scratch_ptr,  # [B * nT, 2 * BLOCK_K + BLOCK_S] int32, any contents
    pages_ptr, phys_ptr,  # [B, nT, K] int64 outputs, contiguous
    nT, S, K, H, cap, null_page,
    s_wb, s_wt, s_wk,
    BLOCK_S: tl.constexpr,
    BLOCK_K: tl.constexpr,
    LOG_K: tl.constexpr,
):
    i, b, t = _slot_row(nT)
    k = tl.arange(0, BLOCK_K)
    if tl.load(when_ptr).to(tl.int32) == 0:
        # Not this layer's re-rank (a compiled step launches every layer's): nothing moves, nothing to load.
        none = tl.full([BLOCK_K], -1, tl.int64)
        tl.store(pages_ptr + i * K + k, none, mask=k < K)
        tl.store(phys_ptr + i * K + k, none, mask=k < K)
    else:
        _reseat_row(slot_page_ptr, wanted_ptr, slot_phys_ptr, table_ptr, heads_ptr, scratch_ptr, pages_ptr, phys_ptr,
                    i, b, t, S, K, H, cap, null_page, s_wb, s_wt, s_wk, BLOCK_S, BLOCK_K, LOG_K)


@triton.jit
def _reseat_row(slot_page_ptr, wanted_ptr, slot_phys_ptr, table_ptr, heads_ptr, scratch_ptr, pages_ptr, phys_ptr,
                i, b, t, S, K, H, cap, null_page, s_wb, s_wt, s_wk,
                BLOCK_S: tl.constexpr, BLOCK_K: tl.constexpr, LOG_K: tl.constexpr):
    """The reseat of one (row ``b``, slot head ``t``), flat index ``i``."""
    s = tl.arange(0, BLOCK_S)
    k = tl.arange(0, BLOCK_K)
    s_ok = s < S
    k_ok = k < K
    srt = scratch_ptr + i * (2 * BLOCK_K + BLOCK_S)  # the wanted pages, ascending (then _BIG)
    mark = srt + BLOCK_K  # 1 at the first place of a kept slot's page in srt
    order = mark + BLOCK_K  # the slots, free ones first (in slot order), then the kept ones
    w = tl.load(wanted_ptr + b * s_wb + t * s_wt + k * s_wk, mask=k_ok, other=-1).to(tl.int32)
    tl.store(srt + k, tl.sort(tl.where(k_ok, w, _BIG)))
    tl.store(mark + k, tl.zeros_like(k))
    tl.debug_barrier()
    # Kept slots: their page is wanted (-1, free, never is).  Each marks its page's first place in srt.
    sp = tl.load(slot_page_ptr + i * S + s, mask=s_ok, other=-1).to(tl.int32)
    at = _lower_bound(srt, sp, LOG_K)
    keep = (sp >= 0) & (tl.load(srt + at, mask=sp >= 0, other=-1) == sp)
    tl.store(mark + at, tl.full([BLOCK_S], 1, tl.int32), mask=keep)
    free = s_ok & ~keep
    n_free = tl.sum(free.to(tl.int32), axis=0)
    place = tl.where(free, tl.cumsum(free.to(tl.int32), axis=0) - 1, n_free + tl.cumsum(keep.to(tl.int32), axis=0) - 1)
    tl.store(order + place, s, mask=s_ok)
    row = (b * H + tl.load(heads_ptr + t)) * cap  # this head's page-table row
    evicted = (sp >= 0) & ~keep
    tl.store(table_ptr + row + tl.where(evicted, sp, 0), tl.zeros_like(sp) + null_page, mask=evicted)
    tl.store(slot_page_ptr + i * S + s, tl.where(keep, sp, -1).to(tl.int64), mask=s_ok)
    tl.debug_barrier()
    # Promoted pages: wanted, not marked.  The r-th takes the r-th free slot (order[r]; past the free slots the
    # reference's clamp to place S - 1, which the layer's slot count never reaches).
    present = tl.load(mark + _lower_bound(srt, w, LOG_K), mask=w >= 0, other=0) != 0
    promote = (w >= 0) & ~present
    rank = tl.cumsum(promote.to(tl.int32), axis=0) - 1
    slot = tl.load(order + tl.minimum(rank, S - 1), mask=promote, other=0)
    phys = tl.load(slot_phys_ptr + i * S + slot, mask=promote, other=-1)
    tl.store(slot_page_ptr + i * S + slot, w.to(tl.int64), mask=promote)
    tl.store(table_ptr + row + tl.where(promote, w, 0), phys.to(tl.int32), mask=promote)
    tl.store(pages_ptr + i * K + k, tl.where(promote, w, -1).to(tl.int64), mask=k_ok)
    tl.store(phys_ptr + i * K + k, phys, mask=k_ok)


def reseat_slots(
    slot_page: torch.Tensor,  # [B, nT, S] int64 (updated in place)
    wanted: torch.Tensor,  # [B, nT, K] int64
    slot_phys: torch.Tensor,  # [B, nT, S] int64
    table_buffer: torch.Tensor,  # [B * H * cap + 1] int32 (updated in place)
    slot_heads: torch.Tensor,  # [nT] int64
    num_heads: int,
    null_page: int,
    when: torch.Tensor | None = None,  # [1] bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as :func:`reference.reseat_slots` (the reference past ``MAX_PAGES`` slots or wanted pages)."""
    B, nT, S = slot_page.shape
    K = wanted.shape[-1]
    if max(S, K) > MAX_PAGES:
        return reference.reseat_slots(slot_page, wanted, slot_phys, table_buffer, slot_heads, num_heads, null_page,
                                      when)
    pages = torch.empty((B, nT, K), dtype=torch.long, device=wanted.device)  # every entry written by the kernel
    phys = torch.empty_like(pages)
    if B * nT == 0 or K == 0:
        return pages, phys
    _check_contiguous("reseat_slots", slot_page=slot_page, slot_phys=slot_phys, table_buffer=table_buffer)
    cap = (table_buffer.numel() - 1) // (B * num_heads)
    heads = slot_heads.to(device=wanted.device, dtype=torch.long)
    block_s, block_k = pow2(S), pow2(K, 2)
    scratch = torch.empty((B * nT, 2 * block_k + block_s), dtype=torch.int32, device=wanted.device)
    _reseat_kernel[(B * nT,)](
        slot_page, wanted, slot_phys, table_buffer, heads, _predicate(when, wanted.device), scratch, pages, phys,
        nT, S, K, num_heads, cap, null_page, *wanted.stride(),
        BLOCK_S=block_s, BLOCK_K=block_k, LOG_K=block_k.bit_length() - 1, num_warps=_warps(max(block_s, block_k), 128),
    )
    return pages, phys


@triton.jit(do_not_specialize_on_alignment=["when_ptr"])
def _place_page_kernel(
    slot_page_ptr,  # [B, nT, S] int64, contiguous (updated)
    slot_phys_ptr,  # [B, nT, S] int64, contiguous
    table_ptr,  # flat int32 page table (updated)
    heads_ptr,  # [nT] int64
    page_ptr,  # [1] int64
    tail_ptr,  # [B, nT] int64, contiguous (updated)
    when_ptr,  # [1] bool: place the page (a True of the wrapper's where the call has no predicate)
    nT, S, H, cap,
    BLOCK_S: tl.constexpr,
):
    i, b, t = _slot_row(nT)
    s = tl.arange(0, BLOCK_S)
    s_ok = s < S
    sp = tl.load(slot_page_ptr + i * S + s, mask=s_ok, other=0)
    first = tl.min(tl.where(s_ok & (sp < 0), s, BLOCK_S), axis=0)  # the first free slot
    on = (first < S) & (tl.load(when_ptr).to(tl.int32) != 0)
    page = tl.load(page_ptr)
    phys = tl.load(slot_phys_ptr + i * S + first, mask=on, other=0)
    # Scalars as one-lane vectors: the interpreter takes no scalar masks.
    one = tl.arange(0, 1)
    lane = (one * 0 + on.to(tl.int32)) != 0
    tl.store(slot_page_ptr + i * S + first + one, one * 0 + page, mask=lane)
    row = (b * H + tl.load(heads_ptr + t)) * cap
    tl.store(table_ptr + row + page + one, (one * 0 + phys).to(tl.int32), mask=lane)
    tl.store(tail_ptr + i + one, one * 0 + phys, mask=lane)


def place_page(
    slot_page: torch.Tensor,  # [B, nT, S] int64 (updated in place)
    slot_phys: torch.Tensor,  # [B, nT, S] int64
    table_buffer: torch.Tensor,  # [B * H * cap + 1] int32 (updated in place)
    slot_heads: torch.Tensor,  # [nT] int64
    num_heads: int,
    page: torch.Tensor,  # [1] int64
    tail: torch.Tensor,  # [B, nT] int64 (updated in place)
    when: torch.Tensor | None = None,  # [1] bool
) -> None:
    """Same contract as :func:`reference.place_page`."""
    B, nT, S = slot_page.shape
    if B * nT == 0 or S == 0:
        return
    _check_contiguous("place_page", slot_page=slot_page, slot_phys=slot_phys, table_buffer=table_buffer, tail=tail)
    cap = (table_buffer.numel() - 1) // (B * num_heads)
    heads = slot_heads.to(device=slot_page.device, dtype=torch.long)
    _place_page_kernel[(B * nT,)](
        slot_page, slot_phys, table_buffer, heads, page, tail, _predicate(when, slot_page.device),
        nT, S, num_heads, cap, BLOCK_S=pow2(S), num_warps=_warps(pow2(S), 512),
    )
