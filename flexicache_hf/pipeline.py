"""A text-generation pipeline that gives every generate call an empty FlexiCache.

A cache holds one batch's conversation, so each call starts from an empty one: the previous call's cache,
``reset()``, when it is sized (``max_new_tokens`` given) and large enough -- as ``generate`` reuses its
StaticCache -- so its buffers keep their addresses and a compiled decode step replays its CUDA graphs instead of
recording new ones (which made a fresh cache's first step ~10x a median one on the H200); a new cache otherwise
(which takes the storage of the one it replaces when their shapes match: ``recycling.py``).
Use it through transformers' own factory::

    pipe = pipeline("text-generation", model=model, tokenizer=tok, pipeline_class=FlexiCachePipeline,
                    flexicache_profile="Llama-3.1-8B-Instruct", flexicache_config=FlexiCacheConfig(token_budget=1024))
"""

from __future__ import annotations

from transformers import TextGenerationPipeline

from .cache import FlexiCache
from .config import FlexiCacheConfig
from .head_profile import resolve_profile
from .hf_compat import generate_cache_kwarg


class FlexiCachePipeline(TextGenerationPipeline):
    """``TextGenerationPipeline`` whose every forward (one prompt or one batch) runs on an empty FlexiCache."""

    def __init__(self, *args, flexicache_profile, flexicache_config: FlexiCacheConfig | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.flexicache_profile = resolve_profile(flexicache_profile)
        self.flexicache_profile.check_model(self.model.config)
        self.flexicache_config = flexicache_config  # None: the profile's settings (FlexiCache(profile)'s own)
        self.last_cache: FlexiCache | None = None  # the most recent call's cache, for its stats (the next call's
        # cache when it fits: read them before the next call)

    def new_cache(self, max_cache_len: int | None = None) -> FlexiCache:
        return FlexiCache(self.flexicache_profile, self.flexicache_config, model_config=self.model.config,
                          max_cache_len=max_cache_len)

    @staticmethod
    def _max_cache_len(model_inputs, generate_kwargs) -> int | None:
        """Prompt length + ``max_new_tokens`` when the call names it, as ``generate`` sizes a ``StaticCache``:
        the cache is then allocated once, and a prompt that cannot fit the model's context with its new tokens
        is refused before any work.  ``None`` (the cache grows) otherwise: the pipeline's and the model's
        generation defaults merge differently across transformers releases, and a guessed length that is
        too short would fail mid-generation."""
        ids, new = model_inputs.get("input_ids"), generate_kwargs.get("max_new_tokens")
        if ids is None or isinstance(new, bool) or not isinstance(new, int):
            return None
        return ids.shape[-1] + new

    def _forward(self, model_inputs, **generate_kwargs):
        if "past_key_values" in generate_kwargs or "cache" in generate_kwargs:
            raise ValueError("FlexiCachePipeline makes its own cache per call; do not pass one (past_key_values= or "
                             "cache=)")
        self.last_cache = self._empty_cache(self._max_cache_len(model_inputs, generate_kwargs))
        return super()._forward(model_inputs, **{generate_cache_kwarg(): self.last_cache}, **generate_kwargs)

    def _empty_cache(self, max_cache_len: int | None) -> FlexiCache:
        """The last call's sized cache reset when it holds ``max_cache_len`` tokens (a batch of another size
        re-allocates inside it), else a new one (the last one released first, so its pinned blocks serve it)."""
        last = self.last_cache
        if last is not None and max_cache_len is not None and (last.max_tokens or 0) >= max_cache_len:
            last.reset()
            return last
        self.last_cache = last = None
        return self.new_cache(max_cache_len)
