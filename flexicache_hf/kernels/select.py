"""Triton twin of :func:`flexicache_hf.kernels.reference.select_pages`: top-k pages, ascending, one launch.

One program owns one (row, head) score vector and reads only its live part, the first ``num_pages`` entries (a
device scalar: a CUDA graph captured on rows as wide as the model's context replays at the cost of the pages that
exist, not of the reserved width).  It walks that part in blocks of ``BLOCK`` scores, so a row of any length
fits, and finds the k-th largest score by a radix select over the 32-bit order-preserving unsigned image of the
floats, 8 bits a pass, most significant first: a pass histograms the current digit of the candidates (keys whose
higher digits equal the prefix found so far) over the live blocks (``tl.histogram``), and a reverse prefix sum
over the 256 bins picks the digit holding the k-th largest.  The passes stop early once every candidate left in
the chosen bucket is selected.  A last walk over the live blocks writes the page ids ``> threshold``, plus the
first ``== threshold`` ties by page id, in ascending order (a prefix sum of the selection mask within a block, a
running count across blocks), then the ``-1`` padding.  No sort, no second kernel: torch's ``topk`` + ``sort`` +
padding is 4-6 launches.

Rows of heads not ``active`` (with ``out``) are left as they are: their programs read and write nothing.  With
``heads`` a program writes its row into head ``heads[j]`` of a wider ``out`` (each kind of head selected on its own
straight into a layer's selection, no gather and scatter of its rows around the launch); with ``keep_margin`` it
first multiplies, in place, the scores of the pages that row of ``out`` holds now (a barrier, then the walks).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import reference
from ._util import pow2


@triton.jit
def _keys(row_ptr, idx, P):
    """Order-preserving unsigned keys of the scores ``idx`` of a row of ``P`` live pages (page ``P - 1``, the
    newest, forced to +inf), and which of ``idx`` are live.  Flip the magnitude bits of negatives (sign-magnitude
    -> two's complement order), then the sign bit (-> unsigned order): -inf maps to 0x007FFFFF."""
    live = idx < P
    x = tl.load(row_ptr + idx, mask=live, other=float("-inf"))
    x = tl.where(idx == P - 1, float("inf"), x)  # the page holding the newest token is always attended
    bits = x.to(tl.int32, bitcast=True)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    return key.to(tl.uint32, bitcast=True) ^ 0x80000000, live


# Flags and head ids are read one scalar at a time: their addresses' alignment changes no code; the row stride (a
# prompt's page count, a decode step's capacity of 16k + 1 pages) is a multiple of 16 in the prompt only.  So a
# prompt's select and a step's are one variant, not two (each variant is a compile in a machine's first process).
@triton.jit(do_not_specialize=["K", "h", "H_out", "margin", "s_sr"],
            do_not_specialize_on_alignment=["active_ptr", "heads_ptr", "keep_ptr"])
def _select_pages_kernel(
    scores_ptr,  # [R, >= P] float32 rows of scores (R = B * h); -inf = not selectable
    out_ptr,  # [B, H_out, K] int64 selected pages, ascending, -1 padded (rows of inactive heads left as they are)
    num_pages_ptr,  # [1] int64 P: live pages per row (read on the device: graph replays see the current count)
    active_ptr,  # [h] bool: heads whose rows are selected now
    heads_ptr,  # [h] int64 (HEAD_MAP): the head of out each row goes to; else row j is head j (H_out = h)
    keep_ptr,  # [h] bool (KEEP_ROWS): the rows the margin applies to; else every row (with KEEP)
    margin,  # KEEP: the pages a row holds in out now score (1 + margin) times theirs
    K,
    h,
    H_out,
    s_sr,  # row stride of scores (its page stride is 1)
    HEAD_MAP: tl.constexpr,
    KEEP: tl.constexpr,
    KEEP_ROWS: tl.constexpr,
    BLOCK: tl.constexpr,  # scores per block of the walks over a row's live pages
    BLOCK_K: tl.constexpr,  # pow2(K): the padding's store
):
    r = tl.program_id(0).to(tl.int64)
    j = r % h
    if tl.load(active_ptr + j).to(tl.int32) != 0:
        P = tl.load(num_pages_ptr)
        row_ptr = scores_ptr + r * s_sr
        if HEAD_MAP:
            out_row = out_ptr + ((r // h) * H_out + tl.load(heads_ptr + j)) * K
        else:
            out_row = out_ptr + r * K
        if KEEP:
            held_k = K
            if KEEP_ROWS:
                held_k = tl.where(tl.load(keep_ptr + j).to(tl.int32) != 0, K, 0)
            kk = tl.arange(0, BLOCK_K)
            now = tl.load(out_row + kk, mask=kk < held_k, other=-1)  # the row's selection before this one
            held = (now >= 0) & (now < P)
            tl.store(row_ptr + now, tl.load(row_ptr + now, mask=held, other=0.0) * (1.0 + margin), mask=held)
            tl.debug_barrier()  # every thread's scaled scores in place before the walks read them
        offs = tl.arange(0, BLOCK)
        bins = tl.arange(0, 256)
        # The threshold t = the need-th largest key, one 8-bit digit a pass from the top.  Invariants: the keys
        # above the prefix (in the digits resolved) are all selected, `need` of the candidates (keys equal to the
        # prefix there) are, and there are at least `need` candidates.  A full row selects min(P, K).
        need = tl.minimum(P, K).to(tl.int32)
        prefix = (r * 0).to(tl.uint32)  # the digits resolved so far, the rest 0
        shift = (r * 0 + 32).to(tl.uint32)  # the lowest bit resolved
        more = need >= 0
        while more:
            shift -= 8
            hist = tl.zeros([256], dtype=tl.int32)
            for start in range(0, P, BLOCK):
                u, live = _keys(row_ptr, start + offs, P)
                cand = live & (((u ^ prefix) >> shift) < 256)  # the higher digits equal the prefix's
                hist += tl.histogram(((u >> shift) & 0xFF).to(tl.int32), 256, mask=cand)
            at_least = tl.cumsum(hist, 0, reverse=True)  # candidates whose digit is >= each bin
            digit = tl.sum((at_least >= need).to(tl.int32), 0) - 1  # the largest digit still reaching need
            need -= tl.sum(tl.where(bins > digit, hist, 0), 0)  # the candidates above it: all selected
            prefix |= digit.to(tl.uint32) << shift
            # Done at the last digit, or once every candidate of the chosen bucket is selected.
            more = (shift > 0) & (tl.sum(tl.where(bins == digit, hist, 0), 0) > need)
        top = prefix >> shift
        written = need * 0
        ties = need * 0
        for start in range(0, P, BLOCK):
            idx = start + offs
            u, live = _keys(row_ptr, idx, P)
            high = u >> shift
            eq = live & (high == top)
            rank = ties + tl.cumsum(eq.to(tl.int32), 0)  # inclusive rank among the ties: lowest page ids win
            sel = live & ((high > top) | (eq & (rank <= need))) & (u > 0x007FFFFF)  # -inf: ranked, never returned
            pos = written + tl.cumsum(sel.to(tl.int32), 0) - 1  # output slots in ascending page order
            tl.store(out_row + pos, idx.to(tl.int64), mask=sel)
            written += tl.sum(sel.to(tl.int32), 0)
            ties += tl.sum(eq.to(tl.int32), 0)
        jj = tl.arange(0, BLOCK_K)
        tl.store(out_row + jj, tl.full([BLOCK_K], -1, tl.int64), mask=(jj < K) & (jj >= written))


def launch_config(width: int) -> tuple[int, int]:
    """``(BLOCK, num_warps)`` for rows ``width`` scores wide: blocks of 1024 scores over 8 warps (4 a thread),
    narrower blocks for narrower rows (never wider than the row, at least one score a thread)."""
    block = min(pow2(width, 32), 1024)
    return block, max(1, min(8, block // 128))


def select_pages(
    scores: torch.Tensor,  # [B, h, P] float32; -inf = not selectable
    k: int,
    *,
    num_pages: torch.Tensor | None = None,  # [1] int64 live pages per row (None: P); only these are read
    active: torch.Tensor | None = None,  # [h] bool rows to select (with ``out``)
    out: torch.Tensor | None = None,  # [B, h, k] ([B, H, k] with heads) int64 contiguous, written in place
    heads: torch.Tensor | None = None,  # [h] int64 (with ``out``): the head of out each row is
    keep_margin: float = 0.0,  # (with ``out``) the pages a row holds in out now score (1 + m) times theirs
    keep: torch.Tensor | None = None,  # [h] bool: the rows keep_margin applies to (None: all)
    block: int | None = None,  # scores per block (a power of two); benchmarks and tests set it
    num_warps: int | None = None,
) -> torch.Tensor:  # [B, h, k] int64, ascending page ids, -1 padded at the end (``out`` when given)
    """Same contract as :func:`reference.select_pages` (ties at the threshold: lowest page ids win), for rows of
    any width; the work and memory traffic follow ``num_pages``, not ``P``."""
    B, h, P = scores.shape
    reference.check_select_out(out, heads, keep_margin)
    if out is None:
        out = torch.empty((B, h, k), dtype=torch.long, device=scores.device)
    elif not out.is_contiguous():
        raise ValueError("select_pages needs a contiguous out")
    if B * h == 0 or k == 0:
        return out
    if active is None:
        active = torch.ones(h, dtype=torch.bool, device=scores.device)
    if P == 0:  # no pages: every active row is padding
        now = out if heads is None else out.index_select(1, heads)
        pad = torch.where(active.view(1, h, 1), -1, now)
        return out.copy_(pad) if heads is None else out.index_copy_(1, heads, pad)
    rows = scores.reshape(B * h, P)
    if keep_margin and (rows.stride(1) != 1 or rows.data_ptr() != scores.data_ptr()):
        # the margin scales the caller's scores in place: a copy of them would lose that
        raise ValueError("select_pages with keep_margin needs scores whose rows are contiguous")
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    if num_pages is None:
        num_pages = torch.full((1,), P, dtype=torch.long, device=scores.device)
    default_block, default_warps = launch_config(P)
    _select_pages_kernel[(B * h,)](
        rows, out, num_pages, active, active if heads is None else heads, active if keep is None else keep,
        float(keep_margin), k, h, out.shape[1], rows.stride(0),
        HEAD_MAP=heads is not None, KEEP=bool(keep_margin), KEEP_ROWS=keep is not None,
        BLOCK=block or default_block, BLOCK_K=pow2(k, 16), num_warps=num_warps or default_warps,
    )
    return out
