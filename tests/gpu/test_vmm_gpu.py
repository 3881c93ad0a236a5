"""On CUDA: ranges that grow in place (flexicache_hf/vmm.py).  A DeviceRange grown across many granules keeps its
address and its contents; a CUDA graph captured on its view (including memory mapped only after the capture)
replays correctly after growth; the device's free memory follows grow_to within one granule and comes back on
release or when the last view dies; out of memory is a torch.OutOfMemoryError that leaves the range as it was.  A
pinned HostRange is registered at its host address (UVA), read and written by GPU kernels through its CUDA view and
copied asynchronously from its CPU view, across growth; its limit refuses before anything is registered; release
unregisters it.  The benchmark runs and its device rows account for what they map.

Run on the lent H200 (never in CI): ``PYTHONPATH=$PWD python -m pytest -q -m gpu tests/gpu/test_vmm_gpu.py``.
"""

import gc

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from cuda.bindings import driver  # noqa: E402

from flexicache_hf.host_memory import HostMemoryError  # noqa: E402
from flexicache_hf.tiers import cuda_alias  # noqa: E402
from flexicache_hf.vmm import (DeviceMemoryError, DeviceRange, HostRange, VmmError, round_up,  # noqa: E402
                               vmm_supported)

DEV = torch.device("cuda", torch.cuda.current_device())
MIB = 1 << 20


