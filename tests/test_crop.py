"""``FlexiCache.crop`` and, through it, transformers' assisted decoding (prompt lookup, an assistant model).

A crop drops the newest tokens: the next steps must be those of the cache as it was before it took them.  Decode
steps dropped without a re-rank among them are undone exactly; a re-rank among them (or a crop into the last prompt
chunk) leaves the cache as a follow-up chunk leaves it (the next step re-ranks every head), which is also what
assisted decoding's verification forwards are.  Small budgets check that the selections and the schedule are the
same, full budgets that the stored states are (against DynamicCache).
"""

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from conftest import tiny_config, twin_models
from flexicache_hf import FlexiCache, FlexiCacheConfig, HeadProfile

PS = 4
# The paper's schedule (every layer re-ranks on steps 3, 6, ...): the tests' step arithmetic (which dropped step
# re-ranked) is written for it; test_crop_of_staggered_steps covers the default schedule.
BUDGETS = {"small": dict(page_size=PS, token_budget=12, rerank_interval=3, stagger_reranks=False),
           "full": dict(page_size=PS, token_budget=512, rerank_interval=3, stagger_reranks=False)}


def feed(model, cache, tokens):
    """Logits ``[B, T, vocab]`` of feeding ``tokens [B, T]`` into ``cache`` (one forward)."""
    with torch.no_grad():
        return model(tokens, past_key_values=cache, use_cache=True).logits


def continue_both(model, a, b, tokens, dense=None, ref=None, exact=True):
    """Feed the same 9 decode tokens, a follow-up chunk of 6 and the rest as decode tokens into ``a`` and ``b``:
    every step's logits must agree (bitwise if ``exact``, else to float rounding: the same tokens computed in
    chunks of other lengths), and with ``dense`` over ``ref`` to 1e-4 where given (a full budget)."""
    for step in [*tokens[:, :9].split(1, 1), tokens[:, 9:15], *tokens[:, 15:].split(1, 1)]:
        la, lb = feed(model, a, step), feed(model, b, step)
        assert torch.equal(la, lb) if exact else torch.allclose(la, lb, atol=1e-5), f"at {a.get_seq_length()}"
        if dense is not None:
            assert torch.allclose(la, feed(dense, ref, step), atol=1e-4), f"at {a.get_seq_length()}, against dense"
    assert a.get_seq_length() == b.get_seq_length()


def dense_of(dense, *parts):
    ref = DynamicCache()
    for p in parts:
        feed(dense, ref, p)
    return ref


def decode_steps(model, cache, tokens):
    for i in range(tokens.shape[1]):
        feed(model, cache, tokens[:, i : i + 1])


@pytest.mark.parametrize("budget", list(BUDGETS))
@pytest.mark.parametrize("max_cache_len", [None, 80])
@pytest.mark.parametrize("offload", [True, False])
@pytest.mark.parametrize("drop", [1, 3, 9])
def test_crop_of_decode_steps_continues_as_the_cache_before_them(budget, max_cache_len, offload, drop):
    crop_decode_steps(budget, max_cache_len, offload, drop, stagger=False)


@pytest.mark.parametrize("budget", list(BUDGETS))
@pytest.mark.parametrize("drop", [1, 3, 9])
def test_crop_of_staggered_steps(budget, drop):
    """The default schedule (layer l re-ranks on steps = l mod R): with R = 3 and two layers, layer 1 re-ranked at
    step 7, so dropping it alone (drop=1) dropped a re-rank too: the next step re-ranks every head."""
    crop_decode_steps(budget, None, True, drop, stagger=True)


