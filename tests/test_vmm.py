"""Ranges that grow in place (flexicache_hf/vmm.py), on the CPU: the rounding arithmetic, argument checks, no VMM
without CUDA, and the pageable HostRange (the same page-major host buffer the CPU path uses) growing at a fixed
address, refusing past its limit before anything changes, and freed by release or with its last view; a
DeviceRange's bookkeeping against a recorded driver (chunks mapped at the committed end, failures undone, out of memory
a torch.OutOfMemoryError, freeing in order).  The CUDA side is tests/gpu/test_vmm_gpu.py."""

import gc
import weakref

import pytest
import torch

from flexicache_hf.host_memory import PAGE, HostMemoryError, PinSettings
from flexicache_hf.vmm import (DeviceMemoryError, DeviceRange, HostRange, VmmError, commit_end, round_up, view_shape,
                               vmm_supported)

MIB = 1 << 20
G = 2 * MIB  # a Hopper granule


def test_round_up():
    assert [round_up(n, G) for n in (0, 1, G - 1, G, G + 1)] == [0, G, G, G, 2 * G]


def test_commit_end_grows_by_whole_chunks_from_the_committed_end():
    assert commit_end(0, 1, G, G, 64 * G) == G
    assert commit_end(G, G, G, G, 64 * G) == G  # already committed: nothing
    assert commit_end(G, G + 1, G, 8 * G, 64 * G) == 9 * G  # at least one chunk
    assert commit_end(G, 20 * G + 5, G, 8 * G, 64 * G) == 25 * G  # whole chunks past the committed end
    assert commit_end(60 * G, 61 * G, G, 8 * G, 64 * G) == 64 * G  # a chunk cut at the cap


def test_commit_end_refuses_past_the_cap():
    with pytest.raises(ValueError, match="passes"):
        commit_end(0, 64 * G + 1, G, G, 64 * G)


def test_view_shape():
    assert view_shape((-1, 4, 8), 2, 1000) == (15, 4, 8)
    assert view_shape((3, -1), 4, 100) == (3, 8)
    assert view_shape((2, 3), 4, 24) == (2, 3)
    for bad in ((-1, -1), (-2, 3)):
        with pytest.raises(ValueError, match="at most one -1"):
            view_shape(bad, 1, 100)
    with pytest.raises(ValueError, match="over the"):
        view_shape((5, 5), 4, 99)
    with pytest.raises(ValueError, match="infer"):
        view_shape((-1, 0), 4, 99)


def test_no_vmm_without_cuda():
    assert vmm_supported("cpu") is False
    assert vmm_supported(torch.device("meta")) is False
    if not torch.cuda.is_available():
        assert vmm_supported(0) is False and vmm_supported("cuda") is False


def test_device_out_of_memory_is_torchs():
    assert issubclass(DeviceMemoryError, torch.OutOfMemoryError) and issubclass(DeviceMemoryError, VmmError)


def test_device_range_arguments():
    for kwargs in (dict(max_bytes=0, device=0), dict(max_bytes=G, device=0, chunk_bytes=-1)):
        with pytest.raises(ValueError, match="at least one byte"):
            DeviceRange(**kwargs)
    with pytest.raises(ValueError, match="CUDA device"):
        DeviceRange(G, "cpu")


def test_host_range_arguments():
    for kwargs in (dict(max_bytes=0), dict(max_bytes=MIB, chunk_bytes=-1), dict(max_bytes=MIB, align=0)):
        with pytest.raises(ValueError, match="at least one byte"):
            HostRange(**kwargs)


def test_host_range_rounds_to_pages_and_rows():
    r = HostRange(10 * MIB + 1, chunk_bytes=1, align=3 * 1024)  # rows of 3 KiB: units of lcm(page, row)
    unit = 3 * PAGE if PAGE == 4096 else r.unit
    assert r.unit == unit and r.reserved_bytes % unit == 0 and r.reserved_bytes >= 10 * MIB + 1
    assert r.chunk_bytes == unit and not r.pinned and r.committed_bytes == 0
    r.grow_to(unit + 1)
    assert r.committed_bytes == 2 * unit
    r.release()


