"""Exact causal attention of a prompt chunk over its cached prefix and itself (torch SDPA).

Shared by the ``"flexicache"`` attention function (any cache but FlexiCache) and :class:`~flexicache_hf.FlexiCache`
prompt chunks, so neither module imports the other for it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def dense_attention(
    query: torch.Tensor,  # [B, Hq, T, D]
    keys: torch.Tensor,  # [B, H, L, D], the last T positions are the queries' own
    values: torch.Tensor,  # [B, H, L, D]
    key_valid: torch.Tensor | None,  # [B, L] bool, False = padding; None = no padding
    scaling: float,
    dropout: float = 0.0,
) -> torch.Tensor:  # [B, T, Hq, D]
    """Exact causal attention of a chunk over its prefix and itself (torch SDPA, GQA native)."""
    B, Hq, T, D = query.shape
    L = keys.shape[2]
    gqa = Hq != keys.shape[1]
    if key_valid is None and T == L:
        out = F.scaled_dot_product_attention(query, keys, values, is_causal=True, scale=scaling, enable_gqa=gqa,
                                             dropout_p=dropout)
    else:
        qpos = torch.arange(L - T, L, device=query.device)
        kpos = torch.arange(L, device=query.device)
        mask = (kpos[None, :] <= qpos[:, None])[None]  # [1, T, L] causal
        if key_valid is not None:
            mask = mask & key_valid[:, None, :]
            # A padding query sees no valid key; let it see itself so softmax stays finite (its output is unused).
            mask = mask | (kpos[None, None, :] == qpos[None, :, None])
        out = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask[:, None], scale=scaling,
                                             enable_gqa=gqa, dropout_p=dropout)
    return out.transpose(1, 2)
