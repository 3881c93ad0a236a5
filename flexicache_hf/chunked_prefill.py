"""A long prompt filled in chunks before ``generate``, which then decodes on the compiled path.

``generate(..., prefill_chunk_size=N)`` is transformers' way to bound a long prompt's activations, but for a
compileable cache (``FlexiCache(profile)`` is one on CUDA, as ``StaticCache``) ``generate`` runs every prompt chunk
through the compiled forward too (transformers 5.17-5.25), and FlexiCache's prompt path (page-locking its host
tier, copies on a side stream, the chunk's exact attention over the cached prefix) is eager work that Dynamo cannot
trace: the call fails.  :func:`prefill_in_chunks` runs those chunks eagerly through the model's own forward, every
prompt token but the last, so the ``generate`` that follows prefills one token and compiles only its decode step.
"""

from __future__ import annotations

import torch

from .hf_compat import forward_cache_kwarg


def prefill_in_chunks(model, input_ids: torch.Tensor, cache, chunk_size: int,
                      attention_mask: torch.Tensor | None = None) -> None:
    """Fill ``cache`` with ``input_ids [B, L]`` but its last token, ``chunk_size`` tokens a forward (eager, no
    gradients), from the tokens ``cache`` already holds on (a follow-up turn passes the whole conversation, as to
    ``generate``).  Then call ``model.generate(input_ids, attention_mask=attention_mask, past_key_values=cache,
    ...)`` with the same ``input_ids``: it prefills the last token and decodes.  A left-padded batch takes its 2D
    ``attention_mask`` (positions counted as ``generate`` counts them); the first chunk is made long enough to hold
    every row's left padding and a token after it (FlexiCache learns a row's padding from its first chunk, and
    refuses a later chunk that changes it).  Any cache works, not only FlexiCache::

        cache = FlexiCache(profile)
        prefill_in_chunks(model, ids, cache, chunk_size=4096)
        out = model.generate(ids, past_key_values=cache, max_new_tokens=256)
    """
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [batch, length], got shape {tuple(input_ids.shape)}")
    if attention_mask is not None and attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask {tuple(attention_mask.shape)} must match input_ids "
                         f"{tuple(input_ids.shape)}")
    start, end = int(cache.get_seq_length()), input_ids.shape[1] - 1  # (a StaticCache's is a tensor)
    if start > end:
        raise ValueError(f"the cache holds {start} tokens, more than input_ids' {input_ids.shape[1]} but one: pass "
                         "the whole sequence the cache was filled with, and the tokens to add")
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
    positions = mask.long().cumsum(-1) - 1  # as generate counts them: a left pad's position is never read
    positions.masked_fill_(mask == 0, 1)
    bounds = list(range(start, end, chunk_size)) + [end]
    if start == 0 and attention_mask is not None and len(bounds) > 2:
        lead = int((mask.long().cumsum(-1) == 0).sum(-1).max())  # the longest left padding
        bounds = [0] + [b for b in bounds[1:] if b > lead] if lead < end else [0, end]
    kwargs = {forward_cache_kwarg(model): cache}
    with torch.no_grad():
        for a, b in zip(bounds, bounds[1:]):
            model(input_ids=input_ids[:, a:b], attention_mask=mask[:, :b], position_ids=positions[:, a:b],
                  use_cache=True, logits_to_keep=1, **kwargs)
