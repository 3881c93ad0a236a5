"""Stability-aware re-ranking of one layer: who is scored this step, their top-K sets, what is attended.

Unstable heads re-rank every decode step.  Stable heads re-rank every R decode steps and in between attend their
last top-K set plus every page created since (the newest pages are always attended); the last query of a first
prompt chunk gives them their first top-K (:meth:`Reranker.seat_prompt`).  A layer whose heads are all stable
skips scoring entirely on the other steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .kernels import KernelOps, reference
from .pages import index_tensor

FAR = 1 << 40  # an offset past every page a cache can hold (attend_list)


@dataclass(frozen=True)
class RerankEvent:
    """What one re-rank selected; given to a :class:`SelectionObserver` (e.g. the stability profiler)."""

    layer_idx: int
    step: int  # decode step of this layer, from 0
    heads: torch.Tensor  # [h] int64 KV heads re-ranked this step
    pages: torch.Tensor  # [B, h, K] int64 selected logical pages (ascending, -1 padded)
    scores: torch.Tensor  # [B, h, num_pages] float32 the scores ranked by (min/max bounds, or the exact mass)
    num_pages: int  # N_t: candidate pages at this step
    query: torch.Tensor  # [B, Hq, D] the decode query that scored them


class SelectionObserver:
    """Receives every re-rank of a :class:`~flexicache_hf.FlexiCache` (override :meth:`on_rerank`)."""

    def on_rerank(self, event: RerankEvent) -> None:  # pragma: no cover - interface
        raise NotImplementedError


def force_pages(scores: torch.Tensor, num_pages, sink_pages: int, recent_pages: int,
                first_page: torch.Tensor | None = None) -> torch.Tensor:
    """``scores [B, ..., P]`` with the first ``sink_pages`` pages (from each row's ``first_page [B]``, its first page
    holding a token that is not padding; None: page 0) and the ``recent_pages`` pages before the newest of
    ``num_pages`` existing ones (an int or a device scalar) raised to +inf: forced pages outrank every bound; empty
    pages stay -inf."""
    if not (sink_pages or recent_pages):
        return scores
    p = torch.arange(scores.shape[-1], device=scores.device)
    if first_page is None:
        forced = p < sink_pages
    else:
        first = first_page.view(-1, *[1] * (scores.dim() - 1))
        forced = (p >= first) & (p < first + sink_pages)
    if recent_pages:
        forced = forced | ((p >= num_pages - 1 - recent_pages) & (p < num_pages))
    return torch.where(forced & (scores > float("-inf")), float("inf"), scores)


class Reranker:
    """Selection state of one layer: each head's current top-K pages, and the rule of what is scored / attended.

    The schedule (which step re-ranks stable heads, the anchor page of their last re-rank) is the cache's
    :class:`~flexicache_hf.layer.schedule.DecodeState`; everything here takes it as device scalars, so one call sequence
    serves eager steps and captured graphs alike.
    """

    def __init__(self, batch: int, num_kv_heads: int, unstable: tuple[int, ...], budget_pages: int,
                 max_recent: int, device: torch.device, sink_pages: int = 0, recent_pages: int = 0, *,
                 stable_scoring: tuple[str, float], unstable_scoring: tuple[str, float], pages: int | None = None,
                 exact_candidates: int = 0, keep_margin: float = 0.0):
        # K pages per head, and the pages a stable head gains between re-ranks; the tensors are as wide as the
        # pages that can exist (``pages``, the layer's capacity, see fit), not as the budget: a budget beyond the
        # context costs what a budget covering it costs.
        self.budget_pages, self.recent_limit = budget_pages, max_recent
        self.width, self.max_recent = (budget_pages, max_recent) if pages is None else (min(budget_pages, pages),
                                                                                         min(max_recent, pages))
        # (group_score, bound_shrink) per kind of head (FlexiCacheConfig.stable_scoring / unstable_scoring)
        self.stable_scoring, self.unstable_scoring = tuple(stable_scoring), tuple(unstable_scoring)
        self.sink_pages, self.recent_pages = sink_pages, recent_pages
        self.exact_candidates = exact_candidates  # pages an "exact" head scores exactly (0: all; config.py)
        self.keep_margin = keep_margin  # a stable head's selected pages score (1 + m) times theirs (config.py)
        self.unstable_host = tuple(unstable)
        self.num_heads, self.num_stable = num_kv_heads, num_kv_heads - len(unstable)
        self._stable_host = tuple(h for h in range(num_kv_heads) if h not in set(unstable))
        self._indices = self._index_block(device)
        # One scoring call for every head unless both kinds exist and score differently.
        self.split_scoring = (self.stable_scoring != self.unstable_scoring and 0 < len(unstable) < num_kv_heads)
        # [is_stable (H) | unstable_active (Hu): all true, they re-rank every step | is_unstable (H)]
        stable = [h not in set(unstable) for h in range(num_kv_heads)]
        self._flags = index_tensor(stable + [True] * len(unstable) + [not s for s in stable], device, torch.bool)
        # Selected logical pages per head (ascending, -1 padded); rows of stable heads change only when due.
        self.selected = torch.full((batch, num_kv_heads, self.width), -1, dtype=torch.long, device=device)
        self.reranks = torch.zeros(num_kv_heads, dtype=torch.long, device=device)  # per-head re-rank count
        # Each row's first page holding a token that is not padding: its sink pages start there (the layer sets it)
        self.first_page = torch.zeros(batch, dtype=torch.long, device=device)

    # The layer's constant head sets and the recent window's offsets live in two tensors (the int64 and the bool
    # ones), read through the views below.
    def _index_block(self, device: torch.device) -> torch.Tensor:
        """``[stable heads | unstable heads | every head | per head: 1 .. max_recent, or FAR for an unstable head]``
        (int64)."""
        recent = range(1, self.max_recent + 1)
        per_head = [o if h not in self.unstable_host else FAR for h in range(self.num_heads) for o in recent]
        return index_tensor([*self._stable_host, *sorted(self.unstable_host), *range(self.num_heads), *per_head],
                            device)

    @property
    def stable_heads(self) -> torch.Tensor:
        return self._indices[:self.num_stable]

    @property
    def unstable_heads(self) -> torch.Tensor:
        return self._indices[self.num_stable:self.num_heads]

    @property
    def all_heads(self) -> torch.Tensor:
        return self._indices[self.num_heads:2 * self.num_heads]

    @property
    def head_offsets(self) -> torch.Tensor:
        """``[H, max_recent]``: for a stable head the pages after its anchor it attends between re-ranks, 1 ..
        max_recent; ``FAR`` (past every page) for an unstable one, which attends its fresh top-K only."""
        return self._indices[2 * self.num_heads:].view(self.num_heads, self.max_recent)

    @property
    def is_stable(self) -> torch.Tensor:
        return self._flags[:self.num_heads]

    @property
    def unstable_active(self) -> torch.Tensor:
        """All true: the unstable heads re-rank every step (the select's ``active`` for them)."""
        return self._flags[self.num_heads:2 * self.num_heads - self.num_stable]

    @property
    def is_unstable(self) -> torch.Tensor:
        return self._flags[2 * self.num_heads - self.num_stable:]

    def buffers(self) -> list[torch.Tensor]:
        return [self._indices, self._flags, self.selected, self.reranks, self.first_page]

    def fit(self, pages: int) -> None:
        """Room for ``pages`` pages per head (the layer's grown capacity): the selection widens to
        ``min(K, pages)`` (new entries -1), the recent window to ``min(max_recent, pages)``.  Never narrows."""
        width, recent = min(self.budget_pages, pages), min(self.recent_limit, pages)
        if width > self.width:
            pad = self.selected.new_full((*self.selected.shape[:2], width - self.width), -1)
            self.selected, self.width = torch.cat([self.selected, pad], -1), width
        if recent > self.max_recent:
            self.max_recent = recent
            self._indices = self._index_block(self._indices.device)

    def clear(self) -> None:
        """No page selected, no re-rank counted (in place)."""
        self.selected.fill_(-1)
        self.reranks.zero_()
        self.first_page.zero_()

    def scored_heads(self, stable_due: bool) -> torch.Tensor:
        """Host-side: the KV heads a step with (or without) a stable re-rank scores (for the observer)."""
        if stable_due and self.num_stable:
            return self.all_heads
        return self.all_heads[list(self.unstable_host)]

    def rerank(self, ops: KernelOps, query: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor,
               num_pages: torch.Tensor, due: torch.Tensor, scale: float | None = None,
               keys: tuple | None = None, with_scores: bool = True) -> torch.Tensor | None:
        """Score the heads due now (unstable heads always; stable ones where ``due``) by their rule and
        store their top-K in ``selected``; returns the scores ``[B, H, P_cap]`` (the live part: the pages up to
        ``num_pages`` of the heads due; ``None`` without ``with_scores`` where each kind of head has its own
        rule); ``scale`` is the attention's softmax scale (``group_score="mass"``, ``"exact"``).  ``keys``: the
        layer's ``(k_pool, page_table, valid_lo, seq_len)``, which heads ranked ``"exact"`` score with."""
        active = self.is_unstable | due
        if not self.split_scoring:
            scores = self._scores(ops, query, kmin, kmax, self.all_heads, num_pages, active, scale,
                                  self.unstable_scoring if self.num_stable == 0 else self.stable_scoring, keys)
            margin = self.keep_margin if self.num_stable else 0.0  # the stable heads' hysteresis, in the select
            # Through the head map (here every head to itself) and the margin's rows only where both kinds exist:
            # a layer of one kind of head then launches the split select's kernel variant for that kind.
            keep = self.is_stable if margin and self.num_stable < self.num_heads else None
            ops.select_pages(scores, self.width, num_pages=num_pages, active=active, out=self.selected,
                             heads=self.all_heads, keep_margin=margin, keep=keep)
        else:  # each kind of head by its own scoring, selected on its own straight into its rows of `selected`
            # (stable heads are active where due, unstable ones always: no per-head indexing of `active`)
            parts = ((self.stable_heads, self.stable_scoring, None, due.expand(self.num_stable).contiguous(),
                      self.keep_margin), (self.unstable_heads, self.unstable_scoring, keys, self.unstable_active, 0.0))
            rows = []
            for heads, scoring, their_keys, their_active, margin in parts:
                rows.append(self._scores(ops, query, kmin, kmax, heads, num_pages, their_active, scale, scoring,
                                         their_keys))
                ops.select_pages(rows[-1], self.width, num_pages=num_pages, active=their_active, out=self.selected,
                                 heads=heads, keep_margin=margin)
            scores = None
            if with_scores:  # one [B, H, P_cap] row per head, for an observer and tests
                scores = rows[0].new_empty((rows[0].shape[0], self.is_stable.numel(), rows[0].shape[2]))
                scores.index_copy_(1, self.stable_heads, rows[0]).index_copy_(1, self.unstable_heads, rows[1])
        self.reranks.add_(active)
        return scores

    def seat_prompt(self, ops: KernelOps, query: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor,
                    num_pages: int, scale: float | None = None) -> torch.Tensor:
        """After a first prompt chunk: the stable heads' top-K for the prompt's last ``query [B, Hq, D]``, stored
        as their selection (their re-rank for step 0: the schedule's next one for them is R steps or their
        staggered phase later); returns it, ``[B, num_stable, K]``."""
        heads = self.stable_heads
        # Straight into their rows of the selection, as a decode step's select of the unstable heads (one kernel
        # variant for both)
        ops.select_pages(self._scores(ops, query, kmin, kmax, heads, num_pages, None, scale, self.stable_scoring),
                         self.width, out=self.selected, heads=heads)
        return self.selected.index_select(1, heads)

    def _scores(self, ops: KernelOps, query, kmin, kmax, heads, num_pages, active, scale,
                scoring: tuple[str, float], keys: tuple | None = None) -> torch.Tensor:
        """The page scores ``heads`` rank by: the bound combined and shrunk as ``scoring`` (group_score,
        bound_shrink) says, or their exact attention mass (``"exact"``, from ``keys``); forced pages +inf."""
        group_score, shrink = scoring
        if group_score == "exact":
            if keys is None:
                raise ValueError("ranking pages by the exact attention mass needs the layer's keys")
            k_pool, page_table, valid_lo, seq_len = keys
            scores = reference.exact_page_mass(query, k_pool, page_table, heads, num_pages, valid_lo, seq_len,
                                               scale, active, lse=ops.page_lse, mass=ops.group_mass,
                                               candidates=self._candidates(ops, query, kmin, kmax, heads, num_pages,
                                                                           active))
        else:
            scores = ops.page_scores(query, kmin, kmax, heads, num_pages, active, group_score, scale, shrink)
        return force_pages(scores, num_pages, self.sink_pages, self.recent_pages, self.first_page)

    def _candidates(self, ops: KernelOps, query, kmin, kmax, heads, num_pages, active) -> torch.Tensor | None:
        """``[B, h, C]``: each head's ``C = exact_candidates`` pages of the largest min/max bound (the group maximum
        of Quest's bound), which alone the exact mass then scores; ``None`` (every page) when ``C`` is 0."""
        if not self.exact_candidates:
            return None
        bound = force_pages(ops.page_scores(query, kmin, kmax, heads, num_pages, active, "max", None, 1.0),
                            num_pages, self.sink_pages, self.recent_pages, self.first_page)
        out = torch.full((bound.shape[0], bound.shape[1], self.exact_candidates), -1, dtype=torch.long,
                         device=bound.device)
        ones = torch.ones(bound.shape[1], dtype=torch.bool, device=bound.device) if active is None else active
        return ops.select_pages(bound, self.exact_candidates, num_pages=num_pages, active=ones, out=out)

    def attend_list(self, newest: torch.Tensor, anchor: torch.Tensor, due: torch.Tensor,
                    previous: torch.Tensor | None = None, late: torch.Tensor | None = None) -> torch.Tensor:
        """``[B, H, K + max_recent]`` logical pages each head attends to this step (-1 padded).

        Heads re-ranked this step attend their fresh top-K (which holds the newest page).  Stable heads
        between re-ranks attend their previous top-K plus the pages created after it (``anchor + 1 ..
        newest``; a decode interval adds at most ``max_recent`` of them, a prompt chunk restarts the schedule).
        ``previous`` (the selection before this step's re-rank) with ``late``: stable heads that re-rank after
        attending (``overlap_loads``) attend it, with the pages after ``anchor`` (then the one before this step).
        """
        sel = self.selected
        if previous is not None:
            sel = torch.where((self.is_stable[:, None] & late)[None], previous, sel)
        B, H, _ = sel.shape
        recent = anchor + self.head_offsets  # [H, max_recent]: an unstable head's lie past every page
        limit = torch.where(due, -1, newest)  # [1]: none where the stable heads re-ranked at this step
        extra = torch.where(recent <= limit, recent, -1).expand(B, H, self.max_recent)
        return torch.cat([sel, extra], dim=-1)

    def select_rows(self, index: torch.Tensor) -> None:
        self.selected, self.first_page = self.selected[index], self.first_page[index]

    def forget_after(self, newest: int) -> None:
        """Drop selected pages past ``newest`` (pages a crop removed; in place, the order kept)."""
        self.selected.masked_fill_(self.selected > newest, -1)
