"""Oracle page selection: FlexiCache's budget, pages ranked by the exact attention mass of the current query.

The question it answers: when FlexiCache (or Quest-like selection, every head re-ranked every step) loses
accuracy at a budget, is it the *ranking* (the per-page key min/max upper bound, taken as the maximum over a
query-head group) or the *budget* itself?  The oracle keeps every key (nothing is offloaded or evicted: this is
an accuracy reference, not a cache one would deploy) and on every decode step gives each KV head exactly the
pages FlexiCache's rules allow — ``token_budget // page_size`` pages, the page being appended to always among
them, ``sink_pages`` first / ``recent_pages`` newest pages forced in when the config has them — but picked by

    mass[b, h, p] = sum over the query heads g of KV head h's group of
                    sum over tokens t of page p of softmax_t(q_g . k_t * scale)

(the softmax over *every* cached key, the new one included), re-ranked every step.  If the oracle stays near
dense where FlexiCache / Quest-like degrade, the bound is the limit; if the oracle degrades too, the budget is.

How it runs: :class:`OracleCache` is a transformers ``Cache`` of :class:`OracleLayer` (a ``DynamicLayer`` that
stores everything).  Prompt chunks are attended exactly, as every policy of the harness prefills densely.  On a
decode step the layer scores the pages with the step's query (handed over by
:func:`~flexicache_hf.eval.query_capture.capture_queries`, as for SnapKV / LServe), and ``update`` returns only
the selected pages' keys and values, gathered per (row, KV head).  Every head attends the same number of tokens
(``K - 1`` full pages plus the newest page's tokens), so the model's own attention function (the dense path of
``"flexicache"`` or ``"sdpa"``) attends exactly the selection; ``get_mask_sizes`` announces that length, with
an offset that puts every attended key before the query, so the causal mask hides nothing of it.

``rank="bound"`` ranks by Quest's bound instead (the same formula as FlexiCache's page scores, on each page's
exact key min/max, combined over the group as the config's ``group_score`` says): the Quest-like selection through this reference path — a cross-check of the plumbing
against :class:`~flexicache_hf.FlexiCache` and a way to measure how much attention mass the bound's selection
keeps (``row_stats``).  ``exact_heads`` (per layer, the KV heads ranked by the exact mass under ``rank="bound"``)
mixes the two: e.g. a profile's unstable heads ranked exactly, its stable ones by the bound -- does a better
ranking of the heads that keep every page on the device alone recover what the bound loses?  Both ranks record, per row, the fraction of the exact attention mass that falls on the
attended pages.

Pages here are counted from position 0; FlexiCache counts its pages back from the end of its first prompt chunk
(``flexicache_hf/layer/schedule.py``: a row's pages do not move with its padding).  The two page grids are the same
when the prompt ends on a page boundary, and shifted by less than a page otherwise (the reference path gathers every
head's pages as equal-length token runs, which a partial first page would break).

The selection rules are FlexiCache's own: the forced pages follow
:meth:`flexicache_hf.rerank.Reranker.rerank`, the top-K and the always-kept newest page are
:func:`flexicache_hf.kernels.reference.select_pages`.  Reference PyTorch, float32 scores; one extra query
projection and one ``q . K`` over the whole context per layer and step (the cost of a dense step again).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer

from ..config import FlexiCacheConfig
from ..kernels import reference
from ..pages import num_pages
from ..rerank import force_pages

RANKS = ("mass", "bound")


def page_mass(query: torch.Tensor, keys: torch.Tensor, page_size: int, scale: float) -> torch.Tensor:
    """Exact attention mass per page: ``[B, H, P]`` float32 (``P = ceil(L / page_size)``).

    ``query [B, Hq, D]`` (one decode query per head), ``keys [B, H, L, D]`` every cached key of the step.  Each
    query head's softmax runs over all ``L`` keys of its KV head; a page's mass is the sum over its tokens and
    over the query heads of the group, so a KV head's pages sum to its group size.
    """
    B, Hq, D = query.shape
    H, L = keys.shape[1], keys.shape[2]
    q = query.float().reshape(B, H, Hq // H, D)
    probs = torch.softmax(torch.einsum("bhgd,bhld->bhgl", q, keys.float()) * scale, dim=-1).sum(2)  # [B, H, L]
    P = num_pages(L, page_size)
    probs = torch.nn.functional.pad(probs, (0, P * page_size - L))
    return probs.reshape(B, H, P, page_size).sum(-1)


def page_minmax(keys: torch.Tensor, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-page per-channel key min and max ``[B, H, P, D]`` (float32): the MinMax cache, from the exact keys
    (the reference kernel's fold into an empty cache)."""
    B, H, L, D = keys.shape
    P = num_pages(L, page_size)
    lo = torch.full((B, H, P, D), float("inf"), device=keys.device)
    hi = torch.full((B, H, P, D), float("-inf"), device=keys.device)
    reference.minmax_update(lo, hi, keys.float(), 0, torch.zeros(B, dtype=torch.long, device=keys.device), page_size)
    return lo, hi


