"""Reserved storage (``flexicache_hf/reserve.py``): an unsized cache laid out for the model's context, its memory
committed a chunk at a time as tokens arrive, so ``generate`` compiles its decode step once.  On the CPU the ranges
are pageable (``MAP_NORESERVE``) and the same code runs; ``reserve.CHUNK_TOKENS`` is set small here so that a few
dozen tokens cross several chunk boundaries."""

import copy
import dataclasses
import pickle

import pytest
import torch
from transformers import DynamicCache

from conftest import compile_config, tiny_config, twin_models
from flexicache_hf import FlexiCache, release_storage, reserve
from flexicache_hf.head_profile import HeadProfile
from flexicache_hf.host_memory import HostMemoryError

PS, CHUNK = 4, 8  # pages of 4 tokens, chunks of 2 pages


def graphs():
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    monkeypatch.setattr(reserve, "CHUNK_TOKENS", CHUNK)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def setup(request):
    cfg = tiny_config(request.param, heads=4, kv_heads=2, layers=2, head_dim=16, max_pos=4096)
    fc, dense = twin_models(cfg)
    ids = torch.randint(2, 90, (2, 13), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # a left-padded row
    profile = HeadProfile.random(cfg, 0.5, seed=2)
    return cfg, fc, dense, ids, mask, profile


def make(profile, **kw):
    return FlexiCache(profile, page_size=PS, token_budget=4096, rerank_interval=3, **kw)  # dense attention's tokens


def generate(model, ids, mask, cache, new, compiled=False):
    kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, attention_mask=mask, pad_token_id=0)
    if compiled:
        kw["compile_config"] = compile_config()
    else:
        kw["disable_compile"] = True
    return model.generate(ids, past_key_values=cache, **kw)[:, ids.shape[1]:]


def want(dense, ids, mask, new):
    return generate(dense, ids, mask, DynamicCache(), new)


def committed(cache):
    return cache.layers[0].storage.reserved.committed


def test_an_unsized_cache_is_compileable_and_reserved_for_the_context(setup):
    cfg, fc, dense, ids, mask, profile = setup
    cache = make(profile)
    assert cache.is_compileable
    out = generate(fc, ids, mask, cache, 30)  # eager: prompt crosses a chunk, decode 3 more
    assert torch.equal(out, want(dense, ids, mask, 30))
    for layer in cache.layers:
        res = layer.storage.reserved
        assert res is not None and res.tokens == 4096 and layer.page_capacity == res.pages
        assert res.committed * PS < 13 + 30 + 2 * CHUNK + PS  # the tokens held and a chunk, not the context
        assert layer.get_mask_sizes(1) == (4096, 0)  # the same mask every decode step


def without_context(profile):
    """``profile`` as a file that does not record the model's context (made before profiles recorded it)."""
    return dataclasses.replace(profile, model=dataclasses.replace(profile.model, max_positions=None))


@pytest.mark.parametrize("known", ["model_config", "profile"])
@pytest.mark.parametrize("compiled", [False, True])
def test_the_prompt_is_written_once_into_reserved_storage(setup, monkeypatch, compiled, known):
    """The context known from model_config, or from the profile's record of it (the README's call): every layer is
    laid out reserved at its update of the first forward, before it stores the prompt, so no growing storage is ever
    allocated (and nothing is moved)."""
    from flexicache_hf.layer.storage import LayerStorage
    from flexicache_hf.tiers import HostTier

    cfg, fc, dense, ids, mask, profile = setup
    grown = []
    grow = LayerStorage.ensure_capacity

    def spy_grow(self, end, stored, max_tokens, host_elsewhere):
        if self.pages_for(end, max_tokens) is not None:
            grown.append(end)  # the growing path would allocate here
        return grow(self, end, stored, max_tokens, host_elsewhere)

    def spy_host_grow(self, *args, **kwargs):
        raise AssertionError("a growing host tier was allocated")

    monkeypatch.setattr(LayerStorage, "ensure_capacity", spy_grow)
    monkeypatch.setattr(HostTier, "grow", spy_host_grow)
    torch._dynamo.reset()
    kw = dict(model_config=cfg) if known == "model_config" else {}
    if known == "model_config":
        profile = without_context(profile)
    cache = make(profile, **kw)
    fc(ids, attention_mask=mask, past_key_values=cache)  # the prompt alone
    for layer in cache.layers:
        res = layer.storage.reserved
        assert res is not None and res.tokens == 4096 and res.committed * PS <= 13 + CHUNK + 2 * PS
    assert grown == []
    cache = make(profile, **kw)
    assert torch.equal(generate(fc, ids, mask, cache, 30, compiled), want(dense, ids, mask, 30))
    assert grown == [] and all(layer.storage.reserved is not None for layer in cache.layers)


