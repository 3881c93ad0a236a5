"""FlexiCache's knobs, validated once, immutable afterwards."""

from __future__ import annotations

from dataclasses import dataclass


GROUP_SCORES = ("max", "mass")  # FlexiCacheConfig.group_score; the page-score kernels take the same names
# FlexiCacheConfig.unstable_group_score also takes "exact": the unstable heads keep every page on the device, so
# their pages can be ranked by the exact attention mass instead of a bound from the MinMax cache.
UNSTABLE_GROUP_SCORES = GROUP_SCORES + ("exact",)


class ConfigError(ValueError):
    """A FlexiCacheConfig value that cannot work."""


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)  # bool is an int subclass: True would read as 1


@dataclass(frozen=True)
class FlexiCacheConfig:
    """Configuration of one :class:`~flexicache_hf.FlexiCache`.

    Args:
        page_size: tokens per KV page (a power of two; Triton tiles pages whole).  Pages are counted back from the
            end of the first prompt chunk (which ends on a page boundary), so a left-padded row's pages are the
            ones it has alone: its tokens never depend on its batch.
        token_budget: the size of each KV head's top-K selection: ``K = token_budget // page_size`` pages, the
            page holding the newest token always among them.  Paper default: 2048 (also 1024).  What a decode step
            attends: an unstable head (re-ranked every step) and a stable head on its re-rank step attend exactly
            their K selected pages; a stable head between re-ranks attends its last selection **plus every page
            created since that re-rank**, at most ``ceil(rerank_interval / page_size)`` more (:attr:`max_recent_pages`):
            up to ``K + ceil(R / page_size)`` pages, e.g. 4-page budget, pages of 8: 6 pages at R = 16, 12 at
            R = 64.  That is the cost: attention reads up to that many pages per stable head and step, and the device
            keeps ``K + R // page_size + 1`` slots per stable head (:attr:`resident_slots`).  Selections are never
            wider than the pages the cache can hold, so a budget beyond the context costs what one covering it costs.
        rerank_interval: stable heads re-rank their top-K pages every ``rerank_interval`` decode steps
            (R in the paper; 16).  Unstable heads re-rank every step.  Between re-ranks a stable head also attends
            the pages created since its last one (see ``token_budget``): a larger R re-ranks less often and attends
            (and keeps on the device) up to ``R / page_size`` more pages.
        offload: keep only the top-K pages of stable heads on the accelerator and every page in (pinned)
            host memory.  ``False`` keeps every page on the device (sparse compute only, like Quest).
        host_memory_limit: cap in bytes on the host tier of one cache (``None``: no cap), counting what the
            tiers hold: exactly their pages with ``max_cache_len``, else the coarser steps a growing pinned tier
            takes (:func:`~flexicache_hf.pages.host_capacity`).  Exceeding it raises
            :class:`~flexicache_hf.HostMemoryError` before anything is written.  With or without it, a growth past
            the memory the machine has left (less a margin) is refused the same way (:mod:`~flexicache_hf.host_room`).
        sink_pages: the first pages (attention sinks) every re-rank keeps, inside the budget.  0 = the paper.
        recent_pages: the newest pages every re-rank keeps, inside the budget (the page being appended to is
            always kept).  0 = the paper.  Small models lean on local context that the min/max bound can miss.
        group_score: how a KV head's query heads (GQA group) turn their per-page bounds into the one score its
            pages are ranked by.  ``"max"`` (the paper, Quest): the group's largest bound.  ``"mass"``: each query
            head's bounds as an estimated attention distribution over pages (softmax of the scaled bound), summed
            over the group — the quantity an oracle selection maximises.
        bound_shrink: the weight ``λ`` of each page's per-channel half-range in its score.  The page score is
            Quest's bound ``q·c + Σ_i |q_i| h_i`` over the page's key box (centre ``c``, half-range ``h``, from the
            MinMax cache); ``λ < 1`` scores ``q·c + λ Σ_i |q_i| h_i``, which is no longer an upper bound.  ``1`` =
            the paper.  An offline study recovered more of the exact attention mass at ``λ = 0.5`` on
            Qwen2.5-Coder-0.5B (``docs/benchmarks/NOTES.md``); at 16k on that model ``0.5`` takes FlexiCache from
            1.115 to 1.051 x dense NLL at budget 2048 (``docs/benchmarks/accuracy.md``).
        unstable_group_score: ``group_score`` for the unstable heads only (``None``: the same as the stable
            heads').  Unstable heads are the ones whose top pages jump between steps, the content lookups that a
            needle question leans on; there the needle's page can rank far lower under ``"mass"`` and a shrunk box
            than under the group maximum of the full bound (``docs/benchmarks/accuracy.md``, "Which heads lose the
            needle").  ``unstable_group_score="max", unstable_bound_shrink=1.0`` gives them the paper's bound while
            the stable heads keep ``group_score`` / ``bound_shrink``.  ``"exact"`` ranks the unstable heads' pages by
            the exact attention mass of the step's query (summed over the group), which their keys, all on the
            device, allow: the oracle's ranking for those heads, at the cost of reading their keys every step.
        unstable_bound_shrink: ``bound_shrink`` for the unstable heads only (``None``: the same as the stable
            heads'; not with ``unstable_group_score="exact"``, which uses no bound).
        exact_candidates: with ``unstable_group_score="exact"``, ``n > 0`` ranks exactly only each unstable head's
            ``n * token_budget / page_size`` pages of the largest min/max bound (the group maximum of Quest's
            bound, the same step's query), so their keys alone are read: the exact ranking's cost follows the
            budget, not the context.  ``0`` (the default): every page (the exact mass over the whole context).
        stagger_reranks: ``True`` (the default): layer ``l`` re-ranks its stable heads on the steps
            ``s ≡ l (mod R)``, ``s > 0``, so each step promotes ~1/R of the pages: the same interval per head, even
            step times (at 16 x 16k on an H200 the paper's schedule made every R-th step ~4x the median).  ``False``
            (the paper): every layer's stable heads re-rank on the same steps ``R, 2R, ...``.  On Qwen2.5-Coder-0.5B
            at 16k the two keep the same accuracy (``docs/benchmarks/accuracy.md``, ``stagger-16k``).  Either way
            the prompt's last query gives the stable heads their first top-K (it stands for step 0's re-rank), and
            after a follow-up prompt chunk step 0 re-ranks every head.
        overlap_loads: ``True``: a stable head due to re-rank attends its previous selection (and the pages since)
            at that step, then re-ranks with the step's query; its promoted pages load from the host tier on a load
            stream while the later layers compute (joined at the end of the forward), and the new selection serves
            the next R steps (one step later than the paper's order, whose loads wait before the attention).  A
            stable head between re-ranks then attends up to ``rerank_interval // page_size + 1`` pages since its
            selection (:attr:`max_recent_pages`).  The re-rank every head makes after a follow-up prompt chunk keeps
            the paper's order.  ``False`` (the default, and the paper): re-rank, load, then attend.  Needs
            ``offload=True`` (without offloading nothing loads).
        keep_margin: ``m >= 0``: a stable head's re-rank keeps a page of its selection unless another page scores
            more than ``1 + m`` times it (the selected pages' scores are multiplied by ``1 + m`` before the top-K;
            ``group_score="mass"`` only, whose scores are attention masses).  Every page a stable head promotes
            crosses from host memory, and many promotions swap pages of near-equal mass at the K-th place (on
            SmolLM2 a re-rank replaces ~21 % of the top-K whether R is 8 or 16: ``bench.promotion``); a margin
            keeps those and still promotes a page that clearly outranks.  Unstable heads (every page on the
            device) are not affected.  ``0`` (the default, and the paper): plain top-K.

    :meth:`paper` gives the paper's settings exactly.
    """

    page_size: int = 16
    token_budget: int = 2048
    rerank_interval: int = 16
    offload: bool = True
    host_memory_limit: int | None = None
    sink_pages: int = 0
    recent_pages: int = 0
    group_score: str = "max"
    stagger_reranks: bool = True
    bound_shrink: float = 1.0
    unstable_group_score: str | None = None
    unstable_bound_shrink: float | None = None
    exact_candidates: int = 0
    overlap_loads: bool = False
    keep_margin: float = 0.0

    def __post_init__(self) -> None:
        ps = self.page_size
        if not _is_int(ps) or ps < 1 or ps > 256 or ps & (ps - 1):
            raise ConfigError(f"page_size must be a power of two in [1, 256], got {ps!r}")
        tb = self.token_budget
        if not _is_int(tb) or tb < 2 * ps or tb % ps:
            raise ConfigError(
                f"token_budget must be a multiple of page_size ({ps}) covering at least 2 pages, got {tb!r}"
            )
        r = self.rerank_interval
        if not _is_int(r) or r < 1:
            raise ConfigError(f"rerank_interval must be a positive integer, got {r!r}")
        for name in ("offload", "stagger_reranks", "overlap_loads"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.overlap_loads and not self.offload:
            raise ConfigError("overlap_loads=True needs offload=True: it moves the loads of offloaded pages behind the "
                              "compute (a re-rank's new selection then serves from the next step); without offloading "
                              "nothing loads and a re-rank serves at once")
        for name in ("sink_pages", "recent_pages"):
            v = getattr(self, name)
            if not _is_int(v) or v < 0:
                raise ConfigError(f"{name} must be a non-negative integer, got {v!r}")
        if self.sink_pages + self.recent_pages >= tb // ps:
            raise ConfigError(
                f"sink_pages + recent_pages ({self.sink_pages} + {self.recent_pages}) must leave room in the budget "
                f"of {tb // ps} pages for pages chosen by score"
            )
        for name, choices in (("group_score", GROUP_SCORES), ("unstable_group_score", UNSTABLE_GROUP_SCORES)):
            v = getattr(self, name)
            optional = name.startswith("unstable")
            if not (optional and v is None) and v not in choices:
                hint = " ('exact' ranks by keys only the unstable heads keep on the device)" if v == "exact" else ""
                raise ConfigError(f"{name} must be one of {choices}{' or None' if optional else ''}, got {v!r}{hint}")
        for name, optional in (("bound_shrink", False), ("unstable_bound_shrink", True)):
            lam = getattr(self, name)
            if optional and lam is None:
                continue
            if isinstance(lam, bool) or not isinstance(lam, (int, float)) or not 0 <= lam <= 1:
                raise ConfigError(f"{name} must be a number in [0, 1]{' or None' if optional else ''}, got {lam!r}")
            object.__setattr__(self, name, float(lam))
        if self.unstable_group_score == "exact" and self.unstable_bound_shrink not in (None, 1.0):
            raise ConfigError(f"unstable_bound_shrink does not apply to unstable_group_score='exact' (no bound), "
                              f"got {self.unstable_bound_shrink!r}")
        n = self.exact_candidates
        if not _is_int(n) or n < 0:
            raise ConfigError(f"exact_candidates must be a non-negative integer, got {n!r}")
        if n and self.unstable_group_score != "exact":
            raise ConfigError(f"exact_candidates applies to unstable_group_score='exact' only, got exact_candidates={n} "
                              f"with unstable_group_score={self.unstable_group_score!r}")
        m = self.keep_margin
        if isinstance(m, bool) or not isinstance(m, (int, float)) or not 0 <= m < float("inf"):
            raise ConfigError(f"keep_margin must be a finite number >= 0, got {m!r}")
        object.__setattr__(self, "keep_margin", float(m))
        if m and self.group_score != "mass":
            raise ConfigError(f"keep_margin scales attention masses: it needs group_score='mass', got "
                              f"group_score={self.group_score!r}")
        cap = self.host_memory_limit
        if cap is not None and (not _is_int(cap) or cap < 0):
            raise ConfigError(f"host_memory_limit must be None or a non-negative number of bytes, got {cap!r}")

    @classmethod
    def paper(cls, **overrides) -> "FlexiCacheConfig":
        """The paper's settings exactly (FlexiCache, §4): 16-token pages, R = 16, a 2048-token budget, pages ranked by
        the group's largest min/max bound (Quest's), no sink or recent pages, every layer re-ranking on the same
        steps; ``overrides`` change single fields (``paper(token_budget=1024)``, the paper's other budget).  The
        paper's 25 % unstable heads are the profile's part: the shipped profiles hold 25 % (one with per-head scores
        re-cuts to any fraction: ``profile.least_stable(0.25)``)."""
        paper = dict(page_size=16, rerank_interval=16, token_budget=2048, group_score="max", bound_shrink=1.0,
                     sink_pages=0, recent_pages=0, stagger_reranks=False, offload=True, unstable_group_score=None,
                     unstable_bound_shrink=None, overlap_loads=False, keep_margin=0.0)
        return cls(**{**paper, **overrides})

    @property
    def stable_scoring(self) -> tuple[str, float]:
        """``(group_score, bound_shrink)`` the stable heads rank their pages by."""
        return self.group_score, self.bound_shrink

    @property
    def unstable_scoring(self) -> tuple[str, float]:
        """``(group_score, bound_shrink)`` the unstable heads rank their pages by (the stable heads' where the
        ``unstable_*`` fields are ``None``)."""
        g, lam = self.unstable_group_score, self.unstable_bound_shrink
        if g == "exact":
            return g, 1.0
        return (self.group_score if g is None else g), (self.bound_shrink if lam is None else lam)

    @property
    def budget_pages(self) -> int:
        """K: the pages of a head's selection (a stable head between re-ranks attends :attr:`max_recent_pages` more
        at most)."""
        return self.token_budget // self.page_size

    def rerank_phase(self, layer: int) -> int:
        """The step (mod R) on which ``layer``'s stable heads re-rank."""
        return layer % self.rerank_interval if self.stagger_reranks else 0

    @property
    def max_recent_pages(self) -> int:
        """Pages a stable head can gain between two re-ranks (new pages are attended until re-ranked): a decode
        step attends at most ``budget_pages + max_recent_pages`` pages of a stable head.  With ``overlap_loads`` a
        re-ranking head attends its previous selection first, so the window after the prompt's seat (steps
        ``0 .. R``, see :attr:`resident_slots`) is attended whole."""
        if self.overlap_loads:
            return self.rerank_interval // self.page_size + 1
        return -(-self.rerank_interval // self.page_size)

    @property
    def resident_slots(self) -> int:
        """Device page slots a stable, offloaded head needs: its top-K plus the pages created before its next re-rank.

        The longest such window follows the prompt's seat: the decode tokens of steps ``0 .. R`` (``R + 1`` of them,
        the re-rank of step ``R`` comes after that step's token is placed), which start up to ``R // page_size + 1``
        pages (the prompt ending on a page boundary).  Between two decode re-ranks ``R`` tokens start at most
        :attr:`max_recent_pages`, never more."""
        return self.budget_pages + self.rerank_interval // self.page_size + 1
