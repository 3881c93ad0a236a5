"""The decode step as torch.compile traces it: one graph, no breaks, the same tokens as the eager path.

On CUDA, ``generate`` compiles a compileable cache's decode step with ``mode="reduce-overhead"`` (CUDA graphs).
These CPU tests take transformers' own route too -- ``generate`` compiling the forward itself -- with the
``aot_eager`` backend (Dynamo + AOT autograd, no code generation), which checks what matters for a graph:
the whole decode forward traces in one piece (``fullgraph=True``), with every kernel an opaque custom op and
all per-step state on the device, so the program never changes from step to step.
"""

import gc

import pytest
import torch
from transformers import DynamicCache

from conftest import compile_config, padded_pair
from flexicache_hf import FlexiCache
from flexicache_hf.head_profile import HeadProfile


def graphs():
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


@pytest.fixture(scope="module")
def setup():
    return padded_pair(37, 5)


def run(model, ids, mask, cache, new, compiled):
    kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, attention_mask=mask, pad_token_id=0)
    if compiled:
        kw["compile_config"] = compile_config()
    else:
        kw["disable_compile"] = True
    return model.generate(ids, past_key_values=cache, **kw)


@pytest.mark.parametrize("offload", [True, False])
def test_compiled_decode_equals_eager_in_one_graph(setup, offload):
    cfg, fc, _, ids, mask = setup
    prof = HeadProfile.from_unstable(cfg, [(0, 1)])
    make = lambda: FlexiCache(prof, page_size=4, token_budget=12, rerank_interval=5, offload=offload,  # noqa: E731
                              max_cache_len=37 + 40)
    eager_cache = make()
    assert eager_cache.is_compileable
    eager = run(fc, ids, mask, eager_cache, 40, compiled=False)
    before = graphs()
    cache = make()
    out = run(fc, ids, mask, cache, 40, compiled=True)
    assert cache.layers[0].state.stale  # the decode steps ran compiled: the host learns their length lazily
    assert torch.equal(out, eager)
    assert graphs() - before <= 1  # one program for every step (re-rank or not, new page or not)
    # a second cache of the same shapes reuses the compiled program
    again = run(fc, ids, mask, make(), 40, compiled=True)
    assert torch.equal(again, eager) and graphs() - before <= 1
    # the device-side counters saw the same steps as the eager run's
    assert cache.stats == eager_cache.stats
    assert cache.get_seq_length() == 37 + 39 and cache.memory_report()["tokens"] == 76


@pytest.mark.parametrize("stagger", [True, False])
def test_compiled_decode_with_loads_behind_the_compute_equals_eager(setup, stagger):
    """``overlap_loads``: the late re-rank (attend, then reseat and load behind the compute, joined at the last
    layer) traced in one graph gives the eager run's tokens and counters, promotes pages, and selects differently
    from the paper's order (the comparison is not vacuous)."""
    cfg, fc, _, ids, mask = setup
    prof = HeadProfile.from_unstable(cfg, [(0, 1)])
    make = lambda overlap: FlexiCache(prof, page_size=4, token_budget=12, rerank_interval=5,  # noqa: E731
                                      stagger_reranks=stagger, overlap_loads=overlap, max_cache_len=37 + 40)
    eager_cache = make(True)
    eager = run(fc, ids, mask, eager_cache, 40, compiled=False)
    before = graphs()
    cache = make(True)
    assert torch.equal(run(fc, ids, mask, cache, 40, compiled=True), eager)
    assert graphs() - before <= 1 and cache.stats == eager_cache.stats and cache.stats.promoted_pages > 0
    paper_order = make(False)
    run(fc, ids, mask, paper_order, 40, compiled=False)
    sel = lambda c: torch.stack([layer.reranker.selected for layer in c.layers])  # noqa: E731
    assert paper_order.stats.promoted_pages != eager_cache.stats.promoted_pages or \
        not torch.equal(sel(paper_order), sel(eager_cache))