def crop_decode_steps(budget, max_cache_len, offload, drop, stagger):
    """21 prompt tokens (pages of 4), 8 decode steps (positions 21..28; the stable heads re-rank at steps 3 and 6).
    drop=1 removes step 7, the first token of page 7 (across a page boundary, no re-rank): undone exactly, the
    steps after it are those of the cache as it was after 7 steps.  drop=3 removes steps 5-7, step 6 re-ranked:
    the cache after 5 steps, whose next step re-ranks every head (as after a follow-up chunk).  drop=9 reaches into
    the prompt: the first 20 prompt tokens (paged from the 21-token prompt's end), the next step re-ranking every
    head."""
    cfg = tiny_config("llama", heads=4, kv_heads=2)
    fc, dense = twin_models(cfg)
    profile = HeadProfile.random(cfg, 0.5, seed=3)
    cfg = {**BUDGETS[budget], "stagger_reranks": stagger}
    make = lambda: FlexiCache(profile, **cfg, offload=offload, max_cache_len=max_cache_len)  # noqa: E731
    g = torch.Generator().manual_seed(drop)
    prompt, steps, after = (torch.randint(2, 96, (2, n), generator=g) for n in (21, 8, 20))
    cache, before = make(), make()
    feed(fc, cache, prompt)
    if drop == 9:  # pages counted from a first chunk of 17 = 21 - 4 tokens, as the cache's (a follow-up then)
        feed(fc, before, prompt[:, :17])
        feed(fc, before, prompt[:, 17:20])
    for i in range(8):
        if 21 + i == 29 - drop:
            before = copy.deepcopy(cache)
        feed(fc, cache, steps[:, i : i + 1])
    buffers = [t.data_ptr() for layer in cache.layers for t in layer.buffers()]
    cache.crop(-drop)
    assert cache.get_seq_length() == 29 - drop
    if max_cache_len is not None:  # in place: a compiled step's CUDA graphs replay on the same buffers
        assert [t.data_ptr() for layer in cache.layers for t in layer.buffers()] == buffers
    rerank_dropped = drop > 1 or stagger  # (staggered: step 7 re-ranked layer 1)
    if rerank_dropped:  # a re-rank (or the prompt's seat) dropped: the next step re-ranks every head
        for state in before.states.values():
            state.restore(state.host_origin + 29 - drop, 0, True)  # (storage positions)
    reranks = cache.stats.head_reranks, before.stats.head_reranks
    full = budget == "full"
    kept = torch.cat([prompt, steps], 1)[:, : 29 - drop]
    feed(fc, cache, after[:, :1]), feed(fc, before, after[:, :1])
    if rerank_dropped:  # every head of every layer re-ranked at that step
        assert cache.stats.head_reranks - reranks[0] == len(cache.layers) * 2
    assert cache.stats.head_reranks - reranks[0] == before.stats.head_reranks - reranks[1]
    if full:
        kept = torch.cat([kept, after[:, :1]], 1)
    continue_both(fc, cache, before, after[:, 1:], dense if full else None, dense_of(dense, kept) if full else None,
                  exact=drop < 9)


@pytest.mark.parametrize("budget", list(BUDGETS))
@pytest.mark.parametrize("legacy", [False, True])
def test_crop_of_a_rejected_draft_equals_taking_only_the_accepted_tokens(budget, legacy):
    """Assisted decoding's pattern: a verification forward of 7 draft tokens (crossing two page boundaries), 5
    of them rejected.  The cache then continues exactly as one that took only the 2 accepted tokens (crop(-5);
    ``legacy``: transformers < 5.18's crop(tokens to keep))."""
    cfg = tiny_config("qwen2", heads=8, kv_heads=2)
    fc, dense = twin_models(cfg)
    profile = HeadProfile.random(cfg, 0.5, seed=4)
    g = torch.Generator().manual_seed(1)
    prompt, steps, draft, after = (torch.randint(2, 96, (1, n), generator=g) for n in (21, 3, 7, 20))
    cache, never = FlexiCache(profile, **BUDGETS[budget]), FlexiCache(profile, **BUDGETS[budget])
    for c, d in ((cache, draft), (never, draft[:, :2])):
        feed(fc, c, prompt)
        decode_steps(fc, c, steps)
        feed(fc, c, d)
    cache.crop(26 if legacy else -5)
    full = budget == "full"
    ref = dense_of(dense, prompt, steps, draft[:, :2]) if full else None
    continue_both(fc, cache, never, after, dense if full else None, ref, exact=False)


