"""``bench.promotion``: what a stable head's re-rank promoted, counted from the cache's own statistics."""

import torch

from conftest import tiny_config, twin_models
from flexicache_hf import HeadProfile
from flexicache_hf.bench.promotion import promotion_share


def test_promotion_share_counts_the_stable_heads_reranks():
    cfg = tiny_config("llama", heads=4, kv_heads=2, layers=2)
    model, _ = twin_models(cfg)
    profile = HeadProfile.random(cfg, 0.5)  # one unstable and one stable KV head per layer
    ids = torch.randint(2, 96, (1, 200))
    r = promotion_share(model, ids, profile, budget=64, new_tokens=17, rerank_interval=4)
    assert r["decode_steps"] == 16 and r["budget_pages"] == 64 // r["page_size"]
    # 2 stable heads (one a layer), staggered (the default): layer 0 at steps 4, 8, 12, layer 1 at 1, 5, 9, 13
    assert r["stable_reranks"] == 3 + 4
    assert 0 < r["promoted_pages"] <= r["stable_reranks"] * r["budget_pages"]
    assert r["replaced_share"] == r["promoted_pages"] / r["stable_reranks"] / r["budget_pages"]
