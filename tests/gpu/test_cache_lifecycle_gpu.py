"""On CUDA: copies and pickles of a FlexiCache (pinned host tier, copy streams), memory freed when a cache is
dropped, and the "flexicache" attention with transformers' own caches (static, offloaded) against "sdpa".

Run on the lent H200 (never in CI): ``python -m pytest -q -m gpu tests/gpu/test_cache_lifecycle_gpu.py``.
"""

import gc
import sys
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache, StaticCache

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from conftest import copied, tiny_config, twin_models  # noqa: E402

from flexicache_hf import FlexiCache, HeadProfile, kept_storage_bytes, release_storage  # noqa: E402

SMALL = dict(page_size=16, token_budget=64, rerank_interval=4)


@pytest.fixture(scope="module")
def models():
    cfg = tiny_config("llama", heads=8, kv_heads=4, layers=3, head_dim=64, max_pos=4096)
    fc, dense = twin_models(cfg)
    return cfg, fc.cuda(), dense.cuda()


def greedy(model, ids, cache, n=12):
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                          do_sample=False, past_key_values=cache)


def host_tensors(cache):
    return [t for layer in cache.layers for t in vars(layer.storage.host).values()
            if isinstance(t, torch.Tensor) and t.device.type == "cpu"]  # (not the CUDA aliases of the pinned pages)


@pytest.mark.parametrize("how", ["deepcopy", "pickle", "torch.save"])
def test_copied_cuda_cache_is_pinned_and_continues_like_the_original(models, how):
    cfg, fc, _ = models
    cache = FlexiCache(HeadProfile.random(cfg, 0.25, seed=1), **SMALL)
    first = greedy(fc, torch.randint(2, 96, (2, 300), device="cuda"), cache)
    twin = copied(cache, how)
    assert host_tensors(twin) and all(t.is_pinned() for t in host_tensors(twin))
    assert twin.layers[0].storage.copies.stream is not cache.layers[0].storage.copies.stream
    follow = torch.cat([first, torch.randint(2, 96, (2, 20), device="cuda")], 1)
    assert torch.equal(greedy(fc, follow, twin), greedy(fc, follow, cache))


def test_dropped_cuda_cache_frees_device_memory_at_once(models):
    """A dropped cache is kept for the next one (:mod:`flexicache_hf.recycling`) by reference counting alone, and
    ``release_storage()`` then frees every byte of it at once: nothing of a cache waits for a garbage collection."""
    cfg, fc, _ = models
    ids = torch.randint(2, 96, (4, 600), device="cuda")
    greedy(fc, ids, FlexiCache(HeadProfile.random(cfg, 0.25), **SMALL))  # warm the allocator
    release_storage()
    gc.collect()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    gc.disable()
    try:
        cache = FlexiCache(HeadProfile.random(cfg, 0.25), **SMALL)
        greedy(fc, ids, cache)
        assert torch.cuda.memory_allocated() > before
        del cache
        assert kept_storage_bytes() > 0  # kept for the next cache of its shape, by reference counting
        release_storage()
        torch.cuda.synchronize()
        assert kept_storage_bytes() == 0
        assert torch.cuda.memory_allocated() == before  # freed by reference counting, no collection needed
    finally:
        gc.enable()


@pytest.mark.parametrize("cache", ["static", "offloaded", "cache_implementation=static"])
def test_flexicache_attention_equals_sdpa_with_transformers_caches_on_cuda(models, cache):
    cfg, fc, dense = models
    ids = torch.randint(2, 96, (2, 40), device="cuda")
    mask = torch.ones_like(ids)
    mask[1, :9] = 0  # left padding
    outs = []
    for model in (fc, dense):
        kw = {"static": lambda: dict(past_key_values=StaticCache(config=cfg, max_cache_len=96)),
              "offloaded": lambda: dict(past_key_values=DynamicCache(config=cfg, offloading=True)),
              "cache_implementation=static": lambda: dict(cache_implementation="static")}[cache]()
        out = model.generate(ids, attention_mask=mask, max_new_tokens=16, min_new_tokens=16, do_sample=False,
                             output_logits=True, return_dict_in_generate=True, **kw)
        outs.append((out.sequences, torch.stack(out.logits, 1)))
    assert torch.equal(outs[0][0], outs[1][0])
    torch.testing.assert_close(outs[0][1], outs[1][1], atol=2e-4, rtol=2e-4)
