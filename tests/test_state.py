"""DecodeState: the step schedule planned once per step (host plan and device scalars agree), and one
schedule per device for a model split across devices."""

import torch

from conftest import tiny_config
from flexicache_hf import FlexiCache
from flexicache_hf.head_profile import HeadProfile
from flexicache_hf.layer.schedule import DecodeState


def test_eager_plan_and_device_state_agree_over_pages_and_reranks():
    st = DecodeState("cpu", page_size=4, rerank_interval=3, capacity=None)
    st.add_chunk(6)  # the prompt ends on a page boundary: storage positions 2..7 (its last query: anchor page 1)
    assert st.host_origin == int(st.origin) == 2 and st.host_length == int(st.length) == 8
    st.anchor_of(0).fill_(1)
    anchor = 1
    for pos in range(8, 32):
        plan = st.begin_eager_step()
        st.begin_layer(0)
        step = pos - 8
        assert int(st.pos) == pos and int(st.length) == pos + 1 and int(st.num_pages) == pos // 4 + 1
        assert plan.new_page == bool(st.new_page) == (pos % 4 == 0)
        assert plan.page_full == bool(st.page_full) == (pos % 4 == 3)
        assert plan.stable_due == (bool(st.due_of(0)),) == (step > 0 and step % 3 == 0,)
        anchor = pos // 4 if step > 0 and step % 3 == 0 else anchor
        assert int(st.anchor_of(0)) == anchor
    assert st.counters.read()["decode_steps"] == 24
    assert [st.anchor_page(0, s) for s in (-1, 0, 2, 3, 5, 6)] == [1, 1, 1, 2, 2, 3]  # the anchor, from the schedule


def test_staggered_phases_rerank_each_layer_every_r_steps_and_all_after_a_follow_up_chunk():
    """After a first chunk (whose last query ranked every layer: "step -1") layer i re-ranks on its phase, at most
    R steps later; after a follow-up chunk every layer re-ranks on step 0 as well."""
    R, phases = 4, (0, 1, 2, 3, 0, 1)
    st = DecodeState("cpu", page_size=2, rerank_interval=R, capacity=None, phases=phases)
    st.add_chunk(5)
    _check_staggered(st, R, phases, first=False)
    st.add_chunk(3)  # a follow-up chunk restarts the schedule with every layer re-ranking at step 0
    _check_staggered(st, R, phases, first=True)
    st.reset()
    st.add_chunk(4)  # a first chunk again
    assert not any(st.begin_eager_step().stable_due)


def _check_staggered(st: DecodeState, R: int, phases: tuple[int, ...], first: bool) -> None:
    last = [0] * len(phases)  # step 0 re-ranks them, or the prompt's last query did in its stead
    for step in range(13):
        plan = st.begin_eager_step()
        for i in range(len(phases)):
            st.begin_layer(i)
        want = tuple(first if step == 0 else (step - ph) % R == 0 for ph in phases)
        assert plan.stable_due == want == tuple(bool(d) for d in st.due)
        assert all(bool(st.due_of(i)) == want[i] and plan.due(i) == want[i] for i in range(len(phases)))
        for i, d in enumerate(want):
            if d:
                assert step - last[i] <= R  # never longer than R between re-ranks
                last[i] = step
                assert int(st.anchor_of(i)) == int(st.page)
        if step:
            assert sum(want) == phases.count(step % R) < len(phases)  # the layers of this phase only


def test_capacity_clamps_and_flags_a_captured_overflow():
    st = DecodeState("cpu", page_size=4, rerank_interval=3, capacity=8)
    st.add_chunk(7)  # storage positions 1..7 (the origin is 1)
    st.advance()  # position 7 (storage 8): the last one
    assert int(st.pos) == 8 and not bool(st.overflow)
    st.advance()  # position 8 does not exist: clamped, flagged
    assert int(st.pos) == 8 and bool(st.overflow)
    st.stale = True
    try:
        st.sync()
    except OverflowError as e:
        assert "max_cache_len=8" in str(e)
    else:
        raise AssertionError("no OverflowError")


def test_the_host_bounds_the_length_by_the_steps_announced_since_it_read_it():
    """Steps the host does not follow (graph replays) count as run once announced: a bound that never says a step
    fits when it does not; an over-count only sends the host back to the device, whose exact length decides."""
    st = DecodeState("cpu", page_size=4, rerank_interval=3, capacity=8)
    st.add_chunk(5)  # storage positions 3..7 of 3..10: room for 3 more
    assert st.surely_fits(3) and not st.surely_fits(4)  # the mirror is exact: so is the answer

    def replay():  # a captured step: the device advances, the host only learns that it is behind
        st.advance()
        st.stale = True

    st.announce(1)
    replay()
    assert st.surely_fits(2) and not st.surely_fits(3)  # one step announced, so counted: room for 2
    st.announce(1)
    st.announce(1)  # the next step announced twice: counted twice
    assert not st.surely_fits(1)  # (room for 1 in truth: the bound is over)
    st.sync()  # so the host reads the length: 9 stored, the step announced last may still run
    assert int(st.length) == st.host_length == 9 and st.surely_fits(2) and not st.surely_fits(3)
    replay()  # it does
    assert st.surely_fits(1) and not st.surely_fits(2)
    st.announce(1)
    replay()  # the last position
    assert not st.surely_fits(1)
    st.sync()
    assert st.host_length == 11 and not st.surely_fits(1) and not bool(st.overflow)


def test_one_schedule_per_device_follows_the_first_and_counts_steps_once():
    """device_map splits: a later device's first layer makes its own schedule part-way through the prompt."""
    cfg = tiny_config("llama", heads=2, kv_heads=2, layers=2, head_dim=8)
    cache = FlexiCache(HeadProfile.all_stable(cfg), page_size=4, token_budget=8)
    first = cache.decode_state(torch.device("cpu"))
    first.add_chunk(6)  # (storage positions from 2: the origin)
    first.add_chunk(4)  # layer 0 took a follow-up chunk before the second device's layer existed
    second = cache.decode_state(torch.device("cpu:0"))  # another device key (a second GPU in practice)
    assert second is not first and cache.decode_state(torch.device("cpu:0")) is second
    assert int(second.length) == 12 and second.host_length == 12 and second.host_origin == int(second.origin) == 2
    for state in cache.states.values():
        state.begin_eager_step()
        for layer in range(2):
            state.begin_layer(layer)
    assert int(first.length) == int(second.length) == 13
    assert all(bool(d) for d in second.due) and [int(a) for a in second.anchor] == [3, 3]
    assert cache.stats.decode_steps == 1  # counted by the first device's schedule only
    cache.reset()
    assert not cache.states


def test_each_layer_reads_its_schedule_from_scalars_of_its_own():
    """A compiled step reads per-layer scalars through pointers: no layer's scalar is a view into a shared tensor
    (a constant index would make every layer's generated kernels a different program, compiled once per layer)."""
    st = DecodeState("cpu", page_size=4, rerank_interval=4, capacity=None, phases=(0, 1, 2))
    ptrs = {t.untyped_storage().data_ptr() for t in st.buffers()}
    assert len(ptrs) == len(st.buffers())
    assert all(st.due_of(i).storage_offset() == st.anchor_of(i).storage_offset() == 0 for i in range(3))
