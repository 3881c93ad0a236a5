"""The ``"flexicache"`` attention function and its mask function, registered with transformers.

transformers calls ``attention_interface(module, query, key, value, attention_mask, scaling=..., ...)``
right after ``past_key_values.update``.  With a :class:`~flexicache_hf.FlexiCache`, ``key``/``value`` are the
:class:`~flexicache_hf.handle.PagedKV` handle that ``update`` returned, which names its cache and layer: the
function gives it back to ``cache.attend`` (prompt chunks get exact causal attention over the cached prefix and
the chunk, decode steps get top-K page selection and sparse paged attention).  With any other cache (or none) it computes exact dense
attention, so a model loaded with ``attn_implementation="flexicache"`` gives what ``"sdpa"`` gives with
``DynamicCache``, ``StaticCache`` (and ``cache_implementation="static"``), offloaded caches or no cache.

The mask function never sees the cache, only the geometry transformers derives from it.  Two cases:

* **Queries last** (``DynamicCache``, ``FlexiCache``, no cache): the keys are exactly the cached prefix and
  the new tokens, so causal attention is implied and padding is the only thing a mask adds.  The mask is the
  2D padding mask ``[B, kv]`` (or ``None`` when nothing is padded): a 4D ``[B, 1, q, kv]`` mask would cost
  memory quadratic in the context for every FlexiCache prompt chunk.
* **Anything else** (a static cache hands attention its whole ``max_cache_len`` buffer, unfilled tail
  included; non-causal mask patterns): transformers' own exact 4D boolean SDPA mask, which the attention
  function passes to transformers' SDPA attention.  FlexiCache refuses such masks.

Sliding-window (and chunked) attention layers are refused by the mask function, before any layer runs.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, causal_mask_function, sdpa_mask

from .dense import dense_attention
from .handle import PagedKV, UnsupportedModelError
from .graph_step import GraphStep

NAME = "flexicache"

_SLIDING = (
    "the 'flexicache' attention serves full-attention layers only; this model has sliding-window (or chunked) "
    "attention layers (window {window}). Load it with attn_implementation='sdpa', or, for checkpoints trained "
    "with full attention (e.g. Mistral v0.2+), set config.sliding_window=None"
)


def _queries_last(q_length: int, kv_length: int, q_offset, kv_offset: int) -> bool:
    """True when the keys are exactly every cached position and then the queries' own (no static buffer)."""
    if isinstance(q_offset, torch.Tensor):
        if q_length == 1:
            return False  # a static cache's (or a graphed FlexiCache's) decode step: never wait for the GPU
        q_offset = int(q_offset)  # a static cache passes a 0-d tensor
    return kv_offset == 0 and q_offset + q_length == kv_length


def flexicache_mask(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset: int = 0,
                    mask_function=causal_mask_function, attention_mask: torch.Tensor | None = None,
                    local_size: int | None = None, **kwargs):
    """The padding mask ``[B, kv_length]`` (bool, True = attend) or ``None`` when the keys are the cached prefix
    and the queries (the usual case); otherwise transformers' exact 4D boolean SDPA mask."""
    if local_size is not None:
        raise UnsupportedModelError(_SLIDING.format(window=local_size))
    plain_2d = attention_mask is None or (attention_mask.dim() == 2 and attention_mask.shape[-1] == kv_length)
    if mask_function is causal_mask_function and plain_2d and _queries_last(q_length, kv_length, q_offset,
                                                                             kv_offset):
        if attention_mask is None:
            return None
        mask = attention_mask.bool()
        return None if bool(mask.all()) else mask
    # Never None here: None means "queries last, no padding" to the attention function.
    for skip in ("allow_is_causal_skip", "allow_is_bidirectional_skip"):
        kwargs.pop(skip, None)
    return sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                     kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask,
                     allow_is_causal_skip=False, allow_is_bidirectional_skip=False, **kwargs)


def flexicache_attention(module: torch.nn.Module, query: torch.Tensor, key, value,
                         attention_mask: torch.Tensor | None, scaling: float | None = None,
                         dropout: float = 0.0, **kwargs):
    """transformers attention function: ``query [B, Hq, T, D]`` -> ``([B, T, Hq, D], None)``."""
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    if isinstance(key, GraphStep):  # a decode step inside torch.compile (FlexiCache.update's graph path)
        return key.attend(query, scaling), None
    if isinstance(key, PagedKV):
        try:
            return _attend_paged(module, query, key, attention_mask, scaling, dropout, kwargs), None
        except BaseException as e:  # the cache names it if this forward is ever resumed
            key.cache.guard.note(e)
            raise
    _refuse_unsupported(kwargs)
    if attention_mask is None or attention_mask.dim() == 2:  # queries last (see flexicache_mask)
        key_valid = None if attention_mask is None else attention_mask.bool()
        return dense_attention(query, key, value, key_valid, scaling, dropout), None
    # transformers' exact 4D mask (a static cache's whole buffer, another mask pattern): transformers' own SDPA.
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  **kwargs)


def _refuse_unsupported(kwargs: dict) -> None:
    if kwargs.get("output_attentions"):
        raise ValueError(
            "output_attentions=True is not supported by the 'flexicache' attention (it never forms the attention "
            "weights); load the model with attn_implementation='eager' to inspect them"
        )
    if kwargs.get("sliding_window") is not None:
        raise UnsupportedModelError(_SLIDING.format(window=kwargs["sliding_window"]))


def _attend_paged(module, query, handle: PagedKV, attention_mask, scaling: float, dropout: float, kwargs: dict):
    try:
        attention_mask = _paged_mask(query, handle, attention_mask, dropout, kwargs)
    except Exception as e:  # refused before anything of the attention ran: the cache undoes the forward
        handle.cache.refused(handle, e)
        raise
    return handle.cache.attend(handle, query, attention_mask, scaling, model_config=module.config)


def _paged_mask(query, handle: PagedKV, attention_mask, dropout: float, kwargs: dict):
    """The 2D padding mask (or None) FlexiCache attends a handle with; refuses what it cannot serve."""
    _refuse_unsupported(kwargs)
    decode = query.shape[2] == 1 and handle.start > 0
    if decode and attention_mask is not None and attention_mask.dim() == 4:
        # generate's static-shape mask of a cache that may be graphed (see FlexiCacheLayer.get_mask_sizes): a
        # decode step reads each row's left padding from the prompt, so the mask adds nothing but, at the forward's
        # first layer, whether the new token is padding, which its row over the keys held and itself says (a view;
        # read only where a row holds nothing but padding so far, layer.prefill.check_token_padding)
        first = handle.layer_idx == 0 and attention_mask.dtype == torch.bool
        attention_mask = attention_mask[:, 0, -1, : handle.start + 1] if first else None
    if attention_mask is not None and attention_mask.dim() != 2:
        raise ValueError(
            "FlexiCache takes causal attention with a 2D padding mask only (the 'flexicache' mask function makes "
            f"one); got a {attention_mask.dim()}D mask. Custom 4D masks and mask patterns other than causal are not "
            "supported, and a 2D attention_mask must cover every cached position and the new tokens"
        )
    if dropout:
        raise ValueError("FlexiCache serves inference only: attention dropout must be 0 (call model.eval())")
    return attention_mask


def register() -> None:
    """Make ``attn_implementation="flexicache"`` available to every transformers model (idempotent)."""
    AttentionInterface.register(NAME, flexicache_attention)
    AttentionMaskInterface.register(NAME, flexicache_mask)
