"""``attn_implementation="sdpa_grouped"``: the strongest dense baseline we could give StaticCache (benchmarks only).

transformers' ``"sdpa"`` cannot use SDPA's grouped-query mode when a mask is passed
(``use_gqa_in_sdpa``), so with a static cache, whose every step carries a mask over the whole buffer, it
first repeats each KV head for its query heads (``repeat_kv``): the KV cache is read, written and read again
4× (Llama-3.1-8B) per decode step.  This function keeps transformers' masks and exactness but avoids that:

* **decode** (one query per row): the ``G`` query heads of a KV head become ``G`` query *rows* of one SDPA
  call per KV head (``[B, Hkv, G, D]`` against ``[B, Hkv, S, D]``), the row's mask broadcast over them; each
  KV head is read once, as a paged kernel would.
* **prompt from position 0 with nothing padded** (the mask function then returns ``None``): causal SDPA with
  ``enable_gqa`` over the first ``T`` keys of the buffer (flash attention, no ``[B, 1, T, S]`` mask).
* **a later prompt chunk with nothing padded** (``generate(prefill_chunk_size=...)``; transformers' mask is then
  exactly causal from the chunk's offset ``o``): SDPA over the ``o + T`` filled keys with torch's lower-right
  causal bias and ``enable_gqa`` (flash attention again), instead of repeating every KV head 4× under a mask
  over the whole buffer.  Chunked prefill is what lets a static cache fill 16 × 30k at all.  When ``generate``
  compiles the chunks (it does for a static cache), neither function reads anything on the host: the chunk takes
  transformers' SDPA with transformers' mask, and the whole forward stays one CUDA graph.
* anything else: transformers' own SDPA attention with transformers' mask.

It is registered by :func:`register` under :data:`NAME` for the ``static-sdpa_grouped`` row of
``bench.generate``; it is no part of FlexiCache.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from torch.nn.attention.bias import causal_lower_right
from transformers.masking_utils import AttentionMaskInterface, causal_mask_function, sdpa_mask

NAME = "sdpa_grouped"


def _prompt_from_start(q_length: int, q_offset) -> bool:
    if q_length == 1 or torch.compiler.is_compiling():
        # a decode step: never read a device offset (it would synchronise every step); a compiled prompt chunk
        # (generate compiles chunked prefill for a static cache): a host read would break the CUDA graph
        return False
    return int(q_offset) == 0


def grouped_mask(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset: int = 0,
                 mask_function=causal_mask_function, attention_mask: torch.Tensor | None = None, **kwargs):
    """``None`` for an unpadded causal prompt that starts at position 0; else transformers' 4D SDPA mask."""
    for skip in ("allow_is_causal_skip", "allow_is_bidirectional_skip"):
        kwargs.pop(skip, None)
    if (mask_function is causal_mask_function and kv_offset == 0 and kwargs.get("local_size") is None
            and _prompt_from_start(q_length, q_offset)
            and (attention_mask is None or bool(attention_mask.bool().all()))):
        return None
    return sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                     kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask,
                     allow_is_causal_skip=False, allow_is_bidirectional_skip=False, **kwargs)


def causal_chunk_end(mask: torch.Tensor) -> int | None:
    """``o + T`` when the 4D boolean (or 0/1 integer) ``mask [B, 1, T, S]`` is exactly causal from offset ``o`` over
    the first ``o + T`` keys with nothing padded (row ``i`` sees keys ``0 .. o + i``); else ``None``.  Prompt chunks
    only: it reads the mask on the host."""
    if mask.is_floating_point() or mask.shape[1] != 1:
        return None  # an additive mask (0 / -inf): transformers' own path
    mask = mask.bool()
    T, S = mask.shape[2], mask.shape[3]
    end = int(mask[0, 0, 0].sum()) - 1 + T  # row 0 sees o + 1 keys
    if end > S or end < T:
        return None
    keys = torch.arange(S, device=mask.device)
    rows = torch.arange(T, device=mask.device)
    expected = keys[None, :] <= (end - T + rows)[:, None]  # [T, S]
    return end if bool((mask[:, 0] == expected).all()) else None


def grouped_sdpa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                 **kwargs):
    """``query [B, Hq, T, D]``, ``key/value [B, Hkv, S, D]`` -> ``([B, T, Hq, D], None)``."""
    B, Hq, T, D = query.shape
    Hkv = key.shape[1]
    if attention_mask is None and T > 1 and not dropout:
        out = F.scaled_dot_product_attention(query, key[:, :, :T], value[:, :, :T], is_causal=True,
                                             scale=scaling, enable_gqa=Hq != Hkv)
        return out.transpose(1, 2).contiguous(), None
    end = None
    if T > 1 and attention_mask is not None and attention_mask.dim() == 4 and not dropout \
            and not torch.compiler.is_compiling():  # reading the mask on the host would break a compiled chunk
        end = causal_chunk_end(attention_mask)
    if end is not None:
        out = F.scaled_dot_product_attention(query, key[:, :, :end], value[:, :, :end],
                                             attn_mask=causal_lower_right(T, end), scale=scaling,
                                             enable_gqa=Hq != Hkv)
        return out.transpose(1, 2).contiguous(), None
    if T == 1 and attention_mask is not None and attention_mask.dim() == 4 and not dropout:
        mask = attention_mask if attention_mask.dtype == torch.bool else attention_mask.to(query.dtype)
        q = query.reshape(B, Hkv, Hq // Hkv, D)  # query head h reads KV head h // G (repeat_kv's order)
        out = F.scaled_dot_product_attention(q, key, value, attn_mask=mask[:, :, :1], scale=scaling)
        return out.reshape(B, Hq, 1, D).transpose(1, 2), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  **kwargs)


def register() -> None:
    AttentionInterface.register(NAME, grouped_sdpa)
    AttentionMaskInterface.register(NAME, grouped_mask)
