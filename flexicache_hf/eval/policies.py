"""KV-cache policies under evaluation: what a policy is, and the cache it builds for one sample.

Every policy runs on the same model object (``attn_implementation="flexicache"``): FlexiCache caches take
its paged path, every other cache its exact dense fallback, so differences in score are the cache's alone.
Budgets are given either in tokens or as a fraction of the sample's context; both become the same token
count for every policy of a sample (rounded down to whole FlexiCache pages, at least two pages).

``oracle`` is not a cache one would deploy but the accuracy reference of the selection: FlexiCache's budget,
page size and sink / recent rules, pages ranked by the exact attention mass of the current query, every head
re-ranked every step (:mod:`flexicache_hf.eval.oracle`).  ``quest-ref`` is the Quest-like selection (min/max
bound) through the same reference path: the numbers of ``quest``, plus the attention mass its pages keep.
``oracle-unstable`` mixes them: the profile's unstable heads (``unstable_fraction``) ranked by the exact mass, the
stable ones by the bound (``group_score`` / ``bound_shrink``), every head every step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from transformers import DynamicCache

from ..cache import FlexiCache
from ..config import FlexiCacheConfig
from ..head_profile import HeadProfile, ProfileError, resolve_profile
from .eviction import lserve_cache, snapkv_cache, streaming_cache
from .oracle import oracle_cache

FAMILIES = ("dense", "flexicache", "quest", "streaming", "snapkv", "lserve", "oracle", "quest-ref",
            "oracle-unstable")
# Families that take FlexiCache's page selection rules (page size, sink and recent pages).
PAGED_FAMILIES = ("flexicache", "quest", "oracle", "quest-ref", "oracle-unstable")
# Families that rank pages by the min/max bound (and so take a group_score).
BOUND_FAMILIES = ("flexicache", "quest", "quest-ref", "oracle-unstable")
# Families that take a head profile (unstable_fraction, profile).
PROFILE_FAMILIES = ("flexicache", "oracle-unstable")


@dataclass(frozen=True)
class Policy:
    """One cell of the grid.  ``budget`` is tokens (int) or a fraction of the context (float < 1)."""

    family: str
    budget: int | float | None = None
    rerank_interval: int = 16  # FlexiCache's R; LServe's re-selection interval
    unstable_fraction: float = 0.25  # PROFILE_FAMILIES only
    profile: str = "measured"  # PROFILE_FAMILIES only: "measured" (the model's profile) or "random" (a control)
    sink_pages: int = 0  # PAGED_FAMILIES only: first pages kept by every re-rank
    recent_pages: int = 0  # PAGED_FAMILIES only: newest pages kept by every re-rank
    group_score: str = "max"  # BOUND_FAMILIES only: FlexiCacheConfig.group_score (how a GQA group ranks pages)
    bound_shrink: float = 1.0  # BOUND_FAMILIES only: FlexiCacheConfig.bound_shrink (the half-range's weight)
    # FlexiCache only: the unstable heads' own (group_score, bound_shrink) (FlexiCacheConfig.unstable_*); None: the
    # same as the stable heads'
    unstable_scoring: tuple[str, float] | None = None
    # FlexiCache only: FlexiCacheConfig.stagger_reranks, set here whatever that field's default (a grid's rows keep
    # meaning what they meant when it ran)
    stagger_reranks: bool = False
    # FlexiCache only, with unstable_scoring ("exact", ...): FlexiCacheConfig.exact_candidates (0: every page)
    exact_candidates: int = 0
    # FlexiCache only, with group_score "mass": FlexiCacheConfig.keep_margin (0: plain top-K)
    keep_margin: float = 0.0
    # FlexiCache only: FlexiCacheConfig.overlap_loads (a stable head due to re-rank attends its previous selection at
    # that step; its promoted pages load behind the later layers)
    overlap_loads: bool = False

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ValueError(f"unknown policy family {self.family!r}; choose from {FAMILIES}")
        if (self.family == "dense") != (self.budget is None):
            raise ValueError("dense takes no budget; every other policy needs one")
        if self.profile not in ("measured", "random"):
            raise ValueError(f"profile must be 'measured' or 'random', got {self.profile!r}")
        if self.profile != "measured" and self.family not in PROFILE_FAMILIES:
            raise ValueError(f"profile applies to {PROFILE_FAMILIES} only, not {self.family!r}")
        if (self.sink_pages or self.recent_pages) and self.family not in PAGED_FAMILIES:
            raise ValueError(f"sink_pages / recent_pages apply to {PAGED_FAMILIES} only, not {self.family!r}")
        if self.group_score != "max" and self.family not in BOUND_FAMILIES:
            raise ValueError(f"group_score applies to {BOUND_FAMILIES} only, not {self.family!r}")
        if self.bound_shrink != 1.0 and self.family not in BOUND_FAMILIES:
            raise ValueError(f"bound_shrink applies to {BOUND_FAMILIES} only, not {self.family!r}")
        if self.unstable_scoring is not None and self.family != "flexicache":
            raise ValueError(f"unstable_scoring applies to flexicache only (its profile has stable heads), "
                             f"not {self.family!r}")
        if self.stagger_reranks and self.family != "flexicache":
            raise ValueError(f"stagger_reranks applies to flexicache only, not {self.family!r}")
        if self.exact_candidates and (self.family != "flexicache" or (self.unstable_scoring or ("",))[0] != "exact"):
            raise ValueError("exact_candidates applies to flexicache with unstable_scoring ('exact', ...) only")
        if self.keep_margin and (self.family != "flexicache" or self.group_score != "mass"):
            raise ValueError("keep_margin applies to flexicache with group_score 'mass' only")
        if self.overlap_loads and self.family != "flexicache":
            raise ValueError(f"overlap_loads applies to flexicache only, not {self.family!r}")

    @property
    def label(self) -> str:
        if self.family == "dense":
            return "dense"
        b = self.budget
        budget = f"{b}" if isinstance(b, int) else f"1/{round(1 / b)}"
        forced = f"-sink{self.sink_pages}-recent{self.recent_pages}" if self.sink_pages or self.recent_pages else ""
        forced += f"-{self.group_score}" if self.group_score != "max" else ""
        forced += f"-shrink{self.bound_shrink:g}" if self.bound_shrink != 1.0 else ""
        if self.unstable_scoring is not None:
            group, shrink = self.unstable_scoring
            forced += f"-unstable-{group}" + ("" if group == "exact" else f"-shrink{shrink:g}")
            forced += f"-cand{self.exact_candidates}" if self.exact_candidates else ""
        forced += "-stagger" if self.stagger_reranks else ""
        forced += f"-keep{self.keep_margin:g}" if self.keep_margin else ""
        forced += "-overlap" if self.overlap_loads else ""
        tag = f"-u{round(100 * self.unstable_fraction)}" + ("-random" if self.profile == "random" else "")
        if self.family == "flexicache":
            return f"flexicache-R{self.rerank_interval}{tag}{forced}@{budget}"
        if self.family == "oracle-unstable":
            return f"oracle-unstable{tag}{forced}@{budget}"
        if self.family == "lserve":
            return f"lserve-R{self.rerank_interval}@{budget}"
        return f"{self.family}{forced}@{budget}"

    def budget_tokens(self, context: int, page_size: int) -> int:
        b = self.budget if isinstance(self.budget, int) else int(self.budget * context)
        return max(2 * page_size, b // page_size * page_size)


@dataclass
class ProfileSource:
    """Where FlexiCache's unstable heads come from: the model's measured profile if shipped, else random.

    A measured profile with per-head scores gives the requested unstable fraction exactly (the least stable
    heads); without scores its own set is used whatever the fraction.  ``used`` records what happened, for
    the report — a random profile is a control, not FlexiCache's claim.
    """

    model_config: object
    name: str | None = None
    seed: int = 0
    used: dict = field(default_factory=dict)

    def profile(self, fraction: float, kind: str = "measured") -> HeadProfile:
        if kind == "random" and 0 < fraction < 1:
            self.used[f"random {fraction}"] = f"random (seed {self.seed}), a control of the same size"
            return HeadProfile.random(self.model_config, fraction, seed=self.seed)
        if fraction == 0:
            self.used[fraction] = "all stable"
            return HeadProfile.all_stable(self.model_config)
        if fraction == 1:
            self.used[fraction] = "all unstable"
            return HeadProfile.all_unstable(self.model_config)
        measured = None
        if self.name:
            try:
                measured = resolve_profile(self.name)
                measured.check_model(self.model_config)
            except ProfileError:
                measured = None
        if measured is not None and measured.scores:
            self.used[fraction] = f"measured {self.name} (scores -> least-stable {fraction:.0%})"
            return measured.least_stable(fraction)
        if measured is not None:
            self.used[fraction] = f"measured {self.name} (its own set; no scores to re-cut)"
            return measured
        self.used[fraction] = f"random (seed {self.seed}): no measured profile for {self.name!r}"
        return HeadProfile.random(self.model_config, fraction, seed=self.seed)


def _unstable_fields(scoring: tuple[str, float] | None) -> dict:
    """FlexiCacheConfig's ``unstable_*`` fields from a policy's ``unstable_scoring`` (none when unset)."""
    if scoring is None:
        return {}
    group_score, shrink = scoring
    return {"unstable_group_score": group_score, "unstable_bound_shrink": shrink}


def make_cache(policy: Policy, model_config, context: int, profiles: ProfileSource, *, page_size: int = 16,
               kernels: str | None = None):
    """A fresh cache implementing ``policy`` for one sample of ``context`` prompt tokens.

    ``kernels="reference"`` gives FlexiCache its PyTorch reference kernels on any device (same selection
    semantics; a fallback when a device kernel is unavailable).
    """
    if policy.family == "dense":
        return DynamicCache()
    budget = policy.budget_tokens(context, page_size)
    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    layers = text.num_hidden_layers
    kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    if policy.family in ("flexicache", "quest"):
        quest = policy.family == "quest"
        # Quest: every head re-ranked every step and every page kept on the device.
        prof = HeadProfile.all_unstable(model_config) if quest else profiles.profile(policy.unstable_fraction, policy.profile)
        cfg = FlexiCacheConfig(page_size=page_size, token_budget=budget, rerank_interval=policy.rerank_interval,
                               offload=not quest, sink_pages=policy.sink_pages, recent_pages=policy.recent_pages,
                               group_score=policy.group_score, bound_shrink=policy.bound_shrink,
                               stagger_reranks=policy.stagger_reranks, exact_candidates=policy.exact_candidates,
                               keep_margin=policy.keep_margin, overlap_loads=policy.overlap_loads,
                               **_unstable_fields(policy.unstable_scoring))
        return FlexiCache(prof, cfg, model_config=model_config, kernels=kernels)
    if policy.family in ("oracle", "quest-ref", "oracle-unstable"):
        cfg = FlexiCacheConfig(page_size=page_size, token_budget=budget, sink_pages=policy.sink_pages,
                               recent_pages=policy.recent_pages, group_score=policy.group_score,
                               bound_shrink=policy.bound_shrink)
        exact = None
        if policy.family == "oracle-unstable":
            prof = profiles.profile(policy.unstable_fraction, policy.profile)
            exact = [prof.unstable_heads(layer) for layer in range(layers)]
        return oracle_cache(layers, cfg, rank="mass" if policy.family == "oracle" else "bound", exact_heads=exact)
    if policy.family == "streaming":
        return streaming_cache(layers, budget)
    if policy.family == "snapkv":
        return snapkv_cache(layers, budget, window=min(32, budget // 2))
    return lserve_cache(layers, kv_heads, budget, interval=policy.rerank_interval)