def test_compiled_decode_with_group_mass_equals_eager(setup):
    """group_score="mass" (a softmax per query head, summed over the group) inside the compiled step: the same
    tokens as eagerly, and a selection of its own (not the group maximum's)."""
    cfg, fc, _, ids, mask = setup
    prof = HeadProfile.from_unstable(cfg, [(0, 1)])
    make = lambda gs: FlexiCache(prof, page_size=4, token_budget=12, rerank_interval=5,  # noqa: E731
                                 group_score=gs, max_cache_len=37 + 24)
    eager_cache = make("mass")
    eager = run(fc, ids, mask, eager_cache, 24, compiled=False)
    cache = make("mass")
    assert torch.equal(run(fc, ids, mask, cache, 24, compiled=True), eager)
    assert cache.stats == eager_cache.stats
    by_max = make("max")
    run(fc, ids, mask, by_max, 24, compiled=False)
    sel = lambda c: torch.stack([layer.reranker.selected for layer in c.layers])  # noqa: E731
    assert not torch.equal(sel(by_max), sel(eager_cache))


def test_compiled_decode_with_a_rule_per_kind_of_head_equals_eager(setup):
    """Unstable heads by the group maximum of the full bound, stable ones by the mass of a shrunk box, inside the
    compiled step: the same tokens and counters as eagerly."""
    cfg, fc, _, ids, mask = setup
    prof = HeadProfile.from_unstable(cfg, [(0, 1), (1, 0)])
    make = lambda: FlexiCache(prof, page_size=4, token_budget=12, rerank_interval=5, group_score="mass",  # noqa: E731
                              bound_shrink=0.5, unstable_group_score="max", unstable_bound_shrink=1.0,
                              max_cache_len=37 + 24)
    eager_cache = make()
    eager = run(fc, ids, mask, eager_cache, 24, compiled=False)
    assert eager_cache.layers[0].reranker.split_scoring
    cache = make()
    assert torch.equal(run(fc, ids, mask, cache, 24, compiled=True), eager)
    assert cache.stats == eager_cache.stats


@pytest.mark.parametrize("keep", [0.0, 0.5])
def test_compiled_decode_with_exact_unstable_ranking_equals_eager(setup, keep):
    """Unstable heads ranked by the exact attention mass (``unstable_group_score="exact"``: the page log-sum-exp
    op over the pool) inside the compiled step, left padding included, with and without a ``keep_margin`` for the
    stable heads: the same tokens and counters as eagerly."""
    cfg, fc, _, ids, mask = setup
    prof = HeadProfile.from_unstable(cfg, [(0, 1), (1, 0)])
    make = lambda: FlexiCache(prof, page_size=4, token_budget=12, rerank_interval=5, group_score="mass",  # noqa: E731
                              bound_shrink=0.5, unstable_group_score="exact", max_cache_len=37 + 24,
                              keep_margin=keep)
    eager_cache = make()
    eager = run(fc, ids, mask, eager_cache, 24, compiled=False)
    cache = make()
    assert torch.equal(run(fc, ids, mask, cache, 24, compiled=True), eager)
    assert cache.stats == eager_cache.stats


def test_compiled_decode_with_a_shrunk_bound_equals_eager(setup):
    """bound_shrink=0.5 reaches the compiled step's page scores: the same tokens as eagerly, and a selection of
    its own (not the bound's)."""
    cfg, fc, _, ids, mask = setup
    prof = HeadProfile.from_unstable(cfg, [(0, 1)])
    make = lambda lam: FlexiCache(prof, page_size=4, token_budget=12, rerank_interval=5,  # noqa: E731
                                  bound_shrink=lam, max_cache_len=37 + 24)
    eager_cache = make(0.5)
    eager = run(fc, ids, mask, eager_cache, 24, compiled=False)
    cache = make(0.5)
    torch._dynamo.reset()  # another shrink is another program: keep the module's other tests within the limit
    try:
        assert torch.equal(run(fc, ids, mask, cache, 24, compiled=True), eager)
    finally:
        torch._dynamo.reset()
    bound = make(1.0)
    run(fc, ids, mask, bound, 24, compiled=False)
    sel = lambda c: torch.stack([layer.reranker.selected for layer in c.layers])  # noqa: E731
    assert not torch.equal(sel(bound), sel(eager_cache))


def test_compiled_decode_with_staggered_reranks_equals_eager(setup):
    """stagger_reranks=True in the compiled step (the per-layer due flags and anchors advance on the device):
    the same tokens and counters as eagerly, in one graph."""
    cfg, fc, _, ids, mask = setup
    prof = HeadProfile.from_unstable(cfg, [(0, 1)])
    make = lambda: FlexiCache(prof, page_size=4, token_budget=12, rerank_interval=5,  # noqa: E731
                              stagger_reranks=True, max_cache_len=37 + 24)
    eager_cache = make()
    eager = run(fc, ids, mask, eager_cache, 24, compiled=False)
    before = graphs()
    cache = make()
    assert torch.equal(run(fc, ids, mask, cache, 24, compiled=True), eager)
    assert graphs() - before <= 1 and cache.stats == eager_cache.stats
    assert cache.layers[1].reranker.reranks.tolist() == eager_cache.layers[1].reranker.reranks.tolist()


