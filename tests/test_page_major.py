"""Every buffer of a layer that grows with the context grows in its outermost dimension (page-major): the pool's
full region, the MinMax cache and the host tier.  Their placement, the spans a token range is copied in, the 2D
copies the CUDA row copy issues (checked here by replaying their arguments on CPU memory), and growth that only
appends."""

import pytest
import torch

from flexicache_hf.kernels import REFERENCE_OPS
from flexicache_hf.kernels.row_copy import PAGE, split_at_pages, blocks, copy_2d_args
from flexicache_hf.pages import PagePool, PoolLayout, token_spans
from flexicache_hf.tiers import CopyStream, HostTier, SlotTable, page_major

CPU = torch.device("cpu")


def test_the_full_region_is_page_major_and_fills_its_range_once():
    lay = PoolLayout(batch=2, num_slot_heads=2, slots=3, num_full_heads=3, page_capacity=5)
    ids = lay.full_ids(CPU)
    assert ids.shape == (2, 3, 5)
    for b in range(2):
        for h in range(3):
            for p in range(5):
                assert int(ids[b, h, p]) == lay.full_base + (p * 2 + b) * 3 + h
    assert sorted(ids.reshape(-1).tolist()) == list(range(lay.full_base, lay.num_physical))


@pytest.mark.parametrize("ps", [1, 4, 8])
def test_token_spans_cover_a_range_in_order_in_at_most_three_parts(ps):
    for first in range(0, 3 * ps + 2):
        for end in range(first, first + 4 * ps + 3):
            spans = token_spans(first, end, ps)
            assert len(spans) <= 3
            positions = [p * ps + o for s in spans for p in range(s.p0, s.p1) for o in range(s.lo, s.hi)]
            assert positions == list(range(first, end))
            for s in spans:  # a span's rows start where its positions do
                assert s.t0 == s.p0 * ps + s.lo - first and 0 <= s.lo < s.hi <= ps


