"""Triton twin of :func:`flexicache_hf.kernels.reference.page_lse`: each page's exact log-sum-exp of the logits.

* grid ``(n, B * h)``, ``n`` capped (``_util.strided_grid``): program ``(t, b*h + j)`` covers the blocks of logical
  pages ``[u * PAGES_PER_BLOCK, (u + 1) * PAGES_PER_BLOCK)``, ``u = t, t + n, ...``, of row ``b``, KV head
  ``heads[j]``.  It gathers their keys through ``page_table`` into one ``[BLOCK_N, BLOCK_D]`` tile (token row ->
  (page slot, offset)) and scores it against **all** query heads of the group at once: the group's queries are the
  M dimension of ``tl.dot`` (padded to ``G_PAD >= 16``), as in :mod:`.sparse_decode`.
* The ``[G_PAD, BLOCK_N]`` logits (``-inf`` on invalid tokens) are viewed as ``[G_PAD, PAGES_PER_BLOCK,
  PAGE_SIZE]`` and reduced over the last axis (``max + log(sum(exp(x - max)))``); a page with no valid token
  gives ``-inf``, not NaN.  Every page is a whole tile row, so no cross-program combine is needed.
* Pages ``>= num_pages`` (read on the device: graph replays see the current count) are never dereferenced,
  and tokens outside ``[valid_lo[b], seq_len)`` are masked, not loaded; their outputs are ``-inf``.  Blocks
  wholly past ``num_pages`` (spare or reserved capacity) are not visited: the row past the live blocks is left
  unwritten (the live part, :mod:`.reference`).
* With ``candidates [B, h, C]`` (logical pages, -1 padded) the blocks cover ``C`` instead of the row: a block
  ``u`` scores candidates ``[u * PAGES_PER_BLOCK, ...)`` of its row and head, gathered through the table
  as the contiguous pages are, and stores each page's log-sum-exp at that page's column; every other column is
  ``-inf`` (one fill first).  Only the candidates' keys are read: the cost follows ``C``, not the context.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._util import dot_upcast, pow2, strided_grid


# The head ids and the candidates' address (the head ids again without candidates) at any byte: one variant for
# every layer (their loads gain nothing from it; each variant is a compile in a machine's first process).
@triton.jit(do_not_specialize=["width", "n_sel", "n_cand"], do_not_specialize_on_alignment=["heads_ptr", "cand_ptr"])
def _page_lse_kernel(
    q_ptr,  # [B, Hq, D]
    k_ptr,  # [N, page_size, D] key pool
    table_ptr,  # [B, H, P_cap] int32 physical page of each logical page
    heads_ptr,  # [h] int64 KV heads to score
    num_pages_ptr,  # [1] int64 pages that exist (read on the device)
    valid_lo_ptr,  # [B] int64
    seq_len_ptr,  # [1] int64 tokens stored (read on the device)
    out_ptr,  # [B, h, GROUP, width] float32, contiguous
    scale,
    width,  # P_cap
    n_sel,  # h
    s_qb, s_qh, s_qd,
    s_kn, s_kt, s_kd,
    s_tb, s_th, s_tp,
    cand_ptr,  # [B, h, n_cand] int64 candidate pages (-1: none), contiguous; unused unless CANDIDATES
    n_cand,
    GROUP: tl.constexpr,
    G_PAD: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,  # tokens per program = PAGES_PER_BLOCK * PAGE_SIZE
    UPCAST: tl.constexpr,  # dot in fp32 with IEEE products (fp32 pools; bf16 under the interpreter)
    CANDIDATES: tl.constexpr,  # score the listed pages only (the rest of the output was filled with -inf)
):
    PAGES_PER_BLOCK: tl.constexpr = BLOCK_N // PAGE_SIZE
    bj = tl.program_id(1).to(tl.int64)
    num_pages = tl.load(num_pages_ptr)
    g = tl.arange(0, G_PAD)
    # A capped grid: program t takes blocks t, t + n, ... of its list (the candidates) or of its row's live pages.
    n_blocks = tl.cdiv(n_cand if CANDIDATES else tl.minimum(num_pages, width), PAGES_PER_BLOCK)
    for t in range(tl.program_id(0), n_blocks, tl.num_programs(0)):
        slot = t * PAGES_PER_BLOCK + tl.arange(0, PAGES_PER_BLOCK)
        if CANDIDATES:
            p = tl.load(cand_ptr + bj * n_cand + slot, mask=slot < n_cand, other=-1)  # [PAGES_PER_BLOCK] logical
            p = tl.where(p < num_pages, p, -1)
            out_mask = (g < GROUP)[:, None] & (p >= 0)[None, :]
            out_off = (bj * GROUP + g)[:, None] * width + tl.where(p >= 0, p, 0)[None, :]
            lse = _block_lse(q_ptr, k_ptr, table_ptr, heads_ptr, valid_lo_ptr, seq_len_ptr, scale, num_pages, bj,
                             n_sel, p, s_qb, s_qh, s_qd, s_kn, s_kt, s_kd, s_tb, s_th, s_tp,
                             GROUP, G_PAD, D, BLOCK_D, PAGE_SIZE, BLOCK_N, UPCAST)
            tl.store(out_ptr + out_off, lse, mask=out_mask)
        else:
            p = slot
            out_mask = (g < GROUP)[:, None] & (p < width)[None, :]
            out_off = (bj * GROUP + g)[:, None] * width + p[None, :]
            lse = _block_lse(q_ptr, k_ptr, table_ptr, heads_ptr, valid_lo_ptr, seq_len_ptr, scale, num_pages,
                             bj, n_sel, p, s_qb, s_qh, s_qd, s_kn, s_kt, s_kd, s_tb, s_th, s_tp,
                             GROUP, G_PAD, D, BLOCK_D, PAGE_SIZE, BLOCK_N, UPCAST)
            tl.store(out_ptr + out_off, lse, mask=out_mask)


@triton.jit
def _block_lse(q_ptr, k_ptr, table_ptr, heads_ptr, valid_lo_ptr, seq_len_ptr, scale, num_pages, bj, n_sel, pages,
               s_qb, s_qh, s_qd, s_kn, s_kt, s_kd, s_tb, s_th, s_tp,
               GROUP: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
               PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr):
    """``[G_PAD, PAGES_PER_BLOCK]`` log-sum-exp of this program's logical ``pages`` ``[PAGES_PER_BLOCK]`` (-1 or
    past ``num_pages``: none, ``-inf``) of row ``bj // n_sel``, scored head ``bj % n_sel``."""
    PAGES_PER_BLOCK: tl.constexpr = BLOCK_N // PAGE_SIZE
    b = bj // n_sel
    j = bj % n_sel
    h = tl.load(heads_ptr + j)
    seq_len = tl.load(seq_len_ptr)
    lo_valid = tl.load(valid_lo_ptr + b)
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, BLOCK_D)
    g_ok = g < GROUP
    d_ok = d < D
    q = tl.load(q_ptr + b * s_qb + (h * GROUP + g)[:, None] * s_qh + d[None, :] * s_qd,
                mask=g_ok[:, None] & d_ok[None, :], other=0.0)  # [G_PAD, BLOCK_D]
    tok = tl.arange(0, BLOCK_N)
    # [BLOCK_N] logical page of each token row: token row r belongs to the program's (r // PAGE_SIZE)-th page
    page = tl.reshape(tl.broadcast_to(pages[:, None], [PAGES_PER_BLOCK, PAGE_SIZE]), [BLOCK_N])
    off = tok % PAGE_SIZE
    listed = (page >= 0) & (page < num_pages)
    phys = tl.load(table_ptr + b * s_tb + h * s_th + page * s_tp, mask=listed, other=0).to(tl.int64)
    pos = page * PAGE_SIZE + off
    ok = listed & (pos >= lo_valid) & (pos < seq_len)  # [BLOCK_N] tokens that exist and count
    k = tl.load(k_ptr + phys[:, None] * s_kn + off[:, None] * s_kt + d[None, :] * s_kd,
                mask=ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_N, BLOCK_D]
    if UPCAST:
        s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s = tl.where(ok[None, :], s * scale, float("-inf"))  # [G_PAD, BLOCK_N] natural-log logits
    s = tl.reshape(s, [G_PAD, PAGES_PER_BLOCK, PAGE_SIZE])
    m = tl.max(s, axis=2)  # [G_PAD, PAGES_PER_BLOCK]
    m_use = tl.where(m == float("-inf"), 0.0, m)  # a page without a valid token: avoid -inf - -inf
    total = tl.sum(tl.exp(s - m_use[:, :, None]), axis=2)
    return tl.where(total == 0.0, float("-inf"), m_use + tl.log(tl.where(total == 0.0, 1.0, total)))


