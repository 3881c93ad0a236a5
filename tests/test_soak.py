"""Short soak: fresh caches in repeated generate calls leave nothing behind (the CPU half of the soak)."""

import gc
import weakref

import torch

from conftest import tiny_config, twin_models
from flexicache_hf import FlexiCache, HeadProfile, release_storage
from flexicache_hf.bench.soak import soak


def test_a_dropped_cache_is_freed_without_the_cyclic_collector():
    cfg = tiny_config("llama", heads=4, kv_heads=2)
    fc, _ = twin_models(cfg)
    cache = FlexiCache(HeadProfile.random(cfg, 0.5), page_size=4, token_budget=16, rerank_interval=3)
    ids = torch.randint(2, 96, (1, 30))
    fc.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False, past_key_values=cache)
    gone, pages = weakref.ref(cache), weakref.ref(cache.layers[0].storage.pool.k)
    gc.disable()
    try:
        del cache
        assert gone() is None  # no reference cycle: freed by reference counting alone
        assert pages() is not None and release_storage() > 0  # its storage kept for the next cache (recycling.py)
        assert pages() is None  # then freed, still without the cyclic collector
    finally:
        gc.enable()


def test_short_soak_leaves_no_live_caches_or_tensors():
    report = soak(calls=30, every=10, warmup=3, prompt_tokens=96, new_tokens=8)
    samples = report["samples"]
    assert [s["calls"] for s in samples] == [0, 10, 20, 30]
    assert all(s["FlexiCache"] == 0 and s["FlexiCacheLayer"] == s["kept_layers"] <= 2 for s in samples)  # (recycling)
    assert report["max_caches_alive_before_gc"] == 0
    assert samples[-1]["Tensor"] <= samples[0]["Tensor"]
    assert samples[-1]["tensor_bytes_cpu"] <= samples[0]["tensor_bytes_cpu"]
