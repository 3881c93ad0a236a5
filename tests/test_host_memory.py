"""Page-locked host blocks without CUDA: the mapping and its parallel population, lending (a block comes back when
the last view of it dies), the keeper's reuse, bound and background pins, and the host-memory cap on exact sizes,
checked for every layer at the first layer's update.  Registration itself is tested on CUDA
(tests/gpu/test_host_pinning_gpu.py)."""

import ctypes
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from conftest import tiny_config, twin_models
from flexicache_hf import FlexiCache, HeadProfile, HostMemoryError, kept_storage_bytes, release_storage
from flexicache_hf import block_keeper, host_memory, recycling
from flexicache_hf.block_keeper import BlockKeeper
from flexicache_hf.host_memory import PAGE, PinnedBlock, PinSettings, pieces, populate
from flexicache_hf.pages import host_capacity, num_pages, room_capacity


class FakeBlock:
    """A keeper's block in ordinary memory (the keeper's logic without mappings or CUDA); frees are recorded."""

    def __init__(self, nbytes, align, device, freed):
        self.nbytes, self.key, self.freed = nbytes, (nbytes, align, device), freed
        self.memory = bytearray(nbytes)

    def lend(self, on_return):
        """As PinnedBlock.lend: a tensor whose last view's death calls ``on_return(self)``."""
        buffer = (ctypes.c_ubyte * self.nbytes).from_buffer(self.memory)
        weakref.finalize(buffer, on_return, self)
        return torch.frombuffer(buffer, dtype=torch.uint8)

    def free(self):
        """Recorded, not done (the memory is a bytearray)."""
        self.freed.append(self.key)


def keeper(fail=(), gate=None, pinners=1):
    """A keeper of FakeBlocks; sizes in ``fail`` fail to pin; ``gate`` (an Event) holds every pin until set."""
    freed, pinned = [], []

    def pin(nbytes, align, device):
        """The keeper's ``pin``: a FakeBlock, after the gate, unless its size fails."""
        if gate is not None:
            gate.wait(10)
        pinned.append(nbytes)
        if nbytes in fail:
            raise OSError(f"no memory for {nbytes}")
        return FakeBlock(nbytes, align, device, freed)

    return BlockKeeper(PinSettings(threads=1, pinners=pinners), pin=pin), freed, pinned


def settle(k, timeout=10):
    """Wait until no background pin is under way."""
    end = time.monotonic() + timeout
    while k._pending and time.monotonic() < end:
        time.sleep(0.01)
    assert not k._pending


def within_bound(k):
    """Whether lent + kept + pending is within the keeper's peak (its bound)."""
    s = k.stats()
    return s["lent_bytes"] + s["kept_bytes"] + s["pending_bytes"] <= s["peak_bytes"]


# ---- blocks -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("threads", [1, 4])
def test_a_block_is_its_exact_bytes_populated_and_comes_back_when_its_last_view_dies(threads):
    n = 5 * PAGE + 123
    pool = ThreadPoolExecutor(threads) if threads > 1 else None
    block = PinnedBlock(n, settings=PinSettings(threads=threads, chunk_bytes=PAGE), pool=pool)
    back = []
    t = block.lend(back.append)
    assert t.dtype == torch.uint8 and t.numel() == n and t.data_ptr() == block.addr and block.addr % PAGE == 0
    assert not t.any()  # fresh anonymous memory
    t.fill_(7)
    view = t[PAGE:].view(torch.int8)[:10]
    del t
    assert back == []  # a view still sees the memory
    assert view.tolist() == [7] * 10
    del view
    assert back == [block]
    block.free()
    assert block.addr == 0
    block.free()  # once only


def test_population_falls_back_to_writing_on_kernels_without_populate_write(monkeypatch):
    monkeypatch.setattr(host_memory, "_populate_write", [False])
    addr = host_memory.map_anonymous(3 * PAGE)
    try:
        populate(addr, 3 * PAGE, PAGE, None)
        assert bytes((ctypes.c_ubyte * (3 * PAGE)).from_address(addr)) == bytes(3 * PAGE)
    finally:
        host_memory.unmap(addr, 3 * PAGE)