@pytest.fixture(autouse=True)
def settled():
    """Each test starts with the device idle and torch's cached blocks given back (free memory is measured)."""
    if not vmm_supported(DEV):
        pytest.skip("this device has no virtual memory management")
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    yield
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def free_bytes() -> int:
    """The device's free bytes, torch's cached blocks given back first."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info(DEV)[0]


def test_vmm_supported_here_and_not_on_the_cpu():
    assert vmm_supported(DEV) and vmm_supported(DEV.index) and vmm_supported("cuda")
    assert not vmm_supported("cpu")


def test_device_range_grows_in_place_keeping_its_contents():
    r = DeviceRange(64 * 2 * MIB, DEV)
    g = r.granularity
    assert g >= 64 * 1024 and g & (g - 1) == 0 and r.chunk_bytes == g and r.reserved_bytes == round_up(128 * MIB, g)
    t = r.tensor((-1,), torch.int32)  # maps the first granule: torch looks the address up
    assert t.device == DEV and t.data_ptr() == r.address and t.numel() == r.reserved_bytes // 4
    assert r.committed_bytes == g
    done = g // 4
    t[:done] = torch.arange(done, device=DEV, dtype=torch.int32)
    for want in (g + 1, 5 * g, 8 * g + 1, 40 * g, r.reserved_bytes):
        r.grow_to(want)
        assert r.committed_bytes == round_up(want, g) and r.address == t.data_ptr()
        end = r.committed_bytes // 4
        t[done:end] = torch.arange(done, end, device=DEV, dtype=torch.int32)  # the new memory is writable
        assert torch.equal(t[:end], torch.arange(end, device=DEV, dtype=torch.int32))  # and the old kept
        done = end
    with pytest.raises(ValueError, match="passes"):
        r.grow_to(r.reserved_bytes + 1)
    typed = r.tensor((-1, 4, 64), torch.bfloat16)  # another view, another dtype, the same address
    assert typed.data_ptr() == r.address and typed.shape[0] == r.reserved_bytes // 512
    r.release()


def test_a_graph_captured_on_a_view_replays_after_growth():
    r = DeviceRange(16 * 2 * MIB, DEV)
    g = r.granularity
    t = r.tensor((-1,), torch.float32)
    n = g // 4  # elements in one granule
    r.grow_to(g)
    t[:n].zero_()
    out = torch.zeros(2, device=DEV)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up on committed memory: the kernels are loaded before the capture
        t[:n].add_(0)
        t[:n].fill_(0)
        out[0] = t[:n].sum()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        t[:n].add_(1)  # the first N elements: committed at the capture
        t[n:3 * n].fill_(2)  # two granules mapped only after the capture
        out[0] = t[:3 * n].sum()
    assert r.committed_bytes == g  # capturing ran nothing
    r.grow_to(3 * g)
    graph.replay()
    torch.cuda.synchronize()
    assert bool((t[:n] == 1).all()) and bool((t[n:3 * n] == 2).all()) and out[0].item() == 5 * n
    r.grow_to(12 * g)  # grow again: the graph's addresses still hold
    assert t.data_ptr() == r.address
    graph.replay()
    torch.cuda.synchronize()
    assert bool((t[:n] == 2).all()) and out[0].item() == 6 * n
    del graph
    r.release()


def test_free_memory_follows_grow_to_and_release():
    free0 = free_bytes()
    r = DeviceRange(16 << 30, DEV, chunk_bytes=64 * MIB)
    g = r.granularity
    assert r.chunk_bytes == round_up(64 * MIB, g)
    assert abs(free0 - free_bytes()) <= g, "reserving addresses maps no memory"
    for want, expect in ((1, r.chunk_bytes), (100 * MIB, 128 * MIB), ((1 << 30) + 1, (1 << 30) + 64 * MIB),
                         (3 << 30, 3 << 30), (1 << 30, 3 << 30)):
        r.grow_to(want)
        assert r.committed_bytes == round_up(expect, g)
        used = free0 - free_bytes()
        assert abs(used - r.committed_bytes) <= g, (want, used, r.committed_bytes)
    r.release()
    assert abs(free0 - free_bytes()) <= g
    assert r.address == 0 and r.committed_bytes == 0
    with pytest.raises(VmmError, match="released"):
        r.grow_to(1)


def test_a_view_keeps_its_range_and_the_last_view_frees_it():
    free0 = free_bytes()
    r = DeviceRange(1 << 30, DEV, chunk_bytes=256 * MIB)
    t = r.tensor((-1,), torch.uint8)
    mem = r._mem
    assert r.committed_bytes == 256 * MIB
    del r
    gc.collect()
    assert mem.start != 0
    t[: 256 * MIB].fill_(1)
    assert int(t[: 256 * MIB : 4096].sum()) == 256 * MIB // 4096
    del t
    gc.collect()
    assert mem.start == 0
    assert abs(free0 - free_bytes()) <= 2 * MIB


def test_out_of_memory_is_torchs_and_changes_nothing():
    total = torch.cuda.mem_get_info(DEV)[1]
    r = DeviceRange(2 * total, DEV)  # addresses for twice the device
    g = r.granularity
    t = r.tensor((-1,), torch.int32)
    t[: g // 4].fill_(5)
    with pytest.raises(torch.OutOfMemoryError) as e:
        r.grow_to(g + free_bytes() + 64 * MIB)  # more than is free, less than the device has
    assert isinstance(e.value, DeviceMemoryError) and "CUDA_ERROR_OUT_OF_MEMORY" in str(e.value)
    assert "cuMemCreate" in str(e.value)
    assert r.committed_bytes == g and t.data_ptr() == r.address and bool((t[: g // 4] == 5).all())
    r.grow_to(2 * g)  # still grows
    t[g // 4: g // 2].fill_(6)
    assert int(t[: g // 2].sum()) == (5 + 6) * (g // 4)
    r.release()


def device_pointer(addr: int) -> int | None:
    """The device address of registered host memory at ``addr`` (None when it is not registered)."""
    err, ptr = driver.cuMemHostGetDevicePointer(addr, 0)
    return int(ptr) if err == driver.CUresult.CUDA_SUCCESS else None


def test_pinned_host_range_is_read_and_written_by_the_gpu_across_growth():
    r = HostRange(256 * MIB, DEV, chunk_bytes=16 * MIB, align=4096)
    cpu = r.tensor((-1, 1024), torch.float32)  # page-major rows of 4 KiB
    r.grow_to(1)
    assert r.committed_bytes == 16 * MIB and r.pinned
    assert device_pointer(r.address) == r.address, "unified addressing: the device sees it at its host address"
    rows = r.committed_bytes // 4096
    cpu[:rows] = torch.arange(rows, dtype=torch.float32)[:, None]
    assert cpu[:rows].is_pinned()
    dev = r.cuda_tensor((-1, 1024), torch.float32)
    assert dev.device == DEV and dev.data_ptr() == cpu.data_ptr() == r.address
    want = torch.arange(rows, dtype=torch.float32, device=DEV)
    assert torch.equal(dev[:rows, 7].clone(), want)  # a GPU kernel reads host memory (UVA)
    assert torch.equal(cuda_alias(cpu[:rows], DEV)[:, 3], want)  # the host tier's alias of it too
    copied = torch.empty(rows, 1024, device=DEV)
    copied.copy_(cpu[:rows], non_blocking=True)  # a DMA copy from the pinned view
    torch.cuda.synchronize()
    assert torch.equal(copied[:, 0], want)

    r.grow_to(100 * MIB)  # several chunks at once
    assert r.committed_bytes == 112 * MIB and r.address == cpu.data_ptr() == dev.data_ptr()
    assert device_pointer(r.address + 16 * MIB) == r.address + 16 * MIB
    more = r.committed_bytes // 4096
    assert cpu[rows:more].is_pinned()
    cpu[rows:more] = 3.0
    assert dev[rows:more].sum().item() == 3.0 * (more - rows) * 1024
    dev[:rows].mul_(2)  # a GPU kernel writes host memory
    torch.cuda.synchronize()
    assert torch.equal(cpu[:rows, 1], 2 * torch.arange(rows, dtype=torch.float32))

    with pytest.raises(HostMemoryError, match="over its limit"):
        r.grow_to(r.committed_bytes + 1, limit=r.committed_bytes)
    assert r.committed_bytes == 112 * MIB and device_pointer(r.address + 112 * MIB) is None
    addr = r.address
    del cpu, dev, copied
    r.release()
    assert device_pointer(addr) is None and r.address == 0


def test_a_graph_on_a_pinned_host_view_replays_after_growth():
    r = HostRange(64 * MIB, DEV, chunk_bytes=4 * MIB)
    dev = r.cuda_tensor((-1,), torch.float32)
    cpu = r.tensor((-1,), torch.float32)
    n = 4 * MIB // 4
    cpu[:n] = 0
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        dev[:n].add_(0)
        dev[:n].fill_(0)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        dev[:n].add_(1)
        dev[n:2 * n].fill_(4)  # committed only after the capture
    r.grow_to(8 * MIB)
    graph.replay()
    torch.cuda.synchronize()
    assert bool((cpu[:n] == 1).all()) and bool((cpu[n:2 * n] == 4).all())
    del graph, dev, cpu
    r.release()


def test_bench_runs_and_accounts_for_what_it_maps():
    from flexicache_hf.bench.vmm import main

    out = main(["--gb", "0.25", "--chunk-mib", "2", "--threads", "4"])
    kinds = {row["kind"] for row in out["rows"]}
    assert kinds == {"device", "host", "host-pageable"} and out["vmm"]
    for row in out["rows"]:
        assert row["committed_gb"] >= 0.25 and row["s_per_gb"] > 0
        if row["kind"] == "device":
            assert abs(row["mem_delta_gb"] - row["committed_gb"]) <= 0.01


def test_a_block_read_across_a_host_ranges_registrations_is_exact_in_few_copies(monkeypatch):
    """``copy_block`` (how a follow-up prompt chunk reads its offloaded prefix back) from a pinned host range committed
    in three growths (three registrations), into the device and back: every byte, a few ``cuMemcpyAsync`` calls
    (cut only where one crosses a registration), the driver path never turned off."""
    from flexicache_hf.kernels import TRITON_OPS
    from flexicache_hf.kernels.row_copy import RowCopier

    r = HostRange(64 * MIB, DEV, chunk_bytes=4 * MIB, align=4096)
    cpu = r.tensor((-1, 1024), torch.float32)
    for nbytes in (5 * MIB, 13 * MIB, 30 * MIB):
        r.grow_to(nbytes)
    rows = r.committed_bytes // 4096
    cpu[:rows] = torch.randn(rows, 1024)
    calls = []
    flat = RowCopier._copy_flat
    monkeypatch.setattr(RowCopier, "_copy_flat", lambda *a: calls.append(a[-1]) or flat(*a))
    first = 7  # (a block that starts inside the first registration, ends inside the last)
    dev = torch.empty(rows - first - 3, 1024, device=DEV)
    TRITON_OPS.copy_block(dev, cpu[first:rows - 3])
    back = torch.empty(rows - first - 3, 1024, device=DEV)
    back.copy_(dev)
    TRITON_OPS.copy_block(cpu[first:rows - 3], back.mul_(2))
    torch.cuda.synchronize()
    assert TRITON_OPS.copy_block.__self__.unavailable is None
    assert torch.equal(dev.cpu() * 2, cpu[first:rows - 3])
    assert 2 <= len(calls) <= 2 * 2 * 2 * 14, calls  # two copies, at most ~2 log2(pages) calls per crossing
    del cpu
    r.release()