def test_a_profile_without_the_context_stores_the_first_prompt_growing_then_moves_it_once(setup):
    cfg, fc, dense, ids, mask, profile = setup
    cache = make(without_context(profile))
    fc(ids, attention_mask=mask, past_key_values=cache)
    assert all(layer.storage.reserved is None for layer in cache.layers)  # the context was not known at layer 0
    cache = make(without_context(profile))
    assert torch.equal(generate(fc, ids, mask, cache, 30), want(dense, ids, mask, 30))
    assert all(layer.storage.reserved is not None and layer.storage.reserved.tokens == 4096
               for layer in cache.layers)


def test_a_profile_recording_less_context_than_the_model_refuses_past_its_reservation(setup):
    """Reserved from the profile's record (64 tokens) before the model's config (4096) is seen: the reservation is
    kept, a warning names model_config, and a sequence past it is refused with the cache unchanged."""
    cfg, fc, dense, ids, mask, profile = setup
    small = dataclasses.replace(profile, model=dataclasses.replace(profile.model, max_positions=64))
    cache = make(small)
    with pytest.warns(UserWarning, match="model_config"):
        out = generate(fc, ids, mask, cache, 8)
    assert torch.equal(out, want(dense, ids, mask, 8))
    assert cache.max_positions == 64 and all(layer.storage.reserved.tokens == 64 for layer in cache.layers)
    held = cache.get_seq_length()
    with pytest.raises(ValueError, match="exceed the 64 positions this cache's storage was reserved for.*model_config"):
        fc(torch.randint(2, 90, (2, 60)), attention_mask=torch.ones(2, held + 60, dtype=torch.long),
           past_key_values=cache)
    assert cache.get_seq_length() == held


def test_with_model_config_the_host_limit_refuses_the_first_forward_before_it_stores(setup):
    cfg, fc, dense, ids, mask, profile = setup
    probe = make(profile, model_config=cfg)
    fc(ids, attention_mask=mask, past_key_values=probe)
    assert probe.host_bytes() > 0
    cache = make(profile, model_config=cfg, host_memory_limit=probe.host_bytes() - 1)
    with pytest.raises(HostMemoryError):
        fc(ids, attention_mask=mask, past_key_values=cache)
    assert cache.get_seq_length() == 0 and cache.host_bytes() == 0
    cache = make(profile, model_config=cfg, host_memory_limit=probe.host_bytes())
    assert torch.equal(generate(fc, ids, mask, cache, 3), want(dense, ids, mask, 3))


def test_compiled_decode_grows_without_a_new_graph(setup):
    cfg, fc, dense, ids, mask, profile = setup
    torch._dynamo.reset()
    cache = make(profile)
    first = generate(fc, ids, mask, cache, 3, compiled=True)  # prompt, then the first compiled steps
    start = committed(cache)
    before = graphs()
    cache.reset()
    new = start * PS - ids.shape[1] + 3 * CHUNK + 2  # 3 chunks past the first commit
    out = generate(fc, ids, mask, cache, new, compiled=True)
    assert graphs() == before  # no recompilation as it grew
    assert committed(cache) >= start + 3 * CHUNK // PS
    assert torch.equal(out, want(dense, ids, mask, new))
    assert torch.equal(first, out[:, :3])


