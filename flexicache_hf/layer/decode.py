"""A decode step (one token per row) in one layer: append the token, then attend its top-K pages.

One body serves eager steps and the CUDA graph ``torch.compile`` captures: it reads the step's schedule from the
cache's device scalars (:class:`~flexicache_hf.layer.schedule.DecodeState`, planned once per step by the cache)
and nothing else from the host.  ``plan`` (:class:`~flexicache_hf.layer.schedule.StepPlan`) is what the host knows
of the step: eagerly it lets a step skip launches the device predicates would mask anyway; a captured step gets
:data:`~flexicache_hf.layer.schedule.GRAPH_PLAN` (nothing known) and runs everything, predicated.
"""

from __future__ import annotations

import torch

from ..rerank import RerankEvent
from ..tiers import copy_context, load_promoted, offload_page
from .schedule import GRAPH_PLAN, StepPlan


def append_token(layer, key_states: torch.Tensor, value_states: torch.Tensor, plan: StepPlan) -> None:
    """Store one token ``[B, H, 1, D]`` at the schedule's position and fold its keys into the MinMax cache (one
    kernel for every head); a page it fills goes to the host (incremental offload)."""
    s, st, ps = layer.storage, layer.state, layer.config.page_size
    st.begin_layer(layer.layer_idx)  # this layer's re-rank schedule for the step
    if s.offloads and plan.may(plan.new_page):
        s.slots.place_new_page(s.ops, st.page, s.tail_phys, None if plan.new_page else st.new_page)
    # Each head's physical row: resident heads' page from the page table, offloaded heads' newest slot.
    phys = s.pool.page_table.index_select(2, st.page)[..., 0].long()  # [B, H]
    if s.offloads:
        phys = phys.index_copy(1, s.slot_heads, s.tail_phys)
    rows = phys * ps + st.offset
    s.ops.append_token(s.pool.k, s.pool.v, s.kmin, s.kmax, key_states[:, :, 0], value_states[:, :, 0], rows,
                       st.page)
    if s.offloads:
        s.host_current = bool(plan.page_full)  # a filled page goes to the host now; else only its slot has it
        if plan.may(plan.page_full):
            with copy_context(s.copies):
                offload_page(s.ops, s.pool, s.host, st.page, s.tail_phys, None if plan.page_full else st.page_full)
            pages = s.batch * s.slot_heads.numel()
            st.counters.add("offloaded_pages", pages if plan.page_full else st.page_full * pages)


def attend_token(layer, q: torch.Tensor, scaling: float, plan: StepPlan) -> torch.Tensor:
    """Top-K selection + sparse paged decode for one token per row; ``q [B, Hq, D]`` -> ``[B, Hq, D]``.

    Unstable heads re-rank every step, stable heads when the schedule says so (their promoted pages then come
    from the host tier into the slots evicted pages free); every head attends its top-K (plus, for stable heads
    between re-ranks, the pages created since their last one).  With ``overlap_loads`` a stable head's scheduled
    re-rank is *late*: scored and selected with the others, it attends its previous selection at this step, and
    its slots are reseated after the attention, the promoted pages loading behind the later layers' compute
    (joined at the last layer).
    """
    s, st, rr = layer.storage, layer.state, layer.reranker
    due, stable_due = st.due_of(layer.layer_idx), plan.due(layer.layer_idx)
    late, stable_late = st.late_of(layer.layer_idx), plan.late(layer.layer_idx)
    lagged = late is not None and rr.num_stable > 0 and plan.may(stable_late)  # a late re-rank may run now
    previous = None
    if rr.num_stable < s.num_kv_heads or plan.may(stable_due) or lagged:  # some head is due
        previous = rr.selected.clone() if lagged else None
        ranked = due if not lagged else due | late
        observer = layer.spec.observer if plan is not GRAPH_PLAN else None
        scores = rr.rerank(s.ops, q, s.kmin, s.kmax, st.num_pages, ranked, scaling,
                           keys=(s.pool.k, s.pool.page_table, s.valid_lo, st.length), with_scores=observer is not None)
        if observer is not None:
            heads, n = rr.scored_heads(bool(stable_due or (lagged and stable_late))), plan.num_pages
            observer.on_rerank(RerankEvent(layer.layer_idx, st.host_step - 1, heads, rr.selected[:, heads],
                                           scores[:, heads, :n], n, q))
    if s.offloads and plan.may(stable_due):
        with copy_context(s.copies):
            pages, phys = s.slots.reseat(s.ops, rr.selected[:, s.slot_heads], None if stable_due else due)
            load_promoted(s.ops, s.pool, s.host, pages, phys)
        s.copies.hand_off()
        st.counters.add("promoted_pages", (pages >= 0).sum())
    anchor = st.since_of(layer.layer_idx) if lagged else st.anchor_of(layer.layer_idx)
    attend = rr.attend_list(st.page, anchor, due, previous, late)
    if layer.spec.count_pages:
        st.counters.add("pages_attended", (attend >= 0).sum())
    out = s.ops.sparse_decode(q, s.pool.k, s.pool.v, s.pool.page_table, attend, s.valid_lo, st.length, scaling)
    if lagged and s.offloads:  # after the attention read the slots: reseat them, load behind the compute
        pages, phys = s.slots.reseat(s.ops, rr.selected[:, s.slot_heads], None if stable_late else late)
        s.copies.hand_off()  # eagerly: offloads queued on the layer's copy stream come before (host pages they write)
        load_promoted(s.ops, s.pool, s.host, pages, phys, behind=True)
        st.counters.add("promoted_pages", (pages >= 0).sum())
    if late is not None and layer.layer_idx == layer.spec.model.num_layers - 1:
        s.ops.join_loads(s.device)  # the forward's last layer: every load behind it is in place
    return out
