"""Every refusal path: a clear error, raised before the cache or the model is left half-changed."""

import copy

import pytest
import torch
from transformers import DynamicCache

from conftest import tiny_config, twin_models
from flexicache_hf import (CacheStateError, ConfigError, FlexiCache, FlexiCacheConfig, HeadProfile, HostMemoryError, ProfileError,
                           UnsupportedModelError)


def gen(model, ids, cache, n=4, **kw):
    return model.generate(ids, max_new_tokens=n, do_sample=False, past_key_values=cache, **kw)


@pytest.mark.parametrize("fields,match", [
    (dict(page_size=12), "power of two"),
    (dict(page_size=0), "power of two"),
    (dict(page_size=512), "power of two"),
    (dict(token_budget=100), "multiple of page_size"),
    (dict(token_budget=16), "at least 2 pages"),
    (dict(rerank_interval=0), "positive"),
    (dict(offload="yes"), "bool"),
    (dict(host_memory_limit=-1), "non-negative"),
    (dict(sink_pages=-1), "non-negative"),
    (dict(token_budget=64, page_size=16, sink_pages=2, recent_pages=2), "leave room"),
    (dict(page_size=True), "power of two"),  # bool is an int subclass: True would mean 1
    (dict(token_budget=True), "multiple of page_size"),
    (dict(rerank_interval=True), "positive integer"),
    (dict(sink_pages=False), "non-negative integer"),
    (dict(recent_pages=True), "non-negative integer"),
    (dict(host_memory_limit=True), "non-negative"),
    (dict(rerank_interval=2.0), "positive integer"),
    (dict(group_score="sum"), "group_score must be one of"),
    (dict(stagger_reranks=1), "stagger_reranks must be a bool"),
    (dict(bound_shrink=1.5), "bound_shrink must be a number in"),
    (dict(bound_shrink=-0.1), "bound_shrink must be a number in"),
    (dict(bound_shrink=float("nan")), "bound_shrink must be a number in"),
    (dict(bound_shrink=True), "bound_shrink must be a number in"),
    (dict(unstable_group_score="sum"), "unstable_group_score must be one of"),
    (dict(unstable_bound_shrink=1.5), "unstable_bound_shrink must be a number in"),
    (dict(unstable_bound_shrink="0.5"), "unstable_bound_shrink must be a number in"),
    (dict(overlap_loads=True, offload=False), "overlap_loads=True needs offload=True"),  # was ignored: other tokens
])
def test_bad_config_values(fields, match):
    with pytest.raises(ConfigError, match=match):
        FlexiCacheConfig(**fields)


def test_paper_settings_and_the_default_schedule():
    """``paper()`` is the paper's setting field by field (its schedule: every layer re-ranks on the same steps);
    the default staggers the re-ranks; overrides change single fields and are validated."""
    paper = FlexiCacheConfig.paper()
    assert (paper.page_size, paper.rerank_interval, paper.token_budget, paper.group_score, paper.bound_shrink,
            paper.sink_pages, paper.recent_pages, paper.stagger_reranks, paper.offload) == (
        16, 16, 2048, "max", 1.0, 0, 0, False, True)
    assert paper.unstable_scoring == paper.stable_scoring == ("max", 1.0)
    assert {paper.rerank_phase(layer) for layer in range(32)} == {0}
    assert FlexiCacheConfig().stagger_reranks and FlexiCacheConfig().rerank_phase(17) == 1
    assert FlexiCacheConfig.paper(token_budget=1024).token_budget == 1024
    with pytest.raises(ConfigError, match="token_budget"):
        FlexiCacheConfig.paper(token_budget=1000)


def test_config_or_fields_not_both():
    cfg = tiny_config("llama", heads=4, kv_heads=2)
    with pytest.raises(TypeError, match="not both"):
        FlexiCache(HeadProfile.all_stable(cfg), FlexiCacheConfig(), token_budget=64)


