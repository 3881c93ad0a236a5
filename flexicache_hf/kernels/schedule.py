"""Triton twins of :func:`~flexicache_hf.kernels.reference_schedule.plan_step` and ``begin_layer``: the decode
schedule's scalars, one program each (a launch where the reference is ~10 one-element operations)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _plan_step_kernel(length, step, current, pos, page, offset, num_pages, new_page, page_full, overflow, origin,
                      capacity, PAGE_SIZE: tl.constexpr, CAPPED: tl.constexpr):
    n = tl.load(length)
    p = n
    if CAPPED:
        end = tl.load(origin) + capacity
        tl.store(overflow, tl.load(overflow) | (n >= end))
        p = tl.minimum(n, end - 1)
    pg = p // PAGE_SIZE  # p >= 0: floor division
    off = p - pg * PAGE_SIZE
    tl.store(pos, p)
    tl.store(page, pg)
    tl.store(offset, off)
    tl.store(num_pages, pg + 1)
    tl.store(new_page, off == 0)
    tl.store(page_full, off == PAGE_SIZE - 1)
    s = tl.load(step)
    tl.store(current, s)
    tl.store(length, p + 1)
    tl.store(step, s + 1)


def plan_step(length: torch.Tensor, step: torch.Tensor, current: torch.Tensor, pos: torch.Tensor,
              page: torch.Tensor, offset: torch.Tensor, num_pages: torch.Tensor, new_page: torch.Tensor,
              page_full: torch.Tensor, overflow: torch.Tensor, origin: torch.Tensor, page_size: int,
              capacity: int) -> None:
    """Same contract as :func:`reference_schedule.plan_step`."""
    _plan_step_kernel[(1,)](length, step, current, pos, page, offset, num_pages, new_page, page_full, overflow,
                            origin, max(capacity, 0), PAGE_SIZE=page_size, CAPPED=capacity >= 0, num_warps=1)


@triton.jit
def _begin_layer_kernel(due, anchor, late, since, current, phase, rerank_all, page, interval,
                        OVERLAP: tl.constexpr):
    cur = tl.load(current)
    on_phase = ((cur - tl.load(phase)) % interval == 0) & (cur > 0)  # zero remainder: the same in C's and Python's
    first = (cur == 0) & (tl.load(rerank_all) != 0)
    old = tl.load(anchor)
    if OVERLAP:
        tl.store(since, old)
        tl.store(due, first)
        tl.store(late, on_phase)
        tl.store(anchor, tl.where(first | on_phase, tl.load(page), old))
    else:
        now = on_phase | first
        tl.store(due, now)
        tl.store(anchor, tl.where(now, tl.load(page), old))


def begin_layer(due: torch.Tensor, anchor: torch.Tensor, late: torch.Tensor, since: torch.Tensor,
                current: torch.Tensor, phase: torch.Tensor, rerank_all: torch.Tensor, page: torch.Tensor,
                interval: int, overlap: bool) -> None:
    """Same contract as :func:`reference_schedule.begin_layer`."""
    _begin_layer_kernel[(1,)](due, anchor, late, since, current, phase, rerank_all, page, interval,
                              OVERLAP=bool(overlap), num_warps=1)
