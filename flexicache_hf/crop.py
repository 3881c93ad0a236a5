"""Going back to fewer tokens, across a cache's layers: ``FlexiCache.crop`` and undoing a refused forward.

* :func:`crop` drops the newest tokens: what transformers' assisted decoding (prompt lookup, an assistant model)
  asks for after each verification forward, for the draft tokens the model rejected.  The step schedule goes back
  first (:meth:`~flexicache_hf.layer.schedule.DecodeState.crop`), then each layer
  (:func:`~flexicache_hf.layer.rewind.rewind`).
* :func:`undo_refused`: a forward whose first layer refused its attention (a 4D mask, right padding,
  ``output_attentions``, another attention function) after that layer's update had stored the forward's tokens
  is undone, so the error loses nothing: the schedule as it was before the forward (the host's mirror, kept at
  layer 0), that layer's tokens dropped.  No other layer has been reached then.
"""

from __future__ import annotations

import threading

import torch

INTEGER_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


def crop(cache, max_length: int) -> None:
    """transformers' ``Cache.crop``: a negative ``max_length`` drops that many of the newest tokens, a positive one
    keeps that many (transformers < 5.18's form; nothing happens if the cache holds no more), 0 changes nothing.
    Every token dropped: the cache is emptied, as :meth:`~flexicache_hf.FlexiCache.reset` does.  A 0-d integer
    tensor counts as its value (transformers 5.17's assisted decoding passes one)."""
    if isinstance(max_length, torch.Tensor) and max_length.ndim == 0 and max_length.dtype in INTEGER_DTYPES:
        max_length = int(max_length)
    if isinstance(max_length, bool) or not isinstance(max_length, int):
        raise TypeError(f"crop takes a number of tokens, got {max_length!r}")
    cache.ensure_usable()
    cache.sync()
    held = cache.layers[0].seq_len
    drop = -max_length if max_length < 0 else max(held - max_length, 0) if max_length > 0 else 0
    if drop > held:
        raise ValueError(f"cannot crop {drop} tokens from a FlexiCache holding {held}")
    if drop == 0:
        return
    if drop < held:
        refuse_emptied_rows(cache, held, held - drop)
    if drop == held:
        cache.reset()
        return
    for state in cache.states.values():
        state.crop(drop)
    for layer in cache.layers:
        if layer.is_initialized:
            layer.rewind(held - drop)


def refuse_emptied_rows(cache, held: int, keep: int) -> None:
    """Refuse a crop to ``keep`` tokens that leaves a left-padded row with padding only (its real tokens all
    dropped): the next token would count as padding there.  Reads the padding on the host only for a padded
    batch; changes nothing."""
    layer = next(layer for layer in cache.layers if layer.is_initialized)
    if not layer.storage.padded:
        return
    lead = layer.left_padding()
    rows = [r for r, n in enumerate(lead) if keep <= n < held]
    if rows:
        least = max(n for n in lead if n < held) + 1
        raise ValueError(f"cannot crop to {keep} tokens: row(s) {rows} of this left-padded batch would keep only "
                         f"padding; keep at least {least} tokens")


def undo_refused(cache, handle) -> bool:
    """Undo the open forward if ``handle``'s attention, refused before it ran, is the forward's first (only layer 0
    has stored its tokens); returns whether it did.  A forward that began on an empty cache is emptied away."""
    guard, layer = cache.guard, cache.layers[0]
    if (handle.cache is not cache or handle.layer_idx != 0 or not guard.open or guard.next != (0, "attend")
            or guard.owner is not threading.current_thread()
            or handle.start + handle.keys.shape[2] != layer.seq_len):  # (a stale handle: not this forward's)
        return False
    if guard.began_empty:
        guard.clear()
        cache.reset()
        return True
    for key, state in cache.states.items():
        plan = state.plan
        if plan is not None and plan.num_pages is not None:  # a decode step: its counts go too
            if state.counts_steps:
                state.counters.add("decode_steps", -1)
            if plan.page_full and layer.storage.offloads and str(layer.storage.device) == key:
                state.counters.add("offloaded_pages", -layer.storage.batch * layer.storage.slot_heads.numel())
        state.restore(*cache.before[key])
    layer.rewind(handle.start)
    guard.clear()
    return True
