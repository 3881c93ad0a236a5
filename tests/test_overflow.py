"""A sized cache driven past ``max_cache_len``: refused before the step that would not fit, never a token from it.

``generate`` never tells a cache its ``max_new_tokens``, and a compiled decode step cannot refuse anything (it runs
on, on the device).  But before every forward, compiled or not, ``generate`` builds the step's mask eagerly and asks
the cache its sizes (``get_mask_sizes``): there ``FlexiCache`` refuses a step whose token would not fit, with the
cache as it was.  These CPU tests take generate's own route, compiling with the ``aot_eager`` backend.
"""

import pytest
import torch
from transformers import DynamicCache
from transformers.generation.streamers import BaseStreamer

from conftest import compile_config, tiny_config, twin_models
from flexicache_hf import FlexiCache
from flexicache_hf.head_profile import HeadProfile
from flexicache_hf.hf_compat import forward_cache_kwarg
from flexicache_hf.layer.schedule import DecodeState

PROMPT = 37


class Tokens(BaseStreamer):
    """What ``generate`` handed out, in order: the prompt, then each step's tokens."""

    def __init__(self):
        self.puts = []

    def put(self, value):
        self.puts.append(value)

    def end(self):
        pass

    def new(self) -> torch.Tensor:
        return torch.stack(self.puts[1:], 1)


@pytest.fixture(scope="module")
def setup():
    torch._dynamo.reset()
    cfg = tiny_config("llama", heads=4, kv_heads=2, layers=2, head_dim=16)
    fc, dense = twin_models(cfg)
    ids = torch.randint(2, 90, (2, PROMPT), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # a left-padded row
    profile = HeadProfile.random(cfg, 0.5, seed=2)
    make = lambda n: FlexiCache(profile, page_size=4, token_budget=128, rerank_interval=3,  # noqa: E731
                                max_cache_len=PROMPT + n)  # a budget over the context: dense attention's tokens
    return fc, dense, ids, mask, make


def generate(model, ids, mask, cache, new, compiled, **kw):
    kw.update(max_new_tokens=new, min_new_tokens=new, do_sample=False, attention_mask=mask, pad_token_id=0)
    if compiled:
        kw["compile_config"] = compile_config()
    else:
        kw["disable_compile"] = True
    return model.generate(ids, past_key_values=cache, **kw)[:, ids.shape[1]:]


def stored(cache):
    """Every token every layer holds (host and device tiers)."""
    cache.sync()
    return [torch.cat(layer.gather_tokens(layer.seq_len)) for layer in cache.layers]


def device_reads(monkeypatch) -> list:
    """Records each time the host reads the schedule back from the device (a synchronisation)."""
    reads, sync = [], DecodeState.sync

    def counted(state):
        reads.append(state.stale)
        sync(state)

    monkeypatch.setattr(DecodeState, "sync", counted)
    return reads


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "eager"])
def test_generate_refuses_the_step_past_max_cache_len_before_it_runs(setup, compiled):
    """max_cache_len = prompt + 5, 20 new tokens: the prompt's token and 5 decode steps fit, the sixth step would
    store token 43 and is refused before it runs.  The tokens handed out are dense attention's, the cache holds
    exactly what a run of 6 tokens leaves, and it serves on after reset()."""
    fc, dense, ids, mask, make = setup
    cache, out = make(5), Tokens()
    with pytest.raises(ValueError, match=r"max_cache_len=42; make the cache with a larger max_cache_len"):
        generate(fc, ids, mask, cache, 20, compiled, streamer=out)
    want = dense.generate(ids, attention_mask=mask, past_key_values=DynamicCache(), max_new_tokens=6,
                          min_new_tokens=6, do_sample=False, pad_token_id=0)[:, PROMPT:]
    assert torch.equal(out.new(), want)
    assert cache.get_seq_length() == PROMPT + 5
    fits = make(5)
    assert torch.equal(generate(fc, ids, mask, fits, 6, compiled), want)
    assert all(torch.equal(a, b) for a, b in zip(stored(cache), stored(fits)))  # nothing written past the fit
    assert cache.stats == fits.stats  # the refused step ran nowhere: not one more decode step counted
    cache.reset()
    other = ids.roll(3, 1)
    assert torch.equal(generate(fc, other, mask, cache, 6, compiled), generate(fc, other, mask, make(5), 6, compiled))


@pytest.mark.parametrize("asks", [1, 2], ids=["asked-once", "asked-twice"])
def test_the_host_counts_steps_and_synchronises_only_when_one_might_not_fit(setup, monkeypatch, asks):
    """Between synchronisations the host counts the steps it was asked about as run: a compiled generate that fits
    never waits for the device; asked twice per step (an over-count) it reads the length back a few times, and
    never refuses a step that fits."""
    fc, _, ids, mask, make = setup
    want = generate(fc, ids, mask, make(20), 20, compiled=False)
    cache = make(20)
    ask = cache.get_mask_sizes
    cache.get_mask_sizes = lambda *a, **kw: [ask(*a, **kw) for _ in range(asks)][-1]
    reads = device_reads(monkeypatch)
    assert torch.equal(generate(fc, ids, mask, cache, 20, compiled=True), want)
    assert cache.get_seq_length() == PROMPT + 19
    synchronised = reads.count(True)
    assert synchronised == 0 if asks == 1 else 0 < synchronised < 8


def test_a_compiled_forward_run_without_generate_is_caught_at_the_next_use(setup):
    """A compiled forward called directly (not through generate) is not announced to the cache: a step past
    max_cache_len runs, inside the buffers, and sets the device flag (the backstop); the next use of the cache
    raises OverflowError until reset()."""
    fc, _, ids, mask, make = setup
    cache = make(5)
    last = generate(fc, ids, mask, cache, 6, compiled=True)[:, -1:]  # full: 42 tokens
    step = fc.get_compiled_call(compile_config())
    with torch.no_grad():
        step(input_ids=last, **{forward_cache_kwarg(fc): cache})  # token 43: past max_cache_len, on the device
    with pytest.raises(OverflowError, match="max_cache_len=42"):
        cache.memory_report()
    with pytest.raises(OverflowError):
        generate(fc, ids, mask, cache, 3, compiled=True)
    cache.reset()
    generate(fc, ids, mask, cache, 5, compiled=True)  # reset: usable again
    assert cache.get_seq_length() == PROMPT + 4
