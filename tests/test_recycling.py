"""A dropped sized cache's storage serves the next cache of its shape (recycling.py): same buffers, a new cache's
results; never shared with a live cache, never kept when it cannot be handed over safely."""

import gc
import weakref

import pytest
import torch

from conftest import tiny_config, twin_models
from flexicache_hf import FlexiCache, HeadProfile, kept_storage_bytes, release_storage
from flexicache_hf.rerank import SelectionObserver

SIZED = dict(page_size=4, token_budget=8, rerank_interval=3, max_cache_len=48)
UNSIZED = {**SIZED, "max_cache_len": None}  # reserved storage (reserve.py: the profile records the context)


def gen(model, ids, cache, n=10):
    return model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, past_key_values=cache,
                          pad_token_id=0, disable_compile=True)


@pytest.fixture
def setup():
    release_storage()
    cfg = tiny_config("llama", heads=4, kv_heads=2, layers=3)
    fc, _ = twin_models(cfg)
    prof = HeadProfile.random(cfg, 0.5, seed=5)
    g = torch.Generator().manual_seed(6)
    a, b = torch.randint(2, 96, (2, 23), generator=g), torch.randint(2, 96, (2, 19), generator=g)
    yield fc, prof, a, b
    release_storage()


def pointers(cache):
    return [t.data_ptr() for layer in cache.layers for t in layer.buffers() + [layer.storage.host.k, layer.storage.host.v]
            if t is not None and t.numel()] + [
        t.data_ptr() for t in cache.layers[0].state.tensors()]


