"""One FlexiCache layer driven directly with random states, checked step by step against naive references."""

import pytest
import torch

from conftest import tiny_config
from flexicache_hf import FlexiCache, HeadProfile
from flexicache_hf.attention import dense_attention
from flexicache_hf.kernels import reference
from flexicache_hf.pages import NULL_PAGE
from flexicache_hf.rerank import FAR, SelectionObserver


class Recorder(SelectionObserver):
    def __init__(self):
        self.events = []

    def on_rerank(self, event):
        self.events.append(event)


def naive_minmax(keys, valid_lo, num_pages, ps):
    """Per-page min/max of the valid tokens of a full key history [B, H, L, D] (+inf/-inf when none)."""
    B, H, L, D = keys.shape
    pad = num_pages * ps - L
    pos = torch.arange(num_pages * ps)
    valid = (pos[None, :] >= valid_lo[:, None]) & (pos[None, :] < L)
    k = torch.nn.functional.pad(keys, (0, 0, 0, pad))
    v = valid[:, None, :, None]
    lo = torch.where(v, k, float("inf")).view(B, H, num_pages, ps, D).amin(3)
    hi = torch.where(v, k, float("-inf")).view(B, H, num_pages, ps, D).amax(3)
    return lo, hi


def naive_sparse(q, keys, values, pages, valid_lo, ps, scale):
    """Softmax over exactly the valid tokens of the listed pages, from the full history."""
    B, Hq, D = q.shape
    H, L = keys.shape[1], keys.shape[2]
    g = Hq // H
    out = torch.zeros(B, Hq, D)
    for b in range(B):
        for h in range(H):
            toks = [p * ps + i for p in pages[b, h].tolist() if p >= 0 for i in range(ps)]
            toks = [t for t in toks if valid_lo[b] <= t < L]
            kk, vv = keys[b, h, toks], values[b, h, toks]
            for j in range(g):
                w = torch.softmax((kk @ q[b, h * g + j]) * scale, -1)
                out[b, h * g + j] = w @ vv
    return out


def framed(t: torch.Tensor, origin: int) -> torch.Tensor:
    """A token history ``[B, H, L, D]`` in storage positions: ``origin`` empty positions first (the cache counts pages
    from its first chunk's end, ``-T mod page_size`` positions before the first token; layer/schedule.py)."""
    return torch.nn.functional.pad(t, (0, 0, origin, 0))


def watch_attended(layer) -> list:
    """Record the page list every decode step of ``layer`` attends (what the Reranker hands sparse decode)."""
    seen, attend_list = [], layer.reranker.attend_list

    def recording(*args):
        seen.append(attend_list(*args))
        return seen[-1]

    layer.reranker.attend_list = recording
    return seen


