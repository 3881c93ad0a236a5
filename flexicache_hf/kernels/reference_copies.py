"""Plain PyTorch reference of the tier copies (the CPU path and the oracle of :mod:`.uva_copy`, :mod:`.behind` and
:mod:`.row_copy`): pages gathered and scattered between the device pool and the host tier, the same behind the
compute, and a prompt's token rows.  :mod:`.reference` re-exports them with the other kernels' references."""

from __future__ import annotations

import torch


def copy_pages(
    dst: torch.Tensor,  # [N_dst, page_size, D]
    dst_index: torch.Tensor,  # [M] int64 destination pages; -1 = skip
    src: torch.Tensor,  # [N_src, page_size, D] (may live on another device, e.g. pinned host memory)
    src_index: torch.Tensor,  # [M] int64 source pages; ignored where dst_index is -1
) -> None:
    """Page gather/scatter between tiers: ``dst[dst_index[i]] = src[src_index[i]]`` for listed i."""
    keep = dst_index >= 0
    d = dst_index[keep].to(dst.device)
    s = src_index[keep].to(src.device)
    dst[d] = src[s].to(dst.device, non_blocking=True)


def copy_kv_pages(dst_k: torch.Tensor, dst_v: torch.Tensor, dst_index: torch.Tensor, src_k: torch.Tensor,
                  src_v: torch.Tensor, src_index: torch.Tensor) -> None:
    """:func:`copy_pages` of the K pools and of the V pools at the same indices (the CUDA kernel does both in one
    launch)."""
    copy_pages(dst_k, dst_index, src_k, src_index)
    copy_pages(dst_v, dst_index, src_v, src_index)


def load_pages_behind(dst_k: torch.Tensor, dst_v: torch.Tensor, dst_index: torch.Tensor, src_k: torch.Tensor,
                      src_v: torch.Tensor, src_index: torch.Tensor) -> None:
    """:func:`copy_kv_pages` behind the compute that follows (CUDA: on the device's load stream, which
    :func:`join_loads` joins).  Here: at once."""
    copy_kv_pages(dst_k, dst_v, dst_index, src_k, src_v, src_index)


def join_loads(device: torch.device) -> None:
    """The compute waits for every :func:`load_pages_behind` on ``device`` (here: none is pending)."""


def copy_rows(
    dst: torch.Tensor,  # [B, H, P, n, D] (e.g. a span of the page-major host tier, pages.Span) or [B, H, T, D]
    src: torch.Tensor,  # the same shape (may live on another device)
) -> None:
    """Token rows between tiers: ``dst[...] = src`` (each (row, head, page) run of ``n * D`` elements contiguous on
    both sides; a ``[B, H, T, D]`` pair is one run per (row, head))."""
    dst.copy_(src)


def copy_block(
    dst: torch.Tensor,  # contiguous (e.g. whole pages of the page-major host tier, or their staging on the device)
    src: torch.Tensor,  # the same shape, contiguous (may live on another device)
) -> None:
    """A contiguous block between tiers: ``dst[...] = src``."""
    dst.copy_(src)
