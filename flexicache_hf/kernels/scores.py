"""Triton twin of :func:`flexicache_hf.kernels.reference.page_scores`: Quest's page bound, GQA max in-kernel.

Per page ``p`` and query head ``g`` the bound is ``sum_i max(q_i * kmin_i, q_i * kmax_i)``.  Since
``kmin <= kmax`` on every non-empty page, ``max(q*lo, q*hi) == max(q, 0) * hi + min(q, 0) * lo`` exactly (one
of the two products is ``q * x`` and the other ``±0``), which turns the bound into two multiply-adds per
channel with no select.  One program loads a ``[BLOCK_P, D]`` tile of kmin and kmax once and evaluates every
query head of the KV head's group against it, keeping the maximum: the MinMax cache is read exactly once per
scored head, which is the whole cost of this memory-bound step.  Only the blocks of pages before ``num_pages`` (a
device scalar) of an active head are visited: a row reserved for the whole context, mostly blocks past it, and the
row of a head not scored now are left unwritten (the live part, :mod:`.reference`); the grid is capped
(:func:`row_programs`) and each program strides over its row's live blocks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import reference
from ._util import num_sms, pow2, strided_grid
from .mass import group_mass


# Programs a row of a launch starts, at most, unless fewer rows than fill the GPU twice (`_util.ROW_PROGRAMS` caps
# a launch over all its rows).  Measured on an H100 at the README call's layer (8 and 16 rows x 5 stable heads, rows
# reserved for 128k tokens, 2,048 live pages, D 128; NOTES, run 29): 32-page tiles and 4 warps, 16 programs a row:
# 28 / 48 us with the heads active (the 64-page, 8-warp tiles and the 4,096-program grid before: 52 / 89 us) and
# 2.9 / 3.5 us on a step that scores none (13.2 / 13.4 us: every program of the whole reserved width read ``active``
# and left).
PROGRAMS_PER_ROW = 16


def row_programs(blocks: int, rows: int, device: torch.device) -> int:
    """Programs along a row of ``blocks`` tiles: :data:`PROGRAMS_PER_ROW`, or enough to start two a multiprocessor
    over ``rows`` rows; never more than ``_util.strided_grid`` allows nor than the row has tiles."""
    return min(strided_grid(blocks, rows), max(PROGRAMS_PER_ROW, -(-2 * num_sms(device) // max(rows, 1))))


@triton.jit(do_not_specialize=["width", "n_sel", "near", "far"])
def _page_scores_kernel(
    q_ptr,  # [B, Hq, D] decode queries
    kmin_ptr,  # [B, H, P_cap, D]
    kmax_ptr,  # [B, H, P_cap, D] (same strides as kmin)
    heads_ptr,  # [h] int64 KV heads to score
    active_ptr,  # [h] bool: score this head now (False: nothing is read or written)
    num_pages_ptr,  # [1] int64 pages that exist (read on the device: graph replays see the current count)
    out_ptr,  # [B, h, width] float32, contiguous
    width,  # pages per output row (>= num_pages; unwritten past num_pages)
    n_sel,  # h
    near, far,  # SHRUNK: reference.narrowing's weights of the narrowed box's ends
    s_qb, s_qh, s_qd,
    s_mb, s_mh, s_mp, s_md,
    GROUP: tl.constexpr,  # query heads per KV head
    GROUP_MAX: tl.constexpr,  # True: store the group's maximum [B, h, width]; False: every head's [B, h, G, width]
    SHRUNK: tl.constexpr,  # FlexiCacheConfig.bound_shrink < 1: score the narrowed box (reference.narrowed)
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    bj = tl.program_id(1).to(tl.int64)
    b = bj // n_sel
    j = bj % n_sel
    on = tl.load(active_ptr + j).to(tl.int32) != 0
    # The live pages of an active head (none of a head not scored now: a stable head between its re-ranks, in a
    # compiled step that launches every head; its count is not even read).
    live = tl.minimum(tl.load(num_pages_ptr, mask=on, other=0), width)
    # A capped grid: program t takes blocks t, t + n, ... of the row's live pages.
    for pid_p in range(tl.program_id(0), tl.cdiv(live, BLOCK_P), tl.num_programs(0)):
        p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)  # [BLOCK_P] logical pages
        _score_tile(q_ptr, kmin_ptr, kmax_ptr, heads_ptr, num_pages_ptr, out_ptr, p, b, j, bj, width, near, far,
                    s_qb, s_qh, s_qd, s_mb, s_mh, s_mp, s_md, GROUP, GROUP_MAX, SHRUNK, D, BLOCK_D, BLOCK_P)


@triton.jit
def _score_tile(q_ptr, kmin_ptr, kmax_ptr, heads_ptr, num_pages_ptr, out_ptr, p, b, j, bj, width, near, far,
                s_qb, s_qh, s_qd, s_mb, s_mh, s_mp, s_md,
                GROUP: tl.constexpr, GROUP_MAX: tl.constexpr, SHRUNK: tl.constexpr, D: tl.constexpr,
                BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr):
    """One program's tile of pages ``p`` of (row ``b``, scored head ``j``): the bound of every query head of the
    group, combined or stored per head."""
    h = tl.load(heads_ptr + j)
    num_pages = tl.load(num_pages_ptr)
    d = tl.arange(0, BLOCK_D)
    p_ok = p < num_pages
    d_ok = d < D
    base = b * s_mb + h * s_mh
    off = base + p.to(tl.int64)[:, None] * s_mp + d[None, :] * s_md
    m2 = p_ok[:, None] & d_ok[None, :]
    lo = tl.load(kmin_ptr + off, mask=m2, other=0.0).to(tl.float32)  # [BLOCK_P, BLOCK_D]
    hi = tl.load(kmax_ptr + off, mask=m2, other=0.0).to(tl.float32)
    # The reference's emptiness test: channel 0 of kmax still -inf (no valid token folded in yet).
    hi0 = tl.load(kmax_ptr + base + p.to(tl.int64) * s_mp, mask=p_ok, other=float("-inf")).to(tl.float32)
    empty = hi0 == float("-inf")
    # Empty pages hold ±inf, whose products with 0 are NaN: zero them (their score is overwritten anyway).
    lo = tl.where(empty[:, None], 0.0, lo)
    hi = tl.where(empty[:, None], 0.0, hi)
    if SHRUNK:
        lo_n = near * lo + far * hi
        hi = near * hi + far * lo
        lo = lo_n
    best = tl.full([BLOCK_P], float("-inf"), tl.float32)
    for g in tl.static_range(GROUP):
        q = tl.load(q_ptr + b * s_qb + (h * GROUP + g) * s_qh + d * s_qd, mask=d_ok, other=0.0).to(tl.float32)
        qp = tl.maximum(q, 0.0)
        qn = tl.minimum(q, 0.0)
        s = tl.sum(qp[None, :] * hi + qn[None, :] * lo, axis=1)  # [BLOCK_P] bound of query head g
        if GROUP_MAX:
            best = tl.maximum(best, s)  # GQA: the group keeps its strongest head's bound
        else:
            s = tl.where(p_ok & ~empty, s, float("-inf"))
            tl.store(out_ptr + (bj * GROUP + g) * width + p, s, mask=p < width)
    if GROUP_MAX:
        best = tl.where(p_ok & ~empty, best, float("-inf"))
        tl.store(out_ptr + bj * width + p, best, mask=p < width)


def page_scores(
    query: torch.Tensor,  # [B, Hq, D] the decode step's queries
    kmin: torch.Tensor,  # [B, H, P_cap, D]
    kmax: torch.Tensor,  # [B, H, P_cap, D]
    heads: torch.Tensor,  # [h] int64 KV heads to score
    num_pages: int | torch.Tensor,  # an int, or a [1] int64 device tensor (then the output spans P_cap)
    active: torch.Tensor | None = None,  # [h] bool: heads scored now (None: all)
    combine: str = "max",  # config.GROUP_SCORES
    scale: float | None = None,  # "mass": the attention's softmax scale (None: D ** -0.5)
    shrink: float = 1.0,  # FlexiCacheConfig.bound_shrink
    *,
    block_p: int | None = None,  # pages per program (benchmarks sweep it); None = 64 for D <= 64, else 32
    num_warps: int | None = None,  # None = 4
    programs: int | None = None,  # programs per row at most (benchmarks sweep it); None = row_programs's
) -> torch.Tensor:  # [B, h, num_pages or P_cap] float32
    """Same contract as :func:`reference.page_scores` on the live pages of the active heads (the rest of a row
    as wide as the capacity is left unwritten); ``combine="mass"`` stores every query head's bound and
    combines them with :func:`.mass.group_mass` (the Triton twin of the reference's ``group_mass``: one more
    launch, which reads only the pages that exist of the active heads)."""
    reference.check_combine(combine)
    reference.check_shrink(shrink)
    B, Hq, D = query.shape
    H = kmin.shape[1]
    n_sel = heads.numel()
    width = kmin.shape[2] if isinstance(num_pages, torch.Tensor) else num_pages
    group_max = combine == "max"
    shape = (B, n_sel, width) if group_max else (B, n_sel, Hq // H, width)
    out = torch.empty(shape, dtype=torch.float32, device=query.device)
    if n_sel == 0 or width == 0 or B == 0:
        return out if group_max else out[:, :, 0]
    if not isinstance(num_pages, torch.Tensor):
        num_pages = torch.full((1,), num_pages, dtype=torch.long, device=query.device)
    if active is None:
        active = torch.ones(n_sel, dtype=torch.bool, device=query.device)
    if kmax.stride() != kmin.stride():
        # rare: give kmax kmin's layout so one set of strides addresses both
        kmax = torch.empty_strided(kmin.size(), kmin.stride(), dtype=kmax.dtype, device=kmax.device).copy_(kmax)
    heads = heads.to(device=query.device, dtype=torch.long)
    # 32 pages x D=128 a program (2 x 8 KiB of bf16 MinMax a tile, 4 warps): measured faster than 64 x 128 on 8 warps
    # at the README call's shape (PROGRAMS_PER_ROW's note); D <= 64 keeps 64-page tiles of the same bytes.
    block_p = block_p or (64 if D <= 64 else 32)
    blocks = triton.cdiv(width, block_p)
    per_row = row_programs(blocks, B * n_sel, query.device) if programs is None else min(programs, blocks)
    grid = (max(1, per_row), B * n_sel)
    _page_scores_kernel[grid](
        query, kmin, kmax, heads, active, num_pages, out, width, n_sel, *reference.narrowing(shrink),
        *query.stride(), *kmin.stride(),
        GROUP=Hq // H, GROUP_MAX=group_max, SHRUNK=shrink != 1.0, D=D, BLOCK_D=pow2(D), BLOCK_P=block_p,
        num_warps=num_warps or 4,
    )
    if group_max:
        return out
    return group_mass(out, D ** -0.5 if scale is None else scale, num_pages, active)
