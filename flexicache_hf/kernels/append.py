"""Triton twin of :func:`flexicache_hf.kernels.reference.append_token`: a decode token into the pool and the
MinMax cache, in one launch.

One program per (row, KV head): it copies the token's key and value into their physical row of the page pool
(``rows``, worked out by the cache: the full region for resident heads, the newest slot for offloaded ones)
and folds the key into that head's MinMax entry of logical page ``page`` (the reference: ~8 launches).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._util import pow2


@triton.jit
def _append_token_kernel(
    k_pool_ptr, v_pool_ptr,  # [num_physical * page_size, D] (the pools' rows, contiguous)
    kmin_ptr, kmax_ptr,  # [B, H, P_cap, D] with strides (kmax shares kmin's: checked on the host)
    key_ptr, value_ptr,  # [B, H, D] with strides
    rows_ptr,  # [B * H] int64 physical row of each (row, head)
    page_ptr,  # [1] int64 logical page of the token
    H,
    s_kb, s_kh, s_vb, s_vh,
    s_mb, s_mh, s_mp, s_md,  # strides of kmin / kmax (the cache's: a [B, H, P_cap, D] view of page-major storage)
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    b = i // H
    h = i % H
    d = tl.arange(0, BLOCK_D)
    ok = d < D
    k = tl.load(key_ptr + b * s_kb + h * s_kh + d, mask=ok)
    v = tl.load(value_ptr + b * s_vb + h * s_vh + d, mask=ok)
    row = tl.load(rows_ptr + i)
    tl.store(k_pool_ptr + row * D + d, k.to(k_pool_ptr.dtype.element_ty), mask=ok)
    tl.store(v_pool_ptr + row * D + d, v.to(v_pool_ptr.dtype.element_ty), mask=ok)
    page = tl.load(page_ptr)
    m_off = b * s_mb + h * s_mh + page * s_mp + d * s_md
    lo = tl.load(kmin_ptr + m_off, mask=ok, other=0.0)
    hi = tl.load(kmax_ptr + m_off, mask=ok, other=0.0)
    # min / max in fp32 (exact for every storage dtype; the interpreter's bf16 arithmetic is not)
    kk = k.to(lo.dtype).to(tl.float32)
    tl.store(kmin_ptr + m_off, tl.minimum(lo.to(tl.float32), kk).to(lo.dtype), mask=ok)
    tl.store(kmax_ptr + m_off, tl.maximum(hi.to(tl.float32), kk).to(hi.dtype), mask=ok)


def append_token(
    k_pool: torch.Tensor,  # [num_physical, page_size, D]
    v_pool: torch.Tensor,
    kmin: torch.Tensor,  # [B, H, P_cap, D] (any strides; kmax's the same)
    kmax: torch.Tensor,
    key: torch.Tensor,  # [B, H, D]
    value: torch.Tensor,
    rows: torch.Tensor,  # [B, H] int64 physical row (page * page_size + offset) of each (row, head)
    page: torch.Tensor,  # [1] int64 logical page of the token
) -> None:
    """Same contract as :func:`reference.append_token` (in place)."""
    B, H, D = key.shape
    for t in (k_pool, v_pool, rows):
        if not t.is_contiguous():
            raise ValueError("append_token needs contiguous pools and rows")
    if kmin.stride() != kmax.stride():
        raise ValueError("append_token needs kmin and kmax laid out alike")
    if key.stride(-1) != 1 or value.stride(-1) != 1:
        key, value = key.contiguous(), value.contiguous()
    _append_token_kernel[(B * H,)](
        k_pool, v_pool, kmin, kmax, key, value, rows, page, H,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1), *kmin.stride(),
        D=D, BLOCK_D=pow2(D), num_warps=1,
    )