def test_host_range_grows_in_place_keeping_its_contents():
    r = HostRange(256 * MIB, chunk_bytes=4 * MIB, settings=PinSettings(threads=2, chunk_bytes=MIB))
    t = r.tensor((-1, 2, 16), torch.float32)  # page-major: [pages, rows, D]
    assert t.shape == (256 * MIB // 128, 2, 16) and t.data_ptr() == r.address
    r.grow_to(1)
    assert r.committed_bytes == 4 * MIB
    n = r.committed_bytes // 128
    t[:n] = torch.arange(n, dtype=torch.float32)[:, None, None]
    for want in (5 * MIB, 9 * MIB + 3, 100 * MIB):  # several chunks at once: populated on the pool's threads
        r.grow_to(want)
        assert r.committed_bytes == round_up(want, 4 * MIB) and r.address == t.data_ptr()
        assert torch.equal(t[:n, 1, 0], torch.arange(n, dtype=torch.float32))  # older pages untouched
        m = r.committed_bytes // 128
        t[n:m] = -1.0
        assert bool((t[n:m] == -1).all())  # the new memory is writable
    r.grow_to(50 * MIB)  # never shrinks
    assert r.committed_bytes == 100 * MIB
    with pytest.raises(ValueError, match="passes"):
        r.grow_to(r.reserved_bytes + 1)
    r.release()


def test_host_ranges_grow_on_the_process_populating_pool(monkeypatch):
    """Every growth of several tasks populates on one kept pool of the settings' threads (a pool made per growth
    stalled a prefill's launching thread on the H200): two ranges, several growths, one pool and its threads only."""
    import threading

    from flexicache_hf import host_memory, vmm

    seen = []
    populate = vmm.populate

    def spy(addr, nbytes, chunk_bytes, pool):
        seen.append(pool)
        return populate(addr, nbytes, chunk_bytes, pool)

    monkeypatch.setattr(vmm, "populate", spy)
    before = {t.ident for t in threading.enumerate()}
    ranges = [HostRange(64 * MIB, chunk_bytes=4 * MIB, settings=PinSettings(threads=3, chunk_bytes=MIB))
              for _ in range(2)]
    for want in (8 * MIB, 20 * MIB, 40 * MIB):
        for r in ranges:
            r.grow_to(want)
    assert len(seen) == 6 and all(p is host_memory.populate_pool(3) for p in seen)
    new = [t for t in threading.enumerate() if t.ident not in before]
    assert len(new) <= 3 and all(t.name.startswith("flexicache-populate") for t in new)  # the pool's, if new
    assert host_memory.populate_pool(3) is not host_memory.populate_pool(2)
    for r in ranges:
        r.release()


def test_host_range_limit_refuses_before_anything_changes():
    r = HostRange(64 * MIB, chunk_bytes=8 * MIB)
    r.grow_to(MIB, limit=20 * MIB)
    assert r.committed_bytes == 8 * MIB
    with pytest.raises(HostMemoryError, match="over its limit"):
        r.grow_to(20 * MIB + 1, limit=20 * MIB)
    assert r.committed_bytes == 8 * MIB
    with pytest.raises(HostMemoryError):
        r.grow_to(9 * MIB, limit=4 * MIB)  # a limit below what is held refuses any growth
    assert r.committed_bytes == 8 * MIB
    r.grow_to(9 * MIB, limit=12 * MIB + 5)  # the chunk is cut at the limit (in whole pages)
    assert r.committed_bytes == 12 * MIB
    r.grow_to(9 * MIB, limit=0)  # nothing to grow: no refusal
    r.release()


def test_host_range_failed_growth_leaves_it_as_it_was(monkeypatch):
    import flexicache_hf.vmm as vmm

    r = HostRange(64 * MIB, chunk_bytes=8 * MIB)
    r.grow_to(1)
    t = r.tensor((-1,), torch.uint8)
    t[: 8 * MIB] = 7

    def fail(*args):
        raise HostMemoryError("populating failed")

    monkeypatch.setattr(vmm, "populate", fail)
    with pytest.raises(HostMemoryError, match="populating"):
        r.grow_to(9 * MIB)
    assert r.committed_bytes == 8 * MIB and bool((t[: 8 * MIB] == 7).all())
    monkeypatch.undo()
    r.grow_to(9 * MIB)
    assert r.committed_bytes == 16 * MIB
    r.release()


def test_host_range_release_and_collection():
    r = HostRange(16 * MIB)
    r.grow_to(MIB)
    r.release()
    assert r.address == 0 and r.committed_bytes == 0
    r.release()  # twice is nothing
    with pytest.raises(VmmError, match="released"):
        r.grow_to(MIB)
    with pytest.raises(VmmError, match="released"):
        r.tensor((-1,), torch.uint8)

    r = HostRange(16 * MIB)
    r.grow_to(MIB)
    mem, ref = r._mem, weakref.ref(r)
    t = r.tensor((4, 1024), torch.int32)
    t.fill_(3)
    del r
    gc.collect()
    assert ref() is not None and mem.start != 0  # the view keeps its range
    v = t[1:]
    del t
    gc.collect()
    assert mem.start != 0 and int(v.sum()) == 3 * 3 * 1024
    del v
    gc.collect()
    assert ref() is None and mem.start == 0


def test_host_range_without_a_device_has_no_cuda_view():
    r = HostRange(MIB)
    with pytest.raises(ValueError, match="no CUDA view"):
        r.cuda_tensor((-1,), torch.uint8)
    r.release()


class FakeDriver:
    """cuda-python's driver module with its memory calls recorded and answered here (the types and enums are the
    real ones): the DeviceRange's bookkeeping, rollbacks and freeing order, without a GPU."""

    def __init__(self, fail: dict | None = None):
        from cuda.bindings import driver

        self._real, self.log, self.fail, self.handles = driver, [], dict(fail or {}), 0

    def __getattr__(self, name):
        return getattr(self._real, name)

    def _result(self, call, *out):
        err = self.fail.pop(call, self._real.CUresult.CUDA_SUCCESS)
        return (err, *out)

    def cuMemGetAllocationGranularity(self, prop, option):
        assert option == self._real.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
        return self._result("granularity", G)

    def cuMemAddressReserve(self, size, align, addr, flags):
        self.log.append(("reserve", size, align))
        return self._result("reserve", 1 << 40)

    def cuMemCreate(self, size, prop, flags):
        assert prop.type == self._real.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED and prop.location.id == 0
        self.handles += 1
        self.log.append(("create", size, self.handles))
        return self._result("create", self.handles)

    def cuMemMap(self, at, size, offset, handle, flags):
        self.log.append(("map", at - (1 << 40), size, handle))
        return self._result("map")

    def cuMemSetAccess(self, at, size, desc, count):
        assert count == 1 and desc[0].flags == self._real.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self.log.append(("access", at - (1 << 40), size))
        return self._result("access")

    def cuMemUnmap(self, at, size):
        self.log.append(("unmap", at - (1 << 40), size))
        return self._result("unmap")

    def cuMemRelease(self, handle):
        self.log.append(("release", handle))
        return self._result("release")

    def cuMemAddressFree(self, at, size):
        self.log.append(("free", at - (1 << 40), size))
        return self._result("free")

    def cuCtxSynchronize(self):
        self.log.append(("sync",))
        return self._result("sync")


@pytest.fixture
def fake(monkeypatch):
    import flexicache_hf.vmm as vmm

    drv = FakeDriver()
    monkeypatch.setattr(vmm, "_driver", lambda index: drv)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)  # no retry through torch's cache
    return drv


