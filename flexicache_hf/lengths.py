"""How long a FlexiCache may get, and the check before each step that keeps a sized cache from overflowing.

A cache holds at most the model's context (``max_position_embeddings``) and, when made with one, ``max_cache_len``
tokens.  ``update`` checks every forward's end (:func:`refuse_length`) before it writes.  A decode step replayed
from a CUDA graph never reaches ``update``, so for those :func:`check_room` runs first: ``generate`` asks the cache
for the mask sizes eagerly before every step (``prepare_inputs_for_generation`` builds a compileable cache's mask
with ``create_masks_for_generate``, in transformers 5.17 and later), and there a sized cache refuses the step that
would not fit.  The device's ``overflow`` flag (``DecodeState``) stays the backstop for compiled forwards run
without ``generate``: it is seen at the cache's next eager use.
"""

from __future__ import annotations


def refuse_length(end: int, max_positions: int | None, max_tokens: int | None, reserved: bool = False) -> None:
    """Refuse (ValueError) ``end`` positions beyond the model's context or beyond ``max_cache_len``; ``reserved``:
    ``max_positions`` is the context the cache's storage was reserved for, below the model's
    (:func:`~flexicache_hf.reserve.fit_reserved`)."""
    if max_positions is not None and end > max_positions:
        if reserved:
            raise ValueError(f"{end} tokens exceed the {max_positions} positions this cache's storage was reserved "
                             "for (its profile's record of the model's context, taken before the cache saw the "
                             "model's config); make the cache with model_config=model.config to reserve the model's "
                             "context")
        raise ValueError(f"{end} tokens exceed the model's context of {max_positions} positions (max_position_embeddings)")
    if max_tokens is not None and end > max_tokens:
        raise ValueError(f"{end} tokens exceed this cache's max_cache_len={max_tokens}; make the cache with a larger "
                         "max_cache_len (prompt length + max_new_tokens), or without one to let it grow")


def check_room(cache, tokens: int) -> None:
    """Refuse (ValueError, before anything changes) a forward of ``tokens`` tokens that would take ``cache`` past its
    ``max_cache_len``, and announce the forward to the step schedule.

    The host does not follow graph replays: it counts the forwards announced since it last knew the length as run
    (``DecodeState.surely_fits``, no synchronisation), and only when that count says these tokens might not fit does
    it synchronise once to learn the exact length.  So a generate that fits never waits for the GPU here, and a
    refusal is decided on the exact length.  Nothing is checked during a forward (a mask asked for mid-forward),
    before the first one, or for a growing cache (neither ``max_cache_len`` nor reserved storage)."""
    if not cache.states or cache.guard.open or any(state.capacity is None for state in cache.states.values()):
        return  # (a schedule's capacity: max_cache_len, or the context of reserved storage, reserve.py)
    if not all(state.surely_fits(tokens) for state in cache.states.values()):
        cache.sync()  # the exact length (raises OverflowError if a step already went past: the device's flag)
        cache.check_length(cache.layers[0].seq_len + tokens)
    for state in cache.states.values():
        state.announce(tokens)