def test_compiled_full_budget_equals_dense(setup):
    cfg, fc, dense, ids, mask = setup
    cache = FlexiCache(HeadProfile.random(cfg, 0.5, seed=2), page_size=4, token_budget=128, rerank_interval=3,
                       max_cache_len=37 + 30)
    out = run(fc, ids, mask, cache, 30, compiled=True)
    want = dense.generate(ids, attention_mask=mask, past_key_values=DynamicCache(), max_new_tokens=30,
                          min_new_tokens=30, do_sample=False, pad_token_id=0)
    assert torch.equal(out, want)


def test_follow_up_turn_after_compiled_steps(setup):
    """A prompt chunk after captured steps: the host first learns how far they went, then runs it eagerly."""
    cfg, fc, _, ids, mask = setup
    prof = HeadProfile.from_unstable(cfg, [(1, 0)])
    outs = []
    for compiled in (False, True):
        cache = FlexiCache(prof, page_size=4, token_budget=16, rerank_interval=4, max_cache_len=160)
        first = run(fc, ids, mask, cache, 20, compiled)
        turn = torch.cat([first, torch.randint(2, 90, (2, 11), generator=torch.Generator().manual_seed(1))], 1)
        mask2 = torch.cat([mask, torch.ones((2, turn.shape[1] - mask.shape[1]), dtype=mask.dtype)], 1)
        outs.append(run(fc, turn, mask2, cache, 15, compiled))
    assert torch.equal(outs[0], outs[1])


def test_compiled_decode_after_reset_reuses_the_program(setup):
    """reset() keeps a sized cache's buffers at their addresses: the next prompt's compiled steps run the same
    program (on CUDA, the same recorded graphs) and give a fresh cache's tokens."""
    cfg, fc, _, ids, mask = setup
    prof = HeadProfile.from_unstable(cfg, [(1, 0)])
    make = lambda: FlexiCache(prof, page_size=4, token_budget=12, rerank_interval=4, max_cache_len=37 + 24)  # noqa: E731
    cache = make()
    run(fc, ids, mask, cache, 24, compiled=True)
    other = ids.roll(7, 1)
    want = run(fc, other, mask, make(), 24, compiled=False)
    before = graphs()
    cache.reset()
    assert torch.equal(run(fc, other, mask, cache, 24, compiled=True), want)
    assert graphs() == before


def test_not_compileable_with_kernels_or_observer(setup, monkeypatch):
    cfg = setup[0]
    prof = HeadProfile.all_stable(cfg)
    assert FlexiCache(prof).is_compileable  # reserved storage (reserve.py): fixed addresses without max_cache_len
    monkeypatch.setattr("flexicache_hf.cache.compileable_unsized", lambda: False)  # CUDA without VMM
    assert not FlexiCache(prof).is_compileable  # its buffers grow: no fixed addresses
    assert not FlexiCache(prof, kernels="reference").is_compileable
    assert not FlexiCache(prof, max_cache_len=64, kernels="reference").is_compileable

    class Seen:
        def on_rerank(self, event):
            pass

    assert not FlexiCache(prof, max_cache_len=64, observer=Seen()).is_compileable


def test_row_selection_after_compiled_steps(setup):
    """batch_select_indices after captured steps (e.g. dropping finished rows): the host first learns how far
    the steps went (each row's newest page is found from the length), then the follow-up turn is exact."""
    cfg, fc, _, ids, mask = setup
    prof = HeadProfile.from_unstable(cfg, [(0, 0), (1, 1)])
    outs, stored = [], []
    for compiled in (False, True):
        cache = FlexiCache(prof, page_size=4, token_budget=12, rerank_interval=3, max_cache_len=37 + 18 + 7 + 8)
        first = run(fc, ids, mask, cache, 18, compiled)
        cache.batch_select_indices(torch.tensor([1]))
        turn = torch.cat([first[1:], torch.randint(2, 90, (1, 7), generator=torch.Generator().manual_seed(2))], 1)
        mask2 = torch.cat([mask[1:], torch.ones((1, turn.shape[1] - mask.shape[1]), dtype=mask.dtype)], 1)
        outs.append(run(fc, turn, mask2, cache, 8, compiled))
        cache.sync()
        stored.append([torch.cat(layer.gather_tokens(layer.seq_len)) for layer in cache.layers])
    assert torch.equal(outs[0], outs[1])
    assert all(torch.equal(a, b) for a, b in zip(*stored))  # every stored token, host and device tiers