def test_committed_bytes_follow_the_tokens(setup):
    """An unsized cache, reserved from its first forward (the profile records the context), commits what a cache
    sized for its tokens plus a chunk holds, far less than one sized for the context.  (Budget 64 tokens, below the
    prompt: the slot region is laid out at its final size, a stable head's budget, as a sized cache's is.)"""
    cfg, fc, dense, _, _, profile = setup
    ids = torch.randint(2, 90, (2, 300), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    monkey_chunk = 64
    reserve.CHUNK_TOKENS = monkey_chunk

    def new(**kw):
        return FlexiCache(profile, page_size=PS, token_budget=64, rerank_interval=3, **kw)

    cache, sized, full = new(), new(max_cache_len=300 + monkey_chunk + PS), new(max_cache_len=4096)
    for c in (cache, sized, full):
        generate(fc, ids, mask, c, 1)
    assert all(layer.storage.reserved is not None for layer in cache.layers)
    for what in ("device_bytes", "host_bytes"):
        got, near, far = (getattr(c, what)() for c in (cache, sized, full))
        assert got <= near * 1.1 + 2 * 4096 * len(cache.layers) * 6  # + OS-page rounding of each range
        assert got < far / 4, what


def test_host_memory_limit_refuses_growth_before_anything_changes(setup):
    cfg, fc, dense, ids, mask, profile = setup
    probe = make(profile)
    generate(fc, ids, mask, probe, 40)  # reserved, a chunk ahead (over what the growing prompt held)
    limit = probe.host_bytes() + 1  # the next chunk passes it
    cache = make(profile, host_memory_limit=limit)
    with pytest.raises(HostMemoryError):
        generate(fc, ids, mask, cache, 40 + 3 * CHUNK)
    held, n = cache.host_bytes(), cache.get_seq_length()
    cache.sync()
    assert cache.host_bytes() == held and committed(cache) == committed(probe)
    assert n <= committed(cache) * PS  # it stopped within what was committed
    cache.reset()  # usable again
    assert torch.equal(generate(fc, ids, mask, cache, 3), want(dense, ids, mask, 3))


def test_a_prompt_past_the_context_is_refused_unchanged(setup):
    cfg, fc, dense, ids, mask, profile = setup
    cache = make(profile)
    generate(fc, ids, mask, cache, 3)
    n, held = cache.get_seq_length(), cache.device_bytes()
    long = torch.randint(2, 90, (2, 4096), generator=torch.Generator().manual_seed(3))
    with pytest.raises(ValueError, match="context"):
        fc(long, past_key_values=cache)
    assert cache.get_seq_length() == n and cache.device_bytes() == held


@pytest.mark.parametrize("how", ["deepcopy", "pickle", "reset", "crop", "reorder"])
def test_copies_and_rows_of_a_reserved_cache(setup, how):
    cfg, fc, dense, ids, mask, profile = setup
    cache = make(profile)
    generate(fc, ids, mask, cache, 12)
    ref = make(profile, max_cache_len=200)
    generate(fc, ids, mask, ref, 12)
    for c in (cache, ref):
        if how == "deepcopy":
            c2 = copy.deepcopy(c)
        elif how == "pickle":
            c2 = pickle.loads(pickle.dumps(c))
        else:
            c2 = c
            if how == "reset":
                c.reset()
            elif how == "crop":
                c.crop(-5)
            else:
                c.reorder_cache(torch.tensor([1, 0]))
        if c is cache:
            got = c2
        else:
            exp = c2
    if how == "deepcopy" or how == "pickle":
        assert got.layers[0].storage.reserved.committed == cache.layers[0].storage.reserved.committed
    if how == "reset":
        assert torch.equal(generate(fc, ids, mask, got, 10), want(dense, ids, mask, 10))
        return
    nxt = torch.full((2, 1), 5)
    m = torch.ones(2, 1)
    a = fc(nxt, past_key_values=got, attention_mask=None).logits
    b = fc(nxt, past_key_values=exp, attention_mask=None).logits
    assert torch.allclose(a, b, atol=1e-5)


def test_a_first_forward_commits_the_host_tiers_ahead_in_the_background(setup, monkeypatch):
    """At layer 0's update of a first forward every offloading layer's host ranges are made and committed on a
    background thread, in layer order; each layer's reservation then takes its own (same objects), and the tokens
    are DynamicCache's."""
    import threading

    from flexicache_hf.vmm import HostRange

    cfg, fc, dense, ids, mask, profile = setup
    made, threads = {}, []
    ahead = reserve.host_ahead
    grow = HostRange.grow_to

    def spy_ahead(cache, context, need, key_states):
        made.update(ahead(cache, context, need, key_states))
        return dict(made)

    def spy_grow(self, nbytes, limit=None):
        threads.append(threading.current_thread().name)
        return grow(self, nbytes, limit)

    monkeypatch.setattr(reserve, "host_ahead", spy_ahead)
    monkeypatch.setattr(HostRange, "grow_to", spy_grow)
    cache = make(profile, model_config=cfg)
    assert torch.equal(generate(fc, ids, mask, cache, 20), want(dense, ids, mask, 20))
    offloading = [layer for layer in cache.layers if layer.storage.offloads]
    assert offloading and sorted(made) == [layer.layer_idx for layer in offloading]
    for layer in offloading:
        assert all(layer.storage.reserved.ranges[n] is made[layer.layer_idx][n] for n in ("host_k", "host_v"))
    assert any(name.startswith("flexicache-reserve") for name in threads)


def test_host_commit_times_split_what_the_forward_waited_from_what_committing_took(setup, monkeypatch):
    """``cache.commit_seconds()``: seconds spent populating and page-locking host ranges on any thread, seconds the
    forwards spent in their own host commits (committing, or waiting for the background one on that range), and
    seconds spent mapping device ranges: what ``bench.generate`` reports to split a first cache's time to first
    token.  Sized storage: zeros."""
    import time

    from flexicache_hf.vmm import HostRange

    cfg, fc, dense, ids, mask, profile = setup
    commit = HostRange._commit

    def slow(self, at, size):
        time.sleep(0.05)
        return commit(self, at, size)

    monkeypatch.setattr(HostRange, "_commit", slow)
    release_storage()  # a dropped cache's committed storage would be taken, and nothing committed
    cache = make(profile, model_config=cfg)
    assert torch.equal(generate(fc, ids, mask, cache, 3), want(dense, ids, mask, 3))
    ranges = [layer.storage.reserved.ranges for layer in cache.layers if layer.storage.offloads]
    assert ranges
    got = cache.commit_seconds()
    assert got["host_commit_s"] >= 0.05 * 2 * len(ranges)  # host_k and host_v of each offloading layer
    assert got["host_commit_s"] == pytest.approx(sum(r[n].commit_s for r in ranges for n in ("host_k", "host_v")))
    assert got["host_wait_s"] >= 0.02  # layer 0's commit met its own range's background commit (or made it)
    assert got["device_commit_s"] > 0  # the device ranges (pools, MinMax) committed too (plain memory on the CPU)
    sized = make(profile, model_config=cfg, max_cache_len=64)
    generate(fc, ids, mask, sized, 3)
    assert sized.commit_seconds() == {"host_wait_s": 0.0, "host_commit_s": 0.0, "device_commit_s": 0.0}


def test_host_ranges_made_ahead_for_another_layout_are_not_used(setup):
    """A range made ahead that does not fit the layer's layout (here: too small) is dropped, not used."""
    from flexicache_hf.pages import PoolLayout

    cfg, fc, dense, ids, mask, profile = setup
    small = reserve._range(4096, torch.device("cpu"), True, 256)
    lay = PoolLayout(2, 1, 8, 1, 64)
    res = reserve.Reservation(lay, 2, PS, 16, torch.float32, torch.device("cpu"), 256, {"host_k": small})
    views = res.tensors(4)
    assert res.ranges["host_k"] is not small and views["host_k"].shape == (64, 2, 1, PS, 16)


@pytest.mark.parametrize("fails", ["background", "everywhere"])
def test_a_host_commit_that_fails_ahead_is_retried_by_its_layer_or_refused_cleanly(setup, monkeypatch, fails):
    """A background commit that fails leaves its range as it was: the layer's own commit does it (the forward goes
    on), or, failing too, raises HostMemoryError at that layer's update; the cache is then empty and serves again."""
    import threading

    from flexicache_hf.vmm import HostRange

    cfg, fc, dense, ids, mask, profile = setup
    grow = HostRange.grow_to
    broken = {"on": True}

    def flaky(self, nbytes, limit=None):
        background = threading.current_thread().name.startswith("flexicache-reserve")
        if broken["on"] and nbytes > self.committed_bytes and (background or fails == "everywhere"):
            raise HostMemoryError("no page-locked memory left (test)")
        return grow(self, nbytes, limit)

    monkeypatch.setattr(HostRange, "grow_to", flaky)
    release_storage()  # (no dropped cache's committed storage to take)
    cache = make(profile, model_config=cfg)
    if fails == "background":
        assert torch.equal(generate(fc, ids, mask, cache, 8), want(dense, ids, mask, 8))
        return
    with pytest.raises(HostMemoryError, match="test"):
        fc(ids, attention_mask=mask, past_key_values=cache)
    assert cache.get_seq_length() == 0
    broken["on"] = False
    assert torch.equal(generate(fc, ids, mask, cache, 8), want(dense, ids, mask, 8))


def test_a_stopped_first_forward_lets_its_unused_host_ranges_go_before_the_next_one_plans(setup, monkeypatch):
    """Host ranges made ahead for layers a refused forward never reached are not held into the next forward: they
    are let go at its layer 0, before it makes its own (no double of the host tier)."""
    import gc
    import time
    import weakref

    cfg, fc, dense, ids, mask, profile = setup
    release_storage()
    cache = make(profile, model_config=cfg)
    seen = []
    ahead = reserve.host_ahead

    def spy(*args):
        out = ahead(*args)
        seen.extend(weakref.ref(r) for ranges in out.values() for r in ranges.values())
        return out

    monkeypatch.setattr(reserve, "host_ahead", spy)
    layer0 = cache.layers[0]
    real = type(layer0).reserve

    def refuse(self, *args):
        if self is layer0:  # layer 1's ranges, made ahead, are never taken
            raise HostMemoryError("refused at layer 0 (test)")
        return real(self, *args)

    monkeypatch.setattr(type(layer0), "reserve", refuse)
    try:
        fc(ids, attention_mask=mask, past_key_values=cache)
        pytest.fail("not refused")
    except HostMemoryError as e:
        assert "test" in str(e)
        del e  # (its traceback's frames hold the plan too)
    monkeypatch.setattr(type(layer0), "reserve", real)
    time.sleep(0.5)  # the background commits end (each holds its range while it runs)
    gc.collect()
    taken = {id(rng) for layer in cache.layers if layer.is_initialized and layer.storage.reserved is not None
             for rng in layer.storage.reserved.ranges.values()}  # (none: layer 0 refused)
    held = [r for r in seen if r() is not None and id(r()) not in taken]
    assert held  # layer 1's ranges, still in the stopped forward's plan
    at_planning = []

    def check(*args):
        gc.collect()
        at_planning.append(sum(r() is not None for r in held))

        return ahead(*args)

    monkeypatch.setattr(reserve, "host_ahead", check)
    fc(ids, attention_mask=mask, past_key_values=cache)
    assert at_planning == [0]  # let go before the new plan made its own