def test_profile_for_another_model_is_refused():
    small, other = tiny_config("llama", heads=4, kv_heads=2), tiny_config("llama", heads=4, kv_heads=4)
    fc, _ = twin_models(small)
    with pytest.raises(ProfileError, match="KV heads"):
        FlexiCache(HeadProfile.all_stable(other), model_config=small)
    cache = FlexiCache(HeadProfile.all_stable(other))  # no config given: caught at the first forward
    with pytest.raises(ProfileError):
        gen(fc, torch.randint(2, 96, (1, 9)), cache)
    with pytest.raises(ProfileError):  # a shipped profile on a tiny model
        FlexiCache("Llama-3.1-8B-Instruct", model_config=small)


def test_unknown_profile_name_lists_the_shipped_ones():
    with pytest.raises(ProfileError, match="Llama-3.1-8B-Instruct"):
        FlexiCache("no-such-model")


def test_sliding_window_layers_are_refused():
    cfg = tiny_config("mistral", heads=4, kv_heads=2)
    cfg.sliding_window = 64
    with pytest.raises(UnsupportedModelError, match="full-attention"):
        FlexiCache(HeadProfile.all_stable(cfg), model_config=cfg)
    qcfg = tiny_config("qwen2", heads=4, kv_heads=2)
    fields = {k: v for k, v in qcfg.to_dict().items() if k != "layer_types"}
    qcfg = type(qcfg)(**{**fields, "use_sliding_window": True, "sliding_window": 32, "max_window_layers": 1})
    with pytest.raises(UnsupportedModelError, match="sliding_attention"):
        FlexiCache(HeadProfile.all_stable(qcfg), model_config=qcfg)


def test_flexicache_with_another_attention_explains_itself():
    cfg = tiny_config("llama", heads=4, kv_heads=2)
    _, dense = twin_models(cfg)
    with pytest.raises(TypeError, match="attn_implementation='flexicache'"):
        gen(dense, torch.randint(2, 96, (1, 9)), FlexiCache(HeadProfile.all_stable(cfg)))


def test_flexicache_attention_without_flexicache_is_dense():
    cfg = tiny_config("llama", heads=4, kv_heads=2)
    fc, dense = twin_models(cfg)
    ids = torch.randint(2, 96, (2, 15))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    assert torch.equal(gen(fc, ids, DynamicCache(), n=8, attention_mask=mask),
                       gen(dense, ids, DynamicCache(), n=8, attention_mask=mask))


def test_right_padding_is_refused():
    cfg = tiny_config("llama", heads=4, kv_heads=2)
    fc, _ = twin_models(cfg)
    ids = torch.randint(2, 96, (2, 12))
    mask = torch.ones_like(ids)
    mask[1, -3:] = 0
    with pytest.raises(ValueError, match="left padding"):
        fc(ids, attention_mask=mask, past_key_values=FlexiCache(HeadProfile.all_stable(cfg)))


def test_prompt_beyond_context_is_refused_before_storing():
    cfg = tiny_config("llama", heads=4, kv_heads=2, max_pos=64)
    fc, _ = twin_models(cfg)
    cache = FlexiCache(HeadProfile.all_stable(cfg), page_size=4, token_budget=16, model_config=fc.config)
    with pytest.raises(ValueError, match="context of 64"):
        fc(torch.randint(2, 96, (1, 70)), past_key_values=cache)
    assert cache.get_seq_length() == 0


def test_host_memory_limit_fails_clearly():
    cfg = tiny_config("llama", heads=4, kv_heads=2)
    fc, _ = twin_models(cfg)
    cache = FlexiCache(HeadProfile.all_stable(cfg), page_size=4, token_budget=16, host_memory_limit=1024)
    with pytest.raises(HostMemoryError, match="host_memory_limit"):
        gen(fc, torch.randint(2, 96, (1, 40)), cache)
    assert cache.get_seq_length() == 0  # refused before anything was written
    tiny = FlexiCache(HeadProfile.all_stable(cfg), page_size=4, token_budget=16, host_memory_limit=1)
    with pytest.raises(HostMemoryError, match=r"need [0-9,]+ bytes, over host_memory_limit=1 byte;") as err:
        gen(fc, torch.randint(2, 96, (1, 40)), tiny)
    assert "0.0 MiB" not in str(err.value)
    roomy = FlexiCache(HeadProfile.all_stable(cfg), page_size=4, token_budget=16, host_memory_limit=1 << 20)
    gen(fc, torch.randint(2, 96, (1, 40)), roomy)