def drive(profile, *, B, H, G, D, prompt, steps, ps, budget, R, offload, valid_lo, seed=0, **extra):
    """Prefill `prompt` random tokens then `steps` decode steps; check every output and selection."""
    torch.manual_seed(seed)
    rec = Recorder()
    cache = FlexiCache(profile, page_size=ps, token_budget=budget, rerank_interval=R, offload=offload,
                       observer=rec, kernels="reference", **extra)
    layer = cache.layers[0]
    scale = D**-0.5
    keys = torch.randn(B, H, prompt, D)
    values = torch.randn(B, H, prompt, D)
    q = torch.randn(B, H * G, prompt, D)
    handle, _ = cache.update(keys, values, 0)
    attended_log = watch_attended(layer)
    pos = torch.arange(prompt)
    mask2d = pos[None, :] >= valid_lo[:, None]
    out = cache.attend(handle, q, mask2d if bool(valid_lo.any()) else None, scale)
    valid = pos[None, :] >= valid_lo[:, None]
    want = dense_attention(q, keys, values, valid if bool(valid_lo.any()) else None, scale)
    rows = valid.T[:, :, None, None].transpose(0, 1)  # compare only non-padding query rows
    torch.testing.assert_close(out * rows, want * rows, atol=1e-5, rtol=1e-5)

    K = budget // ps
    stable = layer.reranker.stable_heads
    # Pages in storage positions (the naive references see the history framed so), valid from lo_s.
    o = -prompt % ps
    lo_s = valid_lo + o
    # What each stable head attends between re-ranks: its last top-K plus the pages made since (anchor, newest].
    # Its first top-K comes from the prompt's last query.
    n = -(-(o + prompt) // ps)
    lo, hi = naive_minmax(framed(keys, o), lo_s, n, ps)
    last = {h: (reference.select_pages(reference.page_scores(q[:, :, -1], lo, hi,
                                                             torch.tensor([h]), n), K)[:, 0], n - 1)
            for h in stable.tolist()}
    history = []
    checked = not set(extra) - {"overlap_loads"}  # the checks below know the plain schedule, and overlap's
    late = cache.config.overlap_loads  # a re-rank after the step's attention (overlap_loads, offloaded pages)
    for step in range(steps):
        k1, v1, q1 = torch.randn(B, H, 1, D), torch.randn(B, H, 1, D), torch.randn(B, H * G, 1, D)
        keys, values = torch.cat([keys, k1], 2), torch.cat([values, v1], 2)
        n_events = len(rec.events)
        handle, _ = cache.update(k1, v1, 0)
        out = cache.attend(handle, q1, None, scale)[:, 0]
        L = keys.shape[2]
        n = -(-(o + L) // ps)
        attended = attended_log[-1]
        # 1. output equals dense softmax over exactly the attended pages, gathered from the full history
        torch.testing.assert_close(out, naive_sparse(q1[:, :, 0], framed(keys, o), framed(values, o), attended, lo_s,
                                                     ps, scale), atol=1e-5, rtol=1e-5)
        # 2. the re-ranked heads selected the reference top-K of min/max scores of the full history
        lo, hi = naive_minmax(framed(keys, o), lo_s, n, ps)
        new_events = rec.events[n_events:]
        if new_events and checked:
            ev = new_events[0]
            ref_scores = reference.page_scores(q1[:, :, 0], lo, hi, ev.heads, n)
            torch.testing.assert_close(ev.scores, ref_scores, atol=1e-4, rtol=1e-4)
            assert torch.equal(ev.pages, reference.select_pages(ref_scores, K))
        history.append((step, [e.heads.tolist() for e in new_events], layer.reranker.selected.clone()))
        # 3. a stable head not re-ranked now attends its last top-K and the pages made since, nothing else; with
        # overlap_loads a head re-ranked at this step (after the prompt's step 0) does too, then takes the new one
        ranked = set(new_events[0].heads.tolist()) if new_events else set()
        for h in stable.tolist():
            if h in ranked and not (late and step > 0):
                last[h] = (layer.reranker.selected[:, h].clone(), n - 1)
                continue
            if checked:
                sel, anchor = last[h]
                for b in range(B):
                    want = {p for p in sel[b].tolist() if p >= 0} | set(range(anchor + 1, n))
                    assert {p for p in attended[b, h].tolist() if p >= 0} == want, (step, h, b)
            if h in ranked:
                last[h] = (layer.reranker.selected[:, h].clone(), n - 1)
        # 4. every attended page of every head is on the device (never the null page); a late re-rank reseated its
        # heads after attending (their pages were on the device then: 1. read them)
        phys = layer.storage.pool.page_table.long().gather(2, attended.clamp_min(0))
        moved = torch.tensor([late and step > 0 and h in ranked for h in range(H)])[None, :, None]
        assert bool(((phys != NULL_PAGE) | (attended < 0) | moved).all())
    return cache, history


@pytest.mark.parametrize("G", [1, 3, 4])
@pytest.mark.parametrize("offload,overlap", [(True, False), (False, False), (True, True)])
def test_small_budget_steps_match_naive_reference(G, offload, overlap):
    """Every step exact over the attended pages, the re-ranked heads' top-K the reference's, the stable heads between
    re-ranks on their last top-K and the pages since (``overlap_loads``: on their re-rank step too, which loads the
    promoted pages after the attention)."""
    cfg = tiny_config("llama", heads=4 * G, kv_heads=4, layers=1, head_dim=8)
    profile = HeadProfile.from_unstable(cfg, [(0, 1)])
    cache, _ = drive(profile, B=2, H=4, G=G, D=8, prompt=45, steps=40, ps=4, budget=16, R=5, offload=offload,
                     valid_lo=torch.tensor([0, 3]), overlap_loads=overlap)
    assert (cache.stats.promoted_pages > 0) == offload


def test_rerank_schedule_is_observable():
    cfg = tiny_config("llama", heads=4, kv_heads=4, layers=1, head_dim=8)
    unstable = {1, 2}
    profile = HeadProfile.from_unstable(cfg, [(0, h) for h in unstable])
    R = 4
    cache, history = drive(profile, B=1, H=4, G=1, D=8, prompt=40, steps=17, ps=4, budget=12, R=R,
                           offload=True, valid_lo=torch.tensor([0]))
    for step, heads, _ in history:
        expect = [0, 1, 2, 3] if step % R == 0 and step else sorted(unstable)  # step 0: the prompt ranked them
        assert heads == [expect]
    # stable heads' selections change only on due steps; unstable ones are re-ranked each step
    for (s0, _, a), (s1, _, b) in zip(history, history[1:]):
        if s1 % R:
            assert torch.equal(a[:, [0, 3]], b[:, [0, 3]])
    assert cache.layers[0].reranker.reranks.tolist() == [4, 17, 17, 4]


@pytest.mark.parametrize("ps,R,prompt,stagger", [(4, 4, 40, False), (4, 8, 40, False), (2, 8, 40, True),
                                                  (4, 8, 41, False), (8, 4, 40, False)])
def test_every_new_page_has_a_slot_until_the_next_rerank(ps, R, prompt, stagger):
    """The prompt's seat, then the decode tokens of steps 0 .. R (R + 1 of them: the prompt ending on a page
    boundary starts R // ps + 1 pages before the first re-rank) and every later interval: each new page of a
    stable head gets a device slot, so every output is exact softmax attention over the attended pages (``drive``
    checks it against the full history)."""
    cfg = tiny_config("llama", heads=4, kv_heads=2, layers=1, head_dim=8)
    cache, history = drive(HeadProfile.from_unstable(cfg, [(0, 1)]), B=2, H=2, G=2, D=8, prompt=prompt,
                           steps=3 * R + 2, ps=ps, budget=3 * ps, R=R, offload=True, valid_lo=torch.tensor([0, 3]),
                           stagger_reranks=stagger)
    assert cache.layers[0].storage.pool.layout.slots == 3 + R // ps + 1
    assert any(heads and 0 in heads[0] for _, heads, _ in history)  # the stable head re-ranked in between


def _random_layer_case(i: int) -> dict:
    """The ``i``-th of a fixed set of small random layer configurations (page size, interval, budget, prompt length
    and alignment, padding, batch, unstable heads, offload, stagger, forced pages)."""
    import random

    r = random.Random(1000 + i)
    ps = r.choice([1, 2, 4, 8])
    R = r.choice([1, 2, 3, 4, 5, 8, 16])
    prompt = r.choice([r.randint(1, 70), ps * r.randint(1, 9)])  # half of them end on a page boundary
    B, H = r.randint(1, 3), r.randint(1, 3)
    lo = [0] + [r.randint(0, prompt - 1) for _ in range(B - 1)]
    extra = {}
    if r.random() < 0.4:
        extra["stagger_reranks"] = True
    if r.random() < 0.3:
        extra.update(sink_pages=r.randint(0, 1), recent_pages=r.randint(0, 2))
    pages = max(r.randint(2, 6), sum(extra.get(k, 0) for k in ("sink_pages", "recent_pages")) + 1)
    case = dict(B=B, H=H, G=r.choice([1, 2, 3]), D=8, prompt=prompt, steps=2 * R + r.randint(1, 2 * ps + 2),
                ps=ps, budget=ps * pages, R=R, offload=r.random() < 0.8, valid_lo=torch.tensor(lo),
                unstable=[(0, h) for h in range(H) if r.random() < 0.4], **extra)
    if r.random() < 0.4 and case["offload"]:  # (drawn last: the cases before overlap_loads existed stay as they
        case["overlap_loads"] = True  # were; it needs offloading)
    return case


@pytest.mark.parametrize("i", range(48))
def test_random_layer_configurations_attend_exactly(i):
    """Seeded random configurations through ``drive``: every step's output is exact softmax attention over the
    attended pages from the full history, and every attended page is on the device (edges of page size, interval,
    prompt alignment, padding, budget and forced pages that the fixed cases above do not reach)."""
    case = _random_layer_case(i)
    unstable, H, G = case.pop("unstable"), case["H"], case["G"]
    cfg = tiny_config("llama", heads=H * G, kv_heads=H, layers=1, head_dim=8)
    kw = {k: case.pop(k) for k in ("stagger_reranks", "sink_pages", "recent_pages", "overlap_loads") if k in case}
    drive(HeadProfile.from_unstable(cfg, unstable), **case, **kw)


def test_all_stable_layer_skips_scoring_between_reranks():
    cfg = tiny_config("llama", heads=2, kv_heads=2, layers=1, head_dim=8)
    cache, history = drive(HeadProfile.all_stable(cfg), B=1, H=2, G=1, D=8, prompt=30, steps=9, ps=4,
                           budget=8, R=4, offload=True, valid_lo=torch.tensor([0]))
    assert [bool(h) for _, h, _ in history] == [s % 4 == 0 and s > 0 for s in range(9)]


def test_full_budget_decode_equals_dense():
    cfg = tiny_config("llama", heads=6, kv_heads=2, layers=1, head_dim=8)
    cache, _ = drive(HeadProfile.random(cfg, 0.5, seed=1), B=3, H=2, G=3, D=8, prompt=33, steps=12, ps=4,
                     budget=64, R=3, offload=True, valid_lo=torch.tensor([0, 5, 2]))
    assert cache.get_seq_length() == 45


def test_offloaded_heads_keep_constant_device_slots():
    cfg = tiny_config("llama", heads=2, kv_heads=2, layers=1, head_dim=8)
    profile = HeadProfile.all_stable(cfg)
    cache, _ = drive(profile, B=1, H=2, G=1, D=8, prompt=200, steps=20, ps=4, budget=16, R=4, offload=True,
                     valid_lo=torch.tensor([0]))
    layer = cache.layers[0]
    assert layer.storage.pool.layout.slots == cache.config.resident_slots  # 4 + 2, not the 55 pages of the context
    resident = (layer.storage.pool.page_table[:, :, :55] != NULL_PAGE).sum(-1)
    assert bool((resident <= cache.config.resident_slots).all())
    assert cache.stats.promoted_pages > 0


def test_sink_and_recent_pages_are_always_selected():
    cfg = tiny_config("llama", heads=4, kv_heads=2, layers=1, head_dim=8)
    cache, history = drive(HeadProfile.from_unstable(cfg, [(0, 1)]), B=2, H=2, G=2, D=8, prompt=60, steps=20,
                           ps=4, budget=24, R=4, offload=True, valid_lo=torch.tensor([0, 6]),
                           sink_pages=1, recent_pages=2)
    for step, heads, selected in history:
        n = -(-(60 + step + 1) // 4)
        for h in heads[0]:
            for b in range(2):
                pages = set(selected[b, h].tolist())
                if b == 0:  # row 1's page 0 is all padding: empty pages are never selectable, sinks or not
                    assert 0 in pages
                else:
                    assert 0 not in pages
                assert {n - 3, n - 2, n - 1} <= pages


def test_reference_decode_work_follows_the_pages_that_exist_not_the_budget():
    """A huge budget on a short context: the reference decode does the work of the pages that exist."""
    from torch.utils.flop_counter import FlopCounterMode

    from conftest import twin_models

    cfg = tiny_config("llama", heads=4, kv_heads=2, max_pos=4096)
    fc, _ = twin_models(cfg)
    ids = torch.randint(2, 96, (1, 40))  # 10 pages of 4 tokens
    flops, tokens = {}, {}
    for budget in (64, 65536):
        cache = FlexiCache(HeadProfile.random(cfg, 0.5), page_size=4, token_budget=budget, rerank_interval=3)
        out = fc(ids, past_key_values=cache)
        step = out.logits[:, -1:].argmax(-1)
        with FlopCounterMode(display=False) as count:
            out = fc(step, past_key_values=cache)
        flops[budget], tokens[budget] = count.get_total_flops(), out.logits
    torch.testing.assert_close(tokens[64], tokens[65536])
    assert flops[65536] <= 1.05 * flops[64], flops


def test_reference_sparse_decode_ignores_unlisted_width():
    torch.manual_seed(0)
    B, H, G, D, ps, n = 2, 2, 2, 8, 4, 7
    k_pool, v_pool = torch.randn(1 + B * H * n, ps, D), torch.randn(1 + B * H * n, ps, D)
    table = (1 + torch.arange(B * H * n)).view(B, H, n).int()
    q = torch.randn(B, H * G, D)
    narrow = torch.tensor([[[0, 2, 6, -1], [1, 3, 5, 6]], [[6, -1, -1, -1], [0, 1, 2, 6]]])
    wide = torch.cat([narrow, torch.full((B, H, 5000), -1)], -1)[..., torch.randperm(5004)]
    want = reference.sparse_decode(q, k_pool, v_pool, table, narrow, torch.tensor([0, 3]), 27, 0.3)
    torch.testing.assert_close(reference.sparse_decode(q, k_pool, v_pool, table, wide, torch.tensor([0, 3]), 27, 0.3),
                               want)


def test_staggered_reranks_spread_the_layers_over_the_interval():
    """stagger_reranks=True: layer l's stable heads re-rank on the steps s = l (mod R), s > 0 (the prompt ranked them
    for step 0); the
    unstable heads every step; the promotions of a re-rank are spread over the steps; and a budget covering every
    page still decodes exactly as dense."""
    from transformers import AutoModelForCausalLM, DynamicCache

    cfg = tiny_config("llama", heads=4, kv_heads=2, layers=4, head_dim=8)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="flexicache").eval()
    ids = torch.randint(2, 90, (1, 40))
    profile = HeadProfile.from_unstable(cfg, [(layer, 1) for layer in range(4)])
    R, steps = 3, 10
    rec = Recorder()
    cache = FlexiCache(profile, page_size=4, token_budget=16, rerank_interval=R, stagger_reranks=True,
                       observer=rec)
    model.generate(ids, past_key_values=cache, max_new_tokens=steps + 1, min_new_tokens=steps + 1, do_sample=False)
    stable_steps = {layer: [e.step for e in rec.events if e.layer_idx == layer and 0 in e.heads.tolist()]
                    for layer in range(4)}
    for layer, got in stable_steps.items():
        assert got == [s for s in range(1, steps) if s % R == layer % R], (layer, got)
    unstable_steps = [e.step for e in rec.events if e.layer_idx == 2 and 1 in e.heads.tolist()]
    assert unstable_steps == list(range(steps))
    full = FlexiCache(profile, page_size=4, token_budget=64, rerank_interval=R, stagger_reranks=True)
    kw = dict(max_new_tokens=12, do_sample=False)
    assert torch.equal(model.generate(ids, past_key_values=full, **kw),
                       model.generate(ids, past_key_values=DynamicCache(), **kw))


def test_prompt_seats_the_last_querys_top_k_and_the_first_step_loads_nothing():
    """After the first prompt chunk the stable heads' selection is the top-K pages of the prompt's last query and the
    offloaded heads' slots hold them, with the prompt's own keys and values (copied on the device): that is their
    re-rank for step 0, so the first decode steps attend them and promote nothing; the schedule re-ranks them R
    steps later.  After a follow-up chunk the next step re-ranks every head over all pages."""
    cfg = tiny_config("llama", heads=8, kv_heads=4, layers=1, head_dim=8)
    profile = HeadProfile.from_unstable(cfg, [(0, 1)])
    torch.manual_seed(3)
    B, H, G, D, T, ps, K, R = 2, 4, 2, 8, 70, 4, 5, 4
    scale = D ** -0.5
    cache = FlexiCache(profile, page_size=ps, token_budget=K * ps, rerank_interval=R, kernels="reference")
    layer = cache.layers[0]
    keys, values, q = torch.randn(B, H, T, D), torch.randn(B, H, T, D), torch.randn(B, H * G, T, D)
    handle, _ = cache.update(keys, values, 0)
    attended_log = watch_attended(layer)
    cache.attend(handle, q, None, scale)
    heads = layer.storage.slot_heads
    assert heads.tolist() == layer.reranker.stable_heads.tolist() == [0, 2, 3]
    o = -T % ps  # storage positions: the prompt ends on a page boundary (page 17 its last, decode starts page 18)
    n = -(-(o + T) // ps)
    lo, hi = naive_minmax(framed(keys, o), torch.full((B,), o), n, ps)
    want = reference.select_pages(reference.page_scores(q[:, :, -1], lo, hi, heads, n, None, "max", scale), K)
    assert torch.equal(layer.reranker.selected[:, heads], want)
    seated = layer.storage.slots.slot_page
    for b in range(B):
        for t, h in enumerate(heads.tolist()):
            got = sorted(p for p in seated[b, t].tolist() if p >= 0)
            assert got == want[b, t].tolist()
            for p in got:  # the slot's contents are the prompt's tokens of that page
                phys = int(layer.storage.pool.page_table[b, h, p])
                toks = slice(max(p * ps - o, 0), min((p + 1) * ps - o, T))
                row = toks.start + o - p * ps  # (page 0 starts with the o empty positions)
                m = toks.stop - toks.start
                assert torch.equal(layer.storage.pool.k[phys, row : row + m], keys[b, h, toks])
                assert torch.equal(layer.storage.pool.v[phys, row : row + m], values[b, h, toks])

    def step():
        k1, v1, q1 = torch.randn(B, H, 1, D), torch.randn(B, H, 1, D), torch.randn(B, H * G, 1, D)
        handle, _ = cache.update(k1, v1, 0)
        cache.attend(handle, q1, None, scale)
        return k1, v1, q1

    history_k = [keys]
    for s in range(R):  # tokens 70..73 (storage 72..75) fill page 18, the first after the prompt's
        history_k.append(step()[0])
        attended = attended_log[-1][:, heads]
        for b in range(B):
            for t in range(len(heads)):
                newer = [18]
                assert sorted(p for p in attended[b, t].tolist() if p >= 0) == want[b, t].tolist() + newer
    assert cache.stats.promoted_pages == 0 and layer.reranker.reranks.tolist() == [0, R, 0, 0]
    history_k.append(step()[0])  # step R: the stable heads' first re-rank after the prompt
    assert layer.reranker.reranks.tolist() == [1, R + 1, 1, 1] and cache.stats.promoted_pages > 0

    more_k, more_v, more_q = torch.randn(B, H, 9, D), torch.randn(B, H, 9, D), torch.randn(B, H * G, 9, D)
    handle, _ = cache.update(more_k, more_v, 0)  # a follow-up chunk: positions 75..83
    cache.attend(handle, more_q, None, scale)
    history_k.append(more_k)
    k1, _, q1 = step()  # its step 0 re-ranks every head over every page
    history_k.append(k1)
    assert layer.reranker.reranks.tolist() == [2, R + 2, 2, 2]
    full = torch.cat(history_k, 2)
    n = -(-(o + full.shape[2]) // ps)
    lo, hi = naive_minmax(framed(full, o), torch.full((B,), o), n, ps)
    fresh = reference.select_pages(reference.page_scores(q1[:, :, 0], lo, hi, heads, n, None, "max", scale), K)
    assert torch.equal(layer.reranker.selected[:, heads], fresh)


def test_a_layers_step_buffers_are_few_and_never_alias():
    """A layer holds few buffers and no two share storage (a compiled step takes the pool as a graph input, and two
    inputs sharing memory make AOT autograd merge them and cudagraph trees skip the graph): the reranker's constant
    head sets and offsets live in two tensors, read through views made on use."""
    cfg = tiny_config("llama", heads=8, kv_heads=4, layers=1, head_dim=8)
    cache = FlexiCache(HeadProfile.from_unstable(cfg, [(0, 1), (0, 3)]), page_size=4, token_budget=8,
                       kernels="reference")
    cache.update(torch.randn(2, 4, 30, 8), torch.randn(2, 4, 30, 8), 0)
    layer, rr = cache.layers[0], cache.layers[0].reranker
    assert rr.stable_heads.tolist() == [0, 2] and rr.unstable_heads.tolist() == [1, 3]
    assert rr.all_heads.tolist() == [0, 1, 2, 3] and rr.is_stable.tolist() == [True, False, True, False]
    assert rr.unstable_active.tolist() == [True, True]
    recent = list(range(1, rr.max_recent + 1))
    assert rr.head_offsets.tolist() == [recent if h in (0, 2) else [FAR] * rr.max_recent for h in range(4)]
    reranker_buffers = rr.buffers()
    assert len(reranker_buffers) == 5  # the head sets and offsets, the flags, the selection, counts, first pages
    bases = [t.untyped_storage().data_ptr() for t in layer.buffers() if t.numel()]
    assert len(bases) == len(set(bases))
