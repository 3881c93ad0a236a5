"""Copying and saving a filled FlexiCache: transformers' prefix-reuse pattern, pickle and torch.save."""

import copy
import pickle

import pytest
import torch
from transformers import DynamicCache

from conftest import copied, tiny_config, twin_models
from flexicache_hf import CacheStateError, FlexiCache, HeadProfile, SelectionObserver

SMALL = dict(page_size=4, token_budget=16, rerank_interval=3)  # stable heads live in slots + the host tier
FULL = dict(page_size=4, token_budget=512, rerank_interval=3)


def greedy(model, ids, cache, n=10):
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                          do_sample=False, past_key_values=cache)


def tensors(obj, seen=None):
    """Every tensor reachable from a cache's attributes (for checking that a copy shares none)."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return []
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for x in obj for t in tensors(x, seen)]
    if isinstance(obj, dict):
        return [t for x in obj.values() for t in tensors(x, seen)]
    if hasattr(obj, "__dict__") and type(obj).__module__.startswith("flexicache_hf"):
        return tensors(vars(obj), seen)
    return []


@pytest.fixture(scope="module")
def models():
    cfg = tiny_config("llama", heads=4, kv_heads=2, layers=3)
    return (cfg, *twin_models(cfg))


def test_deep_copy_of_a_prompt_cache_serves_several_continuations(models):
    """transformers' documented prefix reuse: one prompt's cache, deep-copied for each continuation."""
    cfg, fc, _ = models
    profile = HeadProfile.random(cfg, 0.34, seed=5)
    prefix = torch.randint(2, 96, (1, 37))
    prompt_cache = FlexiCache(profile, **SMALL)
    with torch.no_grad():
        fc(prefix, past_key_values=prompt_cache)
    suffixes = [torch.randint(2, 96, (1, n)) for n in (6, 11, 1)]
    for suffix in suffixes:
        ids = torch.cat([prefix, suffix], 1)
        reused = greedy(fc, ids, copy.deepcopy(prompt_cache))
        fresh = FlexiCache(profile, **SMALL)  # the same prefix forward, then the same continuation
        with torch.no_grad():
            fc(prefix, past_key_values=fresh)
        assert torch.equal(reused, greedy(fc, ids, fresh))
    assert prompt_cache.get_seq_length() == 37  # the copies' continuations never touched the original


def test_deep_copy_mid_generation_continues_like_the_original(models):
    """Copied between decode steps: a partly filled newest page, stable heads between re-ranks, promoted pages."""
    cfg, fc, _ = models
    cache = FlexiCache(HeadProfile.random(cfg, 0.34, seed=6), **SMALL)
    first = greedy(fc, torch.randint(2, 96, (2, 29)), cache, n=8)
    twin = copy.deepcopy(cache)
    assert twin.get_seq_length() == cache.get_seq_length()
    assert twin.profile is cache.profile and twin.layers[1] is not cache.layers[1]
    originals = {t.data_ptr() for t in tensors(cache) if t.numel()}
    assert not originals & {t.data_ptr() for t in tensors(twin) if t.numel()}
    follow = torch.cat([first, torch.randint(2, 96, (2, 7))], 1)
    assert torch.equal(greedy(fc, follow, twin), greedy(fc, follow, cache))
    assert twin.stats.decode_steps == cache.stats.decode_steps


def test_deep_copy_at_full_budget_equals_dynamic_cache_prefix_reuse(models):
    cfg, fc, dense = models
    prefix = torch.randint(2, 96, (1, 25))
    ours, theirs = FlexiCache(HeadProfile.random(cfg, 0.34), **FULL), DynamicCache()
    with torch.no_grad():
        fc(prefix, past_key_values=ours)
        dense(prefix, past_key_values=theirs)
    for n in (4, 9):
        ids = torch.cat([prefix, torch.randint(2, 96, (1, n))], 1)
        assert torch.equal(greedy(fc, ids, copy.deepcopy(ours)), greedy(dense, ids, copy.deepcopy(theirs)))


def test_deep_copy_shares_the_observer():
    class Count(SelectionObserver):
        def __init__(self):
            self.n = 0

        def on_rerank(self, event):
            self.n += 1

    cfg = tiny_config("llama", heads=4, kv_heads=2)
    fc, _ = twin_models(cfg)
    seen = Count()
    cache = FlexiCache(HeadProfile.random(cfg, 0.5), observer=seen, **SMALL)
    first = greedy(fc, torch.randint(2, 96, (1, 20)), cache, n=4)
    before = seen.n
    twin = copy.deepcopy(cache)
    assert twin.observer is seen
    greedy(fc, torch.cat([first, torch.randint(2, 96, (1, 3))], 1), twin, n=4)
    assert seen.n > before


@pytest.mark.parametrize("how", ["pickle", "torch.save"])
def test_pickled_cache_continues_like_the_original(models, how):
    cfg, fc, _ = models
    cache = FlexiCache(HeadProfile.random(cfg, 0.34, seed=7), **SMALL)
    first = greedy(fc, torch.randint(2, 96, (1, 33)), cache, n=6)
    loaded = copied(cache, how)
    assert isinstance(loaded, FlexiCache) and loaded.get_seq_length() == cache.get_seq_length()
    follow = torch.cat([first, torch.randint(2, 96, (1, 5))], 1)
    assert torch.equal(greedy(fc, follow, loaded), greedy(fc, follow, cache))


def test_head_profile_pickles_and_copies():
    cfg = tiny_config("llama", heads=4, kv_heads=2)
    scores = {(l, h): float(l + h) for l in range(2) for h in range(2)}
    profile = HeadProfile.from_scores(cfg, scores, 0.5, provenance={"kind": "test"})
    for other in (pickle.loads(pickle.dumps(profile)), copy.deepcopy(profile), copy.copy(profile)):
        assert other == profile and hash(other) == hash(profile)
        assert dict(other.scores) == scores and other.provenance["kind"] == "test"
        with pytest.raises(TypeError):
            other.provenance["kind"] = "changed"  # still read-only


def test_a_cache_left_unusable_refuses_to_be_copied(models):
    cfg, fc, dense = models
    cache = FlexiCache(HeadProfile.random(cfg, 0.34), **SMALL)
    greedy(fc, torch.randint(2, 96, (1, 20)), cache, n=3)

    def interrupt(*_):
        raise KeyboardInterrupt

    hook = fc.model.layers[1].mlp.register_forward_hook(interrupt)  # after layer 0 attended and layer 1 stored
    try:
        with pytest.raises(KeyboardInterrupt):
            fc(torch.randint(2, 96, (1, 4)), past_key_values=cache)
    finally:
        hook.remove()
    with pytest.raises(CacheStateError, match="reset"):
        copy.deepcopy(cache)
    with pytest.raises(CacheStateError, match="reset"):
        pickle.dumps(cache)


def test_a_forward_outside_no_grad_leaves_no_autograd_history_in_the_cache(models):
    """The cache stores data, not autograd graphs: filled by forwards that track gradients, it copies."""
    cfg, fc, _ = models
    cache = FlexiCache(HeadProfile.random(cfg, 0.34), **SMALL)
    ids = torch.randint(2, 96, (1, 20))
    fc(ids, past_key_values=cache)
    fc(ids[:, :1], past_key_values=cache)
    assert not any(t.requires_grad for layer in cache.layers for t in layer.buffers())
    assert copy.deepcopy(cache).get_seq_length() == 21


def test_copy_of_an_unused_cache_works_like_a_new_one(models):
    cfg, fc, _ = models
    cache = FlexiCache(HeadProfile.random(cfg, 0.34), **SMALL)
    ids = torch.randint(2, 96, (2, 26))
    assert torch.equal(greedy(fc, ids, copy.deepcopy(cache)), greedy(fc, ids, pickle.loads(pickle.dumps(cache))))
    assert cache.get_seq_length() == 0