def test_pieces_cover_the_block_in_whole_pages_and_rows():
    align = 3 * PAGE  # a row of the tier's 2D copies
    spans = pieces(1 << 40, 10 * align + 5 * PAGE, align, 4 * align + 1)
    assert [n for _, n in spans] == [4 * align, 4 * align, 2 * align + 5 * PAGE]
    assert all(a == (1 << 40) + i * 4 * align for i, (a, _) in enumerate(spans))
    assert pieces(0, 100, 7, None) == [(0, 100)] and pieces(0, 100, 7, 100) == [(0, 100)]
    assert [n for _, n in pieces(0, 3 * align, align, PAGE)] == [align] * 3  # a row is never split
    with pytest.raises(ValueError):
        PinSettings(chunk_bytes=PAGE + 1)


# ---- the keeper ---------------------------------------------------------------------------------------------------
def test_a_later_tier_of_the_same_size_takes_the_kept_block():
    k, freed, pinned = keeper()
    a = k.acquire(10_000, 64)
    ptr = a.data_ptr()
    assert k.kept_bytes() == 0 and k.stats()["lent_bytes"] == 10_000
    del a
    assert k.kept_bytes() == 10_000 and k.stats()["lent_bytes"] == 0
    b = k.acquire(10_000, 64)
    assert b.data_ptr() == ptr and pinned == [10_000] and k.stats()["reused"] == 1
    c = k.acquire(10_000, 32)  # another row size is another block (its registration pieces could differ)
    assert c.data_ptr() != ptr and pinned == [10_000, 10_000]
    del b, c
    assert k.release() == 20_000 and sorted(freed) == [(10_000, 32, None), (10_000, 64, None)] and k.kept_bytes() == 0


def test_kept_blocks_never_take_page_locked_memory_past_the_peak():
    k, freed, _ = keeper()
    a, b = k.acquire(100), k.acquire(100)
    del a, b  # peak 200, all of it kept
    c = k.acquire(150)  # would make 350: both kept blocks go, oldest first
    assert freed == [(100, 1, None), (100, 1, None)] and k.kept_bytes() == 0 and within_bound(k)
    d = k.acquire(50)  # lent 200: the peak again
    del c
    e = k.acquire(100)  # 150 kept + 100 new would pass 200: the 150 goes
    assert freed[-1] == (150, 1, None) and within_bound(k)
    del d, e
    assert k.kept_bytes() == 150 and k.stats()["peak_bytes"] == 200


def test_the_bound_holds_whatever_the_order():
    import random

    rng = random.Random(0)
    k, _, _ = keeper()
    held = []
    for _ in range(300):
        if held and rng.random() < 0.45:
            held.pop(rng.randrange(len(held)))
        else:
            held.append(k.acquire(rng.choice([64, 128, 192, 512])))
        assert within_bound(k)
        assert k.stats()["lent_bytes"] == sum(t.numel() for t in held)
    for t in held:  # nothing lent was ever freed: every lent tensor still reads what was written
        t.fill_(3)
    assert all(int(t.min()) == 3 for t in held)


def test_prefetch_pins_what_is_missing_in_order_and_acquires_take_it():
    gate = threading.Event()
    gate.set()
    k, freed, pinned = keeper(gate=gate)
    del_me = k.acquire(64)
    del del_me  # one 64-byte block kept
    gate.clear()
    assert k.prefetch([(64, 1), (64, 1), (32, 1)]) == 96  # the kept 64 covers one of them
    assert k.kept_bytes() == 64 + 96 and within_bound(k)  # pending bytes count as kept until claimed
    gate.set()
    got = [k.acquire(64), k.acquire(64), k.acquire(32)]
    assert pinned == [64, 64, 32] and [t.numel() for t in got] == [64, 64, 32]
    s = k.stats()  # (a background pin done before its acquire was kept, then reused)
    assert s["pins"] == 3 and s["pinned_now"] == 1 and s["reused"] + s["prefetched"] == 3 and s["lent_bytes"] == 160
    assert k.prefetch([(64, 1)]) == 64  # every kept or pending block is taken: a new one
    settle(k)
    assert k.kept_bytes() == 64 and within_bound(k)  # unclaimed: kept
    assert k.release() == 64 and freed == [(64, 1, None)]


