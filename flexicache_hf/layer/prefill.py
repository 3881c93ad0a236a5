"""A prompt chunk (T > 1 tokens) in one layer: store it, attend it exactly, seat the stable heads' first top-K.

The device-resident heads' tokens go into their pages; the offloaded heads' chunk goes whole to the host tier as
one copy queued on the layer's copy stream (the device keeps the newest page).  Attention is exact causal SDPA
over the cached prefix (gathered from wherever it lives) and the chunk.  After a first chunk the prompt's last
query ranks the stable heads' pages (their re-rank for step 0), and those pages are copied into their slots from
the chunk still on the device.  A follow-up chunk reads the offloaded prefix back from the host; the cache starts
the next layer's read while this one attends (:func:`prefetch_prefix`).
"""

from __future__ import annotations

import torch

from ..dense import dense_attention
from ..pages import num_pages
from ..tiers import copy_context, load_promoted, seat_from_chunk


def store_chunk(layer, keys: torch.Tensor, values: torch.Tensor, start: int):
    """Store a chunk ``[B, H, T, D]`` at positions ``start..`` (storage positions ``origin + start..``, the
    schedule's origin already set by this chunk if it is the first); returns the offloaded heads' part ``(k, v)``
    ``[B, slot_heads, T, D]`` (``None`` without offloaded heads), which the handle carries to attention."""
    s, ps = layer.storage, layer.config.page_size
    first = layer.origin + start
    end = first + keys.shape[2]
    if s.full_heads.numel():
        s.pool.store_full(keys[:, s.full_heads], values[:, s.full_heads], first)
    if not s.offloads:
        return None
    k, v = keys[:, s.slot_heads].contiguous(), values[:, s.slot_heads].contiguous()
    s.flush_newest_page(first)
    with copy_context(s.copies):
        s.host.write_tokens(k, v, first)
        s.slots.clear()
        newest = (end - 1) // ps
        s.slots.place_new_page(s.ops, newest, s.tail_phys)
        pages = torch.full_like(s.tail_phys, newest)[..., None]
        load_promoted(s.ops, s.pool, s.host, pages, s.tail_phys[..., None])
    s.copies_pending = True  # joined by the next decode step, not now: later layers overlap the copy
    s.host_current = True  # the chunk went to the host whole, its partial newest page included
    return k, v


def check_padding(layer, start: int, mask2d: torch.Tensor | None) -> tuple[torch.Tensor, bool, bool]:
    """Before attending a chunk: each row's left padding ``[B]`` from the chunk's 2D mask, whether any row is
    padded, and whether a row holds nothing but padding so far (its padding may go on into the next forward, which
    :func:`check_token_padding` checks).  Refuses right padding (or gaps) and a follow-up chunk that changes the
    padding; changes nothing."""
    s = layer.storage
    if mask2d is None:
        lead = torch.zeros(s.batch, dtype=torch.long, device=s.device)
    else:
        m = mask2d.to(s.device, torch.bool)
        lead = (m.long().cumsum(-1) == 0).sum(-1)
        if not bool((m.sum(-1) == m.shape[-1] - lead).all()):
            raise ValueError(
                "FlexiCache supports left padding only (padding tokens first, as with "
                "tokenizer.padding_side='left'); got an attention mask with gaps or right padding"
            )
    # Without a mask nothing is padded: decided on the host, so an unpadded chunk costs no host sync.
    padded = mask2d is not None and bool(lead.any())
    if start and (padded != s.padded or (padded and not torch.equal(lead, s.valid_lo - layer.origin))):
        raise ValueError("a later prompt chunk changed the left padding of rows already in the cache")
    return lead, padded, padded and bool((lead >= mask2d.shape[-1]).any())


def check_token_padding(layer, mask2d: torch.Tensor | None) -> None:
    """Before a one-token forward (a decode step, eager) attends: refuses it when it would add left padding to a row
    that holds nothing but padding so far (a prompt fed a token at a time, ``prefill_chunk_size=1``): a decode step
    takes its token as real.  Reads the mask (a device sync) only in that state; changes nothing."""
    if not getattr(layer.storage, "open_padding", False) or mask2d is None:
        return
    if not bool(mask2d[:, -1].all()):
        raise ValueError(
            "a one-token forward cannot add left padding: a row of this batch holds only padding so far, and a "
            "decode step takes its token as real. Feed the prompt so that its first chunk covers every row's left "
            "padding and a token after it (flexicache_hf.prefill_in_chunks does; generate's prefill_chunk_size "
            "must exceed the longest left padding)")


def observe_chunk(layer, keys: torch.Tensor, start: int, padding: tuple[torch.Tensor, bool, bool]) -> None:
    """Take the chunk's left padding (:func:`check_padding`) and fold its keys into the MinMax cache.  The
    kernels' ``valid_lo`` is a storage position: the first ``origin`` positions count as padding."""
    s = layer.storage
    lead, s.padded, s.open_padding = padding
    s.valid_lo.copy_(lead + layer.origin)  # in place: a decode graph reads it at its address
    layer.reranker.first_page.copy_(torch.div(s.valid_lo, layer.config.page_size, rounding_mode="floor"))
    s.ops.minmax_update(s.kmin, s.kmax, keys, layer.origin + start, s.valid_lo, layer.config.page_size)


