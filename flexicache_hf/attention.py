"""The ``"flexicache"`` attention function and its mask function, registered with transformers.

transformers calls ``attention_interface(module, query, key, value, attention_mask, scaling=..., ...)``
right after ``past_key_values.update``.  With a :class:`~flexicache_hf.FlexiCache`, ``key``/``value`` are the
:class:`~flexicache_hf.cache.PagedKV` handle that ``update`` returned, which carries the layer's paged state:
prompt chunks get exact causal attention over the cached prefix and the chunk, decode steps get top-K
page selection and sparse paged attention.  With any other cache (or none) it computes exact dense
attention, so a model loaded with ``attn_implementation="flexicache"`` stays correct with ``DynamicCache``.

The mask function hands over the 2D padding mask (or ``None`` when nothing is padded): padding is all
FlexiCache needs, and a 4D ``[B, 1, q, kv]`` mask would cost memory quadratic in the context.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from .cache import PagedKV

NAME = "flexicache"


def flexicache_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
                    mask_function=None, attention_mask: torch.Tensor | None = None, **kwargs):
    """The padding mask ``[B, kv_length]`` (bool, True = attend) or ``None`` when there is no padding."""
    if attention_mask is None:
        return None
    mask = attention_mask[:, -kv_length:].bool()
    return None if bool(mask.all()) else mask


def dense_attention(
    query: torch.Tensor,  # [B, Hq, T, D]
    keys: torch.Tensor,  # [B, H, L, D], the last T positions are the queries' own
    values: torch.Tensor,  # [B, H, L, D]
    key_valid: torch.Tensor | None,  # [B, L] bool, False = padding; None = no padding
    scaling: float,
) -> torch.Tensor:  # [B, T, Hq, D]
    """Exact causal attention of a chunk over its prefix and itself (torch SDPA, GQA native)."""
    B, Hq, T, D = query.shape
    L = keys.shape[2]
    gqa = Hq != keys.shape[1]
    if key_valid is None and T == L:
        out = F.scaled_dot_product_attention(query, keys, values, is_causal=True, scale=scaling, enable_gqa=gqa)
    else:
        qpos = torch.arange(L - T, L, device=query.device)
        kpos = torch.arange(L, device=query.device)
        mask = (kpos[None, :] <= qpos[:, None])[None]  # [1, T, L] causal
        if key_valid is not None:
            mask = mask & key_valid[:, None, :]
            # A padding query sees no valid key; let it see itself so softmax stays finite (its output is unused).
            mask = mask | (kpos[None, None, :] == qpos[None, :, None])
        out = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask[:, None], scale=scaling,
                                             enable_gqa=gqa)
    return out.transpose(1, 2)


def flexicache_attention(module: torch.nn.Module, query: torch.Tensor, key, value,
                         attention_mask: torch.Tensor | None, scaling: float | None = None,
                         dropout: float = 0.0, **kwargs):
    """transformers attention function: ``query [B, Hq, T, D]`` -> ``([B, T, Hq, D], None)``."""
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    if attention_mask is not None and attention_mask.dim() != 2:
        raise ValueError(
            "the 'flexicache' attention takes a 2D padding mask (its own mask function makes one); got a "
            f"{attention_mask.dim()}D mask — custom 4D masks are not supported"
        )
    if isinstance(key, PagedKV):
        layer = key.layer
        layer.owner.check_model(module.config)
        return layer.attend(key, query, attention_mask, scaling), None
    # Not a FlexiCache (DynamicCache, or use_cache=False): exact dense attention.
    key_valid = None if attention_mask is None else attention_mask.bool()
    return dense_attention(query, key, value, key_valid, scaling), None


def register() -> None:
    """Make ``attn_implementation="flexicache"`` available to every transformers model (idempotent)."""
    AttentionInterface.register(NAME, flexicache_attention)
    AttentionMaskInterface.register(NAME, flexicache_mask)
