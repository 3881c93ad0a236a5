"""Unstable heads ranked by a scoring of their own (FlexiCacheConfig.unstable_group_score / unstable_bound_shrink):
each kind of head gets exactly its rule, unset fields change nothing, and the eval's policies pass them on."""

import pytest
import torch

from conftest import tiny_config, twin_models
from flexicache_hf import FlexiCache, FlexiCacheConfig
from flexicache_hf.eval.policies import Policy, ProfileSource, make_cache
from flexicache_hf.head_profile import HeadProfile
from flexicache_hf.kernels import reference
from flexicache_hf.kernels import ops_for
from flexicache_hf.rerank import Reranker

STABLE, UNSTABLE = ("mass", 0.5), ("max", 1.0)


def _inputs(B=2, H=4, G=3, P=9, D=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H * G, D, generator=g)
    lo = torch.randn(B, H, P, D, generator=g)
    hi = lo + torch.rand(B, H, P, D, generator=g) * 3
    return q, lo, hi


def test_each_kind_of_head_is_scored_by_its_own_rule():
    q, lo, hi = _inputs()
    B, H, P = lo.shape[0], lo.shape[1], lo.shape[2]
    unstable = (1, 3)
    ops = ops_for(torch.device("cpu"))
    r = Reranker(B, H, unstable, 4, 1, torch.device("cpu"), stable_scoring=STABLE, unstable_scoring=UNSTABLE)
    assert r.split_scoring
    n = torch.tensor([P])
    scores = r.rerank(ops, q, lo, hi, n, due=torch.tensor(True))
    heads = torch.arange(H)
    want_st = reference.page_scores(q, lo, hi, heads, P, None, *STABLE[:1], None, STABLE[1])
    want_un = reference.page_scores(q, lo, hi, heads, P, None, *UNSTABLE[:1], None, UNSTABLE[1])
    for h in range(H):
        want = want_un if h in unstable else want_st
        torch.testing.assert_close(scores[:, h, :P], want[:, h])
    assert not torch.allclose(want_st, want_un)  # the two rules do differ on these inputs
    # not due: the stable heads are not scored (-inf), the unstable ones are, by their rule
    scores = r.rerank(ops, q, lo, hi, n, due=torch.tensor(False))
    assert torch.isinf(scores[:, [0, 2]]).all()
    torch.testing.assert_close(scores[:, [1, 3], :P], want_un[:, [1, 3]])
    # the prompt's seat scores the stable heads only, by theirs
    seat = r.seat_prompt(ops, q, lo, hi, P)
    torch.testing.assert_close(seat, reference.select_pages(want_st[:, [0, 2]], 4))


@pytest.mark.parametrize("unstable", [(), (0, 1, 2, 3)])
def test_a_single_kind_of_head_needs_one_scoring(unstable):
    """All stable: the unstable rule is never used; all unstable: it is everyone's."""
    q, lo, hi = _inputs()
    ops = ops_for(torch.device("cpu"))
    r = Reranker(2, 4, unstable, 4, 1, torch.device("cpu"), stable_scoring=STABLE, unstable_scoring=UNSTABLE)
    assert not r.split_scoring
    scores = r.rerank(ops, q, lo, hi, torch.tensor([9]), due=torch.tensor(True))
    rule = UNSTABLE if unstable else STABLE
    torch.testing.assert_close(scores[..., :9], reference.page_scores(q, lo, hi, torch.arange(4), 9, None, rule[0],
                                                                      None, rule[1]))


def test_config_resolves_the_unstable_rule():
    c = FlexiCacheConfig(group_score="mass", bound_shrink=0.5)
    assert c.stable_scoring == c.unstable_scoring == ("mass", 0.5)
    c = FlexiCacheConfig(group_score="mass", bound_shrink=0.5, unstable_group_score="max", unstable_bound_shrink=1)
    assert c.stable_scoring == ("mass", 0.5) and c.unstable_scoring == ("max", 1.0)
    assert isinstance(c.unstable_bound_shrink, float)
    assert FlexiCacheConfig(bound_shrink=0.5, unstable_group_score="mass").unstable_scoring == ("mass", 0.5)


@pytest.fixture(scope="module")
def models():
    return twin_models(tiny_config("llama", heads=8, kv_heads=2, layers=2))


def _generate(model, cache, prompt, new=12):
    return model.generate(prompt, past_key_values=cache, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                          pad_token_id=0, disable_compile=True)


def test_generation_uses_each_rule(models):
    """Unset or equal to the stable rule: the same tokens as the plain config.  Set apart: the unstable heads
    select pages of their own."""
    fc, _ = models
    prompt = torch.randint(1, 96, (1, 150), generator=torch.Generator().manual_seed(3))
    prof = HeadProfile.from_unstable(fc.config, [(0, 1), (1, 0)])
    base = dict(page_size=8, token_budget=32, rerank_interval=4, group_score="mass", bound_shrink=0.5)
    plain = FlexiCache(prof, **base)
    same = FlexiCache(prof, **base, unstable_group_score="mass", unstable_bound_shrink=0.5)
    split = FlexiCache(prof, **base, unstable_group_score="max", unstable_bound_shrink=1.0)
    out = _generate(fc, plain, prompt)
    assert torch.equal(_generate(fc, same, prompt), out)
    _generate(fc, split, prompt)
    sel = lambda c, l, h: c.layers[l].reranker.selected[:, h]  # noqa: E731
    differs = any(not torch.equal(sel(split, l, h), sel(plain, l, h)) for l, h in ((0, 1), (1, 0)))
    assert split.layers[0].reranker.split_scoring and differs


def test_policy_passes_the_unstable_rule_to_the_cache(models):
    fc, _ = models
    p = Policy("flexicache", 64, 16, 0.5, group_score="mass", bound_shrink=0.5, unstable_scoring=("max", 1.0))
    assert p.label == "flexicache-R16-u50-mass-shrink0.5-unstable-max-shrink1@64"
    cache = make_cache(p, fc.config, 200, ProfileSource(fc.config, None))
    assert cache.config.stable_scoring == ("mass", 0.5) and cache.config.unstable_scoring == ("max", 1.0)
    with pytest.raises(ValueError, match="unstable_scoring applies to flexicache only"):
        Policy("quest", 64, unstable_scoring=("max", 1.0))
