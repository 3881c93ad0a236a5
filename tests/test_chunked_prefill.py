"""``prefill_in_chunks``: a long prompt's chunks through the model's own forward, then ``generate`` decodes (compiled
where the cache is compileable), which ``generate(prefill_chunk_size=...)`` cannot give a compileable cache."""

import pytest
import torch
from transformers import DynamicCache

from conftest import compile_config, padded_pair
from flexicache_hf import FlexiCache, HeadProfile, prefill_in_chunks

FULL = dict(page_size=4, token_budget=512, rerank_interval=3)  # covers every page of these prompts


@pytest.fixture(scope="module")
def setup():
    return padded_pair(45, 6)


def generate(model, ids, mask, cache, n=12, compiled=False):
    kw = dict(compile_config=compile_config()) if compiled else dict(disable_compile=True)
    return model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=n, min_new_tokens=n,
                          do_sample=False, pad_token_id=0, **kw)


@pytest.mark.parametrize("chunk", [1, 2, 4, 5, 16, 44, 100])
def test_a_left_padded_batch_filled_in_chunks_decodes_as_dense(setup, chunk):
    cfg, fc, dense, ids, mask = setup
    want = generate(dense, ids, mask, DynamicCache())
    cache = FlexiCache(HeadProfile.random(cfg, 0.5, seed=1), **FULL)
    prefill_in_chunks(fc, ids, cache, chunk, attention_mask=mask)
    assert cache.get_seq_length() == 44  # every prompt token but the last
    assert torch.equal(generate(fc, ids, mask, cache), want)
    # a DynamicCache filled the same way: dense's tokens too
    dyn = DynamicCache()
    prefill_in_chunks(dense, ids, dyn, chunk, attention_mask=mask)
    assert torch.equal(generate(dense, ids, mask, dyn), want)


@pytest.mark.parametrize("max_cache_len", [None, 45 + 16])
def test_the_decode_after_it_runs_compiled(setup, max_cache_len):
    """The README's call with a prompt filled in chunks: its decode steps run in one compiled graph (``aot_eager``
    here; CUDA graphs on a GPU) and give the eager run's tokens."""
    cfg, fc, _, ids, mask = setup
    prof = HeadProfile.random(cfg, 0.5, seed=4)
    outs = {}
    for compiled in (False, True):
        cache = FlexiCache(prof, page_size=4, token_budget=12, rerank_interval=3, max_cache_len=max_cache_len)
        assert cache.is_compileable
        prefill_in_chunks(fc, ids, cache, 16, attention_mask=mask)
        outs[compiled] = generate(fc, ids, mask, cache, compiled=compiled)
        assert cache.layers[0].state.stale == compiled  # compiled steps: the host learns their length lazily
        assert cache.stats.prompt_tokens == 44  # the last one is generate's, a one-token forward
    assert torch.equal(outs[True], outs[False])


def test_a_follow_up_turn_filled_in_chunks(setup):
    """A later turn: the whole conversation is passed, and only what the cache does not hold yet is run."""
    cfg, fc, dense, ids, mask = setup
    turn = torch.randint(2, 90, (2, 30), generator=torch.Generator().manual_seed(2))
    cache, dyn = FlexiCache(HeadProfile.random(cfg, 0.5, seed=3), **FULL), DynamicCache()
    first, first_dense = generate(fc, ids, mask, cache), generate(dense, ids, mask, dyn)
    assert torch.equal(first, first_dense)
    talk = torch.cat([first, turn], 1)
    talk_mask = torch.cat([mask, torch.ones((2, talk.shape[1] - mask.shape[1]), dtype=mask.dtype)], 1)
    held = cache.get_seq_length()
    prefill_in_chunks(fc, talk, cache, 8, attention_mask=talk_mask)
    assert held < cache.get_seq_length() == talk.shape[1] - 1
    assert torch.equal(generate(fc, talk, talk_mask, cache), generate(dense, talk, talk_mask, dyn))


@pytest.mark.parametrize("bad", [0, -4, True, 2.0, None])
def test_bad_chunk_sizes_are_refused_before_any_forward(setup, bad):
    cfg, fc, _, ids, _ = setup
    cache = FlexiCache(HeadProfile.random(cfg, 0.5), **FULL)
    with pytest.raises(ValueError, match="chunk_size"):
        prefill_in_chunks(fc, ids, cache, bad)
    assert cache.get_seq_length() == 0


def test_bad_shapes_and_a_shorter_sequence_than_the_cache_holds_are_refused(setup):
    cfg, fc, dense, ids, mask = setup
    cache = FlexiCache(HeadProfile.random(cfg, 0.5), **FULL)
    with pytest.raises(ValueError, match="attention_mask"):
        prefill_in_chunks(fc, ids, cache, 8, attention_mask=mask[:, 1:])
    with pytest.raises(ValueError, match="input_ids"):
        prefill_in_chunks(fc, ids[0], cache, 8)
    assert cache.get_seq_length() == 0
    prefill_in_chunks(fc, ids, cache, 16, attention_mask=mask)
    with pytest.raises(ValueError, match="holds 44 tokens"):
        prefill_in_chunks(fc, ids[:, :20], cache, 8, attention_mask=mask[:, :20])
    assert cache.get_seq_length() == 44  # unchanged, and it still decodes as dense
    assert torch.equal(generate(fc, ids, mask, cache), generate(dense, ids, mask, DynamicCache()))


def test_a_one_token_forward_that_would_add_left_padding_is_refused_and_loses_nothing(setup):
    """A decode step takes its token as real; fed a row's padding one token at a time (``prefill_chunk_size=1``,
    or by hand) it would attend padding as tokens. Refused before anything changes; a real token then serves."""
    cfg, fc, dense, ids, mask = setup
    cache = FlexiCache(HeadProfile.random(cfg, 0.5, seed=1), **FULL)
    with torch.no_grad():
        fc(input_ids=ids[:, :3], attention_mask=mask[:, :3], past_key_values=cache)  # row 1: padding only
        assert cache.layers[0].storage.open_padding
        with pytest.raises(ValueError, match="cannot add left padding"):
            fc(input_ids=ids[:, 3:4], attention_mask=mask[:, :4], past_key_values=cache)
        assert cache.get_seq_length() == 3
        real = mask[:, :4].clone()
        real[1, 3] = 1  # the same token, now real for both rows: served
        fc(input_ids=ids[:, 3:4], attention_mask=real, past_key_values=cache)
    assert cache.get_seq_length() == 4 and not cache.layers[0].storage.open_padding
    with pytest.raises(ValueError, match="cannot add left padding"):
        fc.generate(ids, attention_mask=mask, past_key_values=FlexiCache(HeadProfile.random(cfg, 0.5), **FULL),
                    max_new_tokens=2, do_sample=False, pad_token_id=0, disable_compile=True, prefill_chunk_size=1)


@pytest.mark.parametrize("kind,heads,kv", [("mistral", 6, 2), ("qwen2", 8, 2)])
def test_other_supported_families_filled_in_chunks_decode_as_dense(kind, heads, kv):
    from conftest import tiny_config, twin_models

    cfg = tiny_config(kind, heads=heads, kv_heads=kv, layers=2)
    fc, dense = twin_models(cfg)
    ids = torch.randint(2, 90, (2, 40), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    cache = FlexiCache(HeadProfile.random(cfg, 0.25, seed=2), **FULL)
    prefill_in_chunks(fc, ids, cache, 8, attention_mask=mask)
    assert torch.equal(generate(fc, ids, mask, cache), generate(dense, ids, mask, DynamicCache()))
