"""Triton twin of :func:`flexicache_hf.kernels.reference.sparse_decode`: paged split-K decode attention.

Work decomposition (flash-decoding):

* grid ``(S, B * H)``: program ``(s, b*H + h)`` walks pages ``[s * PPS, (s + 1) * PPS)`` of the list
  ``pages[b, h]``, ``BLOCK_N`` tokens (``BLOCK_N / page_size`` pages) per iteration.  Each K/V tile is
  gathered through ``page_table`` once and used by **all** query heads of the KV head's group: the group's
  queries form the M dimension of ``tl.dot`` (padded to ``G_PAD >= 16``, the smallest tensor-core M; the
  padding costs only MMA slots, which are idle in this memory-bound kernel).
* Online softmax in the base-2 domain (``exp2``, scale pre-multiplied by ``log2 e``).  With ``S == 1`` the
  program normalises and writes the output directly; otherwise it writes its partial output and
  log-sum-exp to an fp32 workspace and ``_combine_kernel`` merges the ``S`` partials per query head.
* Tokens are masked, not loaded, when their list entry is ``-1``, their position is padding
  (``< valid_lo[b]``) or not yet written (``>= seq_len``): a masked load issues no memory traffic, and the
  null page 0 is never dereferenced.

``S`` is picked (:func:`plan_splits`) so that ``S * B * H`` programs give every multiprocessor about eight
(batch 1 x 8 heads with a 625-page list is split ~80 ways; batch 40 x 8 heads with a 65-page list 4 ways).
``S == 1`` vs ``S > 1`` is a run-time branch in the epilogue, so one compiled variant serves both.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._util import dot_upcast, num_sms, pow2

LOG2E = 1.4426950408889634


# Integers that change every step or per call (lengths, counts) are not specialised: otherwise Triton
# compiles a new variant whenever one of them turns 1 or a multiple of 16 (e.g. seq_len mid-generation).
@triton.jit(do_not_specialize=["H", "W", "pages_per_split", "num_splits"])
def _sparse_decode_kernel(
    q_ptr,  # [B, Hq, D]
    k_ptr,  # [N, page_size, D] key pool
    v_ptr,  # [N, page_size, D] value pool
    table_ptr,  # [B, H, P_cap] int32 physical page of each logical page
    pages_ptr,  # [B, H, W] int64 logical pages to attend, -1 = none
    valid_lo_ptr,  # [B] int64
    out_ptr,  # [B, Hq, D] query dtype (written when S == 1)
    part_o_ptr,  # [B * H, S, GROUP, D] float32 partial outputs (S > 1)
    part_lse_ptr,  # [B * H, S, GROUP] float32 partial log2-sum-exp (S > 1)
    seq_len_ptr,  # [1] int64 tokens stored (read on the device: graph replays see the current length)
    qk_scale,  # softmax scale * log2(e)
    H,
    W,
    pages_per_split,  # PPS, a multiple of PAGES_PER_BLOCK
    num_splits,  # S
    s_qb, s_qh, s_qd,
    s_kn, s_kt, s_kd,
    s_vn, s_vt, s_vd,
    s_tb, s_th, s_tp,
    s_pb, s_ph, s_pw,
    s_ob, s_oh, s_od,
    GROUP: tl.constexpr,
    G_PAD: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,  # tokens per iteration = PAGES_PER_BLOCK * PAGE_SIZE
    UPCAST: tl.constexpr,  # dot in fp32 with IEEE products (fp32 pools; bf16 under the interpreter)
    NUM_STAGES: tl.constexpr,
):
    split = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H
    h = bh % H
    PAGES_PER_BLOCK: tl.constexpr = BLOCK_N // PAGE_SIZE
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, BLOCK_D)
    g_ok = g < GROUP
    d_ok = d < D
    q = tl.load(q_ptr + b * s_qb + (h * GROUP + g)[:, None] * s_qh + d[None, :] * s_qd,
                mask=g_ok[:, None] & d_ok[None, :], other=0.0)  # [G_PAD, BLOCK_D]
    if UPCAST:
        q = q.to(tl.float32)
    lo_valid = tl.load(valid_lo_ptr + b)
    seq_len = tl.load(seq_len_ptr)
    tok = tl.arange(0, BLOCK_N)
    slot = tok // PAGE_SIZE  # which page of the block each token row belongs to
    off = tok % PAGE_SIZE  # its offset inside the page
    w_begin = split * pages_per_split
    w_end = tl.minimum(w_begin + pages_per_split, W)
    list_base = pages_ptr + b * s_pb + h * s_ph
    table_base = table_ptr + b * s_tb + h * s_th

    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, BLOCK_D], tl.float32)
    for w0 in tl.range(w_begin, w_end, PAGES_PER_BLOCK, num_stages=NUM_STAGES):
        w = w0 + slot  # [BLOCK_N] list position of each token row (repeats per page: L1 hits)
        page = tl.load(list_base + w * s_pw, mask=w < w_end, other=-1)
        listed = page >= 0
        phys = tl.load(table_base + page * s_tp, mask=listed, other=0).to(tl.int64)
        pos = page * PAGE_SIZE + off
        ok = listed & (pos >= lo_valid) & (pos < seq_len)  # [BLOCK_N] tokens that exist and count
        kv_mask = ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + phys[:, None] * s_kn + off[:, None] * s_kt + d[None, :] * s_kd,
                    mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        v = tl.load(v_ptr + phys[:, None] * s_vn + off[:, None] * s_vt + d[None, :] * s_vd,
                    mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where(ok[None, :], s * qk_scale, float("-inf"))  # [G_PAD, BLOCK_N] base-2 logits
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # no valid token yet: avoid inf - inf
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if UPCAST:
            pv = tl.dot(p, v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    l_use = tl.where(l_i == 0.0, 1.0, l_i)  # a row with no valid token yields 0 (the reference's nan_to_num)
    o = acc / l_use[:, None]
    if num_splits > 1:  # a run-time branch: one compiled variant serves both (the epilogue only)
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_use))
        row = bh * num_splits + split
        tl.store(part_o_ptr + (row * GROUP + g)[:, None] * D + d[None, :], o,
                 mask=g_ok[:, None] & d_ok[None, :])
        tl.store(part_lse_ptr + row * GROUP + g, lse, mask=g_ok)
    else:
        tl.store(out_ptr + b * s_ob + (h * GROUP + g)[:, None] * s_oh + d[None, :] * s_od,
                 o.to(out_ptr.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])


@triton.jit(do_not_specialize=["H", "num_splits"])
def _combine_kernel(
    part_o_ptr,  # [B * H, S, GROUP, D] float32
    part_lse_ptr,  # [B * H, S, GROUP] float32 (log2 domain)
    out_ptr,  # [B, Hq, D]
    H,
    num_splits,
    s_ob, s_oh, s_od,
    GROUP: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)  # one program per (b, h, g) = per query head
    g = pid % GROUP
    bh = pid // GROUP
    b = bh // H
    h = bh % H
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_ok = s < num_splits
    lse = tl.load(part_lse_ptr + (bh * num_splits + s) * GROUP + g, mask=s_ok, other=float("-inf"))
    m = tl.max(lse, axis=0)
    m_use = tl.where(m == float("-inf"), 0.0, m)
    wgt = tl.exp2(lse - m_use)  # [BLOCK_S]; empty splits weigh 0
    o = tl.load(part_o_ptr + ((bh * num_splits + s) * GROUP + g)[:, None] * D + d[None, :],
                mask=s_ok[:, None] & (d < D)[None, :], other=0.0)
    den = tl.sum(wgt, axis=0)
    res = tl.sum(o * wgt[:, None], axis=0) / tl.where(den == 0.0, 1.0, den)
    tl.store(out_ptr + b * s_ob + (h * GROUP + g) * s_oh + d * s_od, res.to(out_ptr.dtype.element_ty),
             mask=d < D)


def plan_splits(width: int, rows: int, sms: int, pages_per_block: int, programs_per_sm: int = 8) -> tuple[int, int]:
    """``(S, pages_per_split)`` for a list of ``width`` pages over ``rows = B * H`` (row, head) pairs.

    Aim for ``programs_per_sm`` programs per multiprocessor: ~4 are resident at once (~104 registers x 128
    threads, sm_90), so 8 gives two rounds of short programs and the hardware scheduler evens out the tail (a
    single round of 2-3 long programs per SM leaves SMs idle at the end).  Never fewer than two iterations
    (``2 * pages_per_block`` pages) per split: shorter splits spend more on the prologue, the partial write
    and the combine than they save.
    """
    want = max(1, -(-programs_per_sm * sms // max(rows, 1)))
    min_pages = 2 * pages_per_block
    most = max(1, -(-width // min_pages))
    splits = min(want, most)
    pps = -(-width // splits)
    pps = -(-pps // pages_per_block) * pages_per_block  # whole blocks per split
    return -(-width // pps), pps


def sparse_decode(
    query: torch.Tensor,  # [B, Hq, D]
    k_pool: torch.Tensor,  # [N, page_size, D]
    v_pool: torch.Tensor,  # [N, page_size, D]
    page_table: torch.Tensor,  # [B, H, P_cap] int32 physical page of each logical page
    pages: torch.Tensor,  # [B, H, W] int64 logical pages to attend (-1 = none); no duplicates
    valid_lo: torch.Tensor,  # [B] int64
    seq_len: int | torch.Tensor,  # tokens stored: an int or a [1] int64 device tensor
    scale: float,
    *,
    num_splits: int | None = None,  # tests / benchmarks force a split count; None = plan_splits
    block_n: int | None = None,  # tokens per iteration (a multiple of page_size); None: see below
    num_warps: int = 4,
    num_stages: int = 2,
) -> torch.Tensor:  # [B, Hq, D] in query dtype
    """Same contract as :func:`reference.sparse_decode`."""
    B, Hq, D = query.shape
    H, W = pages.shape[1], pages.shape[2]
    ps = k_pool.shape[1]
    group = Hq // H
    out = torch.empty_like(query)
    if B == 0 or Hq == 0:
        return out
    if W == 0:
        return out.zero_()
    q = query if query.dtype == k_pool.dtype else query.to(k_pool.dtype)  # tl.dot needs one operand dtype
    if not isinstance(seq_len, torch.Tensor):
        seq_len = torch.full((1,), seq_len, dtype=torch.long, device=query.device)
    sms = num_sms(query.device)
    # 128-token tiles when there is work for >= 16 pages per program at 4 programs per SM (measured: H200 at batch
    # 40 x 129 pages, 83% of HBM vs 77% with 64; H100 at batch 8 x 257 8-token pages, 33.2 vs 35.9 us a call,
    # docs/benchmarks/kernels/run31a-decode-tiles-h100.json); 64-token tiles otherwise, so small batches keep
    # enough splits (a split is >= 2 tiles) to spread over the SMs.
    bn = block_n or max(ps, 128 if B * H * W >= 4 * sms * 16 else 64)
    ppb = bn // ps
    if num_splits is None:
        splits, pps = plan_splits(W, B * H, sms, ppb)
    else:
        pps = -(-(-(-W // num_splits)) // ppb) * ppb
        splits = -(-W // pps)
    split = splits > 1
    if split:
        part_o = torch.empty((B * H, splits, group, D), dtype=torch.float32, device=query.device)
        part_lse = torch.empty((B * H, splits, group), dtype=torch.float32, device=query.device)
    else:
        part_o = part_lse = out.new_empty((1,), dtype=torch.float32)  # unused when S == 1
    _sparse_decode_kernel[(splits, B * H)](
        q, k_pool, v_pool, page_table, pages, valid_lo, out, part_o, part_lse,
        seq_len, scale * LOG2E, H, W, pps, splits,
        *q.stride(), *k_pool.stride(), *v_pool.stride(), *page_table.stride(), *pages.stride(),
        *out.stride(),
        GROUP=group, G_PAD=pow2(group, 16), D=D, BLOCK_D=pow2(D, 16), PAGE_SIZE=ps, BLOCK_N=bn,
        UPCAST=dot_upcast(k_pool.dtype), NUM_STAGES=num_stages, num_warps=num_warps,
    )
    if split:
        _combine_kernel[(B * Hq,)](
            part_o, part_lse, out, H, splits, *out.stride(),
            GROUP=group, D=D, BLOCK_D=pow2(D, 16), BLOCK_S=pow2(splits, 2), num_warps=4,
        )
    return out
