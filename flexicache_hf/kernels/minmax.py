"""Triton twin of :func:`flexicache_hf.kernels.reference.minmax_update`: fold new keys into the MinMax cache.

One program owns ``PAGES`` consecutive logical pages of one (row, KV head).  Each thread owns fixed (page,
channel) cells and walks the pages' tokens in unrolled groups, reading the new keys straight from ``keys`` in
their storage dtype (no fp32 copy of a prompt chunk is ever materialised): min / max reduce elementwise in fp32
registers, with no shuffle or shared-memory step, and fold into ``kmin`` / ``kmax``.  The same kernel serves a
decode step (T = 1: one page per (row, head)) and a 32k-token prompt chunk (2048 pages per (row, head)).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import reference
from ._util import pow2


@triton.jit(do_not_specialize=["start", "T", "H"])  # start moves every step: one variant
def _minmax_update_kernel(
    kmin_ptr,  # [B, H, P_cap, D] storage dtype, +inf where empty
    kmax_ptr,  # [B, H, P_cap, D] storage dtype, -inf where empty
    keys_ptr,  # [B, H, T, D] new keys of positions start .. start + T - 1
    valid_lo_ptr,  # [B] int64 first valid position of each row
    start,
    T,
    H,
    s_mb, s_mh, s_mp, s_md,  # strides of kmin (kmax shares them: checked on the host)
    s_kb, s_kh, s_kt, s_kd,  # strides of keys
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    PAGES: tl.constexpr,  # pages per program
    UNROLL: tl.constexpr,  # tokens per unrolled group (divides PAGE_SIZE)
):
    pid_p = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)  # int64: B*H*T*D exceeds 2**31 at B=64 x 32k prompts
    b = bh // H
    h = bh % H
    lo_valid = tl.load(valid_lo_ptr + b)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    end = start + T
    # The program's logical pages (some may lie past the chunk: nothing of them is valid).
    page = start // PAGE_SIZE + pid_p * PAGES + tl.arange(0, PAGES)  # [PAGES]
    base = keys_ptr + b * s_kb + h * s_kh
    col = (d * s_kd)[None, :]
    # Each thread owns fixed (page, channel) cells and walks the page's tokens: the reduction is elementwise in
    # registers (no shuffles, no shared memory), and the unrolled token loads are independent, so a whole
    # group of them is in flight at once.
    lo = tl.full([PAGES, BLOCK_D], float("inf"), tl.float32)
    hi = tl.full([PAGES, BLOCK_D], float("-inf"), tl.float32)
    n_valid = tl.zeros([PAGES], tl.int32)  # a page with no valid token keeps its sentinels
    for t0 in range(0, PAGE_SIZE, UNROLL):
        for u in tl.static_range(UNROLL):
            pos = page * PAGE_SIZE + (t0 + u)  # [PAGES] this token of each page
            ok = (pos >= start) & (pos < end) & (pos >= lo_valid)
            row = (pos - start).to(tl.int64) * s_kt
            k = tl.load(base + row[:, None] + col, mask=ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
            # min/max in fp32 registers; exact (every storage dtype converts exactly).
            lo = tl.minimum(lo, tl.where(ok[:, None], k, float("inf")))
            hi = tl.maximum(hi, tl.where(ok[:, None], k, float("-inf")))
            n_valid += ok.to(tl.int32)
    m_off = b * s_mb + h * s_mh + page.to(tl.int64)[:, None] * s_mp + (d * s_md)[None, :]
    w = d_ok[None, :] & (n_valid[:, None] > 0)  # [PAGES, BLOCK_D]
    cur_lo = tl.load(kmin_ptr + m_off, mask=w, other=0.0)
    cur_hi = tl.load(kmax_ptr + m_off, mask=w, other=0.0)
    tl.store(kmin_ptr + m_off, tl.minimum(cur_lo.to(tl.float32), lo).to(cur_lo.dtype), mask=w)
    tl.store(kmax_ptr + m_off, tl.maximum(cur_hi.to(tl.float32), hi).to(cur_hi.dtype), mask=w)


TILE_ELEMENTS = 1024  # (page, channel) cells per program on a long chunk: 8 pages at D = 128, 8 per thread
UNROLL_TOKENS = 16  # token loads per unrolled group: 16 x 16 B in flight per thread


def minmax_update(
    kmin: torch.Tensor,  # [B, H, P_cap, D] running per-page per-channel key minimum (+inf = empty)
    kmax: torch.Tensor,  # [B, H, P_cap, D] running per-page per-channel key maximum (-inf = empty)
    keys: torch.Tensor,  # [B, H, T, D] keys of positions start .. start + T - 1
    start: int,
    valid_lo: torch.Tensor,  # [B] first valid (non-padding) position of each row
    page_size: int,
) -> None:
    """Same contract as :func:`reference.minmax_update` (in place; padding ignored; empty pages keep ±inf)."""
    B, H, T, D = keys.shape
    if T == 0:
        return
    if kmin.stride() != kmax.stride() or page_size & (page_size - 1):
        return reference.minmax_update(kmin, kmax, keys, start, valid_lo, page_size)
    first_page, last_page = start // page_size, (start + T - 1) // page_size
    n = last_page - first_page + 1
    # Decode steps touch one page: one page per program keeps B*H programs.  Long chunks give each program
    # TILE_ELEMENTS (page, channel) cells (8 pages at D = 128).
    pages = 1 if n <= 2 else max(1, min(pow2(n), TILE_ELEMENTS // pow2(D)))
    grid = (triton.cdiv(n, pages), B * H)
    _minmax_update_kernel[grid](
        kmin, kmax, keys, valid_lo, start, T, H,
        *kmin.stride(), *keys.stride(),
        D=D, BLOCK_D=pow2(D), PAGE_SIZE=page_size, PAGES=pages, UNROLL=min(page_size, UNROLL_TOKENS), num_warps=4,
    )