def test_batch_size_change_is_refused():
    cfg = tiny_config("llama", heads=4, kv_heads=2)
    fc, _ = twin_models(cfg)
    cache = FlexiCache(HeadProfile.all_stable(cfg))
    gen(fc, torch.randint(2, 96, (2, 9)), cache)
    with pytest.raises(ValueError, match="batch size 2"):
        fc(torch.randint(2, 96, (3, 4)), past_key_values=cache)


def test_reset_of_a_sized_cache_keeps_its_buffers_and_serves_like_a_new_one():
    """With max_cache_len, reset() clears the buffers in place (a compiled step's CUDA graphs then replay for the
    next prompt); the next prompt gives what a fresh cache gives, and another batch size allocates anew."""
    cfg = tiny_config("llama", heads=4, kv_heads=2)
    fc, _ = twin_models(cfg)
    prof = HeadProfile.random(cfg, 0.5, seed=3)
    make = lambda: FlexiCache(prof, page_size=4, token_budget=8, rerank_interval=3, max_cache_len=40)  # noqa: E731
    g = torch.Generator().manual_seed(4)
    a, b = torch.randint(2, 96, (2, 21), generator=g), torch.randint(2, 96, (2, 17), generator=g)
    cache = make()
    gen(fc, a, cache, n=12)
    layer = cache.layers[1]
    ptrs = [t.data_ptr() for t in layer.buffers() + cache.layers[0].state.tensors()]
    cache.reset()
    assert cache.get_seq_length() == 0 and cache.stats.decode_steps == 0
    fresh = make()
    assert torch.equal(gen(fc, b, cache, n=12), gen(fc, b, fresh, n=12))
    assert cache.stats == fresh.stats and cache.memory_report()["tokens"] == fresh.memory_report()["tokens"]
    assert [t.data_ptr() for t in layer.buffers() + cache.layers[0].state.tensors()] == ptrs
    for mine, new in zip(cache.layers, fresh.layers):  # every stored token and selection as a new cache's
        assert torch.equal(mine.gather_tokens(mine.seq_len)[0], new.gather_tokens(new.seq_len)[0])
        assert torch.equal(mine.storage.kmin, new.storage.kmin) and torch.equal(mine.reranker.selected, new.reranker.selected)
    cache.reset()
    one = b[:1]
    assert torch.equal(gen(fc, one, cache, n=6), gen(fc, one, make(), n=6))  # another batch: allocated anew
    assert cache.layers[1].storage.batch == 1


def test_reset_empties_the_cache():
    cfg = tiny_config("llama", heads=4, kv_heads=2)
    fc, _ = twin_models(cfg)
    cache = FlexiCache(HeadProfile.random(cfg, 0.25))
    ids = torch.randint(2, 96, (1, 9))
    first = gen(fc, ids, cache)
    cache.reset()
    assert cache.get_seq_length() == 0
    assert torch.equal(gen(fc, ids, cache), first)


# ---- a forward that fails part-way: the cache is as new again, or refuses until reset() -------------------------
SMALL = dict(page_size=4, token_budget=16, rerank_interval=3)


def _four_d_mask(fc, dense, cache, ids):
    T, past = ids.shape[1], cache.get_seq_length()
    causal = torch.ones(T, past + T, dtype=torch.bool).tril(past)
    fc(ids, attention_mask=causal[None, None].expand(ids.shape[0], 1, T, past + T), past_key_values=cache)


def _right_padding(fc, dense, cache, ids):
    mask = torch.ones(ids.shape[0], cache.get_seq_length() + ids.shape[1], dtype=torch.long)
    mask[-1, -3:] = 0
    fc(ids, attention_mask=mask, past_key_values=cache)


FAILURES = {  # each fails inside attention, after layer 0 has stored its tokens
    "4D mask": (_four_d_mask, ValueError, "2D padding mask"),
    "sdpa model": (lambda fc, dense, cache, ids: dense(ids, past_key_values=cache), TypeError, "flexicache"),
    "right padding": (_right_padding, ValueError, "left padding"),
    "output_attentions": (lambda fc, dense, cache, ids: fc(ids, past_key_values=cache, output_attentions=True),
                          ValueError, "output_attentions"),
}