def attend_chunk(layer, handle, query: torch.Tensor, scaling: float) -> torch.Tensor:
    """Exact causal attention ``[B, T, Hq, D]`` of ``query [B, Hq, T, D]`` over the prefix and the chunk; after a
    first chunk, the stable heads' first top-K."""
    s = layer.storage
    if handle.start == 0:
        keys, values = handle.keys, handle.values
    else:
        keys, values = gather_tokens(layer, handle.start, then=(handle.keys, handle.values))
    key_valid = None
    if s.padded:
        key_valid = torch.arange(keys.shape[2], device=s.device)[None, :] >= (s.valid_lo - layer.origin)[:, None]
    out = dense_attention(query, keys, values, key_valid, scaling)
    if handle.start == 0 and layer.reranker.num_stable:
        seat_prompt_top_k(layer, query[:, :, -1], handle.offloaded, scaling)
    return out


def seat_prompt_top_k(layer, q: torch.Tensor, offloaded: tuple[torch.Tensor, torch.Tensor] | None,
                      scaling: float) -> None:
    """After a first prompt chunk: the stable heads' first top-K, from the prompt's last query ``q [B, Hq, D]``
    (the paper keeps a stable head's top-K pages on the device once the prompt is offloaded).  Offloaded heads
    get those pages from the chunk still on the device (``offloaded``: the chunk's keys and values of those
    heads, ``[B, len(slot_heads), T, D]``, which the host copy holds anyway; ``None`` without offload), so no
    decode step loads them from the host; the schedule re-ranks them next R steps later (or on their staggered
    phase), not at step 0.  On the copy stream, behind the chunk's offload."""
    s, ps = layer.storage, layer.config.page_size
    n = num_pages(layer.origin + layer.seq_len, ps)
    with copy_context(s.copies):
        s.copies.keep_alive(q)
        wanted = layer.reranker.seat_prompt(s.ops, q, s.kmin, s.kmax, n, scaling)
        if offloaded is not None:  # the offloaded heads are the stable ones, in the same order
            pages, phys = s.slots.reseat(s.ops, wanted)
            seat_from_chunk(s.pool, pages, phys, *offloaded, ps, first=layer.origin)
    layer.state.anchor_of(layer.layer_idx).fill_(n - 1)  # the newest page when they were ranked
    s.copies_pending = True


def gather_tokens(layer, end: int, then: tuple[torch.Tensor, torch.Tensor] | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Every stored token ``[B, H, end, D]`` of every head, wherever it lives (exact-attention path),
    followed by ``then`` (a chunk's new keys / values ``[B, H, T, D]``) in the same buffers when given."""
    s = layer.storage
    B, H, D = s.batch, s.num_kv_heads, s.head_dim
    T = 0 if then is None else then[0].shape[2]
    keys = torch.empty((B, H, end + T, D), dtype=s.dtype, device=s.device)
    values = torch.empty_like(keys)
    if T:
        keys[:, :, end:], values[:, :, end:] = then
    o = layer.origin
    if s.full_heads.numel():
        keys[:, s.full_heads, :end] = s.pool.read_full("k", o, o + end)
        values[:, s.full_heads, :end] = s.pool.read_full("v", o, o + end)
    if s.offloads:
        prefetched, s.prefetched = s.prefetched, None
        hk, hv = prefetched[1:] if prefetched is not None and prefetched[0] == end else _read_prefix(layer, end)
        s.copies.hand_off()
        s.copies_pending = False
        keys[:, s.slot_heads, :end], values[:, s.slot_heads, :end] = hk, hv
    return keys, values


def _read_prefix(layer, end: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Queue the read of the offloaded heads' first ``end`` tokens ``[B, slot_heads, end, D]`` on the copy
    stream (the newest page flushed first); the caller hands the stream off before using them."""
    s = layer.storage
    hk = torch.empty((s.batch, s.slot_heads.numel(), end, s.head_dim), dtype=s.dtype, device=s.device)
    hv = torch.empty_like(hk)
    s.flush_newest_page(layer.origin + layer.seq_len)
    with copy_context(s.copies):
        s.host.read_tokens(hk, hv, first=layer.origin)
    return hk, hv


def prefetch_prefix(layer, end: int) -> None:
    """Start reading ``layer``'s cached prefix for a follow-up chunk at ``end`` while earlier layers run.

    Only before the layer has taken the chunk (its sequence still ends at ``end``); :func:`gather_tokens` then
    finds the read under way instead of issuing it.
    """
    s = layer.storage if layer.is_initialized else None
    if s is not None and s.offloads and layer.seq_len == end and s.prefetched is None:
        s.prefetched = (end, *_read_prefix(layer, end))
