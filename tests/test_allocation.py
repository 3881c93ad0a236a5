"""Allocate-once layout (``max_cache_len``) and the host tier's growth: sizes, refusals before any change, copies."""

import pytest
import torch

from conftest import tiny_config, twin_models
from flexicache_hf import FlexiCache, HeadProfile
from flexicache_hf.kernels import REFERENCE_OPS
from flexicache_hf.pages import num_pages
from flexicache_hf.tiers import CopyStream, HostMemoryError, HostTier

FULL = dict(page_size=8, token_budget=4096)


def greedy(model, ids, cache, n):
    out = model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=n,
                         do_sample=False, min_new_tokens=n)
    return out[:, ids.shape[1]:]


def buffers(cache):
    """Identity of every allocation a layer holds (growth would replace them)."""
    return [(layer.storage.pool.k.data_ptr(), layer.storage.host.k.data_ptr(), layer.storage.kmin.data_ptr(), layer.page_capacity)
            for layer in cache.layers]


def test_max_cache_len_allocates_once_and_equals_dense():
    cfg = tiny_config("llama", heads=4, kv_heads=2)
    fc, dense = twin_models(cfg)
    profile = HeadProfile.random(cfg, 0.5, seed=1)
    ids = torch.randint(2, 96, (2, 37))
    cache = FlexiCache(profile, **FULL, max_cache_len=37 + 40, model_config=cfg)
    seen = []

    class Stamp:  # a logits processor that records the buffers after every step
        def __call__(self, input_ids, scores):
            seen.append(buffers(cache))
            return scores

    out = fc.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=40,
                      min_new_tokens=40, do_sample=False, logits_processor=[Stamp()])[:, 37:]
    assert torch.equal(out, greedy(dense, ids, None, 40))
    assert all(s == seen[0] for s in seen)  # nothing re-allocated over 40 steps, 5 new pages
    # 77 tokens from the storage origin (< 1 page: the first chunk ends on a page boundary, layer/schedule.py)
    assert all(layer.page_capacity == num_pages(77 + 8 - 1, 8) for layer in cache.layers)


def test_beyond_max_cache_len_refused_before_any_change():
    cfg = tiny_config("llama", heads=4, kv_heads=2)
    fc, dense = twin_models(cfg)
    cache = FlexiCache(HeadProfile.random(cfg, 0.5, seed=1), **FULL, max_cache_len=30)
    ids = torch.randint(2, 96, (1, 24))
    turn = torch.cat([ids, greedy(fc, ids, cache, 4), torch.randint(2, 96, (1, 6))], dim=1)  # 34 tokens
    assert [layer.seq_len for layer in cache.layers] == [27, 27]  # the last new token is not fed back
    with pytest.raises(ValueError, match="max_cache_len=30"):
        greedy(fc, turn, cache, 2)  # the follow-up prompt alone overflows: refused at the first layer
    assert [layer.seq_len for layer in cache.layers] == [27, 27]


def test_max_cache_len_over_the_context_refused_up_front():
    cfg = tiny_config("llama", heads=4, kv_heads=2, max_pos=64)
    with pytest.raises(ValueError, match="exceeds the model's context of 64"):
        FlexiCache(HeadProfile.random(cfg, 0.5), **FULL, max_cache_len=65, model_config=cfg)
    for bad in (0, -3, True, 2.5):
        with pytest.raises(ValueError, match="max_cache_len"):
            FlexiCache(HeadProfile.random(cfg, 0.5), **FULL, max_cache_len=bad)


def tier(batch=2, heads=3, ps=4, D=8, limit=None):
    return HostTier(batch, heads, ps, D, torch.float32, torch.device("cpu"), limit, CopyStream(torch.device("cpu")),
                    REFERENCE_OPS)


def test_host_tier_rows_growth_and_row_selection():
    t = tier()
    t.grow(3)
    k, v = torch.randn(2, 3, 10, 8), torch.randn(2, 3, 10, 8)
    t.write_tokens(k, v, 0)
    t.write_tokens(k[:, :, :2] + 1, v[:, :, :2] + 1, 10)  # a later chunk lands after the first
    t.grow(7)  # one copy of the old tier into the larger one
    assert t.page_capacity == 7
    out_k, out_v = torch.empty(2, 3, 12, 8), torch.empty(2, 3, 12, 8)
    t.read_tokens(out_k, out_v)
    assert torch.equal(out_k[:, :, :10], k) and torch.equal(out_v[:, :, 10:], v[:, :, :2] + 1)
    t.select_rows(torch.tensor([1, 1, 0]))
    again = torch.empty(3, 3, 12, 8), torch.empty(3, 3, 12, 8)
    t.read_tokens(*again)
    assert t.batch == 3 and torch.equal(again[0], out_k[[1, 1, 0]])