def test_device_range_maps_whole_chunks_at_its_committed_end(fake):
    r = DeviceRange(10 * G + 1, 0, chunk_bytes=G + 1)
    assert (r.granularity, r.chunk_bytes, r.reserved_bytes, r.address) == (G, 2 * G, 11 * G, 1 << 40)
    assert fake.log == [("reserve", 11 * G, G)]
    r.grow_to(1)
    r.grow_to(2 * G)  # committed already
    r.grow_to(5 * G + 1)
    r.grow_to(11 * G)  # the last chunk cut at the reservation
    assert r.committed_bytes == 11 * G
    assert fake.log[1:] == [("create", 2 * G, 1), ("map", 0, 2 * G, 1), ("access", 0, 2 * G),
                            ("create", 4 * G, 2), ("map", 2 * G, 4 * G, 2), ("access", 2 * G, 4 * G),
                            ("create", 5 * G, 3), ("map", 6 * G, 5 * G, 3), ("access", 6 * G, 5 * G)]
    with pytest.raises(ValueError, match="passes"):
        r.grow_to(11 * G + 1)
    del fake.log[:]
    r.release()
    assert fake.log == [("sync",), ("unmap", 6 * G, 5 * G), ("release", 3), ("unmap", 2 * G, 4 * G), ("release", 2),
                        ("unmap", 0, 2 * G), ("release", 1), ("free", 0, 11 * G)]
    r.release()
    assert len(fake.log) == 8 and r.address == 0 and r.committed_bytes == 0
    with pytest.raises(VmmError, match="released"):
        r.grow_to(1)


