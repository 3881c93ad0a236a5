"""Exact causal attention of a prompt chunk over its cached prefix and itself (torch SDPA).

Shared by the ``"flexicache"`` attention function (any cache but FlexiCache) and a FlexiCache layer's prompt chunks
(:mod:`flexicache_hf.layer.prefill`), so neither imports the other for it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right


def dense_attention(
    query: torch.Tensor,  # [B, Hq, T, D]
    keys: torch.Tensor,  # [B, H, L, D], the last T positions are the queries' own
    values: torch.Tensor,  # [B, H, L, D]
    key_valid: torch.Tensor | None,  # [B, L] bool, False = padding; None = no padding
    scaling: float,
    dropout: float = 0.0,
) -> torch.Tensor:  # [B, T, Hq, D]
    """Exact causal attention of a chunk over its prefix and itself (torch SDPA, GQA native where SDPA has a
    kernel for it)."""
    B, Hq, T, D = query.shape
    L = keys.shape[2]
    causal = key_valid is None and T == L  # the chunk is the whole sequence, unpadded: SDPA's causal mode
    # A chunk after its prefix, unpadded: query i sees keys up to L - T + i (causal aligned to the lower right),
    # which the flash kernel does without a mask where it runs.
    lower_right = key_valid is None and T < L and flash_lower_right(query, keys, values, dropout)
    flash = lower_right or causal and query.dtype in (torch.float16, torch.bfloat16)
    keys, values, gqa = gqa_inputs(query, keys, values, flash, query.is_cuda)
    if causal or lower_right:
        out = F.scaled_dot_product_attention(query, keys, values, attn_mask=causal_lower_right(T, L) if lower_right
                                             else None, is_causal=causal, scale=scaling, enable_gqa=gqa,
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


def flash_lower_right(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, dropout: float) -> bool:
    """Whether SDPA's flash kernel takes a chunk after its prefix: without it, the chunk's causal mask falls to the
    memory-efficient kernel with every KV head repeated per query head (at 24 x 30k prompts in 4k chunks, 12 GB
    of copies a layer).  Flash only: ``causal_lower_right``'s memory-efficient branch does not group KV heads."""
    if not query.is_cuda or query.dtype not in (torch.float16, torch.bfloat16) or torch.compiler.is_compiling():
        return False  # a traced step (another cache's compiled decode) keeps the plain masked call
    grouped = query.shape[1] != keys.shape[1]
    return torch.backends.cuda.can_use_flash_attention(
        torch.backends.cuda.SDPAParams(query, keys, values, None, dropout, False, grouped))


def gqa_inputs(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, flash: bool, cuda: bool):
    """``(keys, values, enable_gqa)`` for SDPA.  On CUDA only the flash kernel (causal, fp16 / bf16) takes grouped
    KV heads; anything else (float32, a mask) would fall back to the math kernel, which materialises the whole
    ``[B, Hq, T, L]`` score matrix (112 GiB for 8 x 16k float32 prompts).  There the KV heads are repeated per
    query head instead (a copy the size of the chunk's keys), so the memory-efficient kernel runs."""
    Hq, H = query.shape[1], keys.shape[1]
    if Hq == H:
        return keys, values, False
    if flash or not cuda:
        return keys, values, True
    return keys.repeat_interleave(Hq // H, 1), values.repeat_interleave(Hq // H, 1), False