def test_compiled_decode_on_a_new_cache_takes_the_dropped_ones_buffers(setup):
    """A new cache of a dropped one's shape takes its buffers (recycling.py): the compiled steps run the same
    program at the same addresses (on CUDA: the recorded graphs replay) and give a fresh cache's tokens."""
    from flexicache_hf import release_storage

    cfg, fc, _, ids, mask = setup
    prof = HeadProfile.from_unstable(cfg, [(0, 1)])
    make = lambda: FlexiCache(prof, page_size=4, token_budget=12, rerank_interval=4, max_cache_len=37 + 24)  # noqa: E731
    release_storage()
    torch._dynamo.reset()  # the module's other tests used up most of the recompile limit on this model
    cache = make()
    run(fc, ids, mask, cache, 24, compiled=True)
    ptrs = [t.data_ptr() for t in cache.layers[0].buffers()]
    del cache
    gc.collect()  # compiling left reference cycles holding the cache: the cyclic collector frees it
    other = ids.roll(5, 1)
    before = graphs()
    new = make()
    got = run(fc, other, mask, new, 24, compiled=True)
    assert graphs() == before and [t.data_ptr() for t in new.layers[0].buffers()] == ptrs
    del new  # a call that compiled nothing leaves no cycle: handed on at once
    again = make()
    assert torch.equal(run(fc, other, mask, again, 24, compiled=True), got)
    assert graphs() == before and [t.data_ptr() for t in again.layers[0].buffers()] == ptrs
    release_storage()
    assert torch.equal(got, run(fc, other, mask, make(), 24, compiled=False))


def test_inductor_compiles_a_layer_s_cache_work_as_one_op(setup):
    """Compiled by inductor (on the CPU), a decode step holds one ``flexicache::graph_step`` op a layer and none of
    the cache's tensors: every kernel of the step (the loads behind the compute included, ``overlap_loads``) runs
    inside the op, in the eager order, so inductor can neither copy a pool it writes nor run a load before the
    attention that reads its slots; the tokens are the eager run's."""
    import re

    from torch._inductor import config as inductor_config
    from torch._inductor.utils import run_and_get_code
    from transformers import CompileConfig

    cfg, fc, _, ids, mask = setup
    prof = HeadProfile.from_unstable(cfg, [(0, 1)])
    make = lambda: FlexiCache(prof, page_size=4, token_budget=12, rerank_interval=5, overlap_loads=True,  # noqa: E731
                              max_cache_len=37 + 12)
    eager_cache = make()
    eager = run(fc, ids, mask, eager_cache, 12, compiled=False)
    cc = CompileConfig(backend="inductor", fullgraph=True, mode=None)
    cc._compile_all_devices = True
    kw = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False, attention_mask=mask, pad_token_id=0,
              compile_config=cc)
    torch._dynamo.reset()
    cache = make()
    with inductor_config.patch(force_disable_caches=True):
        out, code = run_and_get_code(lambda: fc.generate(ids, past_key_values=cache, **kw))
    torch._dynamo.reset()
    ops = re.findall(r"flexicache\.(\w+)\.default\(", "\n".join(code))
    assert ops == ["graph_step"] * cfg.num_hidden_layers, ops
    assert torch.equal(out, eager)
    assert cache.stats == eager_cache.stats and cache.stats.promoted_pages > 0