def _greedy(model, ids, cache, n=8):
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                          do_sample=False, past_key_values=cache)


@pytest.mark.parametrize("failure", [*FAILURES, "over the context"])
def test_failed_first_forward_leaves_the_cache_as_new(failure):
    cfg = tiny_config("llama", heads=4, kv_heads=2, max_pos=64)
    fc, dense = twin_models(cfg)
    profile = HeadProfile.random(cfg, 0.5, seed=3)
    cache = FlexiCache(profile, **SMALL)  # no model_config: the context is learnt at the first forward
    if failure == "over the context":
        with pytest.raises(ValueError, match="context of 64"):
            fc(torch.randint(2, 96, (2, 70)), past_key_values=cache)
    else:
        run, error, match = FAILURES[failure]
        with pytest.raises(error, match=match):
            run(fc, dense, cache, torch.randint(2, 96, (2, 20)))
    ids = torch.randint(2, 96, (3, 17))  # another batch size and length: nothing of the failed forward is left
    assert torch.equal(_greedy(fc, ids, cache), _greedy(fc, ids, FlexiCache(profile, **SMALL)))


def _bf16_model(fc, dense, cache, ids):
    copy.deepcopy(fc).to(torch.bfloat16)(ids, past_key_values=cache)


def _host_memory(fc, dense, cache, ids):
    fc(torch.randint(2, 96, (ids.shape[0], 60)), past_key_values=cache)


REFUSED = {**FAILURES,  # ... and two refused by the update of the forward's first layer, before it writes
           "bf16 model": (_bf16_model, ValueError, "filled with dtype float32 and now receives bfloat16"),
           "host memory": (_host_memory, HostMemoryError, "host_memory_limit")}
CASES = [(f, T, n) for f in REFUSED for T in (1, 9) for n in (8, 10)
         if not (T == 1 and f in ("right padding", "4D mask", "host memory"))]  # (a decode step's 4D mask is
# generate's static one, which FlexiCache ignores; its 2D mask too: padding is read from the prompt)


@pytest.mark.parametrize("failure,T,n", CASES)
def test_refused_follow_up_loses_nothing(failure, T, n, monkeypatch):
    """A refusal on a filled cache leaves it as it was: the next call continues exactly as on a cache that never
    saw the refused one (small budget: same selections and schedule), with the same length and statistics.  T = 1
    refuses a decode step (n = 10: a step on which the stable heads re-rank), T = 9 a follow-up chunk.  (Reserved
    storage commits a chunk ahead: a small chunk here, so that the follow-up chunk needs more host memory.)"""
    monkeypatch.setattr("flexicache_hf.reserve.CHUNK_TOKENS", 1)
    cfg = tiny_config("llama", heads=4, kv_heads=2)
    fc, dense = twin_models(cfg)
    profile = HeadProfile.random(cfg, 0.5, seed=3)
    ids = torch.randint(2, 96, (2, 21))
    probe = FlexiCache(profile, **SMALL)
    _greedy(fc, ids, probe, n=n)
    limit = dict(host_memory_limit=probe.host_bytes()) if failure == "host memory" else {}
    cache, never = FlexiCache(profile, **SMALL, **limit), FlexiCache(profile, **SMALL, **limit)
    first = _greedy(fc, ids, cache, n=n)
    assert torch.equal(first, _greedy(fc, ids, never, n=n))
    run, error, match = REFUSED[failure]
    with pytest.raises(error, match=match):
        run(fc, dense, cache, first[:, -1:] if T == 1 else torch.randint(2, 96, (2, T)))
    assert cache.get_seq_length() == never.get_seq_length() and cache.stats == never.stats
    follow = torch.cat([first, torch.randint(2, 96, (2, 5))], 1)
    assert torch.equal(_greedy(fc, follow, cache), _greedy(fc, follow, never))
    assert cache.stats == never.stats


