"""The oracle selection policy (flexicache_hf.eval.oracle): FlexiCache's budget and page rules, pages ranked by
the exact attention mass of the current query.  Tiny random Llama models (tests/conftest.py)."""

import pytest
import torch
from transformers import DynamicCache

from flexicache_hf import FlexiCache, FlexiCacheConfig, HeadProfile
from flexicache_hf.eval import report, runner
from flexicache_hf.eval.decoding import _forward, greedy, teacher_forced
from flexicache_hf.eval.grids import EvalConfig, named_configs
from flexicache_hf.eval.oracle import OracleCache, OracleLayer, page_bound, page_mass, select
from flexicache_hf.eval.policies import Policy, ProfileSource, make_cache
from flexicache_hf.eval.query_capture import capture_queries
from flexicache_hf.rerank import SelectionObserver

from conftest import tiny_config, twin_models

PS = 16


@pytest.fixture(scope="module")
def models():
    """(flexicache, sdpa) twins with 4 query heads per KV head (Qwen2.5-0.5B has 7)."""
    return twin_models(tiny_config("llama", heads=8, kv_heads=2))


@torch.inference_mode()
def step_logits(model, prompt, cont, cache) -> torch.Tensor:
    """Logits ``[steps + 1, B, V]``: after the prompt, then after each continuation token (decode steps)."""
    out = []
    with capture_queries(model):
        out.append(_forward(model, prompt, cache))
        for tok in cont.T[:-1]:
            out.append(_forward(model, tok[:, None], cache))
    return torch.stack(out)