def test_a_compiled_forward_that_reads_the_length_for_its_positions_equals_eager(setup):
    """A compiled decode forward called without ``position_ids`` reads the cache's length for its positions (the one
    cache tensor in the graph; the op advances it out of the graph's sight): inductor still reads it before the
    first layer's op, so every step's logits are the eager forward's."""
    cfg, fc, _, ids, _ = setup
    ids = ids[:1]
    prof = HeadProfile.from_unstable(cfg, [(0, 1)])
    make = lambda: FlexiCache(prof, page_size=4, token_budget=12, rerank_interval=3,  # noqa: E731
                              max_cache_len=ids.shape[1] + 12)
    step = torch.compile(fc.forward, backend="inductor", fullgraph=True)
    logits = {}
    for name, forward in (("eager", fc.forward), ("compiled", step)):
        cache, tok, out = make(), ids, []
        with torch.no_grad():
            for i in range(10):
                logit = (fc if i == 0 else forward)(input_ids=tok, past_key_values=cache).logits[:, -1]
                tok = logit.argmax(-1, keepdim=True)
                out.append(logit)
        logits[name] = torch.stack(out)
    torch._dynamo.reset()
    assert torch.allclose(logits["compiled"], logits["eager"], atol=1e-4, rtol=1e-4)


def test_the_op_finds_each_cache_by_its_schedule_and_forgets_caches_gone(setup):
    """``graph_step.register``: each eager forward makes its cache the owner of its schedule's ``length``; a cache
    that is gone leaves no entry once another registers; an unknown ``length`` is refused, not guessed."""
    from flexicache_hf import graph_step
    from flexicache_hf.handle import CacheStateError

    cfg, fc, _, ids, mask = setup
    prof = HeadProfile.from_unstable(cfg, [(0, 1)])
    caches = [FlexiCache(prof, page_size=4, token_budget=12, max_cache_len=37 + 4) for _ in range(2)]
    for cache in caches:
        run(fc, ids, mask, cache, 2, compiled=False)
        key = cache.layers[0].state.length.data_ptr()
        assert graph_step._CACHES[key]() is cache
    del cache
    caches.pop()
    gc.collect()  # gone (its storage kept for the next cache of its shape, which takes its schedule too)
    assert any(r() is None for r in graph_step._CACHES.values())
    third = FlexiCache(prof, page_size=4, token_budget=12, max_cache_len=37 + 4)
    run(fc, ids, mask, third, 2, compiled=False)
    assert all(r() is not None for r in graph_step._CACHES.values())
    assert graph_step._CACHES[third.layers[0].state.length.data_ptr()]() is third
    stray = torch.zeros(1, dtype=torch.long)
    q = torch.zeros(2, cfg.num_attention_heads, cfg.head_dim)
    kv = torch.zeros(2, cfg.num_key_value_heads, 1, cfg.head_dim)
    with pytest.raises(CacheStateError, match="schedule or storage it does not know"):
        graph_step.graph_step(q, kv, kv, stray, third.layers[0].storage.pool.k, 0, 1.0)
    with pytest.raises(CacheStateError, match="schedule or storage it does not know"):  # another layer's pool
        graph_step.graph_step(q, kv, kv, third.layers[0].state.length, third.layers[1].storage.pool.k, 0, 1.0)


def test_a_compiled_step_takes_each_layer_s_pool_and_new_rows_are_static_again(setup):
    """Each layer's op takes the layer's K pool as a graph input (a recorded CUDA graph holds the addresses its op
    used; cudagraph trees record anew when a static input moves), and row selection, which makes new buffers,
    marks them static as the first ones were."""
    from flexicache_hf.layer import FlexiCacheLayer

    cfg, fc, _, ids, mask = setup
    prof = HeadProfile.from_unstable(cfg, [(0, 1)])
    cache = FlexiCache(prof, page_size=4, token_budget=12, max_cache_len=37 + 8)
    seen = []

    def backend(gm, example_inputs):
        seen.extend(node for node in gm.graph.nodes if node.target is torch.ops.flexicache.graph_step.default)
        return gm.forward

    cc = compile_config()
    cc.backend = backend
    kw = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False, attention_mask=mask, pad_token_id=0,
              compile_config=cc)
    torch._dynamo.reset()
    fc.generate(ids, past_key_values=cache, **kw)
    torch._dynamo.reset()
    assert len(seen) == cfg.num_hidden_layers
    pools = [node.args[4] for node in seen]  # the graph's inputs: each layer's own pool
    assert all(p.op == "placeholder" for p in pools) and len({p.name for p in pools}) == cfg.num_hidden_layers
    marked = []
    with pytest.MonkeyPatch.context() as monkey:
        monkey.setattr(FlexiCacheLayer, "mark_static", lambda layer: marked.append(layer.storage.pool.k.data_ptr()))
        cache.batch_select_indices(torch.tensor([1, 0]))
    assert marked == [layer.storage.pool.k.data_ptr() for layer in cache.layers]