def test_device_out_of_memory_changes_nothing(fake):
    r = DeviceRange(8 * G, 0)
    r.grow_to(G)
    fake.fail["create"] = fake.CUresult.CUDA_ERROR_OUT_OF_MEMORY
    with pytest.raises(torch.OutOfMemoryError, match="cuMemCreate failed: CUDA_ERROR_OUT_OF_MEMORY") as e:
        r.grow_to(4 * G)
    assert isinstance(e.value, DeviceMemoryError) and r.committed_bytes == G
    r.grow_to(4 * G)
    assert r.committed_bytes == 4 * G and fake.log[-3:] == [("create", 3 * G, 3), ("map", G, 3 * G, 3),
                                                            ("access", G, 3 * G)]


def test_a_failed_mapping_is_undone(fake):
    r = DeviceRange(8 * G, 0)
    fake.fail["access"] = fake.CUresult.CUDA_ERROR_INVALID_VALUE
    with pytest.raises(VmmError, match="cuMemSetAccess failed: CUDA_ERROR_INVALID_VALUE"):
        r.grow_to(G)
    assert r.committed_bytes == 0 and fake.log[-2:] == [("unmap", 0, G), ("release", 1)]
    fake.fail["map"] = fake.CUresult.CUDA_ERROR_OUT_OF_MEMORY
    with pytest.raises(DeviceMemoryError, match="cuMemMap"):
        r.grow_to(G)
    assert r.committed_bytes == 0 and fake.log[-2:] == [("map", 0, G, 2), ("release", 2)]


def test_a_device_range_is_freed_when_collected(fake):
    gc.collect()  # earlier tests' ranges
    r = DeviceRange(4 * G, 0)
    r.grow_to(G)
    del fake.log[:]
    del r  # no cycle: freed at once
    assert fake.log == [("sync",), ("unmap", 0, G), ("release", 1), ("free", 0, 4 * G)]


def test_freeing_failures_only_warn(fake):
    r = DeviceRange(4 * G, 0)
    r.grow_to(G)
    fake.fail["unmap"] = fake.CUresult.CUDA_ERROR_INVALID_VALUE
    with pytest.warns(UserWarning, match="cuMemUnmap failed"):
        r.release()
    assert fake.log[-1] == ("free", 0, 4 * G) and r.address == 0


def test_out_of_memory_retries_once_after_torchs_cache_is_emptied(fake, monkeypatch):
    emptied = []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(1))
    r = DeviceRange(8 * G, 0)
    fake.fail["create"] = fake.CUresult.CUDA_ERROR_OUT_OF_MEMORY
    r.grow_to(G)  # the second try maps
    assert emptied == [1] and r.committed_bytes == G
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    fake.fail["create"] = fake.CUresult.CUDA_ERROR_OUT_OF_MEMORY
    with pytest.raises(DeviceMemoryError):
        r.grow_to(2 * G)  # never while a stream captures
    assert emptied == [1] and r.committed_bytes == G


def test_ranges_are_not_copied(fake):
    import copy
    import pickle

    for r in (HostRange(MIB), DeviceRange(G, 0)):
        for how in (copy.copy, copy.deepcopy, pickle.dumps):
            with pytest.raises(TypeError, match="not copied"):
                how(r)
        r.release()
