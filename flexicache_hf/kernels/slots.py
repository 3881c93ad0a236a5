"""Triton twin of :func:`flexicache_hf.kernels.reference.reseat_slots`: a stable head's re-rank, seated in one launch.

One program per (row, slot head).  It holds the head's slot row (``S`` logical pages) and its wanted top-K (``K``
pages) in registers and compares them all against all (``[S, K]``, a few thousand booleans), which gives the kept
slots and the promoted pages; a prefix sum ranks the free slots and the promoted pages, and the r-th promoted page
takes the r-th free slot.  Evicted pages' table entries go to the null page and promoted ones' to their new slot,
by masked stores into the flat page table itself.  A program whose predicate is off (a layer not re-ranking in
a compiled step) only writes its "nothing to load" outputs.  The reference spends ~10 operations on this (comparisons,
a sort, a prefix sum, gathers, scatters and two table writes); compiled into a decode step they were ~10 kernels
per layer at every step, since the step runs them predicated whether or not the layer re-ranks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import reference
from ._util import pow2

# The [S, K] comparison lives in registers: beyond this many cells (budget 2048 with 16-token pages is
# 256 x 128) the reference's sort-based operations take over.
MAX_CELLS = 1 << 15


@triton.jit
def _slot_row(nT):
    """This program's (row, slot head): its flat index ``b * nT + t``, ``b`` and ``t``."""
    i = tl.program_id(0).to(tl.int64)
    return i, i // nT, i % nT


def _check_contiguous(fn: str, **tensors: torch.Tensor) -> None:
    for name, x in tensors.items():
        if not x.is_contiguous():
            raise ValueError(f"{fn} needs a contiguous {name}")


