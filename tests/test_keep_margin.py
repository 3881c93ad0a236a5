"""``FlexiCacheConfig.keep_margin``: a stable head's re-rank keeps a selected page unless another outscores it by more
than the margin; unstable heads and a zero margin are plain top-K; bad values are refused."""

import pytest
import torch

from conftest import tiny_config, twin_models
from flexicache_hf import FlexiCache, FlexiCacheConfig, HeadProfile
from flexicache_hf.config import ConfigError
from flexicache_hf.eval.policies import Policy
from flexicache_hf.kernels import ops_for
from flexicache_hf.kernels.reference import keep_selected
from flexicache_hf.rerank import Reranker


def test_keep_selected_scales_the_selected_pages_only():
    scores = torch.tensor([[[1.0, 2.0, 3.0, 4.0], [1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]]])
    selected = torch.tensor([[[1, 3, -1], [-1, -1, -1], [0, -1, -1]]])
    keep_selected(scores, selected, 0.5)
    assert scores.tolist() == [[[1.0, 3.0, 3.0, 6.0], [1.0, 2.0, 3.0, 4.0], [7.5, 6.0, 7.0, 8.0]]]
    rows = torch.tensor([False, True, True])  # only these heads' rows
    scores = torch.tensor([[[1.0, 2.0], [1.0, 2.0], [1.0, 2.0]]])
    keep_selected(scores, torch.tensor([[[1], [1], [0]]]), 1.0, rows)
    assert scores.tolist() == [[[1.0, 2.0], [1.0, 4.0], [2.0, 2.0]]]


def _reranker(margin, unstable=(1,)):
    return Reranker(1, 2, unstable, 2, 1, torch.device("cpu"), stable_scoring=("mass", 1.0),
                    unstable_scoring=("mass", 1.0), keep_margin=margin)


def _box(values):
    """MinMax of zero width whose mass under a unit query follows ``values`` (one page per value, both heads)."""
    v = torch.tensor(values).view(1, 1, -1, 1).expand(1, 2, -1, 1)
    return v.clone(), v.clone()


@pytest.mark.parametrize("margin, kept", [(0.0, False), (0.5, True)])
def test_a_stable_head_keeps_a_page_a_little_below_a_newcomer(margin, kept):
    ops, q, n = ops_for(torch.device("cpu")), torch.ones(1, 2, 1), torch.tensor([4])
    r = _reranker(margin)
    r.rerank(ops, q, *_box([0.0, 1.0, 2.0, 3.0]), n, due=torch.tensor(True), scale=1.0)
    assert r.selected[0, :, :2].tolist() == [[2, 3], [2, 3]]
    # page 1 now edges out page 2 (mass ratio e^0.1 < 1.5), page 3 stays first
    r.rerank(ops, q, *_box([0.0, 2.1, 2.0, 3.0]), n, due=torch.tensor(True), scale=1.0)
    stable, unstable = r.selected[0, 0, :2].tolist(), r.selected[0, 1, :2].tolist()
    assert unstable == [1, 3]  # unstable heads: plain top-K whatever the margin
    assert stable == ([2, 3] if kept else [1, 3])
    # a page far above (mass ratio e^2) is promoted despite the margin
    r.rerank(ops, q, *_box([0.0, 4.0, 2.0, 3.0]), n, due=torch.tensor(True), scale=1.0)
    assert r.selected[0, 0, :2].tolist() == [1, 3]


def test_keep_margin_is_checked():
    for bad in (-0.1, float("inf"), float("nan"), True, "1"):
        with pytest.raises(ConfigError, match="keep_margin"):
            FlexiCacheConfig(group_score="mass", keep_margin=bad)
    with pytest.raises(ConfigError, match="group_score='mass'"):
        FlexiCacheConfig(keep_margin=0.5)  # the paper's group maximum is no mass
    assert FlexiCacheConfig.paper().keep_margin == 0.0
    with pytest.raises(ValueError, match="keep_margin"):
        Policy("flexicache", 64, keep_margin=0.5)
    assert Policy("flexicache", 64, group_score="mass", keep_margin=0.5).label.endswith("-keep0.5@64")


def test_a_margin_promotes_fewer_pages_in_generate():
    cfg = tiny_config("llama", heads=4, kv_heads=2, layers=2)
    model, _ = twin_models(cfg)
    profile = HeadProfile.random(cfg, 0.5)
    ids = torch.randint(2, 96, (1, 300))
    promoted = []  # random weights: nearly every promotion swaps pages of near-equal mass
    for m in (0.0, 0.05):
        cache = FlexiCache(profile, page_size=8, token_budget=64, rerank_interval=4, group_score="mass", keep_margin=m,
                           model_config=model.config)
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=33, min_new_tokens=33,
                       do_sample=False, past_key_values=cache)
        promoted.append(cache.stats.promoted_pages)
    assert promoted[1] < promoted[0] / 4


def test_a_margin_changes_nothing_before_the_first_rerank():
    cfg = tiny_config("llama", heads=4, kv_heads=2, layers=2)
    model, _ = twin_models(cfg)
    profile = HeadProfile.random(cfg, 0.5)
    ids = torch.randint(2, 96, (1, 100))
    out = []
    for m in (0.0, 0.5):
        cache = FlexiCache(profile, page_size=8, token_budget=32, group_score="mass", keep_margin=m,
                           model_config=model.config)
        out.append(model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False,
                                  past_key_values=cache))
    assert torch.equal(out[0][:, :101], out[1][:, :101])  # the first token comes from the prompt's seat alone
