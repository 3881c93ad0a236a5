"""flexicache_hf.eval.needle_ranks: the rank of the answer's page per KV head under each scoring rule."""

import pytest
import torch

from flexicache_hf.eval.needle_ranks import (RULES, answer_token, head_ranks, needle_ranks, parse_rule, rank_of,
                                             report)
from flexicache_hf.eval.oracle import page_bound, page_mass
from flexicache_hf.eval.tasks import make_samples
from flexicache_hf.head_profile import HeadProfile

from test_eval import CharTokenizer, tiny_llama


def test_rank_counts_pages_scoring_strictly_higher():
    s = torch.tensor([0.5, 2.0, 2.0, -1.0])
    assert rank_of(s, 1) == 0 and rank_of(s, 2) == 0 and rank_of(s, 0) == 2 and rank_of(s, 3) == 3


def test_head_ranks_by_every_rule_and_the_split():
    """Head 1 holds one key aligned with its query on page 2: the exact mass ranks that page first; each rule's
    rank is the rank in that rule's own scores; the split takes the unstable rule on unstable heads only."""
    g = torch.Generator().manual_seed(0)
    B, H, G, L, D, ps = 1, 2, 3, 40, 8, 4
    keys = torch.randn(B, H, L, D, generator=g) * 0.3
    q = torch.randn(B, H * G, D, generator=g) * 0.3
    keys[0, 1, 9] = q[0, G:2 * G].mean(0) * 40  # token 9 = page 2 of head 1
    rows = head_ranks(q, keys, 0.35, ps, 2, unstable={1}, split=("mass-shrink0.5", "max-shrink0.8"), min_mass=0.5)
    assert [r["head"] for r in rows] == [1]  # head 0 puts little mass on page 2
    (r,) = rows
    assert r["exact"] == 0 and r["mass_on_page"] == pytest.approx(float(page_mass(q, keys, ps, 0.35)[0, 1, 2]))
    for name in (*RULES, "max-shrink0.8"):  # the split's rules are ranked beside the asked ones
        gs, lam = parse_rule(name)
        assert r[name] == rank_of(page_bound(q, keys, ps, gs, 0.35, lam)[0, 1], 2)
    assert r["split"] == r["max-shrink0.8"] and r["unstable"]
    (s,) = head_ranks(q, keys, 0.35, ps, 2, unstable=set(), split=("mass-shrink0.5", "max"), min_mass=0.5)
    assert s["split"] == s["mass-shrink0.5"] and not s["unstable"]


def test_rule_names_parse_to_group_and_shrink():
    assert parse_rule("max") == ("max", 1.0) and parse_rule("mass-shrink0.5") == ("mass", 0.5)
    assert parse_rule("max-shrink0.75") == ("max", 0.75)
    for bad in ("sum", "max-shrink0", "max-shrink1.5", "mass-shrinkx", "maxx"):
        with pytest.raises(ValueError, match="unknown rule"):
            parse_rule(bad)


def test_answer_token_finds_the_value_or_says_it_is_missing():
    tok = CharTokenizer()
    ids = tok.encode("the number is 4711.")
    assert answer_token(ids, tok, "4711") == len("the number is")
    with pytest.raises(ValueError, match="not in the context"):
        answer_token(ids, tok, "1234")


def test_needle_ranks_end_to_end_on_a_tiny_model():
    model, tok = tiny_llama(), CharTokenizer()
    sample = make_samples(tok, "niah_multikey", 300, 1, 0)[0]
    res = needle_ranks(model, tok, sample, page_size=8, budget=64,
                       profile=HeadProfile.from_unstable(model.config, [(0, 1)]), min_mass=0.0, at_step=2)
    assert len(res["output"]) == 3  # one character a token: the prompt's token and two decode steps'
    ids_context = res["context_tokens"]
    assert res["answer_page"] * 8 <= ids_context and res["budget_pages"] == 8
    assert len(res["heads"]) == 2 * 2  # min_mass 0: every (layer, KV head)
    for r in res["heads"]:
        assert r["split"] == (r["max"] if (r["layer"], r["head"]) == (0, 1) else r["mass-shrink0.5"])
    assert res["heads_missing_the_page"]["split"] == sum(r["split"] >= 8 for r in res["heads"])
    assert "| layer | KV head |" in report(res)
    with pytest.raises(ValueError, match="at_step must be"):
        needle_ranks(model, tok, sample, page_size=8, budget=64, profile=HeadProfile.all_stable(model.config),
                     at_step=0)
    with pytest.raises(ValueError, match="unknown rule"):
        needle_ranks(model, tok, sample, page_size=8, budget=64, profile=HeadProfile.all_stable(model.config),
                     split=("mass", "sum"))
    with pytest.raises(ValueError, match="split is"):
        needle_ranks(model, tok, sample, page_size=8, budget=64, profile=HeadProfile.all_stable(model.config),
                     split=("mass",))