@triton.jit
def _reseat_kernel(
    slot_page_ptr,  # [B, nT, S] int64, contiguous (updated)
    wanted_ptr,  # [B, nT, K] int64, with strides
    slot_phys_ptr,  # [B, nT, S] int64, contiguous
    table_ptr,  # [B * H * cap (+ 1)] int32 flat page table (updated)
    heads_ptr,  # [nT] int64 KV head of each slot row
    when_ptr,  # [1] bool (read only if USE_WHEN)
    pages_ptr, phys_ptr,  # [B, nT, K] int64 outputs, contiguous
    nT, S, K, H, cap, null_page,
    s_wb, s_wt, s_wk,
    USE_WHEN: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    i, b, t = _slot_row(nT)
    k = tl.arange(0, BLOCK_K)
    on = 1
    if USE_WHEN:
        on = tl.load(when_ptr).to(tl.int32)
    if on == 0:
        # Not this layer's re-rank (a compiled step launches every layer's): nothing moves, nothing to load.
        none = tl.full([BLOCK_K], -1, tl.int64)
        tl.store(pages_ptr + i * K + k, none, mask=k < K)
        tl.store(phys_ptr + i * K + k, none, mask=k < K)
    else:
        _reseat_row(slot_page_ptr, wanted_ptr, slot_phys_ptr, table_ptr, heads_ptr, pages_ptr, phys_ptr,
                    i, b, t, S, K, H, cap, null_page, s_wb, s_wt, s_wk, BLOCK_S, BLOCK_K)


@triton.jit
def _reseat_row(slot_page_ptr, wanted_ptr, slot_phys_ptr, table_ptr, heads_ptr, pages_ptr, phys_ptr,
                i, b, t, S, K, H, cap, null_page, s_wb, s_wt, s_wk,
                BLOCK_S: tl.constexpr, BLOCK_K: tl.constexpr):
    """The reseat of one (row ``b``, slot head ``t``), flat index ``i``."""
    s = tl.arange(0, BLOCK_S)
    k = tl.arange(0, BLOCK_K)
    s_ok = s < S
    k_ok = k < K
    sp = tl.load(slot_page_ptr + i * S + s, mask=s_ok, other=-1).to(tl.int32)  # pages < 2**31: int32 math
    w = tl.load(wanted_ptr + b * s_wb + t * s_wt + k * s_wk, mask=k_ok, other=-1).to(tl.int32)
    match = ((sp[:, None] == w[None, :]) & (sp[:, None] >= 0)).to(tl.int32)  # [S, K]; -1 never matches
    keep = (tl.sum(match, axis=1) > 0) & (sp >= 0)
    promote = (w >= 0) & (tl.sum(match, axis=0) == 0)
    row = (b * H + tl.load(heads_ptr + t)) * cap  # this head's page-table row
    evicted = s_ok & (sp >= 0) & ~keep
    tl.store(table_ptr + row + tl.where(evicted, sp, 0), tl.zeros_like(sp) + null_page, mask=evicted)
    free = s_ok & ~keep
    free_rank = tl.cumsum(free.to(tl.int32), axis=0) - 1  # [S]: the r-th free slot has rank r
    prom_rank = tl.cumsum(promote.to(tl.int32), axis=0) - 1  # [K]
    take = free[:, None] & promote[None, :] & (free_rank[:, None] == prom_rank[None, :])  # [S, K]: slot s <- page k
    taken = tl.sum(take.to(tl.int32), axis=1) > 0  # [S]
    new_page = tl.sum(tl.where(take, w[None, :], 0), axis=1)  # [S]
    sp_new = tl.where(keep, sp, tl.where(taken, new_page, -1))
    tl.store(slot_page_ptr + i * S + s, sp_new.to(tl.int64), mask=s_ok)
    slot_phys = tl.load(slot_phys_ptr + i * S + s, mask=s_ok, other=0).to(tl.int32)
    phys = tl.sum(tl.where(take, slot_phys[:, None], 0), axis=0)  # [K]
    phys = tl.where(promote, phys, -1)
    pages = tl.where(promote, w, -1)
    tl.store(table_ptr + row + tl.where(promote, w, 0), phys.to(tl.int32), mask=k_ok & promote)
    tl.store(pages_ptr + i * K + k, pages.to(tl.int64), mask=k_ok)
    tl.store(phys_ptr + i * K + k, phys.to(tl.int64), mask=k_ok)


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
    """Same contract as :func:`reference.reseat_slots`."""
    B, nT, S = slot_page.shape
    K = wanted.shape[-1]
    if pow2(S) * pow2(K) > MAX_CELLS:
        return reference.reseat_slots(slot_page, wanted, slot_phys, table_buffer, slot_heads, num_heads, null_page,
                                      when)
    pages = torch.empty((B, nT, K), dtype=torch.long, device=wanted.device)  # every entry written by the kernel
    phys = torch.empty_like(pages)
    if B * nT == 0 or K == 0:
        return pages, phys
    _check_contiguous("reseat_slots", slot_page=slot_page, slot_phys=slot_phys, table_buffer=table_buffer)
    cap = (table_buffer.numel() - 1) // (B * num_heads)
    heads = slot_heads.to(device=wanted.device, dtype=torch.long)
    _reseat_kernel[(B * nT,)](
        slot_page, wanted, slot_phys, table_buffer, heads, pages if when is None else when, pages, phys,
        nT, S, K, num_heads, cap, null_page, *wanted.stride(),
        USE_WHEN=when is not None, BLOCK_S=pow2(S), BLOCK_K=pow2(K),
        num_warps=8 if pow2(S) * pow2(K) > 4096 else 4,
    )
    return pages, phys


@triton.jit
def _place_page_kernel(
    slot_page_ptr,  # [B, nT, S] int64, contiguous (updated)
    slot_phys_ptr,  # [B, nT, S] int64, contiguous
    table_ptr,  # flat int32 page table (updated)
    heads_ptr,  # [nT] int64
    page_ptr,  # [1] int64
    tail_ptr,  # [B, nT] int64, contiguous (updated)
    when_ptr,  # [1] bool (read only if USE_WHEN)
    nT, S, H, cap,
    USE_WHEN: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    i, b, t = _slot_row(nT)
    s = tl.arange(0, BLOCK_S)
    s_ok = s < S
    sp = tl.load(slot_page_ptr + i * S + s, mask=s_ok, other=0)
    first = tl.min(tl.where(s_ok & (sp < 0), s, BLOCK_S), axis=0)  # the first free slot
    on = first < S
    if USE_WHEN:
        on = on & (tl.load(when_ptr).to(tl.int32) != 0)
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
        slot_page, slot_phys, table_buffer, heads, page, tail, page if when is None else when,
        nT, S, num_heads, cap, USE_WHEN=when is not None, BLOCK_S=pow2(S), num_warps=1,
    )