def _mass_of(mass: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
    """Mass ``[B, H]`` of the listed pages (-1 = none)."""
    return torch.where(pages >= 0, mass.gather(2, pages.clamp_min(0)), 0).sum(-1)


# ---- (1) a budget covering every page is dense --------------------------------------------------------------
@pytest.mark.parametrize("forced", [(0, 0), (1, 4)], ids=["paper", "sink1-recent4"])
def test_oracle_with_budget_covering_every_page_is_dense(models, forced):
    fc, sd = models
    prompt = torch.randint(1, 96, (2, 100))
    steps = 12  # 112 tokens: 7 pages, the budget holds 8
    dense = greedy(fc, prompt, DynamicCache(), steps)
    policy = Policy("oracle", 8 * PS, sink_pages=forced[0], recent_pages=forced[1])
    cache = make_cache(policy, fc.config, 100, ProfileSource(fc.config, None))
    assert greedy(fc, prompt, cache, steps) == dense
    cont = torch.tensor(dense)
    ref = step_logits(fc, prompt, cont, DynamicCache())
    for model in (fc, sd):  # the "flexicache" dense path and stock sdpa
        cache = make_cache(policy, fc.config, 100, ProfileSource(fc.config, None))
        torch.testing.assert_close(step_logits(model, prompt, cont, cache), ref, atol=1e-5, rtol=1e-5)
        layer = cache.layers[1]
        assert layer.last["pages"].tolist() == [[list(range(7))] * 2] * 2  # every page, through the gather path
        assert [r["attended_mass"] for r in cache.row_stats()] == pytest.approx([1.0, 1.0], abs=1e-6)


# ---- (2) the ranking: true mass, not the min/max bound ------------------------------------------------------
def _constructed():
    """One KV head, two query heads, 2-token pages.  Page 1 holds keys aligned with the query (most of the mass);
    page 2's keys point away in opposite directions: exact dot products 0, but its min/max box reaches far."""
    q = torch.tensor([[[1.0, 1.0], [1.0, 0.8]]])  # [B=1, Hq=2, D=2]
    pages = [[0.0, 0.0], [0.0, 0.0],  # page 0
             [2.0, 2.0], [2.0, 2.0],  # page 1: q.k = 4 (3.6)
             [5.0, -5.0], [-5.0, 5.0],  # page 2: q.k = 0 (+-1), bound 10 (9)
             [0.0, 0.0]]  # page 3: the newest token
    return q, torch.tensor(pages)[None, None]  # keys [1, 1, 7, 2]


def test_ranking_by_mass_picks_the_page_holding_the_attention():
    q, keys = _constructed()
    mass = page_mass(q, keys, page_size=2, scale=1.0)
    bound = page_bound(q, keys, page_size=2)
    assert mass.sum(-1).item() == pytest.approx(2.0)  # the group's two softmaxes
    assert mass[0, 0, 1] > 0.9 * 2 and bound[0, 0, 2] > bound[0, 0, 1]  # the case is what it claims
    assert select(bound, 2).tolist() == [[[2, 3]]]  # the bound ranks the empty-handed page first
    assert select(mass, 2).tolist() == [[[1, 3]]]  # the oracle takes the page with the mass (newest kept)
    assert select(mass, 3, sink_pages=1).tolist() == [[[0, 1, 3]]]  # a sink page is forced in, as in FlexiCache
    # The layer attends exactly those pages' keys: page 1's two tokens and the newest one.
    layer = OracleLayer(FlexiCacheConfig(page_size=2, token_budget=4))
    layer.update(keys[:, :, :6], keys[:, :, :6])
    assert layer.get_mask_sizes(1) == (3, 4)  # announced first: 3 keys attended, at positions 4..6 <= the query's 6
    layer.query, layer.scaling = q[:, :, None], 1.0
    k, _ = layer.update(keys[:, :, 6:], keys[:, :, 6:])
    assert k[0, 0].tolist() == [[2.0, 2.0], [2.0, 2.0], [0.0, 0.0]]


def test_group_mass_lets_each_query_head_have_its_page():
    """Two query heads of one KV head: head 0 has a large query and keys that are all alike to it (its attention
    is spread evenly), head 1 a small query that points at page 2 alone.  The group's maximum bound follows head 0
    whatever page 2 holds; ``group_score="mass"`` gives each head a distribution over pages and picks page 2."""
    D, ps = 4, 2
    q = torch.tensor([[[8.0, 0.0, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0]]])  # [1, 2, D]
    page = lambda a, b: [[a, b, 0.0, 0.0], [a, b, 0.0, 0.0]]  # noqa: E731
    keys = torch.tensor(page(1.0, 0.0) + page(1.05, 0.0) + page(1.0, 6.0) + page(1.02, 0.0) + [[0.0] * D])
    keys = keys[None, None]  # [1, 1, 9, D]: pages 0-3 full, page 4 the newest token
    scale = 1.0
    mass = page_mass(q, keys, ps, scale)
    top = mass[0, 0, :4].argmax().item()
    assert top == 2  # the oracle: head 1's whole softmax sits on page 2
    by_max = select(page_bound(q, keys, ps), 2)
    by_mass = select(page_bound(q, keys, ps, "mass", scale), 2)
    assert by_max.tolist() == [[[1, 4]]]  # head 0's largest bound (1.05 * 8) outvotes head 1
    assert by_mass.tolist() == [[[2, 4]]]
    s = page_bound(q, keys, ps, "mass", scale)
    assert s.sum().item() == pytest.approx(2.0, abs=1e-5)  # one distribution per query head


@pytest.mark.parametrize("group_score,shrink", [("max", 1.0), ("mass", 1.0), ("mass", 0.5)])
def test_quest_ref_matches_flexicache_quest_for_either_group_score(models, group_score, shrink):
    """The Triton-free reference path and FlexiCache's own selection agree for both combines and a shrunk bound
    (and the two combines do select differently on this model)."""
    fc, _ = models
    # (a prompt ending on a page boundary: FlexiCache counts pages back from its end, the reference path from 0)
    prompt = torch.randint(1, 96, (1, 128), generator=torch.Generator().manual_seed(1))
    cont = torch.randint(1, 96, (1, 10), generator=torch.Generator().manual_seed(2))
    profiles = ProfileSource(fc.config, None)
    q = make_cache(Policy("quest", 3 * PS, group_score=group_score, bound_shrink=shrink), fc.config, 128, profiles)
    r = make_cache(Policy("quest-ref", 3 * PS, group_score=group_score, bound_shrink=shrink), fc.config, 128,
                   profiles)
    torch.testing.assert_close(step_logits(fc, prompt, cont, r), step_logits(fc, prompt, cont, q),
                               atol=1e-4, rtol=1e-4)
    if group_score == "mass":
        other = make_cache(Policy("quest-ref", 3 * PS), fc.config, 128, profiles)
        step_logits(fc, prompt, cont, other)
        assert not torch.equal(other.layers[1].last["pages"], r.layers[1].last["pages"]) or \
            any(not torch.equal(a.last["pages"], b.last["pages"]) for a, b in zip(other.layers, r.layers))


def test_group_score_applies_to_bound_families_only():
    with pytest.raises(ValueError, match="group_score applies"):
        Policy("oracle", 64, group_score="mass")
    with pytest.raises(ValueError, match="bound_shrink applies"):
        Policy("snapkv", 64, bound_shrink=0.5)
    assert Policy("quest", 64, group_score="mass", bound_shrink=0.5).label == "quest-mass-shrink0.5@64"
    assert Policy("flexicache", 64, 16, 0.25, "measured", 1, 4, "mass").label == \
        "flexicache-R16-u25-sink1-recent4-mass@64"


# ---- (3) the oracle's pages hold at least the Quest-like selection's mass, step by step ---------------------
class Recorder(SelectionObserver):
    def __init__(self):
        self.events = []

    def on_rerank(self, event):
        if event.layer_idx == 0:
            self.events.append(event)


def exact_mass(query: torch.Tensor, keys: torch.Tensor, page_size: int, scale: float) -> torch.Tensor:
    """``[B, H, P]``: each query head's softmax over all keys, summed per page and over the KV head's group
    (written out independently of the oracle's page_mass)."""
    B, Hq, D = query.shape
    H, L = keys.shape[1], keys.shape[2]
    out = torch.zeros(B, H, -(-L // page_size), dtype=torch.float64)
    for b in range(B):
        for hq in range(Hq):
            h = hq // (Hq // H)
            w = torch.softmax((keys[b, h].double() @ query[b, hq].double()) * scale, dim=0)
            for p in range(out.shape[2]):
                out[b, h, p] += w[p * page_size:(p + 1) * page_size].sum()
    return out


def test_oracle_pages_hold_more_mass_than_quest_like_selection(models):
    """Layer 0's keys and queries depend on the tokens only, so the oracle cache's selection and FlexiCache's own
    Quest-like one (every head re-ranked every step) can be compared on the same keys and query of every step."""
    fc, _ = models
    P0, steps, K = 160, 12, 3
    prompt = torch.randint(1, 96, (2, P0))
    cont = torch.randint(1, 96, (2, steps))
    rec = Recorder()
    quest = FlexiCache(HeadProfile.all_unstable(fc.config), FlexiCacheConfig(page_size=PS, token_budget=K * PS,
                                                                               offload=False), observer=rec)
    teacher_forced(fc, prompt, cont.tolist(), quest)
    oracle = make_cache(Policy("oracle", K * PS), fc.config, P0, ProfileSource(fc.config, None))
    picked = []  # the oracle cache's layer-0 pages at each decode step
    with torch.inference_mode(), capture_queries(fc):
        _forward(fc, prompt, oracle)
        for tok in cont.T[:-1]:
            _forward(fc, tok[:, None], oracle)
            picked.append(oracle.layers[0].last["pages"])
    assert len(rec.events) == len(picked) == steps - 1
    keys_all, scale, gains = oracle.layers[0].keys, fc.config.head_dim ** -0.5, []
    for ev, mine in zip(rec.events, picked):
        L = P0 + ev.step + 1
        keys = keys_all[:, :, :L]
        assert ev.num_pages == -(-L // PS) > K and mine.shape == ev.pages.shape == (2, 2, K)
        # FlexiCache's scores are the bound the oracle's quest-ref computes from the exact keys.
        torch.testing.assert_close(ev.scores, page_bound(ev.query, keys, PS), atol=1e-4, rtol=1e-5)
        mass = exact_mass(ev.query, keys, PS, scale)
        assert (mine[..., -1] == ev.num_pages - 1).all() and (ev.pages == ev.num_pages - 1).any(-1).all()
        got, theirs = _mass_of(mass, mine), _mass_of(mass, ev.pages)
        assert (got >= theirs - 1e-9).all(), (ev.step, got, theirs)
        gains.append((got - theirs).max().item())
    assert max(gains) > 1e-3  # the two rankings do differ on this model: the comparison is not vacuous


# ---- quest-ref reproduces FlexiCache's Quest-like policy (the plumbing is FlexiCache's selection) -----------
@pytest.mark.parametrize("forced", [(0, 0), (1, 1)], ids=["paper", "sink1-recent1"])
def test_quest_ref_matches_flexicache_quest(models, forced):
    fc, _ = models
    prompt = torch.randint(1, 96, (1, 128))  # (ends on a page boundary: the same pages, see above)
    cont = torch.randint(1, 96, (1, 10))
    profiles = ProfileSource(fc.config, None)
    q = make_cache(Policy("quest", 3 * PS, sink_pages=forced[0], recent_pages=forced[1]), fc.config, 128, profiles)
    r = make_cache(Policy("quest-ref", 3 * PS, sink_pages=forced[0], recent_pages=forced[1]), fc.config, 128,
                   profiles)
    a, b = step_logits(fc, prompt, cont, q), step_logits(fc, prompt, cont, r)
    torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(a, step_logits(fc, prompt, cont, DynamicCache()), atol=1e-3)  # sparse for real
    assert isinstance(r, OracleCache) and 0 < r.row_stats()[0]["attended_mass"] < 1


# ---- the harness: by name in grids, runner, report ----------------------------------------------------------
def test_oracle_runs_in_the_harness(tmp_path):
    from test_eval import CharTokenizer, tiny_llama  # a 128-token model for the character tokenizer

    model = tiny_llama()
    cfg = EvalConfig(name="test", tasks=("niah_single",), task_length=200, samples=1, budgets=(1 / 4,),
                     families=("oracle",), rerank_intervals=(), unstable_fractions=(), reach_lengths=(),
                     fidelity_prompt=160, fidelity_length=6, fidelity_budgets=(64,),
                     fidelity_families=("quest", "oracle", "quest-ref"), fidelity_free_run=False)
    results = runner.run(model, CharTokenizer(), cfg, profile_name=None, progress=False)
    assert {r["policy"] for r in results["tasks"]} == {"dense", "oracle@1/4"}
    rows = {r["policy"]: r for r in results["fidelity"]}
    assert set(rows) == {"dense", "quest@64", "oracle@64", "quest-ref@64"}
    assert 0 < rows["oracle@64"]["attended_mass"] <= 1 and "attended_mass" not in rows["quest@64"]
    assert rows["quest-ref@64"]["nll"] == pytest.approx(rows["quest@64"]["nll"], rel=1e-4)
    report.write(results, cfg, tmp_path, "cmd", "### test")
    text = (tmp_path / "report.md").read_text()
    assert "| oracle@64 | " in text and "attended mass" in text


def test_oracle_grids():
    cfgs = named_configs()
    cfg = cfgs["oracle-16k"]()
    assert cfg.model == "qwen2.5-coder-0.5b" and cfg.fidelity_prompt == 16384 and cfg.fidelity_docs >= 8
    labels = [p.label for p in cfg.fidelity_policies()]
    for b in (1024, 2048):
        for want in ("quest", "flexicache-R16-u25-random", "flexicache-R16-u25-random-sink1-recent4", "oracle",
                     "oracle-sink1-recent4", "quest-ref", "quest-mass", "quest-ref-mass",
                     "flexicache-R16-u25-random-sink1-recent4-mass"):
            assert f"{want}@{b}" in labels
    assert labels[0] == "dense" and len(labels) == len(set(labels)) == 19
    assert {p.label for p in cfg.task_policies()} >= {"oracle@1024", "quest@2048", "flexicache-R16-u25@1024"}
    p8 = cfgs["oracle-16k-pages8"]()
    assert p8.page_size == 8 and p8.fidelity_policies() == cfg.fidelity_policies()
    with pytest.raises(ValueError, match="sink_pages"):
        Policy("streaming", 256, sink_pages=1)
    for name, length, budgets in (("qwen-8k", 8192, (512, 1024, 2048)), ("qwen-16k", 16384, (1024, 2048)),
                                  ("qwen-32k", 32768, (2048, 4096))):
        c = cfgs[name]()
        assert c.model == "qwen2.5-coder-0.5b" and c.fidelity_prompt == length and c.task_length < length
        labels = {p.label for p in c.task_policies()}
        for b in budgets:
            assert {f"{f}@{b}" for f in ("quest", "streaming", "snapkv", "lserve-R16", "flexicache-R16-u25",
                                          "flexicache-R16-u25-random")} <= labels
    for name, base in (("qwen-16k-later-question", "qwen-16k"), ("qwen-32k-later-question", "qwen-32k")):
        later, same = cfgs[name](), cfgs[base]()
        assert later.question_after_context and not same.question_after_context and later.fidelity_docs == 0
        assert later.task_length == same.task_length and not later.task_extra
        assert later.task_policies() == [p for p in same.task_policies() if p not in same.task_extra]
    pb = {p.label for p in cfgs["profiles-qwen-cpu-budgets"]().fidelity_policies()}
    assert pb == {"dense"} | {f"flexicache-R16-u25{k}@{b}" for b in (512, 1024) for k in ("", "-random")}
    lq, qp = cfgs["later-question-cpu"](), cfgs["question-in-prompt-cpu"]()
    assert lq.question_after_context and not qp.question_after_context and lq.task_policies() == qp.task_policies()
    sel, p8 = cfgs["select-16k"](), cfgs["select-16k-pages8"]()
    assert sel.fidelity_prompt == 16384 and p8.page_size == 8 and sel.page_size == 16
    assert [p.label for p in sel.fidelity_policies()][:4] == ["dense", "flexicache-R16-u25@1024",
                                                              "flexicache-R16-u25-mass@1024", "quest-mass@1024"]
    assert all(p.group_score == "mass" for p in p8.fidelity_policies()[1:])
    rest = cfgs["select-16k-rest"]()
    assert rest.page_size == 8 and rest.fidelity_prompt == 16384 and [p.label for p in rest.fidelity_policies()] == [
        "dense", "quest-mass@2048", "flexicache-R16-u25-random-mass@1024", "flexicache-R16-u25-mass@2048",
        "flexicache-R16-u25-random-mass@2048"]
    assert {p.label for p in cfgs["profiles-qwen-cpu"]().fidelity_policies()} == {
        "dense", "flexicache-R16-u25@256", "flexicache-R16-u25-random@256", "flexicache-R16-u25-mass@256",
        "flexicache-R16-u25-random-mass@256"}


def test_retention_grids_with_the_long_generation_settings():
    cfgs = named_configs()
    want = ["flexicache-R16-u38-mass-shrink0.5@{b}", "quest-mass-shrink0.5@{b}", "flexicache-R16-u25-mass@{b}"]
    for name, length, budget in (("qwen-16k-retention-unstable", 16384, 1024),
                                 ("qwen-32k-retention-unstable", 32768, 2048)):
        c = cfgs[name]()
        assert c.model == "qwen2.5-coder-0.5b" and c.question_after_context and c.page_size == 8
        assert c.samples == 16 and c.task_length < length and c.fidelity_docs == 0
        assert [p.label for p in c.task_policies()] == ["dense"] + [w.format(b=budget) for w in want]
    cpu = cfgs["retention-shrink-qwen-cpu"]()
    assert cpu.tasks == ("niah_multikey",) and cpu.task_length < 4096 and cpu.question_after_context
    assert [p.label for p in cpu.task_policies()] == ["dense"] + [w.format(b=256) for w in want]


def test_profile_grid_with_the_recommended_qwen_setting():
    c = named_configs()["profiles-qwen-cpu-recommended"]()
    assert c.model == "qwen2.5-coder-0.5b" and c.page_size == 8 and c.fidelity_prompt == 4096
    assert [p.label for p in c.fidelity_policies()] == ["dense"] + [
        f"flexicache-R16-u38{k}-mass-shrink0.5@{b}" for b in (256, 512) for k in ("", "-random")]
    r = named_configs()["select-16k-unstable-random"]()
    assert r.page_size == 8 and r.fidelity_prompt == 16384 and [p.label for p in r.fidelity_policies()] == ["dense"] + [
        f"flexicache-R16-u38-random-mass-shrink0.5@{b}" for b in (2048, 1024)]


def test_oracle_unstable_ranks_the_profiles_unstable_heads_exactly(models):
    """``oracle-unstable``: the profile's unstable heads take the exact mass, the others the bound; with every head
    unstable it is the oracle, with none the Quest-like reference path (logits equal step for step)."""
    fc, _ = models
    prompt = torch.randint(1, 96, (1, 120), generator=torch.Generator().manual_seed(1))
    cont = torch.randint(1, 96, (1, 8), generator=torch.Generator().manual_seed(2))
    profiles = ProfileSource(fc.config, None)
    mixed = make_cache(Policy("oracle-unstable", 3 * PS, 1, 0.5, group_score="mass", bound_shrink=0.5), fc.config,
                       120, profiles)
    step_logits(fc, prompt, cont, mixed)
    exact = profiles.profile(0.5)
    for li, layer in enumerate(mixed.layers):
        last, heads = layer.last, exact.unstable_heads(li)
        assert layer.exact_heads == heads
        bound = page_bound(last["query"], layer.keys, PS, "mass", last["scale"], 0.5)
        for h in range(last["scores"].shape[1]):
            torch.testing.assert_close(last["scores"][:, h], (last["mass"] if h in heads else bound)[:, h])
    runs = {}
    for name, policy in (("all", Policy("oracle-unstable", 3 * PS, 1, 1.0)), ("oracle", Policy("oracle", 3 * PS)),
                         ("none", Policy("oracle-unstable", 3 * PS, 1, 0.0)), ("ref", Policy("quest-ref", 3 * PS))):
        runs[name] = step_logits(fc, prompt, cont, make_cache(policy, fc.config, 120, profiles))
    torch.testing.assert_close(runs["all"], runs["oracle"])
    torch.testing.assert_close(runs["none"], runs["ref"])
    assert Policy("oracle-unstable", 1024, 1, 0.375, group_score="mass", bound_shrink=0.5).label == \
        "oracle-unstable-u38-mass-shrink0.5@1024"
    with pytest.raises(ValueError, match="exact_heads"):
        OracleLayer(FlexiCacheConfig(page_size=PS, token_budget=3 * PS), "mass", (0,))
    with pytest.raises(ValueError, match="profile applies to"):
        Policy("quest-ref", 1024, profile="random")
    with pytest.raises(ValueError, match="one entry per layer"):
        OracleCache(2, FlexiCacheConfig(page_size=PS, token_budget=3 * PS), "bound", [(0,)])


def test_oracle_unstable_grids():
    cfgs = named_configs()
    ret, base = cfgs["qwen-16k-retention-oracle-unstable"](), cfgs["qwen-16k-retention-oracle"]()
    assert ret.tasks == ("niah_multikey",) and ret.samples == base.samples == 16 and ret.page_size == 8
    assert [p.label for p in ret.task_policies()] == ["dense", "oracle-unstable-u38-mass-shrink0.5@1024",
                                                      "oracle-unstable-u38@1024"]
