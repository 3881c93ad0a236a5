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


def test_the_speed_benchmarks_shape_runs_with_the_llama_profiles_settings(monkeypatch):
    """``--llama8b-layers``: the bench's own random weights (here a narrow stand-in of the shape), a random 25 %
    profile that carries the shipped Llama-3.1-8B-Instruct settings, R and margins on top."""
    from transformers import LlamaConfig

    from flexicache_hf.bench import promotion
    from flexicache_hf.bench.generate import cli

    def narrow(layers):
        return LlamaConfig(vocab_size=120001, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                           num_attention_heads=8, num_key_value_heads=4, head_dim=16, max_position_embeddings=4096,
                           initializer_range=0.5)  # attention far from uniform: pages do change

    monkeypatch.setattr(cli, "llama8b_config", narrow)
    report = promotion.main("--llama8b-layers 2 --prompt-tokens 300 --new-tokens 17 --budgets 64 --intervals 4 "
                            "--keep-margins 0 1".split())
    rows = report["rows"]
    assert [(r["weights"], r["rerank_interval"], r["keep_margin"]) for r in rows] == [("random", 4, 0.0),
                                                                                      ("random", 4, 1.0)]
    assert all(r["page_size"] == 8 for r in rows)  # the Llama profile's settings, not FlexiCacheConfig's 16
    assert rows[0]["promoted_pages"] > 0  # (the margin's effect: test_keep_margin.py)
    assert report["model"] == "Llama-3.1-8B shape, 2 layers"
