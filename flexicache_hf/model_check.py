"""Which models a FlexiCache serves: the profile's shape, full-attention layers only, within the model's context."""

from __future__ import annotations

from .handle import UnsupportedModelError
from .head_profile import HeadProfile
from .sharding import tp_size_of


def check_served(profile: HeadProfile, model_config, max_tokens: int | None) -> tuple[int | None, int | None]:
    """Refuse a model a cache with ``profile`` (and ``max_cache_len=max_tokens``) cannot serve: another shape than the
    profile's, or non-full attention, or a ``max_cache_len`` beyond its context.  Returns ``(max_positions,
    tp_size)``: the model's context (``max_position_embeddings``) and its tensor-parallel size."""
    profile.check_model(model_config)
    layer_types = getattr(model_config, "layer_types", None) or []
    odd = sorted({t for t in layer_types if t != "full_attention"})
    window = getattr(model_config, "sliding_window", None)
    uses_window = getattr(model_config, "use_sliding_window", True)
    if odd or (window is not None and uses_window and not layer_types):
        raise UnsupportedModelError(
            f"FlexiCache serves full-attention layers only; this model has {odd or ['sliding_window=' + str(window)]}. "
            "(For checkpoints trained with full attention, e.g. Mistral v0.2+, set config.sliding_window=None.)"
        )
    limit = getattr(model_config, "max_position_embeddings", None)
    if limit is not None and max_tokens is not None and max_tokens > limit:
        raise ValueError(f"max_cache_len={max_tokens} exceeds the model's context of {limit} positions "
                         "(max_position_embeddings): shorten the prompt or max_new_tokens")
    return limit, tp_size_of(model_config)
