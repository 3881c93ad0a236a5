"""Triton twin of :func:`flexicache_hf.kernels.reference.select_pages`: top-k pages, ascending, one launch.

One program owns one (row, head) score vector ``[num_pages]`` (held whole in registers, up to
``max_pages``).  Instead of sorting it finds the k-th largest score by a radix search over the 32-bit
order-preserving integer image of the floats (16 passes of 2 bits up to 4k pages; each pass counts 4
candidate thresholds in one block reduction), then selects ``> threshold`` plus the first few ``== threshold`` ties, and writes the selected page ids in
ascending order by prefix-summing the selection mask.  No sort, no second kernel for the ordering or the
``-1`` padding: torch's ``topk`` + ``sort`` + padding is 4-6 launches.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import reference
from ._util import num_sms, pow2


@triton.jit(do_not_specialize=["K", "h"])
def _select_pages_kernel(
    scores_ptr,  # [R, >= P] float32 rows of scores (R = B * h); -inf = not selectable
    out_ptr,  # [R, K] int64 selected pages, ascending, -1 padded (rows of inactive heads are left as they are)
    num_pages_ptr,  # [1] int64 P: pages per row (read on the device: graph replays see the current count)
    active_ptr,  # [h] bool: heads whose rows are selected now
    K,
    h,
    s_sr,  # row stride of scores (its page stride is 1)
    BLOCK_P: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BITS: tl.constexpr,  # radix bits resolved per pass (2**BITS candidate thresholds counted at once)
    PASSES: tl.constexpr,  # 32 // BITS
):
    r = tl.program_id(0).to(tl.int64)
    P = tl.load(num_pages_ptr)
    kk = tl.minimum(P, K)  # how many pages a full row selects
    idx = tl.arange(0, BLOCK_P)
    active = (idx * 0 + tl.load(active_ptr + r % h).to(tl.int32)) != 0  # a vector (the interpreter)
    in_row = (idx < P) & active
    x = tl.load(scores_ptr + r * s_sr + idx, mask=in_row, other=float("-inf"))
    x = tl.where(idx == P - 1, float("inf"), x)  # the page holding the newest token is always attended
    # Order-preserving integer image of a float (flip the magnitude bits of negatives: sign-magnitude ->
    # two's complement order), shifted to u in [1, 2**32]; lanes past the row get 0, below every float.
    # Order-preserving unsigned image of a float: flip the magnitude bits of negatives (sign-magnitude ->
    # two's complement order), then the sign bit (-> unsigned order).  -inf maps to 0x007FFFFF; lanes past
    # the row get 0, below every float.  uint32 halves the registers of an int64 image.
    bits = x.to(tl.int32, bitcast=True)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    u = key.to(tl.uint32, bitcast=True) ^ 0x80000000
    u = tl.where(in_row, u, 0)
    # t = the largest value with count(u >= t) >= kk (the kk-th largest u), most significant bits first,
    # BITS bits per pass: count u >= base + j * 2**shift for all 2**BITS values of j in one block reduction
    # and keep the largest j whose count still reaches kk (counts fall as j grows).  BITS divides 32, so a
    # candidate never overflows.  Fewer passes than 32 bisection steps: the passes' block reductions
    # (barriers) are the latency, the compares are cheap.
    j = tl.arange(0, 1 << BITS).to(tl.uint32)
    base = (r * 0).to(tl.uint32)  # a scalar: count(u >= 0) = BLOCK_P >= kk always holds
    for i in tl.static_range(PASSES):
        shift = (PASSES - 1 - i) * BITS  # compile-time (static_range unrolls the passes)
        cand = base + (j << shift)  # [2**BITS]
        counts = tl.sum((u[:, None] >= cand[None, :]).to(tl.int32), axis=0)
        jstar = tl.sum((counts >= kk).to(tl.int32), axis=0) - 1  # >= 0: j = 0 is base itself
        base = base + (jstar.to(tl.uint32) << shift)
    gt = u > base
    eq = u == base
    need = kk - tl.sum(gt.to(tl.int32), axis=0)  # ties at the threshold fill the rest, lowest page first
    eq_rank = tl.cumsum(eq.to(tl.int32), axis=0)  # inclusive rank among the ties
    sel = (gt | (eq & (eq_rank <= need))) & (u > 0x007FFFFF)  # -inf (unselectable) and padding never returned
    pos = tl.cumsum(sel.to(tl.int32), axis=0) - 1  # output slot of each selected page: ascending ids
    tl.store(out_ptr + r * K + pos, idx.to(tl.int64), mask=sel & active)
    cnt = tl.sum(sel.to(tl.int32), axis=0)
    jj = tl.arange(0, BLOCK_K)
    tl.store(out_ptr + r * K + jj, tl.full([BLOCK_K], -1, tl.int64), mask=(jj < K) & (jj >= cnt) & ((jj * 0 + tl.load(active_ptr + r % h).to(tl.int32)) != 0))


def select_pages_triton(scores: torch.Tensor, k: int, *, num_pages: torch.Tensor | None = None,
                        active: torch.Tensor | None = None, out: torch.Tensor | None = None,
                        num_warps: int | None = None, radix_bits: int | None = None) -> torch.Tensor:
    """The Triton kernel itself (tests call it directly; :func:`select_pages` dispatches).

    ``num_warps`` / ``radix_bits`` (benchmarks sweep them).  Defaults, from the H200 sweep at 625 pages
    (``docs/benchmarks/rerank.json``): 2 radix bits (16 passes, 79 registers: ~6 programs per SM, where
    4 bits needs 125-255 registers and runs 2 per SM -- 14.8 us vs 9.6 us for 320 rows); 8 warps while
    the rows fit in one round on the SMs (lowest latency: 6.9 us), 4 warps beyond (more resident
    programs); 16 warps past 4096 pages, and 1 radix bit once a thread holds more than 32 scores.
    """
    B, h, P = scores.shape
    if out is None:
        out = torch.empty((B, h, k), dtype=torch.long, device=scores.device)
    if B * h == 0 or k == 0:
        return out
    rows = scores.reshape(B * h, P)
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    if num_pages is None:
        num_pages = torch.full((1,), P, dtype=torch.long, device=scores.device)
    if active is None:
        active = torch.ones(h, dtype=torch.bool, device=scores.device)
    block_p = pow2(P, 16)
    rows_fit = B * h <= 2 * num_sms(scores.device)
    warps = num_warps or (16 if block_p > 4096 else (8 if rows_fit and block_p > 512 else 4))
    per_thread = max(1, block_p // (32 * warps))
    radix = radix_bits or (2 if per_thread <= 32 else 1)  # divides 32: candidates never overflow
    _select_pages_kernel[(B * h,)](
        rows, out, num_pages, active, k, h, rows.stride(0),
        BLOCK_P=block_p, BLOCK_K=pow2(k, 16), BITS=radix, PASSES=32 // radix, num_warps=warps,
    )
    return out


def select_pages(
    scores: torch.Tensor,  # [B, h, P] float32; -inf = not selectable
    k: int,
    *,
    num_pages: torch.Tensor | None = None,  # [1] int64 pages per row (None: P)
    active: torch.Tensor | None = None,  # [h] bool rows to select (with ``out``)
    out: torch.Tensor | None = None,  # [B, h, k] int64 written in place (active rows only)
    max_pages: int = reference.MAX_SELECT_PAGES,
) -> torch.Tensor:  # [B, h, k] int64, ascending page ids, -1 padded at the end
    """Same contract as :func:`reference.select_pages` (ties at the threshold: lowest page ids win).

    ``max_pages``: the longest score vector one program holds in registers (32 Ki fp32 over 16 warps = 64
    values per thread; 512k tokens at page size 16); longer vectors go to torch.topk (which synchronises:
    a cache that graphs its decode refuses such lengths up front).
    """
    if scores.shape[-1] > max_pages or scores.shape[-1] == 0:
        return reference.select_pages(scores, k, num_pages=num_pages, active=active, out=out)
    return select_pages_triton(scores, k, num_pages=num_pages, active=active, out=out)