def test_an_acquire_waits_for_the_background_pin_of_its_size():
    gate = threading.Event()
    k, _, pinned = keeper(gate=gate)
    k.prefetch([(32, 1)])
    out = []
    waiter = threading.Thread(target=lambda: out.append(k.acquire(32)))
    waiter.start()
    end = time.monotonic() + 10
    while k.stats()["lent_bytes"] != 32 and time.monotonic() < end:
        time.sleep(0.01)
    s = k.stats()
    assert s["lent_bytes"] == 32 and s["pending_bytes"] == 0 and not out  # claimed, still being pinned
    gate.set()
    waiter.join(10)
    assert out[0].numel() == 32 and pinned == [32] and k.stats()["prefetched"] == 1 and within_bound(k)


def test_prefetch_frees_the_kept_blocks_its_plan_does_not_use_first():
    k, freed, _ = keeper()
    a, b = k.acquire(10), k.acquire(20)
    del a, b  # peak 30, kept 10 (older) and 20
    k.prefetch([(20, 1), (25, 1)])  # 20 is kept; 25 is pinned: 55 > the 45 planned, the unplanned 10 goes
    assert freed == [(10, 1, None)]
    settle(k)
    assert within_bound(k) and k.stats()["peak_bytes"] == 45


def test_a_failed_background_pin_raises_host_memory_error_at_the_acquire_that_needs_it():
    k, _, _ = keeper(fail=(48,))
    k.prefetch([(48, 1)])
    with pytest.raises(HostMemoryError, match="no memory for 48"):
        k.acquire(48)
    assert k.stats()["lent_bytes"] == 0 and k.kept_bytes() == 0
    k.prefetch([(48, 1)])
    settle(k)  # unclaimed and failed: nothing kept, the acquire tries again (and fails again, clearly)
    with pytest.raises(HostMemoryError, match="no memory for 48"):
        k.acquire(48)


def test_release_storage_frees_kept_blocks_and_counts_them(monkeypatch):
    k, freed, _ = keeper()
    monkeypatch.setattr(recycling, "BLOCKS", k)
    t = k.acquire(4096)
    base = kept_storage_bytes()
    del t
    assert kept_storage_bytes() == base + 4096
    assert release_storage() == base + 4096 and freed == [(4096, 1, None)] and kept_storage_bytes() == 0