@pytest.mark.parametrize("kw", [SIZED, UNSIZED], ids=["sized", "reserved"])
def test_next_cache_of_the_shape_takes_the_storage_and_answers_as_a_new_one(setup, kw):
    fc, prof, a, b = setup
    SIZED = kw  # (the test's one shape)
    cache = FlexiCache(prof, **SIZED)
    gen(fc, a, cache)
    ptrs, layers = pointers(cache), [id(layer) for layer in cache.layers]
    del cache
    assert kept_storage_bytes() > 0
    taken = FlexiCache(prof, **SIZED)
    assert kept_storage_bytes() > 0 and not any(layer.is_initialized for layer in taken.layers)  # until it runs
    got = gen(fc, b, taken)
    assert kept_storage_bytes() == 0  # handed over, not held twice
    assert [id(layer) for layer in taken.layers] == layers
    assert taken.storage_reused
    assert pointers(taken) == ptrs
    release_storage()
    fresh = FlexiCache(prof, **SIZED)
    assert not any(layer.is_initialized for layer in fresh.layers)
    assert torch.equal(got, gen(fc, b, fresh))
    assert not fresh.storage_reused
    assert taken.stats == fresh.stats
    for mine, new in zip(taken.layers, fresh.layers):  # every stored token and selection as a new cache's
        assert torch.equal(mine.gather_tokens(mine.seq_len)[0], new.gather_tokens(new.seq_len)[0])
        held = -(-new.seq_len // 4)  # (reserved storage: the pages past these may be committed by one, not the other)
        assert torch.equal(mine.storage.kmin[:, :, :held], new.storage.kmin[:, :, :held])
        assert torch.equal(mine.reranker.selected, new.reranker.selected)
    assert taken.host_bytes() == fresh.host_bytes()
    taken.reset()
    assert not taken.storage_reused  # (it runs on what it holds)


def test_another_batch_size_allocates_anew_inside_the_taken_cache(setup):
    fc, prof, a, b = setup
    gen(fc, a, FlexiCache(prof, **SIZED))  # dropped at once: kept
    taken = FlexiCache(prof, **SIZED)
    one = b[:1]
    got = gen(fc, one, taken)
    assert taken.layers[0].storage.batch == 1
    release_storage()
    assert torch.equal(got, gen(fc, one, FlexiCache(prof, **SIZED)))


def test_a_cache_of_another_shape_frees_the_kept_storage(setup):
    fc, prof, a, _ = setup
    gen(fc, a, FlexiCache(prof, **SIZED))
    assert kept_storage_bytes() > 0
    other = FlexiCache(prof, **{**SIZED, "max_cache_len": 64})
    kept = kept_layer()
    gen(fc, a, other)  # its first forward frees the kept storage (before allocating its own)
    assert kept() is None and kept_storage_bytes() == 0
    del other
    assert kept_storage_bytes() > 0
    gen(fc, a, FlexiCache(prof, **{**SIZED, "token_budget": 12}))  # another configuration: freed too
    assert kept_storage_bytes() > 0  # (that cache's own, once it is dropped)
    gen(fc, a, FlexiCache(prof, **UNSIZED, kernels="reference"))  # a growing cache takes nothing, frees it
    assert kept_storage_bytes() == 0
    gen(fc, a, FlexiCache(prof, **UNSIZED))  # reserved storage: kept when dropped, like a sized cache's
    assert kept_storage_bytes() > 0
    sized = FlexiCache(prof, **SIZED)
    gen(fc, a, sized)  # a sized cache does not take it: freed
    assert not sized.storage_reused and kept_storage_bytes() == 0


def test_a_loop_that_replaces_its_cache_holds_one_storage_at_a_time(setup):
    fc, prof, a, _ = setup
    cache = FlexiCache(prof, **SIZED)
    gen(fc, a, cache)
    first = set(pointers(cache))
    for _ in range(3):
        cache = FlexiCache(prof, **SIZED)  # the previous one is dropped here: kept, then taken by the forward
        gen(fc, a, cache)
        assert set(pointers(cache)) == first and kept_storage_bytes() == 0


def kept_layer():
    """A weak reference to the first layer of the kept storage."""
    from flexicache_hf.recycling import KEEPER

    return weakref.ref(KEEPER._kept.layers[0])


def test_a_live_cache_never_shares_its_storage(setup):
    fc, prof, a, _ = setup
    first = FlexiCache(prof, **SIZED)
    gen(fc, a, first)
    second = FlexiCache(prof, **SIZED)
    gen(fc, a, second)
    assert not set(pointers(first)) & set(pointers(second))


def test_nothing_kept_from_unsized_observed_unused_or_still_referenced_caches(setup):
    fc, prof, a, _ = setup
    gen(fc, a, FlexiCache(prof, **UNSIZED, kernels="reference"))  # unsized, not compileable: it grows
    FlexiCache(prof, **SIZED)  # never ran a forward
    assert kept_storage_bytes() == 0

    class Seen(SelectionObserver):
        def on_rerank(self, event):
            pass

    gen(fc, a, FlexiCache(prof, **SIZED, observer=Seen()))
    assert kept_storage_bytes() == 0
    cache = FlexiCache(prof, **SIZED)
    gen(fc, a, cache)
    layer = cache.layers[1]
    del cache
    gc.collect()
    new = FlexiCache(prof, **SIZED)  # someone holds a layer of the dropped cache: its storage is not handed on
    gen(fc, a, new)
    assert layer not in new.layers and layer.is_initialized and kept_storage_bytes() == 0


def test_a_cache_dropped_after_a_failed_forward_serves_the_next_one_cleanly(setup):
    fc, prof, a, b = setup
    cache = FlexiCache(prof, **SIZED)
    gen(fc, a, cache)
    # beyond the cache's 48 tokens: refused (transformers 5.17 first builds a mask for the repeated prompt that does
    # not end at the cache's end, which FlexiCache refuses as well)
    with pytest.raises(ValueError, match="max_cache_len|4D mask"):
        gen(fc, a, cache, n=30)
    del cache
    taken = FlexiCache(prof, **SIZED)
    got = gen(fc, b, taken)
    release_storage()
    assert torch.equal(got, gen(fc, b, FlexiCache(prof, **SIZED)))


@pytest.mark.parametrize("kw", [SIZED, UNSIZED], ids=["sized", "reserved"])
def test_storage_made_under_inference_mode_is_not_handed_to_a_cache_outside_it(setup, kw):
    """Tensors made under ``torch.inference_mode()`` may not be updated in place outside it: such kept storage is
    freed, not handed on (a cache outside inference mode allocates its own), and taken inside inference mode."""
    fc, prof, a, b = setup
    with torch.inference_mode():
        gen(fc, a, FlexiCache(prof, **kw))
    assert kept_storage_bytes() > 0
    outside = FlexiCache(prof, **kw)
    got = gen(fc, b, outside)
    assert not outside.storage_reused
    assert torch.equal(got, gen(fc, b, FlexiCache(prof, **kw)))
    del outside
    with torch.inference_mode():
        gen(fc, a, FlexiCache(prof, **kw))
        inside = FlexiCache(prof, **kw)
        gen(fc, b, inside)
        assert inside.storage_reused
