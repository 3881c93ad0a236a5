"""Permanent-eviction baselines as transformers ``Cache`` subclasses: StreamingLLM, SnapKV-style, LServe-like.

They are the comparison FlexiCache is judged against at the same token budget: each keeps at most
``budget`` tokens per KV head and forgets the rest for good, where FlexiCache keeps everything and only
*attends* to ``budget`` tokens.

Conventions shared by every layer here (and tested):

* ``budget`` counts the tokens a decode step attends to, the new token included — the same meaning as
  ``FlexiCacheConfig.token_budget`` — so a layer *stores* ``budget - 1`` tokens between steps.
* ``update`` returns the stored tokens plus the new ones (a prompt is therefore attended exactly, as every
  policy in the harness prefills densely) and evicts afterwards, for storage only.
* Positions keep counting logical tokens while the keys shrink: ``get_seq_length`` is the logical length
  (transformers derives position ids from it) and ``get_mask_sizes`` gives the physical key count with the
  offset that maps the new tokens onto their logical positions (so a causal mask built by sdpa stays
  causal inside a chunk).
* Every head of a layer stores the same number of tokens (one ``[B, H, n, D]`` tensor), but not the same
  tokens; keys carry RoPE already, so their order in storage is irrelevant to a decode step.
* Left padding is not supported (the harness runs batch 1).

SnapKV and LServe need the *query* that scored the keys, which ``Cache.update`` never sees; the harness
hands it over with :func:`flexicache_hf.eval.query_capture.capture_queries` (``wants_query`` asks for it).
"""

from __future__ import annotations

import random

import torch
import torch.nn.functional as F
from transformers.cache_utils import Cache, DynamicLayer


class EvictionLayer(DynamicLayer):
    """A ``DynamicLayer`` that keeps at most ``budget - 1`` tokens per head; subclasses pick which."""

    is_croppable = False
    wants_query = False

    def __init__(self, budget: int):
        super().__init__()
        if budget < 2:
            raise ValueError(f"budget must be >= 2 tokens (the newest one and one more), got {budget}")
        self.budget = budget
        self.logical = 0  # tokens seen, evicted ones included
        self.query = None  # [B, Hq, T, D] of the forward in flight (set by capture_queries)

    @property
    def capacity(self) -> int:
        return self.budget - 1

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        keys = torch.cat([self.keys, key_states], dim=-2)
        values = torch.cat([self.values, value_states], dim=-2)
        T = key_states.shape[-2]
        self.logical += T
        keep = self.select(keys, T) if keys.shape[-2] > self.capacity else None
        if keep is None:
            self.keys, self.values = keys, values
        else:
            idx = keep[..., None].expand(-1, -1, -1, keys.shape[-1])
            self.keys, self.values = keys.gather(2, idx), values.gather(2, idx)
        self.query = None  # a query belongs to one forward; never score with a stale one
        return keys, values

    def select(self, keys: torch.Tensor, new_tokens: int) -> torch.Tensor:
        """``[B, H, capacity]`` indices into ``keys`` (stored + new) to keep; called only when over capacity."""
        raise NotImplementedError

    def stored(self) -> int:
        return 0 if not self.is_initialized else self.keys.shape[-2]

    def get_seq_length(self) -> int:
        return self.logical

    def get_mask_sizes(self, query_length) -> tuple[int, int]:
        if isinstance(query_length, torch.Tensor):  # older transformers pass cache_position
            query_length = query_length.shape[0]
        stored = self.stored()
        return stored + query_length, self.logical - stored

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove:
            raise NotImplementedError("evicted tokens cannot be rolled back (no assisted decoding)")

    def reset(self) -> None:
        super().reset()
        self.logical, self.query = 0, None

    def _need_query(self) -> torch.Tensor:
        if self.query is None:
            raise RuntimeError(f"{type(self).__name__} scores keys with the model's queries: run the model "
                               "inside flexicache_hf.eval.query_capture.capture_queries(model)")
        return self.query


def _sink_recent(n: int, sink: int, keep: int, device) -> torch.Tensor:
    """Indices of the first ``sink`` and the last ``keep - sink`` of ``n`` tokens (ascending)."""
    sink = min(sink, keep)
    return torch.cat([torch.arange(sink, device=device), torch.arange(n - (keep - sink), n, device=device)])


