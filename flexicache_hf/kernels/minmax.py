"""Triton twin of :func:`flexicache_hf.kernels.reference.minmax_update`: fold new keys into the MinMax cache.

One program owns ``PAGES`` consecutive logical pages of one (row, KV head): it reads the new keys of those
pages as one tile straight from ``keys`` in their storage dtype (no fp32 copy of a prompt chunk is ever materialised),
reduces min / max over the page's valid tokens in fp32 registers, and folds the result into
``kmin`` / ``kmax``.  The same kernel serves a decode step (T = 1: one page per (row, head)) and a 32k-token
prompt chunk (2048 pages per (row, head)).
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
    PAGES: tl.constexpr,  # pages per program, loaded as one [PAGES, PAGE_SIZE, BLOCK_D] tile
):
    pid_p = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)  # int64: B*H*T*D exceeds 2**31 at B=64 x 32k prompts
    b = bh // H
    h = bh % H
    lo_valid = tl.load(valid_lo_ptr + b)
    t = tl.arange(0, PAGE_SIZE)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    end = start + T
    # The program's logical pages (some may lie past the chunk: nothing of them is valid).
    page = start // PAGE_SIZE + pid_p * PAGES + tl.arange(0, PAGES)  # [PAGES]
    pos = page[:, None] * PAGE_SIZE + t[None, :]  # [PAGES, PAGE_SIZE] token positions
    ok = (pos >= start) & (pos < end) & (pos >= lo_valid)
    row = (pos - start).to(tl.int64) * s_kt  # [PAGES, PAGE_SIZE]
    k_off = b * s_kb + h * s_kh + row[:, :, None] + (d * s_kd)[None, None, :]
    # One load of the whole tile: every page's keys are in flight at once.
    k = tl.load(keys_ptr + k_off, mask=ok[:, :, None] & d_ok[None, None, :], other=0.0).to(tl.float32)
    # min/max of each page's valid tokens; exact in fp32 (every storage dtype converts exactly).
    lo = tl.min(tl.where(ok[:, :, None], k, float("inf")), axis=1)  # [PAGES, BLOCK_D]
    hi = tl.max(tl.where(ok[:, :, None], k, float("-inf")), axis=1)
    n_valid = tl.sum(ok.to(tl.int32), axis=1)  # [PAGES]; a page with no valid token keeps its sentinels
    m_off = b * s_mb + h * s_mh + page.to(tl.int64)[:, None] * s_mp + (d * s_md)[None, :]
    w = d_ok[None, :] & (n_valid[:, None] > 0)  # [PAGES, BLOCK_D]
    cur_lo = tl.load(kmin_ptr + m_off, mask=w, other=0.0)
    cur_hi = tl.load(kmax_ptr + m_off, mask=w, other=0.0)
    tl.store(kmin_ptr + m_off, tl.minimum(cur_lo.to(tl.float32), lo).to(cur_lo.dtype), mask=w)
    tl.store(kmax_ptr + m_off, tl.maximum(cur_hi.to(tl.float32), hi).to(cur_hi.dtype), mask=w)


TILE_ELEMENTS = 8192  # keys per program on a long chunk: 16 KiB of fp16, 32 fp32 registers per thread at 8 warps


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
    # Decode steps touch one page: one page per program keeps B*H programs.  Long chunks load a tile of
    # TILE_ELEMENTS keys per program (4 pages of 16 tokens at D = 128), all in flight at once.
    pages = 1 if n <= 2 else max(1, min(pow2(n), TILE_ELEMENTS // (page_size * pow2(D))))
    grid = (triton.cdiv(n, pages), B * H)
    _minmax_update_kernel[grid](
        kmin, kmax, keys, valid_lo, start, T, H,
        *kmin.stride(), *keys.stride(),
        D=D, BLOCK_D=pow2(D), PAGE_SIZE=page_size, PAGES=pages, num_warps=4 if pages == 1 else 8,
    )