def test_a_failure_after_a_write_still_refuses_until_reset():
    """A refusal at a later layer (another layer has attended and changed its selections) cannot be undone: the
    cache refuses with CacheStateError, naming it, until reset()."""
    cfg = tiny_config("llama", heads=4, kv_heads=2)
    fc, dense = twin_models(cfg)
    cache = FlexiCache(HeadProfile.random(cfg, 0.5, seed=3), **SMALL)
    ids = torch.randint(2, 96, (2, 21))
    first = _greedy(fc, ids, cache)
    dense.model.layers[0].self_attn.config = fc.config  # layer 0 attends with FlexiCache, layer 1 with SDPA
    fc.model.layers[1].self_attn.config = dense.config
    try:
        with pytest.raises(TypeError, match="flexicache"):
            fc(first[:, -1:], past_key_values=cache)
    finally:
        fc.model.layers[1].self_attn.config = fc.config
    with pytest.raises(CacheStateError, match=r"(?s)layer 1 of 2.*attention.*flexicache.*reset\(\)"):
        cache.get_seq_length()
    cache.reset()
    assert torch.equal(_greedy(fc, ids, cache), first)


def test_over_the_context_on_a_follow_up_is_refused_before_storing():
    cfg = tiny_config("llama", heads=4, kv_heads=2, max_pos=64)
    fc, dense = twin_models(cfg)
    full = dict(page_size=4, token_budget=64, rerank_interval=3)
    cache, ref = FlexiCache(HeadProfile.random(cfg, 0.5, seed=3), **full), DynamicCache()
    ids = torch.randint(2, 96, (1, 30))
    first = _greedy(fc, ids, cache)
    assert torch.equal(first, _greedy(dense, ids, ref))
    with pytest.raises(ValueError, match="context of 64"):
        fc(torch.randint(2, 96, (1, 40)), past_key_values=cache)
    assert cache.get_seq_length() == first.shape[1] - 1  # untouched: the limit was known at layer 0's update
    follow = torch.cat([first, torch.randint(2, 96, (1, 5))], 1)
    assert torch.equal(_greedy(fc, follow, cache, n=4), _greedy(dense, follow, ref, n=4))


def test_error_outside_flexicache_mid_forward_is_caught_on_next_use():
    """An error between layers (here: layer 1's MLP), which FlexiCache never sees, still marks the forward open."""
    cfg = tiny_config("llama", heads=4, kv_heads=2, layers=3)
    fc, _ = twin_models(cfg)
    profile = HeadProfile.random(cfg, 0.5, seed=3)
    cache = FlexiCache(profile, **SMALL)
    ids = torch.randint(2, 96, (1, 19))
    first = _greedy(fc, ids, cache)

    def boom(*_):
        raise KeyboardInterrupt

    hook = fc.model.layers[1].mlp.register_forward_hook(boom)
    try:
        with pytest.raises(KeyboardInterrupt):
            fc(torch.randint(2, 96, (1, 4)), past_key_values=cache)
        with pytest.raises(CacheStateError, match="layer 2 of 3.*raised outside FlexiCache"):
            cache.get_seq_length()
        fresh = FlexiCache(profile, **SMALL)
        with pytest.raises(KeyboardInterrupt):  # on a cache that was empty: it is as new again
            fc(ids, past_key_values=fresh)
    finally:
        hook.remove()
    assert fresh.get_seq_length() == 0
    assert torch.equal(_greedy(fc, ids, fresh), first)


def test_reset_also_clears_stats():
    cfg = tiny_config("llama", heads=4, kv_heads=2)
    fc, _ = twin_models(cfg)
    cache = FlexiCache(HeadProfile.random(cfg, 0.5), **SMALL)
    ids = torch.randint(2, 96, (1, 19))
    _greedy(fc, ids, cache)
    once = (cache.stats.decode_steps, cache.stats.prompt_tokens, cache.stats.head_reranks)
    assert once[0] == 7 and once[1] == 19
    cache.reset()
    assert cache.stats.decode_steps == cache.stats.prompt_tokens == cache.stats.head_reranks == 0
    _greedy(fc, ids, cache)
    assert (cache.stats.decode_steps, cache.stats.prompt_tokens, cache.stats.head_reranks) == once