def _tile(page_size: int, rows: int) -> int:
    """Tokens a program scores: 128 for launches of >= 16 (row, head) pairs (measured: H100, 16 pairs of 2,048
    8-token pages, 31.3 against 35.4 us a call with 64, ``docs/benchmarks/kernels/run31a-decode-tiles-h100.json``),
    else 64, so fewer pairs keep more programs (the grid covers reserved capacity, so the live pages are unknown
    here); never under one page, and >= 16 tokens (tl.dot's smallest N)."""
    return max(page_size, 128 if rows >= 16 else 64)


def page_lse(
    query: torch.Tensor,  # [B, Hq, D] the decode step's queries
    k_pool: torch.Tensor,  # [N, page_size, D] key pool
    page_table: torch.Tensor,  # [B, H, P_cap] int32 physical page of each logical page
    heads: torch.Tensor,  # [h] int64 KV heads to score
    num_pages: torch.Tensor,  # [1] int64 pages that exist (device tensor, never read on the host)
    valid_lo: torch.Tensor,  # [B] int64 first non-padding position per row
    seq_len: torch.Tensor,  # [1] int64 tokens stored (device tensor, never read on the host)
    scale: float,  # the attention's softmax scale
    candidates: torch.Tensor | None = None,  # [B, h, C] int64 logical pages to score (-1 padded); None: all
    *,
    block_n: int | None = None,  # tokens per program (a multiple of page_size); None: see _tile
    num_warps: int = 4,
) -> torch.Tensor:  # [B, h, G, P_cap] float32
    """Same contract as :func:`reference.page_lse` on the live pages (the row past them is left unwritten)."""
    B, Hq, D = query.shape
    H, width = page_table.shape[1], page_table.shape[2]
    ps = k_pool.shape[1]
    group = Hq // H
    n_sel = heads.numel()
    shape = (B, n_sel, group, width)
    if B == 0 or n_sel == 0 or width == 0:
        return torch.full(shape, float("-inf"), dtype=torch.float32, device=query.device)
    listed = candidates is not None
    if listed:  # the kernel writes the candidates' columns only
        out = torch.full(shape, float("-inf"), dtype=torch.float32, device=query.device)
        cand = candidates.to(device=query.device, dtype=torch.long).contiguous()
        n_cand = cand.shape[2]
        if n_cand == 0:
            return out
    else:
        out = torch.empty(shape, dtype=torch.float32, device=query.device)  # the kernel writes the live blocks
        cand, n_cand = heads, 0  # (an unused pointer)
    upcast = dot_upcast(k_pool.dtype)
    q = query if upcast or query.dtype == k_pool.dtype else query.to(k_pool.dtype)  # tl.dot: one operand dtype
    heads = heads.to(device=query.device, dtype=torch.long)
    bn = block_n or _tile(ps, B * n_sel)
    grid = (strided_grid(triton.cdiv(n_cand if listed else width, bn // ps), B * n_sel), B * n_sel)
    _page_lse_kernel[grid](
        q, k_pool, page_table, heads, num_pages, valid_lo, seq_len, out, scale, width, n_sel,
        *q.stride(), *k_pool.stride(), *page_table.stride(), cand, n_cand,
        GROUP=group, G_PAD=pow2(group, 16), D=D, BLOCK_D=pow2(D, 16), PAGE_SIZE=ps, BLOCK_N=bn,
        UPCAST=upcast, CANDIDATES=listed, num_warps=num_warps,
    )
    return out
