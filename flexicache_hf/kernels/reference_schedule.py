"""Plain PyTorch reference of the decode schedule's two kernels (the CPU path and the oracle of
:mod:`.schedule`): the step's plan, made once per step, and each layer's part of it.

Their state is one-element tensors (:class:`~flexicache_hf.layer.schedule.DecodeState` owns them and says what each
means), written once a step (a layer) by one launch each, where the same arithmetic as tensor code is a dozen tiny
kernels; every kernel of the step then reads them.
"""

from __future__ import annotations

import torch


def plan_step(length: torch.Tensor, step: torch.Tensor, current: torch.Tensor, pos: torch.Tensor,
              page: torch.Tensor, offset: torch.Tensor, num_pages: torch.Tensor, new_page: torch.Tensor,
              page_full: torch.Tensor, overflow: torch.Tensor, origin: torch.Tensor, page_size: int,
              capacity: int) -> None:
    """The next decode token: stored at ``pos`` = ``length``, capped at ``origin + capacity - 1`` (``capacity``
    -1: no cap), ``overflow`` set once ``length`` reaches that end; its ``page`` and ``offset`` there,
    ``num_pages`` (once it is appended), whether it starts (``new_page``) or fills (``page_full``) its page;
    ``current`` = this step's index, ``step`` and ``length`` advanced past it."""
    p = length  # read before it is written: `length.copy_(p + 1)` computes `p + 1` first
    if capacity >= 0:
        end = origin + capacity
        overflow.logical_or_(length >= end)
        p = torch.minimum(length, end - 1)
    pos.copy_(p)
    page.copy_(torch.div(p, page_size, rounding_mode="floor"))
    offset.copy_(p - page * page_size)
    num_pages.copy_(page + 1)
    new_page.copy_(offset == 0)
    page_full.copy_(offset == page_size - 1)
    current.copy_(step)
    length.copy_(p + 1)
    step.add_(1)


def begin_layer(due: torch.Tensor, anchor: torch.Tensor, late: torch.Tensor, since: torch.Tensor,
                current: torch.Tensor, phase: torch.Tensor, rerank_all: torch.Tensor, page: torch.Tensor,
                interval: int, overlap: bool) -> None:
    """A layer's part of step ``current``: its stable heads re-rank on the steps ``s > 0``, ``s ≡ phase (mod
    interval)``, and on step 0 if ``rerank_all``; ``anchor`` becomes ``page`` when they do.  ``overlap``: the steps
    ``s > 0`` on phase are ``late`` instead (``due`` only step 0's), and ``since`` keeps the anchor from before
    (``late`` and ``since`` untouched without ``overlap``)."""
    on_phase = (torch.remainder(current - phase, interval) == 0) & (current > 0)
    first = (current == 0) & rerank_all
    if not overlap:
        due.copy_(on_phase | first)
        anchor.copy_(torch.where(due, page, anchor))
        return
    since.copy_(anchor)
    due.copy_(first)
    late.copy_(on_phase)
    anchor.copy_(torch.where(due | late, page, anchor))