def test_crop_counts():
    cfg = tiny_config("llama", heads=4, kv_heads=2)
    fc, _ = twin_models(cfg)
    profile = HeadProfile.random(cfg, 0.5, seed=3)
    cache = FlexiCache(profile, **BUDGETS["small"])
    ids = torch.randint(2, 96, (1, 30))
    feed(fc, cache, ids)
    cache.crop(0)
    cache.crop(40)  # keep 40: the cache holds fewer, nothing to do (as transformers < 5.18)
    assert cache.get_seq_length() == 30
    with pytest.raises(ValueError, match="cannot crop 31 tokens"):
        cache.crop(-31)
    with pytest.raises(TypeError):
        cache.crop(True)
    with pytest.raises(TypeError):
        cache.crop(torch.tensor(-2.0))
    cache.crop(torch.tensor(-2))  # transformers 5.17's assisted decoding passes a 0-d tensor
    assert cache.get_seq_length() == 28
    feed(fc, cache, ids[:, 28:])  # the two tokens back
    assert cache.get_seq_length() == 30 and cache.is_croppable
    cache.crop(-30)  # every token: as new
    assert cache.get_seq_length() == 0
    other = torch.randint(2, 96, (1, 17))
    out = fc.generate(other, max_new_tokens=6, do_sample=False, past_key_values=cache)
    assert torch.equal(out, fc.generate(other, max_new_tokens=6, do_sample=False,
                                        past_key_values=FlexiCache(profile, **BUDGETS["small"])))


def assistant_for(cfg):
    """A smaller model of the same vocabulary (one layer, its own random weights) drafting for the tiny one."""
    torch.manual_seed(7)
    small = tiny_config("llama", heads=2, kv_heads=1, layers=1)
    return AutoModelForCausalLM.from_config(small, attn_implementation="sdpa").eval()


@pytest.mark.parametrize("kind,heads,kv", [("llama", 4, 2), ("mistral", 6, 2), ("qwen2", 8, 2)])
@pytest.mark.parametrize("assist", ["lookup 3", "lookup 10", "assistant"])
@pytest.mark.parametrize("max_cache_len", [None, 200])
def test_assisted_decoding_at_a_budget_covering_every_page_gives_dynamic_cache_tokens(kind, heads, kv, assist,
                                                                                       max_cache_len):
    """Greedy assisted decoding (prompt lookup 3 and 10 tokens, an assistant model) with FlexiCache, budget
    covering every page: DynamicCache's tokens exactly.  The prompt repeats itself, so drafts are long and some are
    rejected (crops of up to 10 tokens, across pages)."""
    cfg = tiny_config(kind, heads=heads, kv_heads=kv)
    fc, dense = twin_models(cfg)
    g = torch.Generator().manual_seed(2)
    seg = torch.randint(2, 96, (1, 23), generator=g)
    ids = torch.cat([seg, seg, seg[:, :9], seg, seg[:, :5]], 1)
    how = (dict(prompt_lookup_num_tokens=int(assist.split()[1])) if assist.startswith("lookup")
           else dict(assistant_model=assistant_for(cfg)))
    run = lambda model, cache, **kw: model.generate(ids, max_new_tokens=40, min_new_tokens=40, do_sample=False,  # noqa: E731
                                                    past_key_values=cache, **kw)
    cache = FlexiCache(HeadProfile.random(cfg, 0.25, seed=1), **BUDGETS["full"], max_cache_len=max_cache_len)
    want = run(dense, DynamicCache())
    assert torch.equal(run(dense, DynamicCache(), **how), want)
    assert torch.equal(run(fc, cache, **how), want)
    assert cache.get_seq_length() == ids.shape[1] + 39


