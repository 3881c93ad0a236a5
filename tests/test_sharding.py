"""FlexiCache under transformers' tensor parallelism: each rank's layers hold a block of the global KV heads, and the
profile's (global) unstable heads map to that block's local indices."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache

from conftest import tiny_config, twin_models
from flexicache_hf import FlexiCache, HeadProfile
from flexicache_hf.dense import dense_attention
from flexicache_hf.head_profile import ModelIdentity, ProfileError
from flexicache_hf.sharding import HeadShard, TensorParallel, kv_head_shard, tp_size_of

FULL = dict(page_size=4, token_budget=512, rerank_interval=3)  # covers every page: exact attention


def ident(kv_heads: int, head_dim: int = 16) -> ModelIdentity:
    return ModelIdentity("LlamaForCausalLM", "llama", 2, 2 * kv_heads, kv_heads, head_dim, "tiny")


def fake_world(monkeypatch, world: int, rank: int) -> None:
    """Make this process look like rank ``rank`` of an initialised ``torch.distributed`` world."""
    monkeypatch.setattr(torch.distributed, "is_available", lambda: True)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda *a, **k: world)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda *a, **k: rank)


# ---- the mapping ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("heads,world,rank", [(2, 2, 0), (2, 2, 1), (8, 2, 1), (8, 4, 0), (8, 4, 3), (8, 8, 5),
                                              (32, 4, 2)])
def test_rank_holds_its_contiguous_block(heads, world, rank):
    local = heads // world
    shard = kv_head_shard(ident(heads), 0, local, 16, TensorParallel(world, rank))
    assert shard == HeadShard(heads, rank * local, local)
    assert list(shard.heads) == list(range(rank * local, (rank + 1) * local))
    every = range(heads)
    assert shard.to_local(every) == tuple(range(local))
    # the profile's unstable heads: those in the block, as local indices (sorted); the others are not this rank's
    unstable = {0, heads - 1, rank * local + local - 1}
    assert shard.to_local(unstable) == tuple(sorted(h - rank * local for h in unstable if h in shard.heads))


def test_every_head_when_the_layer_holds_them_all():
    for tp in (TensorParallel(), TensorParallel(4, 3)):  # also under TP when the KV heads are not sharded
        assert kv_head_shard(ident(4), 1, 4, 16, tp) == HeadShard(4, 0, 4)
    assert HeadShard(4, 0, 4).to_local([3, 1]) == (1, 3)


def test_refused_without_tensor_parallelism_as_before():
    with pytest.raises(ProfileError, match=r"layer 1 has 2 KV heads of dim 16, but the profile was made for 4 KV "
                                           r"heads of dim 16 \(tiny\); profile this model"):
        kv_head_shard(ident(4), 1, 2, 16)  # half the heads, but no tensor parallelism: another model
    with pytest.raises(ProfileError, match="profile this model"):
        kv_head_shard(ident(4), 0, 4, 32, TensorParallel(2, 0))  # another head_dim


@pytest.mark.parametrize("profile_heads,local,world", [(4, 3, 2), (6, 2, 2), (8, 2, 2), (8, 4, 4), (6, 4, 4)])
def test_refused_when_the_block_does_not_match_the_tp_size(profile_heads, local, world):
    # (4, 3): not a share at all; (6, 2) / (8, 2): a share, but of another tp size; (6, 4, 4): 6 heads do not split in 4
    with pytest.raises(ProfileError, match=rf"layer 0 has {local} KV heads .* tensor parallelism over {world} ranks"
                                           r".*model_config=model.config"):
        kv_head_shard(ident(profile_heads), 0, local, 16, TensorParallel(world, 1))


def test_tensor_parallel_group_of_the_process(monkeypatch):
    assert TensorParallel.of_process() == TensorParallel(1, 0)  # torch.distributed not initialised
    fake_world(monkeypatch, 4, 3)
    assert TensorParallel.of_process() == TensorParallel(4, 3)
    assert TensorParallel.of_process(2) == TensorParallel(2, 1)  # tp innermost in transformers' mesh
    assert TensorParallel.of_process(1) == TensorParallel(1, 0)
    with pytest.raises(ValueError, match="does not divide"):
        TensorParallel.of_process(3)
    with pytest.raises(ValueError):
        TensorParallel(2, 2)


def test_tp_size_of_a_config():
    cfg = tiny_config("llama", heads=4, kv_heads=2)
    assert tp_size_of(cfg) is None

    class Dist:
        tp_size = 2

    cfg.distributed_config = Dist()
    assert tp_size_of(cfg) == 2

    class Model:
        config = cfg

    assert tp_size_of(Model()) == 2


# ---- a cache on one rank of a (faked) tensor-parallel world --------------------------------------------------
def drive_layers(cache, local_heads: int, *, D=16, G=2, prompt=13, steps=6, seed=0):
    """Prompt + decode steps through every layer of ``cache`` with ``local_heads`` KV heads; each output is checked
    against exact attention over the same states (the budget covers every page)."""
    torch.manual_seed(seed)
    scale = D**-0.5
    hist = {}
    for step in range(steps + 1):
        T = prompt if step == 0 else 1
        for i, layer in enumerate(cache.layers):
            k, v = torch.randn(1, local_heads, T, D), torch.randn(1, local_heads, T, D)
            q = torch.randn(1, local_heads * G, T, D)
            keys, values = (k, v) if step == 0 else (torch.cat([hist[i][0], k], 2), torch.cat([hist[i][1], v], 2))
            hist[i] = keys, values
            handle, _ = cache.update(k, v, i)
            out = cache.attend(handle, q, None, scale)
            if T == 1:
                want = dense_attention(q, keys, values, None, scale)
            else:
                want = dense_attention(q, k, v, None, scale)
            torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


def test_cache_on_rank_one_of_two_maps_the_profile(monkeypatch):
    cfg = tiny_config("llama", heads=8, kv_heads=4)
    profile = HeadProfile.from_unstable(cfg, [(0, 1), (0, 2), (1, 3)])
    cache = FlexiCache(profile, kernels="reference", **FULL)
    with pytest.raises(ProfileError, match="profile this model"):  # half the heads without tensor parallelism
        cache.update(torch.randn(1, 2, 3, 16), torch.randn(1, 2, 3, 16), 0)
    fake_world(monkeypatch, 2, 1)
    drive_layers(cache, 2)
    l0, l1 = cache.layers
    assert (l0.shard, l1.shard) == (HeadShard(4, 2, 2), HeadShard(4, 2, 2))
    # layer 0: global 2 (local 0) unstable, global 3 (local 1) stable; layer 1: global 3 (local 1) unstable
    assert (l0.storage.full_heads.tolist(), l0.storage.slot_heads.tolist(), l0.reranker.unstable_host) == ([0], [1], (0,))
    assert (l1.storage.full_heads.tolist(), l1.storage.slot_heads.tolist(), l1.reranker.unstable_host) == ([1], [0], (1,))
    assert cache.stats.head_steps == 6 * 2 * 2  # this rank's heads only
    cache.reset()  # initialised again from the profile's global heads, not from the local ones
    drive_layers(cache, 2, seed=1)
    assert l0.reranker.unstable_host == (0,) and l1.reranker.unstable_host == (1,)


def test_cache_takes_the_tp_size_from_the_model_config(monkeypatch):
    cfg = tiny_config("llama", heads=8, kv_heads=4)
    profile = HeadProfile.from_unstable(cfg, [(0, 0), (1, 1)])
    fake_world(monkeypatch, 4, 3)  # 2 data-parallel replicas x tp 2: rank 3 is tp rank 1
    with pytest.raises(ProfileError, match="over 4 ranks each rank holds 1 of them.*model_config=model.config"):
        FlexiCache(profile, kernels="reference", **FULL).update(torch.randn(1, 2, 3, 16), torch.randn(1, 2, 3, 16), 0)

    class Dist:
        tp_size = 2

    cfg.distributed_config = Dist()
    cache = FlexiCache(profile, model_config=cfg, kernels="reference", **FULL)
    assert cache.tp_size == 2
    drive_layers(cache, 2)
    assert [layer.shard.start for layer in cache.layers] == [2, 2]
    assert [layer.reranker.unstable_host for layer in cache.layers] == [(), ()]  # (0, 0) and (1, 1) are rank 0's
    assert [layer.storage.slot_heads.tolist() for layer in cache.layers] == [[0, 1], [0, 1]]


# ---- transformers' tensor parallelism, 2 ranks on CPU (gloo) -------------------------------------------------
def greedy(model, ids, cache, n):
    return model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, past_key_values=cache)


@pytest.mark.skipif(not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
                    reason="tensor parallelism on CPU needs torch.distributed with the gloo backend")
def test_tp_plan_auto_two_ranks_generates_the_single_process_tokens(tmp_path):
    cfg = tiny_config("llama", heads=8, kv_heads=4, layers=2)
    fc, dense = twin_models(cfg, seed=3)
    fc.save_pretrained(tmp_path / "model")
    profile = HeadProfile.from_unstable(cfg, [(0, 1), (0, 2), (1, 3)])
    profile.save(tmp_path / "profile.json")
    torch.manual_seed(5)
    ids = torch.randint(2, 96, (1, 37))
    n = 16
    want = greedy(dense, ids, DynamicCache(), n).tolist()
    assert greedy(fc, ids, FlexiCache(profile, **FULL), n).tolist() == want

    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TP_PROMPT": json.dumps(ids.tolist()), "TP_NEW_TOKENS": str(n),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(Path(__file__).with_name("tp_worker.py")), str(tmp_path / "model"), str(tmp_path / "profile.json"),
           str(tmp_path)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]

    for rank in (0, 1):
        r = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert (r["tp_size"], r["cache_tp_size"], r["config_kv_heads"]) == (2, 2, 4)
        assert r["flexicache"] == want and r["flexicache_untold"] == want and r["dynamic"] == want
        assert r["untold_starts"] == [2 * rank, 2 * rank]
        got = [(x["start"], x["count"], x["num_kv_heads"]) for x in r["layers"]]
        assert got == [(2 * rank, 2, 2)] * 2
        for layer, x in enumerate(r["layers"]):
            local_unstable = [h - 2 * rank for h in profile.unstable_heads(layer) if 2 * rank <= h < 2 * rank + 2]
            assert x["reranker_unstable"] == local_unstable and x["full_heads"] == local_unstable
            assert x["slot_heads"] == [h for h in range(2) if h not in local_unstable]
        assert r["stats_head_steps"] == (n - 1) * 2 * 2
