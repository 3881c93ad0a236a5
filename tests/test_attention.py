"""The "flexicache" attention function with transformers' own caches: exact dense attention, like "sdpa".

A model loaded with attn_implementation="flexicache" must give the tokens (and, within float rounding, the logits)
of the same weights on "sdpa" whatever cache it runs with, or refuse clearly before any cache is written.
"""

import pytest
import torch
from transformers import DynamicCache, StaticCache

from conftest import tiny_config, twin_models
from flexicache_hf import FlexiCache, HeadProfile, UnsupportedModelError

FAMILIES = [("llama", 4, 4), ("mistral", 6, 2), ("qwen2", 8, 2)]


def run(model, ids, mask, n=16, **kw):
    out = model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                         output_logits=True, return_dict_in_generate=True, **kw)
    return out.sequences, torch.stack(out.logits, 1)


def left_padded(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    L = max(lengths)
    ids = torch.zeros(len(lengths), L, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, L - n:] = torch.randint(2, 96, (n,), generator=g)
        mask[i, L - n:] = 1
    return ids, mask


def assert_same(got, want):
    assert torch.equal(got[0], want[0]), f"{(got[0] == want[0]).float().mean():.3f} of the tokens agree"
    torch.testing.assert_close(got[1], want[1], atol=1e-4, rtol=1e-4)


CACHES = {
    "dynamic": lambda cfg: dict(past_key_values=DynamicCache()),
    "static": lambda cfg: dict(past_key_values=StaticCache(config=cfg, max_cache_len=96)),
    "cache_implementation=static": lambda cfg: dict(cache_implementation="static"),
    "no cache": lambda cfg: dict(use_cache=False),
}


@pytest.mark.parametrize("cache", list(CACHES))
@pytest.mark.parametrize("kind,heads,kv", FAMILIES)
def test_equals_sdpa_with_transformers_caches(kind, heads, kv, cache):
    cfg = tiny_config(kind, heads=heads, kv_heads=kv)
    fc, dense = twin_models(cfg)
    ids, mask = left_padded([29])
    assert_same(run(fc, ids, mask, **CACHES[cache](cfg)), run(dense, ids, mask, **CACHES[cache](cfg)))


@pytest.mark.parametrize("cache", list(CACHES))
def test_left_padded_batch_equals_sdpa(cache):
    cfg = tiny_config("qwen2", heads=8, kv_heads=2)
    fc, dense = twin_models(cfg)
    ids, mask = left_padded([23, 31, 17], seed=1)
    assert_same(run(fc, ids, mask, **CACHES[cache](cfg)), run(dense, ids, mask, **CACHES[cache](cfg)))


def test_multi_turn_static_cache_equals_sdpa():
    cfg = tiny_config("llama", heads=4, kv_heads=2)
    fc, dense = twin_models(cfg)
    follow = torch.randint(2, 96, (1, 11))
    got, want = [], []
    for model, out in ((fc, got), (dense, want)):
        cache = StaticCache(config=cfg, max_cache_len=80)
        ids, mask = left_padded([21], seed=3)
        first = run(model, ids, mask, n=8, past_key_values=cache)
        ids = torch.cat([first[0], follow], 1)
        out += [first, run(model, ids, torch.ones_like(ids), n=8, past_key_values=cache)]
    for g, w in zip(got, want):
        assert_same(g, w)


def test_prefill_logits_with_static_cache_equal_sdpa():
    """The forward itself (no generate): the static cache hands attention its whole unfilled buffer."""
    cfg = tiny_config("mistral", heads=6, kv_heads=2)
    fc, dense = twin_models(cfg)
    ids, mask = left_padded([12, 20], seed=4)
    outs = []
    for model in (fc, dense):
        cache = StaticCache(config=cfg, max_cache_len=64)
        first = model(ids, attention_mask=mask, past_key_values=cache).logits
        step = model(ids[:, -1:], attention_mask=torch.cat([mask, torch.ones_like(mask[:, :1])], 1),
                     past_key_values=cache).logits
        outs.append((first * mask[..., None], step))
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_sliding_window_layers_are_refused_before_any_cache_is_written():
    cfg = tiny_config("mistral", heads=4, kv_heads=2)
    cfg.sliding_window = 8
    fc, _ = twin_models(cfg)
    cache = DynamicCache()
    with pytest.raises(UnsupportedModelError, match="sliding"):
        fc(torch.randint(2, 96, (1, 12)), past_key_values=cache)
    assert cache.get_seq_length() == 0


def test_output_attentions_is_refused():
    cfg = tiny_config("llama", heads=4, kv_heads=2)
    fc, _ = twin_models(cfg)
    ids = torch.randint(2, 96, (1, 9))
    for cache in (DynamicCache(), FlexiCache(HeadProfile.all_stable(cfg))):
        with pytest.raises(ValueError, match="output_attentions"):
            fc(ids, past_key_values=cache, output_attentions=True)


@pytest.mark.parametrize("dtype,flash,masked", [(torch.float32, False, False), (torch.bfloat16, False, True),
                                                (torch.bfloat16, True, False)])
def test_prompt_attention_without_a_grouped_kernel_repeats_kv_heads_exactly(dtype, flash, masked):
    """Where CUDA SDPA has no grouped-query kernel (float32, or a mask), dense_attention repeats each KV head for
    its query heads; the result must be SDPA's grouped-query attention (query head h reads KV head h // group)."""
    from flexicache_hf.dense import dense_attention, gqa_inputs

    torch.manual_seed(0)
    B, Hq, H, T, D = 2, 6, 2, 9, 8
    q, k, v = torch.randn(B, Hq, T, D), torch.randn(B, H, T, D), torch.randn(B, H, T, D)
    keys, values, grouped = gqa_inputs(q.to(dtype), k, v, flash, cuda=True)
    assert grouped == flash and keys.shape[1] == (H if flash else Hq)
    mask = None
    if masked:
        mask = torch.ones(B, T, dtype=torch.bool)
        mask[1, :3] = False
    want = dense_attention(q, k, v, mask, 0.3)  # CPU: SDPA's grouped mode
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    att = causal[None] if mask is None else causal[None] & mask[:, None, :] | torch.eye(T, dtype=torch.bool)[None]
    got = torch.nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=att[:, None], scale=0.3,
                                                          enable_gqa=grouped).transpose(1, 2)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("T", [1, 4, 9])
def test_a_chunk_after_its_prefix_takes_the_lower_right_causal_call_exactly(monkeypatch, T):
    """On CUDA half precision a chunk after its prefix goes to SDPA's flash kernel through ``causal_lower_right``
    (no mask, KV heads grouped as they are); forced here on the CPU (torch materialises the same bias), it must
    equal the explicit-mask call: query i of the chunk sees keys up to L - T + i."""
    import flexicache_hf.dense as dense

    torch.manual_seed(1)
    B, Hq, H, L, D = 2, 6, 2, 13, 8
    q, k, v = torch.randn(B, Hq, T, D), torch.randn(B, H, L, D), torch.randn(B, H, L, D)
    assert not dense.flash_lower_right(q, k, v, 0.0)  # the CPU keeps the masked call
    want = dense.dense_attention(q, k, v, None, 0.3)
    seen = []
    monkeypatch.setattr(dense, "flash_lower_right", lambda *a: seen.append(a) or True)
    got = dense.dense_attention(q, k, v, None, 0.3)
    assert len(seen) == 1
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    causal = torch.ones(T, L, dtype=torch.bool).tril(L - T)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1),
                                                           attn_mask=causal, scale=0.3).transpose(1, 2)
    torch.testing.assert_close(got, ref, atol=1e-6, rtol=1e-6)