def test_spans_move_token_rows_into_page_major_storage_and_back():
    ps, B, H, D, first, T = 4, 2, 3, 5, 6, 13
    rows = torch.randn(B, H, T, D)
    store = torch.zeros(8, B, H, ps, D)
    for span in token_spans(first, first + T, ps):
        span.pages(store).copy_(span.rows(rows))
    for t in range(T):
        pos = first + t
        assert torch.equal(store[pos // ps, :, :, pos % ps], rows[:, :, t])
    back = torch.empty_like(rows)
    for span in token_spans(first, first + T, ps):
        span.rows(back).copy_(span.pages(store))
    assert torch.equal(back, rows)


def make_pool(slots=3, cap=5, B=2):
    layout = PoolLayout(B, 2, slots, 1, cap)
    return PagePool(layout, torch.tensor([2]), torch.tensor([0, 1]), 3, 4, 8, torch.float32, CPU)


def resident_tokens(pool, end):
    """The resident head's tokens read through the page table, as the kernels read them: ``[B, 1, end, D]``."""
    pos = torch.arange(end)
    phys = pool.page_table[:, pool.full_heads][:, :, pos // pool.page_size].long()  # [B, 1, end]
    return pool.k[phys, pos % pool.page_size]


def test_a_chunk_stored_in_the_full_region_is_where_the_page_table_says():
    pool = make_pool()
    keys, values = torch.randn(2, 1, 17, 8), torch.randn(2, 1, 17, 8)
    pool.store_full(keys[:, :, :3], values[:, :, :3], 2)  # a chunk inside a page, then one across pages
    pool.store_full(keys[:, :, 3:], values[:, :, 3:], 5)
    assert torch.equal(resident_tokens(pool, 19)[:, :, 2:], keys)
    assert torch.equal(pool.read_full("k", 2, 19), keys) and torch.equal(pool.read_full("v", 4, 11), values[:, :, 2:9])


@pytest.mark.parametrize("slots", [3, 5])
def test_growth_appends_pages_and_keeps_every_page_where_it_was(slots):
    """Without new slots the old pool is the new one's prefix; with new slots, slot j stays slot j and the full
    region moves whole (its pages keep their place relative to its base)."""
    pool = make_pool()
    table = SlotTable(pool, CPU)
    table.set_pages(torch.tensor([[[0, 4, -1], [1, -1, 3]], [[2, -1, -1], [0, 1, 2]]]))
    pool.k.copy_(torch.randn_like(pool.k))
    old, old_k, old_table = pool.layout, pool.k.clone(), pool.page_table.clone()
    before = resident_tokens(pool, 20)
    pool.grow(9, slots)
    new = pool.layout
    assert new.page_capacity == 9 and new.slots == slots
    if slots == old.slots:
        assert torch.equal(pool.k[1 : old.num_physical], old_k[1:])
    n_full = old.num_physical - old.full_base
    assert torch.equal(pool.k[new.full_base : new.full_base + n_full], old_k[old.full_base :])
    assert torch.equal(resident_tokens(pool, 20), before)
    table.relayout(pool)
    for b in range(2):
        for h in range(2):
            for j in range(old.slots):
                assert torch.equal(pool.k[int(table.slot_phys[b, h, j])], old_k[1 + (b * 2 + h) * old.slots + j])
    assert torch.equal(pool.page_table[:, :2, :5] != 0, old_table[:, :2] != 0)  # the same pages resident


def test_the_host_tier_is_page_major_and_grows_by_appending():
    ps, B, H, D = 4, 2, 3, 8
    t = HostTier(B, H, ps, D, torch.float32, CPU, None, CopyStream(CPU), REFERENCE_OPS)
    t.grow(4)
    t.k.zero_(), t.v.zero_()  # a tier is never zeroed (a kept block may hold NaN from its last use): compared whole here
    k, v = torch.randn(B, H, 11, D), torch.randn(B, H, 11, D)
    t.write_tokens(k, v, 3)  # starts and ends inside a page
    assert t.k.shape == (4, B, H, ps, D)
    for i in range(11):
        pos = 3 + i
        assert torch.equal(t.k[pos // ps, :, :, pos % ps], k[:, :, i])
    pages = torch.tensor([[[2, 0]] * H] * B)  # [B, heads, n] logical pages
    flat = t.pages("v")[t.page_index(pages).reshape(-1)].view(B, H, 2, ps, D)
    assert torch.equal(flat[:, :, 0], t.v[2]) and torch.equal(flat[:, :, 1], t.v[0])
    held = t.k.clone()
    t.grow(9)
    assert t.k.shape[0] == 9 and torch.equal(t.k[:4], held)
    out = torch.empty(B, H, 11, D), torch.empty(B, H, 11, D)
    t.read_tokens(*out, first=3)
    assert torch.equal(out[0], k) and torch.equal(out[1], v)


def replay_2d(args, dst_base: torch.Tensor, src_base: torch.Tensor) -> None:
    """What ``cuMemcpy2DAsync`` does with :func:`copy_2d_args`' arguments, on CPU memory (addresses are bytes into
    the two contiguous base tensors)."""
    d_ptr, d_pitch, s_ptr, s_pitch, width, height = args
    db, sb = dst_base.reshape(-1).view(torch.uint8), src_base.reshape(-1).view(torch.uint8)
    d0, s0 = d_ptr - dst_base.data_ptr(), s_ptr - src_base.data_ptr()
    for r in range(height):
        db[d0 + r * d_pitch : d0 + r * d_pitch + width] = sb[s0 + r * s_pitch : s0 + r * s_pitch + width]


@pytest.mark.parametrize("B,H,first,T", [(1, 2, 5, 40), (2, 3, 0, 16), (4, 4, 6, 20), (3, 1, 3, 2), (1, 1, 8, 3)])
def test_row_copy_2d_arguments_move_a_chunk_into_the_page_major_tier_and_back(B, H, first, T):
    """The CUDA row copy's plan (blocks of evenly spaced runs, one cuMemcpy2DAsync each) replayed on the CPU:
    it writes what the reference writes, nothing else, in min(pages, rows x heads) copies per whole-page span."""
    ps, D, cap = 4, 8, 16
    chunk = torch.randn(B, H, T, D, dtype=torch.float16)
    tier, want = torch.zeros(cap, B, H, ps, D, dtype=torch.float16), torch.zeros(cap, B, H, ps, D, dtype=torch.float16)
    for span in token_spans(first, first + T, ps):
        REFERENCE_OPS.copy_rows(span.pages(want), span.rows(chunk))
        parts = blocks(span.pages(tier), span.rows(chunk))
        assert len(parts) == min(span.p1 - span.p0, B * H)
        for d, s in parts:
            args = copy_2d_args(d, s)
            assert args is not None
            replay_2d(args, tier, chunk)
    assert torch.equal(tier, want)
    back = torch.zeros_like(chunk)
    for span in token_spans(first, first + T, ps):
        for d, s in blocks(span.rows(back), span.pages(tier)):
            replay_2d(copy_2d_args(d, s), back, tier)
    assert torch.equal(back, chunk)


@pytest.mark.parametrize("cuts", [(), (3,), (1, 7), (0, 5, 6, 11)])
def test_row_copy_across_registrations_is_cut_into_halves_that_each_lie_in_one(cuts):
    """A 2D copy whose host rows cross a registration (the driver's CUDA_ERROR_INVALID_VALUE) is cut in halves of
    rows until none crosses: every row is copied once, no copy that the driver took crosses a boundary, and no
    per-run fallback is needed (cuts: the registration boundaries, as row indices where a new piece begins)."""
    from flexicache_hf.kernels.row_copy import RowCopier

    class Driver:  # cuMemcpy2DAsync's contract as far as registrations go: a copy stays inside one registration
        pass

    pitch, width, height, base = 64, 48, 12, 1 << 20
    bounds = [base + c * pitch for c in cuts]
    taken: list[tuple[int, int]] = []

    def copy_2d(self, driver, device, args):
        src, height = args[2], args[5]
        end = src + (height - 1) * pitch + width
        if any(src < b < end for b in bounds):
            return None  # crosses a registration
        taken.append(((src - base) // pitch, height))
        return True

    copier = RowCopier()
    copier._copy_2d = copy_2d.__get__(copier)
    assert copier._copy_split(Driver(), None, (0, pitch, base, pitch, width, height))
    rows = sorted(r for start, n in taken for r in range(start, start + n))
    assert rows == list(range(height))
    assert len(taken) <= 1 + 2 * len(cuts) * height.bit_length()  # a few calls per boundary, never one per row


@pytest.mark.parametrize("offset", [0, 1000])
def test_a_block_read_is_cut_only_where_it_crosses_a_registration(offset):
    """``copy_block``'s CUDA plan replayed on the CPU: one flat copy, and where the driver refuses one that crosses a
    registration of host memory (each starts and ends on an OS page), that copy cut at a page near its middle. A
    prefix of ~40 pages over 3 registrations takes a handful of calls and moves every byte; a copy refused within
    one page is no registration's doing, and the plan says so (False: torch then copies it)."""
    host = torch.randint(0, 255, (48 * PAGE,), dtype=torch.uint8)
    dev = torch.zeros(40 * PAGE, dtype=torch.uint8)
    base = host.data_ptr() // PAGE * PAGE  # registrations: pages [0, 7), [7, 30), [30, ...) of the host's first page
    bounds = [base + 7 * PAGE, base + 30 * PAGE]
    src0 = host.data_ptr() + offset
    calls = []

    def copy(dst, src, n):
        calls.append(n)
        if any(src < b < src + n for b in bounds):
            return None
        d, s = dst - dev.data_ptr(), src - host.data_ptr()
        dev[d:d + n] = host[s:s + n]
        return True

    assert split_at_pages(copy, dev.data_ptr(), src0, dev.numel(), host_is_src=True)
    assert torch.equal(dev, host[offset:offset + dev.numel()])
    assert len(calls) <= 2 + 4 * len(bounds) * 6  # (log2 of the range in pages per boundary, both halves)
    assert not split_at_pages(lambda d, s, n: None, dev.data_ptr(), src0, dev.numel(), host_is_src=True)


def test_a_chunks_whole_pages_staged_page_major_are_the_tiers_bytes():
    """What a chunk's offload from a device writes as one block (``tiers.page_major``): the whole pages, laid out as
    the tier holds them after the reference's row copies."""
    ps, B, H, D, first, T = 4, 2, 3, 8, 6, 19
    rows = torch.randn(B, H, T, D)
    t = HostTier(B, H, ps, D, torch.float32, CPU, None, CopyStream(CPU), REFERENCE_OPS)
    t.grow(8)
    t.write_tokens(rows, rows * 2, first)  # (same device: span by span through copy_rows)
    whole = [span for span in token_spans(first, first + T, ps) if span.hi - span.lo == ps]
    assert len(whole) == 1
    span = whole[0]
    assert torch.equal(page_major(span, rows), t.k[span.p0:span.p1])
    assert torch.equal(page_major(span, rows * 2), t.v[span.p0:span.p1])
