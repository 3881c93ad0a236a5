"""What a FlexiCache did so far: decode steps, re-ranks, pages moved between the tiers (``cache.stats``)."""

from __future__ import annotations

from dataclasses import dataclass

from .layer.schedule import DeviceCounters


@dataclass(frozen=True)
class CacheStats:
    """What one cache did so far (``cache.stats``: a snapshot; reading it synchronises with the device)."""

    decode_steps: int = 0
    prompt_tokens: int = 0
    pages_attended: int = 0  # sum over decode steps, layers, rows and KV heads of listed pages (count_pages=True)
    head_reranks: int = 0  # (layer, KV head) re-rank events
    head_steps: int = 0  # (layer, KV head) decode steps
    promoted_pages: int = 0  # pages loaded from the host tier into device slots
    offloaded_pages: int = 0  # pages written to the host tier during decode (per row/head)


def cache_stats(layers, states: dict, prompt_tokens: int) -> CacheStats:
    """The statistics of a cache's ``layers`` and their step schedules ``states`` (reads the device counters)."""
    if not states:
        return CacheStats(prompt_tokens=prompt_tokens)
    c = {name: 0 for name in DeviceCounters.NAMES}
    for state in states.values():  # decode steps are counted by the first device's only
        for name, value in state.counters.read().items():
            c[name] += value
    live = [layer for layer in layers if layer.is_initialized]
    return CacheStats(
        decode_steps=c["decode_steps"], prompt_tokens=prompt_tokens, pages_attended=c["pages_attended"],
        head_reranks=sum(int(layer.reranker.reranks.sum()) for layer in live),
        head_steps=c["decode_steps"] * sum(layer.storage.num_kv_heads for layer in live),
        promoted_pages=c["promoted_pages"], offloaded_pages=c["offloaded_pages"])


class CacheAccounting:
    """What a :class:`~flexicache_hf.FlexiCache` did and holds (its ``layers``, step schedules ``states`` and
    ``prompt_tokens``; ``sync`` brings the host's lengths up to date after graph replays)."""

    @property
    def stats(self) -> CacheStats:
        """What this cache did so far (a snapshot; synchronises with the device)."""
        self.sync()
        return cache_stats(self.layers, self.states, self.prompt_tokens)

    def host_bytes(self) -> int:
        return sum(layer.host_bytes() for layer in self.layers)

    def device_bytes(self) -> int:
        return sum(layer.device_bytes() for layer in self.layers)

    def commit_seconds(self) -> dict:
        """Reserved storage's commits, summed over layers, over the storage's life (a recycled storage's earlier
        caches included): ``host_wait_s``, the seconds forwards spent committing the host tier or waiting for a
        background commit; ``host_commit_s``, the seconds spent populating and page-locking on any thread;
        ``device_commit_s``, the seconds forwards spent mapping device memory."""
        per_layer = [layer.commit_seconds() for layer in self.layers]
        keys = ("host_wait_s", "host_commit_s", "device_commit_s")
        return {key: sum(t[i] for t in per_layer) for i, key in enumerate(keys)}

    def dense_bytes(self) -> int:
        self.sync()
        return sum(layer.dense_bytes() for layer in self.layers)

    def memory_report(self) -> dict:
        """Device / host bytes held now, against what ``DynamicCache`` would hold for the same tokens."""
        self.sync()
        dev, dense = self.device_bytes(), self.dense_bytes()
        return {"tokens": self.get_seq_length(), "device_bytes": dev, "host_bytes": self.host_bytes(),
                "dense_bytes": dense, "device_saving": 1 - dev / dense if dense else 0.0}
