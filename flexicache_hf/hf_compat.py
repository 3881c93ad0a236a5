"""What differs between the transformers releases we support (>= 5.17), in one place."""

from __future__ import annotations

import functools
import inspect

from transformers.generation import utils as generation_utils


def generate_cache_kwarg() -> str:
    """The name under which ``generate`` takes a cache: ``"cache"`` where transformers has renamed it (the old
    ``past_key_values`` still works there, with a deprecation warning, until 6.0), else ``"past_key_values"``."""
    return "cache" if "cache" in getattr(generation_utils, "ALL_CACHE_NAMES", ()) else "past_key_values"


def forward_cache_kwarg(model) -> str:
    """The name under which ``model``'s forward takes a cache: ``"cache"`` where the installed release renamed it
    (5.24 still takes ``past_key_values`` with a deprecation warning; 5.40 drops it), else ``"past_key_values"``."""
    return _forward_name(type(model))


@functools.lru_cache(maxsize=None)
def _forward_name(model_class) -> str:
    try:  # the deprecation decorator wraps the forward; the signature is the wrapped one's
        params = inspect.signature(inspect.unwrap(model_class.forward)).parameters
    except (TypeError, ValueError):
        params = {}
    if "cache" in params:
        return "cache"
    return "past_key_values" if "past_key_values" in params else generate_cache_kwarg()
