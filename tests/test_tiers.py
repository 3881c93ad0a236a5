"""Invariants of the device slot bookkeeping (hypothesis): after any sequence of reseats the resident set is
exactly what was asked, the page table points each resident page at its slot, and nothing else."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flexicache_hf.kernels import REFERENCE_OPS
from flexicache_hf.pages import NULL_PAGE, PagePool, PoolLayout
from flexicache_hf.tiers import SlotTable

B, HEADS, SLOTS, PAGES = 2, 2, 5, 12


def make_table():
    layout = PoolLayout(B, HEADS, SLOTS, 1, PAGES)
    pool = PagePool(layout, torch.tensor([2]), torch.tensor([0, 1]), 3, 4, 8, torch.float32, torch.device("cpu"))
    return pool, SlotTable(pool, torch.device("cpu"))


wanted_sets = st.lists(st.lists(st.lists(st.integers(0, PAGES - 1), max_size=SLOTS, unique=True),
                                min_size=HEADS, max_size=HEADS), min_size=B, max_size=B)


@settings(max_examples=60, deadline=None)
@given(st.lists(wanted_sets, min_size=1, max_size=6))
def test_reseat_keeps_exactly_the_wanted_pages(rounds):
    pool, slots = make_table()
    for wanted_lists in rounds:
        wanted = torch.full((B, HEADS, SLOTS), -1, dtype=torch.long)
        for b in range(B):
            for h in range(HEADS):
                w = sorted(wanted_lists[b][h])
                wanted[b, h, : len(w)] = torch.tensor(w, dtype=torch.long)
        before = slots.slot_page.clone()
        pages, phys = slots.reseat(REFERENCE_OPS, wanted)
        for b in range(B):
            for h in range(HEADS):
                want = set(wanted_lists[b][h])
                held = set(slots.slot_page[b, h][slots.slot_page[b, h] >= 0].tolist())
                assert held == want
                # only pages that were absent are loaded, each into the slot now holding it
                loaded = {p for p in pages[b, h].tolist() if p >= 0}
                assert loaded == want - set(before[b, h].tolist())
                for p, f in zip(pages[b, h].tolist(), phys[b, h].tolist()):
                    if p >= 0:
                        s = slots.slot_page[b, h].tolist().index(p)
                        assert f == int(slots.slot_phys[b, h, s])
                # kept pages did not move
                for s, p in enumerate(before[b, h].tolist()):
                    if p in want:
                        assert int(slots.slot_page[b, h, s]) == p
                # the page table: resident pages -> their slot, every other page -> the null page
                table = pool.page_table[b, h].tolist()
                for p in range(PAGES):
                    if p in want:
                        s = slots.slot_page[b, h].tolist().index(p)
                        assert table[p] == int(slots.slot_phys[b, h, s])
                    else:
                        assert table[p] == NULL_PAGE
        # the resident head's table is untouched (identity placement in the full region)
        assert torch.equal(pool.page_table[:, 2], pool.layout.full_ids(torch.device("cpu"))[:, 0].int())
