"""Hand each decoder layer's queries to caches that score keys with them (SnapKV, LServe, the oracle).

``Cache.update`` receives keys and values only.  A forward pre-hook on every attention module recomputes
the layer's RoPE'd queries from the same inputs the module is about to use (one extra q-projection) and
stores them on the cache layer, right before the module calls ``update``.  Nothing is patched: the hooks
live only inside the ``with`` block, and caches that do not ask (``wants_query``) cost nothing.
"""

from __future__ import annotations

import contextlib
import sys

import torch


def _queries(module: torch.nn.Module, hidden: torch.Tensor, position_embeddings) -> torch.Tensor:
    """``[B, Hq, T, D]`` queries exactly as Llama-family attention computes them before attending."""
    B, T, _ = hidden.shape
    q = module.q_proj(hidden).view(B, T, -1, module.head_dim)
    if hasattr(module, "q_norm"):  # Qwen3-style per-head RMSNorm before RoPE
        q = module.q_norm(q)
    q = q.transpose(1, 2)
    # The module's own RoPE helper, so partial-rotary or model-specific variants stay right.
    rope = getattr(sys.modules[type(module).__module__], "apply_rotary_pos_emb")
    cos, sin = position_embeddings
    q, _ = rope(q, q, cos, sin)
    return q


def _hook(module, args, kwargs):
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    if cache is None or not getattr(cache, "wants_query", False):
        return None
    layer = cache.layers[module.layer_idx]
    if getattr(layer, "wants_query", False):
        hidden = args[0] if args else kwargs["hidden_states"]
        layer.query = _queries(module, hidden, kwargs["position_embeddings"])
        if getattr(layer, "wants_scaling", False):  # the module's softmax scale (the oracle's exact attention)
            layer.scaling = getattr(module, "scaling", None)
    return None


@contextlib.contextmanager
def capture_queries(model: torch.nn.Module):
    """Within the block, caches with ``wants_query`` receive each layer's queries before ``update``."""
    handles = [m.register_forward_pre_hook(_hook, with_kwargs=True)
               for m in model.modules() if hasattr(m, "q_proj") and hasattr(m, "layer_idx")]
    if not handles:
        raise ValueError(f"{type(model).__name__} has no attention modules with q_proj/layer_idx to hook")
    try:
        yield model
    finally:
        for h in handles:
            h.remove()
