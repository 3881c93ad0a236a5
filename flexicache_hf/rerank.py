"""Stability-aware re-ranking of one layer: who is scored this step, their top-K sets, what is attended.

Unstable heads re-rank every decode step.  Stable heads re-rank on decode steps ``0, R, 2R, ...`` and in
between attend their last top-K set plus every page created since (the newest pages are always attended).
A layer whose heads are all stable skips scoring entirely on the other steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .kernels import KernelOps


@dataclass(frozen=True)
class RerankEvent:
    """What one re-rank selected; given to a :class:`SelectionObserver` (e.g. the stability profiler)."""

    layer_idx: int
    step: int  # decode step of this layer, from 0
    heads: torch.Tensor  # [h] int64 KV heads re-ranked this step
    pages: torch.Tensor  # [B, h, K] int64 selected logical pages (ascending, -1 padded)
    scores: torch.Tensor  # [B, h, num_pages] float32 min/max upper bounds
    num_pages: int  # N_t: candidate pages at this step
    query: torch.Tensor  # [B, Hq, D] the decode query that scored them


class SelectionObserver:
    """Receives every re-rank of a :class:`~flexicache_hf.FlexiCache` (override :meth:`on_rerank`)."""

    def on_rerank(self, event: RerankEvent) -> None:  # pragma: no cover - interface
        raise NotImplementedError


class Reranker:
    """Schedule and selection state of one layer."""

    def __init__(self, batch: int, num_kv_heads: int, unstable: tuple[int, ...], budget_pages: int,
                 rerank_interval: int, max_recent: int, device: torch.device, sink_pages: int = 0,
                 recent_pages: int = 0):
        self.budget_pages, self.interval, self.max_recent = budget_pages, rerank_interval, max_recent
        self.sink_pages, self.recent_pages = sink_pages, recent_pages
        stable = tuple(h for h in range(num_kv_heads) if h not in set(unstable))
        self.unstable = torch.tensor(unstable, dtype=torch.long, device=device)
        self.unstable_host = torch.tensor(unstable, dtype=torch.long)  # for host-side counters (no sync)
        self.all_heads = torch.arange(num_kv_heads, device=device)
        self.is_stable = torch.ones(num_kv_heads, dtype=torch.bool, device=device)
        self.is_stable[self.unstable] = False
        self.num_stable = len(stable)
        # Selected logical pages per head (ascending, -1 padded); rows of stable heads change only when due.
        self.selected = torch.full((batch, num_kv_heads, budget_pages), -1, dtype=torch.long, device=device)
        self.anchor = 0  # newest page when stable heads last re-ranked
        self.step = 0  # decode steps taken by this layer
        self.reranks = torch.zeros(num_kv_heads, dtype=torch.long)  # per-head re-rank count (host ints)

    def restart(self) -> None:
        """A prompt chunk just added pages that no head has scored (a first prompt or a multi-turn follow-up,
        any number of pages): the next decode step is step 0 again, which re-ranks every head."""
        self.step = 0

    def stable_due(self, step: int) -> bool:
        return self.num_stable > 0 and step % self.interval == 0

    def due_heads(self, step: int) -> torch.Tensor | None:
        """KV heads to score at decode ``step``: every head on stable steps, else the unstable ones."""
        if self.stable_due(step):
            return self.all_heads
        return self.unstable if self.unstable.numel() else None

    def rerank(self, ops: KernelOps, query: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor,
               heads: torch.Tensor, num_pages: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Score ``heads`` with the MinMax cache and store their top-K; returns (pages, scores)."""
        scores = ops.page_scores(query, kmin, kmax, heads, num_pages)
        if self.sink_pages or self.recent_pages:  # forced pages outrank every bound (empty pages stay -inf)
            forced = scores[:, :, : self.sink_pages]
            forced.masked_fill_(forced > float("-inf"), float("inf"))
            if self.recent_pages:
                forced = scores[:, :, max(0, num_pages - 1 - self.recent_pages):]
                forced.masked_fill_(forced > float("-inf"), float("inf"))
        pages = ops.select_pages(scores, self.budget_pages)
        self.selected[:, heads] = pages
        if heads.numel() == self.reranks.numel():
            self.reranks += 1
        else:
            self.reranks[self.unstable_host] += 1
        return pages, scores

    def attend_list(self, num_pages: int, stable_rerank: bool) -> torch.Tensor:
        """``[B, H, K + max_recent]`` logical pages each head attends to this step (-1 padded).

        Heads re-ranked this step attend their fresh top-K (which holds the newest page).  Stable heads
        between re-ranks attend their previous top-K plus the pages created after it.
        """
        sel = self.selected
        B, H, _ = sel.shape
        extra = sel.new_full((B, H, self.max_recent), -1)
        newest = num_pages - 1
        if not stable_rerank and self.num_stable and newest > self.anchor:
            recent = torch.arange(self.anchor + 1, newest + 1, device=sel.device)
            n = recent.numel()
            if n > self.max_recent:  # cannot happen: decode adds one interval of pages, a prompt chunk restarts
                raise RuntimeError(f"{n} pages since the last re-rank exceed the {self.max_recent} reserved")
            extra[:, :, :n] = torch.where(self.is_stable[None, :, None], recent, -1)
        return torch.cat([sel, extra], dim=-1)

    def select_rows(self, index: torch.Tensor) -> None:
        self.selected = self.selected[index]
