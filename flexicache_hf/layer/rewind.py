"""Going back to fewer tokens in one layer: a rejected draft's tokens (``crop``) or a refused forward's write.

The cache first sets the step schedule back (:meth:`~flexicache_hf.layer.schedule.DecodeState.crop` /
``restore``); the layer then makes its storage what it would be had it never taken the dropped tokens:

* the newest kept page's MinMax entry is folded again from the keys it keeps, later entries are emptied;
* the stable heads' device slots hold again what a decode step expects: their selection, the pages created since
  their last re-rank (the schedule's anchor) and the newest kept page, whose slot takes the next token.  Pages
  that no longer exist give their slots back; a kept page that left the slots comes back from the host tier;
* the newest kept page reaches the host tier at its next flush (its slot is the copy that is current).

Tokens past the new end stay where they were written (the pools, the host tier): positions at or past the length
are never read, and the next tokens overwrite them.  Plain PyTorch plus the kernels a re-rank already uses.
"""

from __future__ import annotations

import torch

from ..pages import num_pages
from ..tiers import copy_context, load_promoted


def rewind(layer, end: int) -> None:
    """Keep the first ``end`` (> 0) tokens of ``layer`` (its schedule already set back by the cache)."""
    s, ps = layer.storage, layer.config.page_size
    s.join_copies()  # queued tier copies land before the slots change
    s.prefetched = None
    newest = (end - 1) // ps
    layer.reranker.forget_after(newest)
    if s.offloads:
        anchor = layer.state.anchor_page(layer.layer_idx, layer.state.host_step - 1)
        _reseat(layer, newest, anchor)
        s.host_current = end % ps == 0  # a partial newest page: its slot is the current copy
    _refold(layer, newest, end, num_pages(layer.seq_len, ps))
    layer.seq_len = end


def _reseat(layer, newest: int, anchor: int) -> None:
    """The stable heads' slots: their selection, the pages after the anchor and the newest page, nothing past it
    (a page that left the slots is loaded from the host tier); ``tail_phys`` at the newest page's slot."""
    s, rr = layer.storage, layer.reranker
    B, nT = s.batch, s.slot_heads.numel()
    recent = torch.arange(max(anchor + 1, 0), newest + 1, device=s.device)
    wanted = torch.cat([rr.selected[:, s.slot_heads], recent.expand(B, nT, -1),
                        torch.full((B, nT, 1), newest, dtype=torch.long, device=s.device)], dim=-1)
    wanted = wanted.sort(-1).values
    repeat = torch.cat([torch.zeros_like(wanted[..., :1], dtype=torch.bool), wanted[..., 1:] == wanted[..., :-1]], -1)
    wanted = torch.where(repeat, -1, wanted)  # each page once (the reseat seats every wanted entry)
    with copy_context(s.copies):
        pages, phys = s.slots.reseat(s.ops, wanted)
        load_promoted(s.ops, s.pool, s.host, pages, phys)
    s.copies.hand_off()
    s.tail_phys.copy_(s.slots.phys_of(newest))


def _refold(layer, newest: int, end: int, pages: int) -> None:
    """MinMax: the newest kept page from the keys it keeps (valid ones), the pages after it empty again."""
    s, ps = layer.storage, layer.config.page_size
    s.kmin[:, :, newest:pages].fill_(float("inf"))
    s.kmax[:, :, newest:pages].fill_(float("-inf"))
    phys = s.pool.page_table[:, :, newest].long()  # [B, H]: resident heads' page, offloaded heads' slot
    keys = s.pool.k[phys][:, :, : end - newest * ps].contiguous()  # [B, H, kept, D]
    s.ops.minmax_update(s.kmin, s.kmax, keys, newest * ps, s.valid_lo, ps)
