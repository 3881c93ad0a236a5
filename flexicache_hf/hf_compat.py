"""What differs between the transformers releases we support (>= 5.17), in one place."""

from __future__ import annotations

from transformers.generation import utils as generation_utils


def generate_cache_kwarg() -> str:
    """The name under which ``generate`` takes a cache: ``"cache"`` where transformers has renamed it (the old
    ``past_key_values`` still works there, with a deprecation warning, until 6.0), else ``"past_key_values"``."""
    return "cache" if "cache" in getattr(generation_utils, "ALL_CACHE_NAMES", ()) else "past_key_values"