def _group_scores(query: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """``q·k`` per (KV head, query, key), the max over the query heads sharing a KV head: ``[B, H, Tq, L]``.

    Max, not mean: a key matters to a KV head if any of its query heads wants it.
    """
    B, Hq, Tq, D = query.shape
    H = keys.shape[1]
    logits = torch.einsum("bhgtd,bhld->bhgtl", query.reshape(B, H, Hq // H, Tq, D).float(), keys.float())
    return logits.amax(dim=2)


class StreamingLayer(EvictionLayer):
    """StreamingLLM: ``sink`` attention-sink tokens plus the most recent ones."""

    def __init__(self, budget: int, sink: int = 4):
        super().__init__(budget)
        self.sink = sink

    def select(self, keys, new_tokens):
        B, H, n, _ = keys.shape
        return _sink_recent(n, self.sink, self.capacity, keys.device).expand(B, H, -1)


class SnapKVLayer(EvictionLayer):
    """SnapKV-style: after prefill keep, per head, the prompt tokens the prompt's last ``window`` queries
    attend to most (pooled over neighbouring positions), plus the window; evict the rest for good.

    At a fixed budget the selected prompt tokens stay pinned and the window slides over generated tokens
    (SnapKV proper lets decode tokens accumulate; a fixed budget is what makes the comparison fair).
    """

    wants_query = True

    def __init__(self, budget: int, window: int = 32, pool: int = 7):
        super().__init__(budget)
        self.window, self.pool = window, pool
        self.pinned = 0  # leading stored tokens chosen at prefill; never evicted by the sliding window

    def select(self, keys, new_tokens):
        B, H, n, _ = keys.shape
        cap = self.capacity
        window = min(self.window, cap)
        prefill = new_tokens == n  # the whole prompt in one forward, nothing stored before
        if not prefill or cap - window == 0 or n - window <= 0:
            # Decode (or no room to pin): the pinned prompt tokens stay, the oldest unpinned ones go.
            idx = torch.cat([torch.arange(self.pinned, device=keys.device),
                             torch.arange(n - (cap - self.pinned), n, device=keys.device)])
            return idx.expand(B, H, -1)
        q = self._need_query()[:, :, -window:]  # [B, Hq, w, D]
        scale = keys.shape[-1] ** -0.5
        logits = _group_scores(q, keys) * scale  # [B, H, w, n]
        qpos = torch.arange(n - window, n, device=keys.device)
        causal = torch.arange(n, device=keys.device)[None, :] <= qpos[:, None]
        attn = logits.masked_fill(~causal, float("-inf")).softmax(-1)[..., : n - window].sum(2)  # [B, H, n-w]
        # Pooling keeps the neighbours of a hot token, so an answer is not kept without its context.
        attn = F.avg_pool1d(attn.reshape(B * H, 1, -1), self.pool, stride=1, padding=self.pool // 2,
                            count_include_pad=False).reshape(B, H, -1)
        self.pinned = cap - window
        top = attn.topk(self.pinned, dim=-1).indices.sort(-1).values
        recent = torch.arange(n - window, n, device=keys.device).expand(B, H, -1)
        return torch.cat([top, recent], dim=-1)


class LServeLayer(EvictionLayer):
    """LServe-like: ``streaming`` KV heads keep sink + recent tokens; the others keep the tokens that the
    latest query-aware selection (token-granular, re-run every ``interval`` decode steps and at prefill)
    scored highest — everything not selected is evicted for good.  Between selections the newest tokens
    are kept and the lowest-scored survivors of the last selection go first.
    """

    wants_query = True

    def __init__(self, budget: int, streaming_heads: tuple[int, ...], interval: int = 16, sink: int = 4,
                 local: int = 16):
        super().__init__(budget)
        self.streaming_heads, self.interval, self.sink, self.local = streaming_heads, interval, sink, local
        self.scores = None  # [B, H, stored] score of each stored token at the last selection
        self.step = 0  # decode steps since prefill

    def update(self, key_states, value_states, *args, **kwargs):
        T = key_states.shape[-2]
        due = T > 1 or self.step % self.interval == 0
        self.step = 0 if T > 1 else self.step + 1
        self._due = due
        return super().update(key_states, value_states, *args, **kwargs)

    def select(self, keys, new_tokens):
        B, H, n, _ = keys.shape
        cap, dev = self.capacity, keys.device
        old = self.scores if self.scores is not None else keys.new_zeros((B, H, 0), dtype=torch.float32)
        fresh = torch.full((B, H, new_tokens), float("inf"), device=dev)
        scores = torch.cat([old, fresh], dim=-1)
        if self._due:  # re-score every stored token with the current (last) query
            scores = _group_scores(self._need_query()[:, :, -1:], keys)[:, :, 0]
            recent = torch.arange(n, device=dev) >= n - min(self.local, cap)
            scores = scores.masked_fill(recent, float("inf"))  # the local window is always kept
        keep = scores.topk(cap, dim=-1).indices.sort(-1).values
        if self.streaming_heads:
            sh = torch.tensor(self.streaming_heads, device=dev)
            keep[:, sh] = _sink_recent(n, self.sink, cap, dev).expand(B, len(self.streaming_heads), -1)
        self.scores = scores.gather(2, keep)
        return keep

    def reset(self) -> None:
        super().reset()
        self.scores, self.step = None, 0


class EvictionCache(Cache):
    """A transformers ``Cache`` of eviction layers (one per decoder layer)."""

    def __init__(self, layers: list[EvictionLayer]):
        super().__init__(layers=layers)

    @property
    def wants_query(self) -> bool:
        return any(layer.wants_query for layer in self.layers)


def streaming_cache(num_layers: int, budget: int, sink: int = 4) -> EvictionCache:
    return EvictionCache([StreamingLayer(budget, sink) for _ in range(num_layers)])


def snapkv_cache(num_layers: int, budget: int, window: int = 32, pool: int = 7) -> EvictionCache:
    return EvictionCache([SnapKVLayer(budget, window, pool) for _ in range(num_layers)])


def lserve_streaming_heads(num_layers: int, num_kv_heads: int, fraction: float = 0.5,
                           seed: int = 0) -> list[tuple[int, ...]]:
    """Which KV heads of each layer stream.  LServe learns them (DuoAttention gates); without trained gates a
    seeded draw of ``round(fraction * H)`` heads per layer is the honest stand-in."""
    rng = random.Random(seed)
    k = round(fraction * num_kv_heads)
    return [tuple(sorted(rng.sample(range(num_kv_heads), k))) for _ in range(num_layers)]


def lserve_cache(num_layers: int, num_kv_heads: int, budget: int, interval: int = 16,
                 streaming_fraction: float = 0.5, seed: int = 0) -> EvictionCache:
    heads = lserve_streaming_heads(num_layers, num_kv_heads, streaming_fraction, seed)
    return EvictionCache([LServeLayer(budget, heads[i], interval) for i in range(num_layers)])
