"""Every refusal path: a clear error, raised before the cache or the model is left half-changed."""

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from conftest import tiny_config, twin_models
from flexicache_hf import (ConfigError, FlexiCache, FlexiCacheConfig, HeadProfile, HostMemoryError, ProfileError,
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
])
def test_bad_config_values(fields, match):
    with pytest.raises(ConfigError, match=match):
        FlexiCacheConfig(**fields)


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
    roomy = FlexiCache(HeadProfile.all_stable(cfg), page_size=4, token_budget=16, host_memory_limit=1 << 20)
    gen(fc, torch.randint(2, 96, (1, 40)), roomy)


def test_crop_is_refused_for_assisted_decoding():
    cfg = tiny_config("llama", heads=4, kv_heads=2)
    fc, _ = twin_models(cfg)
    cache = FlexiCache(HeadProfile.all_stable(cfg))
    gen(fc, torch.randint(2, 96, (1, 9)), cache)
    cache.crop(0)
    with pytest.raises(NotImplementedError, match="cannot crop"):
        cache.crop(-2)


def test_batch_size_change_is_refused():
    cfg = tiny_config("llama", heads=4, kv_heads=2)
    fc, _ = twin_models(cfg)
    cache = FlexiCache(HeadProfile.all_stable(cfg))
    gen(fc, torch.randint(2, 96, (2, 9)), cache)
    with pytest.raises(ValueError, match="batch size 2"):
        fc(torch.randint(2, 96, (3, 4)), past_key_values=cache)


def test_reset_empties_the_cache():
    cfg = tiny_config("llama", heads=4, kv_heads=2)
    fc, _ = twin_models(cfg)
    cache = FlexiCache(HeadProfile.random(cfg, 0.25))
    ids = torch.randint(2, 96, (1, 9))
    first = gen(fc, ids, cache)
    cache.reset()
    assert cache.get_seq_length() == 0
    assert torch.equal(gen(fc, ids, cache), first)
