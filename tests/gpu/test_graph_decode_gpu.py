"""Graph decode on the GPU: generate compiles FlexiCache's decode step (torch.compile "reduce-overhead",
CUDA graphs) exactly as it does StaticCache's, and the tokens are the eager path's.

Run on a CUDA machine (never in CI).  Checks, per model: one compiled program for every step, no CUDA graph
skipped (cudagraph trees count each skip with its reason), greedy tokens equal to the eager FlexiCache path
token for token with a budget covering every page and with a budget of a quarter of the prompt, on a
left-padded batch; a second cache takes the first one's storage and replays its CUDA graphs (records none);
SmolLM2 (real weights, fp32) when its GGUF is available, a tiny random Llama always.
"""

import gc

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from flexicache_hf import FlexiCache, HeadProfile

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)


def counters():
    from torch._dynamo.utils import counters as c

    return dict(c["stats"]), dict(c["inductor"])


def recordings() -> int:
    from flexicache_hf.bench.generate import cudagraph_recordings

    return cudagraph_recordings()


def generate(model, ids, mask, cache, new, compiled):
    kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, attention_mask=mask,
              pad_token_id=model.config.pad_token_id or 0, past_key_values=cache)
    if not compiled:
        kw["disable_compile"] = True
    return model.generate(ids, **kw)


def left_padded(ids: torch.Tensor, pad: int, cut: int):
    """Row 1 of ``ids`` with its first ``cut`` tokens replaced by padding (and masked out)."""
    ids = ids.clone()
    mask = torch.ones_like(ids)
    ids[1, :cut], mask[1, :cut] = pad, 0
    return ids, mask


def check_graph_equals_eager(model, ids, mask, profile, budget, new, **cfg):
    make = lambda: FlexiCache(profile, token_budget=budget, max_cache_len=ids.shape[1] + new,  # noqa: E731
                              model_config=model.config, **cfg)
    eager_cache = make()
    eager = generate(model, ids, mask, eager_cache, new, compiled=False)
    torch._dynamo.reset()
    before, _ = counters()  # the counters add up over the process: this check's own graphs are the difference
    cache = make()
    assert cache.is_compileable
    graph = generate(model, ids, mask, cache, new, compiled=True)
    stats, inductor = counters()
    assert cache.layers[0].state.stale, "the decode steps did not run compiled"
    assert inductor.get("cudagraph_skips", 0) == 0, inductor
    assert cache.stats == eager_cache.stats
    assert recordings() > 0, "cudagraph trees recorded no graph (or the counter is unreadable)"
    del cache
    gc.collect()  # compiling left reference cycles holding the cache; freed, its storage is kept (recycling.py)
    recorded = recordings()
    again = generate(model, ids, mask, make(), new, compiled=True)  # a second cache: same program, same graphs
    stats2, _ = counters()
    same = (graph == eager).all(-1)
    assert bool(same.all()), f"rows {(~same).nonzero().flatten().tolist()} differ"
    assert torch.equal(again, eager)
    assert stats2["unique_graphs"] == stats["unique_graphs"] <= before.get("unique_graphs", 0) + 2, (before, stats2)
    assert recordings() == recorded, "the second cache's steps recorded new CUDA graphs instead of replaying"
    return stats2


SPLIT = dict(group_score="mass", bound_shrink=0.5, unstable_group_score="max", unstable_bound_shrink=1.0)
EXACT = dict(group_score="mass", bound_shrink=0.5, unstable_group_score="exact")


OVERLAP = dict(overlap_loads=True)  # loads behind the compute: a load stream forked and joined inside the graph


@pytest.mark.parametrize("offload,stagger,scoring", [(True, False, {}), (False, False, {}), (True, True, {}),
                                                     (True, False, SPLIT), (True, False, EXACT),
                                                     (True, True, OVERLAP), (True, False, {**EXACT, **OVERLAP})])
def test_tiny_llama_graph_equals_eager(offload, stagger, scoring):
    cfg = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
                      pad_token_id=0)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="flexicache").cuda().eval()
    ids, mask = left_padded(torch.randint(2, 90, (2, 300), device="cuda"), 0, 17)
    prof = HeadProfile.from_unstable(cfg, [(0, 1)])
    check_graph_equals_eager(model, ids, mask, prof, 64, 80, page_size=16, rerank_interval=8, offload=offload,
                             stagger_reranks=stagger, **scoring)


@pytest.fixture(scope="module")
def smollm2_fp32():
    from flexicache_hf.models import default_gguf_path, load_default_model

    try:
        default_gguf_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    return load_default_model(dtype=torch.float32, device="cuda", attn_implementation="flexicache")


@pytest.mark.parametrize("budget", ["all", "quarter"])
def test_smollm2_graph_equals_eager(smollm2_fp32, budget):
    from flexicache_hf.data import long_prompt
    from flexicache_hf.head_profile import resolve_profile

    model, tok = smollm2_fp32
    prompt = long_prompt(tok, 2048).cuda()
    ids, mask = left_padded(torch.cat([prompt, prompt.roll(-333, 1)]), tok.pad_token_id or 0, 200)
    tokens = 512 if budget == "quarter" else 4096  # a quarter of the prompt, or every page
    check_graph_equals_eager(model, ids, mask, resolve_profile("SmolLM2-135M-Instruct"), tokens, 128)


def test_rows_reordered_between_compiled_calls_record_anew():
    """Rows reordered (same batch size) between two compiled generate calls on one cache: the reorder makes new
    buffers, so the recorded CUDA graphs (which hold the old addresses inside each layer's op) must not replay;
    the pools are static graph inputs, so cudagraph trees record anew, and the second call's tokens are the eager
    path's."""
    cfg = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
                      pad_token_id=0)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="flexicache").cuda().eval()
    ids = torch.randint(2, 90, (2, 300), device="cuda")
    mask = torch.ones_like(ids)
    prof = HeadProfile.from_unstable(cfg, [(0, 1)])
    follow_up = torch.randint(2, 90, (2, 20), device="cuda")  # drawn once: both paths take the same turn
    outs = []
    for compiled in (False, True):
        cache = FlexiCache(prof, token_budget=64, page_size=16, max_cache_len=300 + 40 + 20 + 40,
                           model_config=model.config)
        first = generate(model, ids, mask, cache, 40, compiled)
        cache.batch_select_indices(torch.tensor([1, 0], device="cuda"))
        turn = torch.cat([first.flip(0), follow_up], 1)
        outs.append((first, generate(model, turn, torch.ones_like(turn), cache, 40, compiled)))
    assert torch.equal(outs[0][0], outs[1][0]), "the first call's compiled tokens are not the eager path's"
    assert torch.equal(outs[0][1], outs[1][1]), "after the reorder the compiled tokens are not the eager path's"