@pytest.mark.slow
def test_prompt_lookup_at_an_eighth_of_the_prompt_scores_as_the_eval_harness(smollm2):
    """SmolLM2 on the eval harness's needle task (~1k tokens), FlexiCache's budget 1/8 of the prompt: greedy
    prompt-lookup decoding (3 and 10 tokens) finds at least the needles the harness's own step-by-step FlexiCache
    decoding finds (its verification forwards attend exactly; measured: 2 of 2 here, the harness 1 of 2)."""
    from flexicache_hf.eval.decoding import greedy, stop_ids
    from flexicache_hf.eval.tasks import make_samples, render

    model, tok = smollm2
    samples = make_samples(tok, "niah_single", 1024, 3, 0)
    harness, lookup = [], {3: [], 10: []}
    for s in (samples[0], samples[2]):
        ids = render(tok, s.context, s.question, s.answer_prefix)
        budget = ids.shape[1] // 8 // 16 * 16
        make = lambda: FlexiCache("SmolLM2-135M-Instruct", FlexiCacheConfig(page_size=16, token_budget=budget),  # noqa: E731
                                  model_config=model.config)  # the harness's config, not the profile's settings
        (out,) = greedy(model, ids, make(), s.max_new_tokens, stop_ids(model, tok))
        harness.append(s.score(tok.decode(out, skip_special_tokens=True)))
        for n, scores in lookup.items():
            cache = make()
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=s.max_new_tokens,
                                 do_sample=False, past_key_values=cache, prompt_lookup_num_tokens=n)[0, ids.shape[1]:]
            scores.append(s.score(tok.decode(out, skip_special_tokens=True)))
            assert cache.get_seq_length() == ids.shape[1] + len(out) - 1
    assert all(sum(scores) >= sum(harness) for scores in lookup.values()), (harness, lookup)


def test_a_crop_that_leaves_a_row_only_its_left_padding_is_refused_and_loses_nothing():
    """A left-padded row whose real tokens a crop would all drop would take its next token as padding (a wrong
    answer without an error before): refused, the cache unchanged; a crop that keeps each row a real token equals
    DynamicCache's."""
    cfg = tiny_config("llama", heads=4, kv_heads=2, layers=2, head_dim=16)
    fc, dense = twin_models(cfg)
    ids = torch.randint(2, 90, (3, 16), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    for row, pads in ((1, 3), (2, 8)):
        mask[row, :pads] = 0
        ids[row, :pads] = 0
    cache, ref = FlexiCache(HeadProfile.all_stable(cfg), **BUDGETS["full"]), DynamicCache()
    with torch.no_grad():
        fc(ids, attention_mask=mask, past_key_values=cache, use_cache=True)
        dense(ids, attention_mask=mask, past_key_values=ref, use_cache=True)
    untouched = copy.deepcopy(cache)
    with pytest.raises(ValueError, match=r"row\(s\) \[2\] .* keep at least 9 tokens"):
        cache.crop(-8)
    assert cache.get_seq_length() == 16
    tok = torch.randint(2, 90, (3, 1), generator=torch.Generator().manual_seed(2))
    step = torch.cat([mask, torch.ones((3, 1), dtype=mask.dtype)], 1)
    with torch.no_grad():
        assert torch.equal(fc(tok, attention_mask=step, past_key_values=cache).logits,
                           fc(tok, attention_mask=step, past_key_values=untouched).logits)
    cache.crop(-8)  # 17 held: row 2 keeps its first real token
    ref.crop(-7)
    step = torch.cat([mask[:, :9], torch.ones((3, 1), dtype=mask.dtype)], 1)
    with torch.no_grad():
        got = fc(tok, attention_mask=step, past_key_values=cache).logits
        want = dense(tok, attention_mask=step, past_key_values=ref).logits
    assert torch.allclose(got, want, atol=1e-4)
