"""Unstable heads ranked by the exact attention mass (``FlexiCacheConfig(unstable_group_score="exact")``): the
page log-sum-exp kernel's reference against the oracle's exact mass, and FlexiCache's selection against the
oracle's, step for step."""

import pytest
import torch

from conftest import tiny_config, twin_models
from flexicache_hf import FlexiCache, FlexiCacheConfig
from flexicache_hf.config import ConfigError
from flexicache_hf.eval.oracle import OracleCache, page_mass, select
from flexicache_hf.head_profile import HeadProfile
from flexicache_hf.kernels import reference
from flexicache_hf.rerank import SelectionObserver
from test_oracle import step_logits


def paged(keys: torch.Tensor, page_size: int, spare: int = 3, seed: int = 0):
    """``keys [B, H, L, D]`` scattered over a shuffled pool: ``(k_pool [N, ps, D], page_table [B, H, P + spare])``."""
    B, H, L, D = keys.shape
    P = -(-L // page_size)
    cap = P + spare
    pool = torch.full((1 + B * H * cap, page_size, D), float("nan"))  # unwritten slots must never be read
    table = torch.zeros(B, H, cap, dtype=torch.int32)
    perm = torch.randperm(B * H * cap, generator=torch.Generator().manual_seed(seed)) + 1
    i = 0
    for b in range(B):
        for h in range(H):
            for p in range(cap):
                table[b, h, p] = int(perm[i])
                i += 1
            for p in range(P):
                tok = keys[b, h, p * page_size:(p + 1) * page_size]
                pool[table[b, h, p], : tok.shape[0]] = tok
    return pool, table


@pytest.mark.parametrize("L,ps", [(37, 4), (32, 8), (5, 8)])
def test_exact_page_mass_is_the_oracles_mass(L, ps):
    g = torch.Generator().manual_seed(L)
    B, H, G, D = 2, 3, 4, 8
    keys = torch.randn(B, H, L, D, generator=g)
    q = torch.randn(B, H * G, D, generator=g)
    pool, table = paged(keys, ps)
    P = -(-L // ps)
    heads = torch.tensor([2, 0])
    n, length, lo = torch.tensor([P]), torch.tensor([L]), torch.zeros(B, dtype=torch.long)
    mass = reference.exact_page_mass(q, pool, table, heads, n, lo, length, 0.3)
    assert mass.shape == (B, 2, table.shape[2]) and torch.isinf(mass[..., P:]).all()
    torch.testing.assert_close(mass[..., :P], page_mass(q, keys, ps, 0.3)[:, heads])
    # left padding: row 1's first 3 tokens take no attention; the softmax runs over the others
    lo = torch.tensor([0, 3])
    mass = reference.exact_page_mass(q, pool, table, heads, n, lo, length, 0.3)
    logits = torch.einsum("hgd,htd->hgt", q[1].view(H, G, D), keys[1]) * 0.3
    probs = torch.softmax(logits.masked_fill(torch.arange(L) < 3, float("-inf")), dim=-1)
    want = torch.nn.functional.pad(probs, (0, P * ps - L)).view(H, G, P, ps).sum((1, 3))  # [H, P]
    torch.testing.assert_close(mass[1, :, :P], want[heads])
    torch.testing.assert_close(mass[0, :, :P], page_mass(q, keys, ps, 0.3)[0, heads])  # row 0 unpadded
    lse = reference.page_lse(q, pool, table, heads, n, lo, length, 0.3)
    assert lse.shape == (B, 2, G, table.shape[2])
    # an inactive head's row is -inf
    off = reference.exact_page_mass(q, pool, table, heads, n, lo, length, 0.3, active=torch.tensor([False, True]))
    assert torch.isinf(off[:, 0]).all() and torch.equal(off[:, 1], mass[:, 1])


def test_config_takes_exact_for_the_unstable_heads_only():
    c = FlexiCacheConfig(group_score="mass", bound_shrink=0.5, unstable_group_score="exact")
    assert c.unstable_scoring == ("exact", 1.0) and c.stable_scoring == ("mass", 0.5)
    with pytest.raises(ConfigError, match="only the unstable heads keep on the device"):
        FlexiCacheConfig(group_score="exact")
    with pytest.raises(ConfigError, match="does not apply"):
        FlexiCacheConfig(unstable_group_score="exact", unstable_bound_shrink=0.5)
    for bad in (-1, 1.5, True):
        with pytest.raises(ConfigError, match="exact_candidates"):
            FlexiCacheConfig(unstable_group_score="exact", exact_candidates=bad)
    with pytest.raises(ConfigError, match="applies to unstable_group_score='exact' only"):
        FlexiCacheConfig(exact_candidates=2)


class UnstableCheck(SelectionObserver):
    """An observer that checks the unstable heads' scores at every re-rank (``checked`` counts the heads checked)."""

    def __init__(self, cache, profile):
        self.cache, self.profile, self.checked = cache, profile, 0


def resident_keys(layer) -> torch.Tensor:
    """``[B, H, L, D]`` float32: the keys the layer holds on the device for its unstable heads (its resident pool, in
    head order), zeros for the other heads."""
    resident = layer.storage.pool.read_full("k", 0, layer.seq_len)  # [B, full_heads, L, D]
    keys = torch.zeros(resident.shape[0], layer.storage.num_kv_heads, layer.seq_len, resident.shape[-1])
    keys[:, layer.storage.full_heads] = resident.float()
    return keys


def generate_checked(fc, check_type, **fields):
    """Ten greedy tokens after a 152-token prompt (ends on a page boundary), the unstable heads (0, 1) and (1, 0)
    ranked exactly and checked by ``check_type`` at every re-rank; returns the check and the cache."""
    prompt = torch.randint(1, 96, (1, 152), generator=torch.Generator().manual_seed(3))
    prof = HeadProfile.from_unstable(fc.config, [(0, 1), (1, 0)])
    cfg = FlexiCacheConfig(page_size=8, token_budget=32, rerank_interval=4, group_score="mass", bound_shrink=0.5,
                           unstable_group_score="exact", **fields)
    check = check_type(None, prof)
    cache = check.cache = FlexiCache(prof, cfg, model_config=fc.config, observer=check)
    fc.generate(prompt, past_key_values=cache, max_new_tokens=10, min_new_tokens=10, do_sample=False,
                pad_token_id=0, disable_compile=True)
    return check, cache


class CandidateCheck(UnstableCheck):
    """At every re-rank with ``exact_candidates``: each unstable head's scores are the exact mass over its
    candidates alone (its ``C`` pages of the largest group-max bound, the newest page among them), renormalised
    over them, -inf elsewhere; its top-K lies among them."""

    def on_rerank(self, event):
        layer = self.cache.layers[event.layer_idx]
        C = layer.config.exact_candidates * layer.config.budget_pages
        L, ps = layer.seq_len, layer.config.page_size
        n = -(-L // ps)
        keys = resident_keys(layer)
        bound = reference.page_scores(event.query, layer.storage.kmin[:, :, :n].float(),
                                      layer.storage.kmax[:, :, :n].float(), event.heads, n)
        heads = event.heads.tolist()
        for h in self.profile.unstable_heads(event.layer_idx):
            row = heads.index(h)
            cand = select(bound[:, row:row + 1], C)[:, 0]  # [B, C] ascending, -1 padded
            scores = event.scores[:, row, :n]
            G = event.query.shape[1] // layer.storage.num_kv_heads
            for b in range(keys.shape[0]):
                listed = cand[b][cand[b] >= 0]
                assert int(n - 1) in listed.tolist()
                assert torch.isinf(scores[b][~torch.isin(torch.arange(n), listed)]).all()
                q = event.query[b, h * G:(h + 1) * G].float()  # [G, D]
                logits = q @ keys[b, h].T * layer.storage.head_dim ** -0.5  # [G, L]
                inside = torch.isin(torch.arange(L) // ps, listed)
                probs = torch.softmax(logits.masked_fill(~inside, float("-inf")), -1).sum(0)  # over the candidates
                want = torch.nn.functional.pad(probs, (0, n * ps - L)).view(n, ps).sum(-1)[listed]
                torch.testing.assert_close(scores[b, listed], want, atol=1e-5, rtol=1e-5)
                assert set(event.pages[b, row][event.pages[b, row] >= 0].tolist()) <= set(listed.tolist())
            self.checked += 1


@pytest.mark.parametrize("factor", [1, 2])
def test_exact_candidates_score_only_the_pages_of_the_largest_bound(models, factor):
    check, _ = generate_checked(models[0], CandidateCheck, exact_candidates=factor)
    assert check.checked == 2 * 9


def test_exact_candidates_covering_every_page_rank_as_the_full_exact_mass(models):
    """Candidates as many as the pages: the same tokens as the exact mass over every page (eager and on the
    reference and CPU paths alike)."""
    fc, _ = models
    prompt = torch.randint(1, 96, (2, 100), generator=torch.Generator().manual_seed(5))
    prof = HeadProfile.from_unstable(fc.config, [(0, 1), (1, 0)])
    base = dict(page_size=8, token_budget=16, group_score="mass", bound_shrink=0.5, unstable_group_score="exact")
    outs = []
    for n in (0, 10):  # 10 x 2 pages >= the 14 pages of 100 + 12 tokens
        cache = FlexiCache(prof, FlexiCacheConfig(**base, exact_candidates=n), model_config=fc.config)
        outs.append(fc.generate(prompt, past_key_values=cache, max_new_tokens=12, min_new_tokens=12,
                                do_sample=False, pad_token_id=0, disable_compile=True))
    assert torch.equal(outs[0], outs[1])


@pytest.fixture(scope="module")
def models():
    return twin_models(tiny_config("llama", heads=8, kv_heads=2, layers=2))


def test_flexicache_with_every_head_exact_is_the_oracle(models):
    """Every head unstable and ranked exactly: FlexiCache's logits are the oracle's, step for step."""
    fc, _ = models
    prompt = torch.randint(1, 96, (1, 152), generator=torch.Generator().manual_seed(3))  # ends on a page boundary
    cont = torch.randint(1, 96, (1, 12), generator=torch.Generator().manual_seed(4))
    cfg = FlexiCacheConfig(page_size=8, token_budget=32, group_score="mass", bound_shrink=0.5,
                           unstable_group_score="exact")
    cache = FlexiCache(HeadProfile.all_unstable(fc.config), cfg, model_config=fc.config)
    oracle = OracleCache(2, cfg, "mass")
    torch.testing.assert_close(step_logits(fc, prompt, cont, cache), step_logits(fc, prompt, cont, oracle),
                               atol=1e-4, rtol=1e-4)
    for layer, ref in zip(cache.layers, oracle.layers):
        torch.testing.assert_close(layer.reranker.selected, ref.last["pages"])


class ExactCheck(UnstableCheck):
    """At every re-rank, the unstable heads' scores must be the exact mass of the step's query over the keys the
    cache holds for them (its resident pool), and their new top-K the oracle's selection of that mass."""

    def on_rerank(self, event):
        layer = self.cache.layers[event.layer_idx]
        unstable = self.profile.unstable_heads(event.layer_idx)
        mass = page_mass(event.query, resident_keys(layer), layer.config.page_size, layer.storage.head_dim ** -0.5)
        heads = event.heads.tolist()
        for h in unstable:
            row = heads.index(h)
            torch.testing.assert_close(event.scores[:, row], mass[:, h], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(event.pages[:, row], select(mass[:, h:h + 1], layer.config.budget_pages)[:, 0])
            self.checked += 1


@pytest.mark.parametrize("offload", [True, False])
def test_unstable_heads_rank_by_the_exact_mass_beside_offloaded_stable_heads(models, offload):
    check, cache = generate_checked(models[0], ExactCheck, offload=offload)
    assert check.checked == 2 * 9  # two unstable heads, every decode step (the first token comes from the prompt)
    assert cache.layers[0].reranker.split_scoring


def test_exact_grids_and_policy(models):
    from flexicache_hf.eval.grids import named_configs
    from flexicache_hf.eval.policies import Policy, ProfileSource, make_cache

    cfgs = named_configs()
    fid = cfgs["select-16k-exact"]()
    assert fid.page_size == 8 and fid.fidelity_prompt == 16384 and [p.label for p in fid.fidelity_policies()] == [
        "dense"] + [f"flexicache-R{r}-u38{t}-mass-shrink0.5-unstable-exact@{b}"
                    for r, t, b in ((16, "", 2048), (1, "", 2048), (16, "", 1024), (1, "", 1024),
                                    (16, "-random", 2048), (16, "-random", 1024))]
    for name, budget in (("qwen-16k-retention-exact", 1024), ("qwen-32k-retention-exact", 2048)):
        c = cfgs[name]()
        assert c.samples == 16 and c.question_after_context and c.page_size == 8
        assert [p.label for p in c.task_policies()] == ["dense"] + [
            f"flexicache-R16-u{u}-mass-shrink0.5-unstable-exact@{budget}" for u in (38, 25)]
    cpu = cfgs["exact-qwen-cpu"]()
    assert cpu.page_size == 8 and [p.label for p in cpu.fidelity_policies()][1:] == [
        f"flexicache-R16-u38-mass-shrink0.5-unstable-exact@{b}" for b in (256, 512)]
    c32 = cfgs["exact-qwen-cpu-32k"]()
    assert c32.task_indices == (4,) and c32.samples == 5 and c32.tasks == ("niah_multikey",)
    assert [p.label for p in c32.task_policies()] == ["dense", "flexicache-R16-u38-mass-shrink0.5@2048",
                                                      "flexicache-R16-u38-mass-shrink0.5-unstable-exact@2048"]
    fc, _ = models
    cache = make_cache(fid.fidelity_policies()[1], fc.config, 200, ProfileSource(fc.config, None), page_size=8)
    assert cache.config.unstable_scoring == ("exact", 1.0) and cache.config.stable_scoring == ("mass", 0.5)