def page_bound(query: torch.Tensor, keys: torch.Tensor, page_size: int, combine: str = "max",
               scale: float | None = None, shrink: float = 1.0) -> torch.Tensor:
    """Quest's upper bound per page ``[B, H, P]``, combined over the group as ``combine`` says (the group's
    maximum by default) — FlexiCache's page scores (the reference kernel) on the exact per-page key min/max."""
    lo, hi = page_minmax(keys, page_size)
    heads = torch.arange(keys.shape[1], device=keys.device)
    return reference.page_scores(query, lo, hi, heads, lo.shape[2], None, combine, scale, shrink)


def select(scores: torch.Tensor, budget_pages: int, sink_pages: int = 0, recent_pages: int = 0) -> torch.Tensor:
    """The pages a head attends: ``[B, H, min(K, P)]`` int64, ascending, the newest page (``P - 1``) always in.

    FlexiCache's rule on any ranking: forced pages (:func:`~flexicache_hf.rerank.force_pages`), then the top-K of
    :func:`~flexicache_hf.kernels.reference.select_pages`.  With ``P <= K`` every page is selected.
    """
    P = scores.shape[-1]
    pages = reference.select_pages(force_pages(scores, P, sink_pages, recent_pages), budget_pages)
    return pages[..., : min(budget_pages, P)]


def gather_index(pages: torch.Tensor, length: int, page_size: int) -> torch.Tensor:
    """Token indices ``[B, H, n]`` of ascending ``pages`` (the newest page last, the only partial one), truncated
    to the valid tokens: ``n = length - (P - k) * page_size`` for ``k`` selected of ``P`` pages."""
    P, k = num_pages(length, page_size), pages.shape[-1]
    idx = (pages[..., None] * page_size + torch.arange(page_size, device=pages.device)).flatten(-2)
    return idx[..., : length - (P - k) * page_size]