# ---- host tiers: exact bytes, the cap checked for every layer at the first layer ------------------------------------
def test_host_capacity_steps_are_coarse_bounded_and_shared_by_nearby_sizes():
    caps = [host_capacity(p) for p in range(1, 5000)]
    assert all(p <= c <= max(p, p * 5 // 4) for p, c in zip(range(1, 5000), caps))
    assert caps == sorted(caps) and all(host_capacity(c) == c for c in caps)
    assert sorted(set(caps[1024:2048])) == [1280, 1536, 1792, 2048]  # pages 1025..2048: 4 sizes per doubling
    assert room_capacity(100, None, 16, 0) == num_pages(115, 16) + 8
    assert room_capacity(100, 200, 16, 0) == num_pages(215, 16)
    assert room_capacity(100, None, 16, 64) is None


def test_first_forward_checks_every_layers_host_tier_at_layer_0_on_exact_bytes():
    cfg = tiny_config("llama", heads=4, kv_heads=2)
    fc, _ = twin_models(cfg)
    profile = HeadProfile.from_unstable(cfg, [(0, 0), (0, 1)])  # layer 0 offloads nothing, layer 1 both heads
    ids = torch.randint(2, 96, (2, 40))
    kw = dict(page_size=4, token_budget=16, kernels="reference")  # growing storage (not compileable: no reservation)
    probe = FlexiCache(profile, **kw)
    fc(ids, past_key_values=probe)
    need = probe.host_bytes()
    pages = room_capacity(40, None, 4, 0)
    assert need == 2 * 2 * 2 * pages * 4 * 16 * 4  # K and V, 2 rows, 2 heads, fp32: no rounding
    assert probe.layers[1].host_plan(40, torch.zeros(2, 2, 40, 16)) == []  # room already
    exact = FlexiCache(profile, **kw, host_memory_limit=need)
    fc(ids, past_key_values=exact)
    assert exact.host_bytes() == need
    short = FlexiCache(profile, **kw, host_memory_limit=need - 1)
    with pytest.raises(HostMemoryError, match=r"need [0-9,]+ bytes, over host_memory_limit"):
        fc(ids, past_key_values=short)
    assert short.layers[0].seq_len == 0 and not short.guard.open  # refused at layer 0: nothing written anywhere


@pytest.mark.parametrize("max_cache_len", [None, 70])
def test_the_plan_predicts_every_layers_host_blocks(max_cache_len):
    cfg = tiny_config("llama", heads=4, kv_heads=2, layers=3)
    fc, _ = twin_models(cfg)
    cache = FlexiCache(HeadProfile.random(cfg, 0.5, seed=4), page_size=4, token_budget=16, max_cache_len=max_cache_len,
                       kernels="reference")  # unsized: growing storage (not compileable, so not reserved)
    keys = torch.zeros(2, 2, 30, 16)
    plans = [layer.host_plan(30, keys) for layer in cache.layers]
    before = block_keeper.BLOCKS.stats()["pins"]
    fc(torch.randint(2, 96, (2, 30)), past_key_values=cache)
    assert [sum(n for n, _ in plan) for plan in plans] == [layer.host_bytes() for layer in cache.layers]
    assert [plan[0][1] if plan else 0 for plan in plans] == [  # the run: one page of one (row, head), page-major
        layer.storage.host.k[0, 0, 0].nbytes if layer.storage.host.k is not None else 0 for layer in cache.layers]
    assert block_keeper.BLOCKS.stats()["pins"] == before  # off CUDA nothing is page-locked
    assert any(plans) and all(len(plan) in (0, 2) for plan in plans)  # K and V of each layer that offloads



_IMPORT_RACE = """
import threading, time
from flexicache_hf.cuda_context import cuda_core
errors = []
def use(i):
    time.sleep(0.002 * i)  # arrivals spread over the import (threads arriving together all wait on its lock)
    try:
        cuda_core().Device
    except Exception as e:
        errors.append(repr(e))
threads = [threading.Thread(target=use, args=(i,)) for i in range(100)]
[t.start() for t in threads]
[t.join() for t in threads]
print(len(errors), errors[:1])
"""


def test_threads_importing_cuda_core_at_once_all_get_it():
    """cuda-core 1.2's ``__init__`` overwrites its own ``__spec__``, so a thread importing it while another is inside
    that ``__init__`` got ``cannot import name 'Device'`` (the README call's background host commits met it on the
    H200); through ``cuda_context.cuda_core`` every thread gets the whole module.  Fresh interpreters, 100 threads
    arriving over 0.2 s: with a plain ``from cuda.core import Device`` about half of them failed in every run."""
    import subprocess
    import sys

    pytest.importorskip("cuda.core")
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", _IMPORT_RACE], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert out.stdout.split()[0] == "0", out.stdout


def _numa_policy(addr: int) -> str:
    """The policy ``/proc/self/numa_maps`` shows for the mapping holding ``addr`` (the kernel may merge a mapping
    with a neighbour of the same policy: its line starts at their first address)."""
    for line in open("/proc/self/maps"):
        start, end = (int(x, 16) for x in line.split()[0].split("-"))
        if start <= addr < end:
            break
    else:
        raise AssertionError("address not mapped")
    for line in open("/proc/self/numa_maps"):
        if line.startswith(f"{start:x} "):
            return line.split()[1]
    raise AssertionError("mapping not listed")


@pytest.mark.skipif(host_memory._SYS_MBIND is None, reason="mbind's syscall number is known for x86-64 and arm64")
def test_a_mapping_prefers_the_node_it_is_given_and_keeps_first_touch_otherwise():
    n = 4 * PAGE
    placed, plain = host_memory.map_anonymous(n, None, node=0), host_memory.map_anonymous(n, None)
    try:
        host_memory.populate(placed, n, n, None), host_memory.populate(plain, n, n, None)
        assert _numa_policy(placed) == "prefer:0"
        assert _numa_policy(plain) == "default"
        assert not host_memory.prefer_node(placed, n, 64)  # past the mask: refused, nothing changed
        assert _numa_policy(placed) == "prefer:0"
    finally:
        host_memory.unmap(placed, n), host_memory.unmap(plain, n)


def test_pages_prefer_the_gpus_node_only_when_asked_and_pinned(monkeypatch):
    monkeypatch.setattr(host_memory, "device_numa_node", lambda device: {0: 1}[device])
    assert host_memory.pages_node(0, PinSettings()) == 1
    assert host_memory.pages_node(0, PinSettings(numa=False)) is None
    assert host_memory.pages_node(None, PinSettings()) is None  # pageable (the CPU path): first touch


@pytest.fixture
def fresh_node_lookup():
    """device_numa_node learns a device's node once per process: each test looks it up afresh and leaves no answer."""
    host_memory.device_numa_node.cache_clear()
    yield
    host_memory.device_numa_node.cache_clear()


def test_a_host_of_one_node_asks_the_driver_nothing(monkeypatch, fresh_node_lookup):
    monkeypatch.setattr(host_memory, "numa_nodes", lambda: 1)
    monkeypatch.setattr(host_memory, "_driver", lambda device: pytest.fail("the driver was asked"))
    assert host_memory.device_numa_node(0) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="page-locks through the CUDA driver")
def test_a_pinned_block_prefers_its_gpus_node():
    node = host_memory.device_numa_node(0)
    block = PinnedBlock(4 * PAGE, device=0)
    try:
        assert _numa_policy(block.addr) == ("default" if node is None else f"prefer:{node}")
    finally:
        block.free()


class _FakeDriver:
    """cuda.bindings.driver's few names device_numa_node reads: HOST_NUMA_ID answers ``numa_id`` (an error when
    None), the PCI attributes domain 0, bus 0x19, device 0."""

    class CUresult:
        CUDA_SUCCESS, CUDA_ERROR_INVALID_VALUE = 0, 1

    class CUdevice_attribute:
        CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID, CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID = "numa", "domain"
        CU_DEVICE_ATTRIBUTE_PCI_BUS_ID, CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID = "bus", "device"

    def __init__(self, numa_id):
        self.numa_id = numa_id

    def cuDeviceGetAttribute(self, attr, device):
        if attr == "numa":
            return (1, -1) if self.numa_id is None else (0, self.numa_id)
        return 0, {"domain": 0, "bus": 0x19, "device": 0}[attr]


@pytest.mark.parametrize("numa_id, sysfs, want", [(1, None, 1), (None, "0\n", 0), (None, "-1\n", None),
                                                  (None, OSError, None)])
def test_the_gpus_node_comes_from_the_driver_else_its_pci_function(monkeypatch, fresh_node_lookup, numa_id, sysfs,
                                                                   want):
    import builtins

    real_open, seen = builtins.open, []

    def fake_open(path, *a, **k):
        if str(path).startswith("/sys/bus/pci/devices/"):
            seen.append(path)
            if sysfs is OSError:
                raise OSError("no such file")
            import io
            return io.StringIO(sysfs)
        return real_open(path, *a, **k)

    monkeypatch.setattr(builtins, "open", fake_open)
    monkeypatch.setattr(host_memory, "numa_nodes", lambda: 2)
    monkeypatch.setattr(host_memory, "_driver", lambda device: _FakeDriver(numa_id))
    assert host_memory.device_numa_node(0) == want
    assert seen == ([] if numa_id is not None else ["/sys/bus/pci/devices/0000:19:00.0/numa_node"])


def test_a_driver_that_fails_leaves_placement_to_first_touch_with_a_warning(monkeypatch, fresh_node_lookup):
    def broken(device):
        raise HostMemoryError("no driver")

    monkeypatch.setattr(host_memory, "numa_nodes", lambda: 2)
    monkeypatch.setattr(host_memory, "_driver", broken)
    with pytest.warns(UserWarning, match="first touched"):
        assert host_memory.device_numa_node(0) is None


@pytest.mark.skipif(host_memory._SYS_MBIND is None, reason="mbind's syscall number is known for x86-64 and arm64")
def test_pinned_blocks_and_host_ranges_map_on_their_gpus_node(monkeypatch):
    from flexicache_hf import vmm

    monkeypatch.setattr(host_memory, "device_numa_node", lambda device: 0)  # (a host whose GPU is near node 0)
    for module in (host_memory, vmm):  # page-locking needs CUDA: registered spans stand in
        monkeypatch.setattr(module, "register", lambda addr, n, device, align=1, piece=None: [])
    block = PinnedBlock(4 * PAGE, device=0)
    host = vmm.HostRange(8 * PAGE, device=0, chunk_bytes=PAGE)
    plain = PinnedBlock(4 * PAGE, device=0, settings=PinSettings(numa=False))
    try:
        host.grow_to(PAGE)
        assert _numa_policy(block.addr) == "prefer:0"
        assert _numa_policy(host._live().start) == "prefer:0"
        assert _numa_policy(plain.addr) == "default"
    finally:
        block.free(), plain.free()