def test_host_tier_limit_refused_without_change_and_exact_sizes():
    t = tier(limit=2 * 2 * 3 * 5 * 4 * 8 * 4)  # exactly 5 pages of K and V
    t.grow(5)
    with pytest.raises(Exception, match="host_memory_limit"):
        t.grow(6)
    assert t.page_capacity == 5 and t.k.shape[0] == 5
    with pytest.raises(Exception, match="host_memory_limit"):  # the other layers' bytes count against the cap
        tier(limit=2 * 2 * 3 * 5 * 4 * 8 * 4).grow(4, 2 * 2 * 3 * 2 * 4 * 8 * 4)  # 4 pages here, 2 elsewhere
    for pinned in (False, True):  # no allocator rounding either way: a sized cache's tier is exactly its pages
        t = tier()
        t.pinned = pinned
        assert [t.capacity_for(n) for n in (5, 6, 9, 1000)] == [5, 6, 9, 1000]
        # (bytes, run): the run is one page of one (row, head), the page-major tier's unit
        assert t.bytes_for(6) == 2 * 6 * 2 * 3 * 4 * 8 * 4 and t.blocks_for(6) == [(6 * 768, 4 * 8 * 4)] * 2
    unpinned, pinned = tier(), tier()
    pinned.pinned = True  # a growing cache's pinned tier takes coarse steps (page-locking is dear); pageable: exact
    assert [unpinned.capacity_for(n, headroom=True) for n in (9, 1000, 1025)] == [9, 1000, 1025]
    assert [pinned.capacity_for(n, headroom=True) for n in (9, 1000, 1025)] == [10, 1024, 1280]
    assert pinned.bytes_for(9, headroom=True) == 2 * 10 * 768


def test_pipeline_sizes_the_cache_and_refuses_a_call_beyond_the_context_up_front():
    from transformers import pipeline

    from conftest import word_tokenizer
    from flexicache_hf.pipeline import FlexiCachePipeline

    tok = word_tokenizer()
    cfg = tiny_config("llama", heads=4, kv_heads=2, max_pos=64)
    fc, _ = twin_models(cfg)
    pipe = pipeline("text-generation", model=fc, tokenizer=tok, pipeline_class=FlexiCachePipeline,
                    flexicache_profile=HeadProfile.random(cfg, 0.5), flexicache_config=None)
    prompt = " ".join(f"w{j % 90 + 2}" for j in range(40))
    pipe(prompt, max_new_tokens=8, do_sample=False)
    assert pipe.last_cache.max_tokens == 48 and pipe.last_cache.layers[0].page_capacity == num_pages(48 + 15, 16)
    with pytest.raises(ValueError, match="exceeds the model's context of 64"):
        pipe(prompt, max_new_tokens=30, do_sample=False)  # 40 + 30 > 64: refused before the prefill


def test_pinned_tier_counts_exact_bytes_against_the_cap():
    per_page = 2 * 3 * 4 * 8 * 4  # bytes of one page of K for every row and head (768)
    for limit, headroom, fits in ((2 * 9 * per_page, False, True), (2 * 9 * per_page - 1, False, False),
                                  (2 * 9 * per_page, True, False), (2 * 10 * per_page, True, True)):
        t = tier(limit=limit)
        t.pinned = True
        if fits:  # 9 pages: exactly 9 (sized), or the 10 of the growing tier's step (host_capacity)
            assert t.check_grow(9, headroom=headroom) == (10 if headroom else 9)
            continue
        with pytest.raises(HostMemoryError, match=r"need [0-9,]+ bytes, over host_memory_limit") as err:
            t.grow(9, headroom=headroom)
        assert "rounded" not in str(err.value)
        assert t.page_capacity == 0 and t.k is None  # refused before anything was allocated


@pytest.mark.parametrize("page_size,budget,interval", [(16, 1 << 20, 16), (1, 1 << 16, 16), (16, 1 << 30, 1 << 30)])
@pytest.mark.parametrize("max_cache_len", [None, 60])
def test_a_budget_beyond_the_context_costs_what_one_covering_it_costs(page_size, budget, interval, max_cache_len):
    """Selections and the recent window are as wide as the pages the cache can hold, not as the budget (or R):
    a huge budget takes the memory of one covering every page the cache can hold, and gives the same tokens."""
    cfg = tiny_config("llama", heads=4, kv_heads=2)
    fc, _ = twin_models(cfg)
    profile = HeadProfile.random(cfg, 0.25, seed=2)
    ids = torch.randint(2, 96, (2, 40))
    huge = FlexiCache(profile, page_size=page_size, token_budget=budget, rerank_interval=interval,
                      max_cache_len=max_cache_len)
    covering = FlexiCache(profile, page_size=page_size, token_budget=2048 * page_size,  # pages beyond any capacity here
                          # (an unsized cache's is the context's: reserved storage)
                          rerank_interval=interval, max_cache_len=max_cache_len)
    assert torch.equal(greedy(fc, ids, huge, 12), greedy(fc, ids, covering, 12))
    assert huge.device_bytes() == covering.device_bytes()
    for layer in huge.layers:
        pages = layer.page_capacity
        assert layer.reranker.selected.shape[-1] <= pages and layer.reranker.head_offsets.shape[-1] <= pages
        assert layer.reranker.selected.nbytes < 2 ** 16