class OracleLayer(DynamicLayer):
    """Stores every key; on a decode step returns only the keys / values of the pages the ranking selects."""

    is_croppable = False
    wants_query = True
    wants_scaling = True

    def __init__(self, config: FlexiCacheConfig, rank: str = "mass", exact_heads: tuple[int, ...] = ()):
        super().__init__()
        if rank not in RANKS:
            raise ValueError(f"rank must be one of {RANKS}, got {rank!r}")
        if exact_heads and rank != "bound":
            raise ValueError("exact_heads mixes the exact mass into rank='bound' only")
        self.config, self.rank = config, rank
        self.exact_heads = tuple(sorted(exact_heads))  # KV heads ranked by the exact mass under rank="bound"
        self.query = None  # [B, Hq, T, D] of the forward in flight (capture_queries)
        self.scaling = None  # the attention module's softmax scale (capture_queries; else 1/sqrt(D))
        self.last = None  # the last decode step: {"pages", "scores", "mass", "query", "scale"} (tests, diagnostics)
        self.mass_sum = None  # [B] sum over decode steps and query heads of the attended fraction of the mass
        self.mass_count = 0  # decode steps x query heads summed into mass_sum

    def _length_after(self, query_length: int) -> int:
        return self.get_seq_length() + query_length

    def get_mask_sizes(self, query_length) -> tuple[int, int]:
        if isinstance(query_length, torch.Tensor):  # older transformers pass cache_position
            query_length = query_length.shape[0]
        L = self._length_after(query_length)
        if query_length != 1:
            return L, 0
        ps, K = self.config.page_size, self.config.budget_pages
        attended = L - max(0, num_pages(L, ps) - K) * ps
        return attended, L - attended  # the attended keys all precede the query: the causal mask keeps them

    def update(self, key_states, value_states, *args, **kwargs):
        keys, values = super().update(key_states, value_states, *args, **kwargs)
        query, self.query = self.query, None  # a query belongs to one forward; never score with a stale one
        if key_states.shape[-2] != 1:
            return keys, values  # prompt chunks: exact attention, as every policy of the harness prefills
        if query is None:
            raise RuntimeError("the oracle ranks pages with the model's queries: run the model inside "
                               "flexicache_hf.eval.query_capture.capture_queries(model)")
        q = query[:, :, -1]
        L, ps = keys.shape[-2], self.config.page_size
        scale = self.scaling if self.scaling is not None else keys.shape[-1] ** -0.5
        mass = page_mass(q, keys, ps, scale)
        scores = mass if self.rank == "mass" else page_bound(q, keys, ps, self.config.group_score, scale,
                                                             self.config.bound_shrink)
        if self.exact_heads:
            exact = list(self.exact_heads)
            scores = scores.clone()
            scores[:, exact] = mass[:, exact]
        pages = select(scores, self.config.budget_pages, self.config.sink_pages, self.config.recent_pages)
        self._record(pages, scores, mass, group=q.shape[1] // keys.shape[1], query=q, scale=scale)
        idx = gather_index(pages, L, ps)[..., None].expand(-1, -1, -1, keys.shape[-1])
        return keys.gather(2, idx), values.gather(2, idx)

    def _record(self, pages, scores, mass, group: int, query, scale: float) -> None:
        self.last = {"pages": pages, "scores": scores, "mass": mass, "query": query, "scale": scale}
        kept = mass.gather(2, pages).sum(-1)  # [B, H]: the group's mass on the attended pages (<= group)
        s = kept.sum(1).double().cpu()
        self.mass_sum = s if self.mass_sum is None else self.mass_sum + s
        self.mass_count += kept.shape[1] * group

    def reset(self) -> None:
        super().reset()
        self.query, self.last, self.mass_sum, self.mass_count = None, None, None, 0

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove:
            raise NotImplementedError("the oracle cache does not support crop (no assisted decoding)")


class OracleCache(Cache):
    """One :class:`OracleLayer` per decoder layer; ``config`` is the FlexiCache configuration it mirrors (page
    size, token budget, sink and recent pages; the re-rank interval and offload do not apply: every head
    re-ranks every step, nothing is offloaded)."""

    def __init__(self, num_layers: int, config: FlexiCacheConfig, rank: str = "mass",
                 exact_heads: list[tuple[int, ...]] | None = None):
        if exact_heads is not None and len(exact_heads) != num_layers:
            raise ValueError(f"exact_heads needs one entry per layer ({num_layers}), got {len(exact_heads)}")
        heads = exact_heads or [()] * num_layers
        super().__init__(layers=[OracleLayer(config, rank, heads[i]) for i in range(num_layers)])
        self.config, self.rank = config, rank

    @property
    def wants_query(self) -> bool:
        return True

    def row_stats(self) -> list[dict]:
        """Per batch row: ``attended_mass``, the mean over decode steps, layers and query heads of the fraction of
        the exact attention mass (softmax over every cached key) on the pages attended (1.0 = dense)."""
        layers = [layer for layer in self.layers if layer.mass_sum is not None]
        if not layers:
            return []
        total = sum(layer.mass_sum for layer in layers)
        count = sum(layer.mass_count for layer in layers)
        return [{"attended_mass": float(v) / count} for v in total]


def oracle_cache(num_layers: int, config: FlexiCacheConfig, rank: str = "mass",
                 exact_heads: list[tuple[int, ...]] | None = None) -> OracleCache:
    return OracleCache(num_layers, config, rank, exact_heads)
