"""The machine's room for the host tier (``flexicache_hf/host_room.py``): a forward whose host tiers would grow past
the memory the machine has left is refused with a HostMemoryError before anything changes, whatever
``host_memory_limit`` says (the README call sets none); kept blocks and unreachable caches are given back first."""

import gc

import pytest
import torch
from conftest import tiny_config, twin_models
from flexicache_hf import FlexiCache, HeadProfile, HostMemoryError, host_room, release_storage

GIB = 1 << 30


def fake_room(monkeypatch, spare: int, total: int = 0, calls: list | None = None, after=None):
    """The machine's room as ``spare`` bytes past the margin kept free (``after``: the spare once reclaimed)."""
    seen = calls if calls is not None else []

    def room():
        seen.append(1)
        left = spare if after is None or len(seen) == 1 else after
        return host_room.margin_bytes(total) + left, total

    monkeypatch.setattr(host_room, "machine_room", room)
    return seen


def test_growth_within_the_room_passes_and_past_it_is_refused_with_what_was_available(monkeypatch):
    fake_room(monkeypatch, spare=1000)
    host_room.check_host_growth(need=5000, limit=None, new=1000)
    with pytest.raises(HostMemoryError, match="would grow by 1,001 bytes, but this machine has .* available"):
        host_room.check_host_growth(need=5000, limit=None, new=1001)
    host_room.check_host_growth(need=5000, limit=None, new=0)  # nothing new: nothing to check
    with pytest.raises(HostMemoryError, match="host_memory_limit"):  # the cap is checked first, room or not
        host_room.check_host_growth(need=5000, limit=4999, new=1)


def test_memory_is_reclaimed_before_refusing(monkeypatch):
    released = []
    monkeypatch.setattr(host_room.BLOCKS, "release", lambda: released.append(1) or 0)
    calls = fake_room(monkeypatch, spare=10, after=10_000)
    host_room.check_host_growth(need=5000, limit=None, new=5000)
    assert released == [1] and len(calls) == 2  # read, reclaimed, read again: room now


def test_the_margin_kept_free():
    assert host_room.margin_bytes(0) == GIB
    assert host_room.margin_bytes(128 * GIB) == int(128 * GIB * host_room.MARGIN_FRACTION)


def test_this_machines_room_reads_as_bytes():
    room = host_room.machine_room()
    if room is None:
        pytest.skip("no /proc/meminfo")
    available, total = room
    assert 0 <= available <= total and total > 0


@pytest.fixture(scope="module")
def setup():
    cfg = tiny_config("llama", heads=4, kv_heads=2, layers=2, head_dim=16, max_pos=4096)
    fc, dense = twin_models(cfg)
    return cfg, fc, dense, HeadProfile.random(cfg, 0.5, seed=2)


def gen(model, ids, cache, n):
    return model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, past_key_values=cache,
                          disable_compile=True, pad_token_id=0)[:, ids.shape[1]:]


@pytest.mark.parametrize("sized", [False, True], ids=["readme-call", "max_cache_len"])
def test_a_first_forward_past_the_room_is_refused_before_it_stores_and_the_cache_serves_on(setup, monkeypatch,
                                                                                            sized):
    cfg, fc, _, profile = setup
    ids = torch.randint(2, 90, (2, 40), generator=torch.Generator().manual_seed(0))
    kw = dict(page_size=4, token_budget=16, rerank_interval=3, max_cache_len=48 if sized else None)
    probe = FlexiCache(profile, **kw)
    gen(fc, ids, probe, 4)
    need = probe.host_bytes()
    del probe
    gc.collect()
    release_storage()  # (else the next cache of its shape takes the probe's storage, committed memory and all)
    cache = FlexiCache(profile, **kw)
    fake_room(monkeypatch, spare=need // 4)
    with pytest.raises(HostMemoryError, match="this machine has"):
        gen(fc, ids, cache, 4)
    assert cache.get_seq_length() == 0 and cache.host_bytes() == 0
    monkeypatch.undo()
    assert torch.equal(gen(fc, ids, cache, 4), gen(fc, ids, FlexiCache(profile, **kw), 4))  # as a new cache serves


def test_a_later_forward_past_the_room_is_refused_and_keeps_the_tokens(setup, monkeypatch):
    """The README call commits its host tier as tokens arrive: a follow-up prompt whose growth the machine has no
    room for stops generate with the error; the cache keeps what it held and serves again once there is room."""
    cfg, fc, _, profile = setup
    ids = torch.randint(2, 90, (1, 20), generator=torch.Generator().manual_seed(1))
    kw = dict(page_size=4, token_budget=16, rerank_interval=3)
    cache = FlexiCache(profile, **kw)
    gen(fc, ids, cache, 2)
    held, n = cache.host_bytes(), cache.get_seq_length()
    fake_room(monkeypatch, spare=0)
    with pytest.raises(HostMemoryError, match="this machine has"):
        gen(fc, torch.randint(2, 90, (1, 3000)), cache, 2)
    assert cache.host_bytes() == held and cache.get_seq_length() == n
    monkeypatch.undo()
    cache.reset()
    assert torch.equal(gen(fc, ids, cache, 4), gen(fc, ids, FlexiCache(profile, **kw), 4))
