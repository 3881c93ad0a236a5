"""Buffers whose addresses never move while their memory grows, for an unsized cache's CUDA graphs.

An unsized cache grows with its context; a CUDA graph captured on its buffers replays only while they stay where they
are.  Both ranges here reserve addresses for the most the cache may hold (the model's context) once and commit memory
behind them as the cache grows, never moving and never shrinking (``release`` gives everything back).  Buffers laid
out page-major (outermost dimension: pages) grow at their end, so the committed prefix is exactly the pages in use.

* :class:`DeviceRange`: ``cuMemAddressReserve`` for the whole range; ``grow_to`` maps physical memory in chunks of
  whole allocation granules (``cuMemCreate`` + ``cuMemMap`` + ``cuMemSetAccess``, read-write for the device).
* :class:`HostRange`: an ``mmap`` of the whole range (``MAP_NORESERVE``: address space only); ``grow_to`` populates
  the new chunk with :mod:`~flexicache_hf.host_memory`'s threads and page-locks it (``cuMemHostRegister``, portable
  and mapped; its device address checked equal to its host address), chunk by chunk.  Without a device it is plain
  pageable memory (the CPU path), grown the same way.

Both are viewed as torch tensors of the reserved size (``tensor``): a captured step sees one shape and one address for
the cache's whole life.  Only the committed prefix may be touched: on the device anything past it is an illegal
address; on the host it is pageable memory nobody counted.  The cache maps one ``chunk_bytes`` ahead of what the next
steps can write, from a host-side hook before each decode step, so a replayed graph never reaches unmapped memory.

Where :func:`vmm_supported` is false (no driver, a CPU device, a GPU without virtual memory management) callers keep
today's eager path, with one warning suggesting ``max_cache_len`` (a sized cache captures its graphs as before).

Memory mapped here is the driver's, not torch's: ``torch.cuda.mem_get_info`` sees it, ``torch.cuda.memory_allocated``
does not.  Driver failures raise :class:`VmmError` naming the call and its ``CUresult``; running out of device memory
raises :class:`DeviceMemoryError`, a ``torch.OutOfMemoryError``, and leaves the range as it was.
"""

from __future__ import annotations

import ctypes
import math
import threading
import time
import warnings
import weakref
from concurrent.futures import ThreadPoolExecutor

import torch

from .host_memory import (PAGE, HostMemoryError, PinSettings, _driver, discard, format_bytes, map_anonymous, pages_node,
                          populate, populate_pool, register, unmap, unregister)

_BYTES = {1: "|u1", 2: "<i2", 4: "<i4", 8: "<i8"}  # __cuda_array_interface__ type codes by width (no bfloat16 code)


class VmmError(RuntimeError):
    """A CUDA driver call of a range failed (the message names the call and its ``CUresult``), or the range was
    used after ``release``."""


class DeviceMemoryError(VmmError, torch.OutOfMemoryError):
    """The device has no memory for a :class:`DeviceRange` to grow by; the range is as it was."""


# ---- integer arithmetic (no CUDA) --------------------------------------------------------------------------------
def round_up(n: int, unit: int) -> int:
    """``n`` rounded up to a multiple of ``unit`` (> 0)."""
    return -(-n // unit) * unit


def commit_end(committed: int, want: int, unit: int, chunk: int, cap: int) -> int:
    """Where the committed prefix ends after growing to hold ``want`` bytes.

    Unchanged when ``want <= committed``; else ``committed`` plus whole ``chunk`` bytes (a multiple of ``unit``, the
    granule) up to at least ``want``, cut at ``cap`` (a multiple of ``unit``: the reservation, or a limit).  ValueError
    when ``want`` is past ``cap``.
    """
    if want <= committed:
        return committed
    if round_up(want, unit) > cap:
        raise ValueError(f"growing to {want:,} bytes passes the {cap:,} bytes this range may hold")
    return min(cap, committed + round_up(want - committed, chunk))


def view_shape(shape: tuple[int, ...], itemsize: int, nbytes: int) -> tuple[int, ...]:
    """``shape`` with its one ``-1`` (if any) made as large as ``nbytes`` allow; ValueError when it does not fit."""
    shape = tuple(int(s) for s in shape)
    free = [i for i, s in enumerate(shape) if s == -1]
    if len(free) > 1 or any(s < 0 and s != -1 for s in shape):
        raise ValueError(f"a view's shape has non-negative sizes and at most one -1, got {shape}")
    rest = math.prod(s for s in shape if s != -1) * itemsize
    if free:
        if rest == 0:
            raise ValueError(f"cannot infer the -1 of {shape}: the other sizes hold nothing")
        shape = shape[: free[0]] + (nbytes // rest,) + shape[free[0] + 1:]
    elif rest > nbytes:
        raise ValueError(f"a view of {shape} needs {rest:,} bytes, over the {nbytes:,} reserved")
    return shape


class _Interface:
    """What ``torch.as_tensor`` reads a CUDA view from; torch keeps it with the view's storage, and it keeps
    ``owner`` (a module-level class: a class made per call would sit in a reference cycle, freed only by the GC)."""

    def __init__(self, ptr: int, numel: int, typestr: str, owner: object):
        self.owner = owner
        self.__cuda_array_interface__ = {"shape": (numel,), "typestr": typestr, "data": (ptr, False), "version": 3,
                                         "strides": None}


def _cuda_view(ptr: int, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, owner: object
               ) -> torch.Tensor:
    """A CUDA tensor over ``[ptr, ...)`` (as ``tiers.cuda_alias``: ``__cuda_array_interface__``, as a same-width
    integer type, re-typed after); its storage holds ``owner`` until the last view dies."""
    with torch.cuda.device(device):
        flat = torch.as_tensor(_Interface(ptr, math.prod(shape), _BYTES[dtype.itemsize], owner), device=device)
    return flat.view(dtype).view(shape)


def _name(err) -> str:
    return getattr(err, "name", str(err))


def _call(driver, call: str, *args):
    """``driver.<call>(*args)``'s result after its ``CUresult`` (one value, several, or ``None``); a failure raises
    VmmError, DeviceMemoryError when it is ``CUDA_ERROR_OUT_OF_MEMORY``."""
    err, *out = getattr(driver, call)(*args)
    if err != driver.CUresult.CUDA_SUCCESS:
        oom = err == driver.CUresult.CUDA_ERROR_OUT_OF_MEMORY
        raise (DeviceMemoryError if oom else VmmError)(f"{call} failed: {_name(err)}")
    return out[0] if len(out) == 1 else (tuple(out) or None)


def _warn_call(driver, call: str, *args) -> None:
    """``driver.<call>(*args)`` while freeing: a failure only warns (the rest is freed either way)."""
    (err,) = getattr(driver, call)(*args)
    if err != driver.CUresult.CUDA_SUCCESS:
        warnings.warn(f"FlexiCache: {call} failed while freeing a range: {_name(err)}")


def _device_index(device: int | str | torch.device) -> int:
    if isinstance(device, int):
        return device
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"a device range lives on a CUDA device, got {device}")
    return torch.cuda.current_device() if device.index is None else device.index


def vmm_supported(device: int | str | torch.device) -> bool:
    """Whether ``device`` is a CUDA device whose driver supports virtual memory management (reserve, then map).

    Never raises: ``False`` on a CPU device, without a driver or cuda-python, or when a driver call fails.  Creates
    no context (``cuInit`` and attribute queries only)."""
    try:
        index = _device_index(device)
        from cuda.bindings import driver
        _call(driver, "cuInit", 0)
        dev = _call(driver, "cuDeviceGet", index)
        attr = driver.CUdevice_attribute
        return all(_call(driver, "cuDeviceGetAttribute", a, dev) == 1 for a in (
            attr.CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, attr.CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING))
    except Exception:  # noqa: BLE001  (no driver library, no device, no cuda-python: all mean "not here")
        return False


# ---- what both kinds of range share -----------------------------------------------------------------------------
class _Range:
    """A reserved range's addresses, sizes and end (``_mem``: what its finalizer frees; ``start`` 0 once freed)."""

    _mem: "_DeviceMemory | _HostMemory"

    @property
    def address(self) -> int:
        """The range's first address (on the host and, pinned, on the devices), fixed until ``release``; 0 after."""
        return self._mem.start

    @property
    def reserved_bytes(self) -> int:
        return self._mem.reserved

    @property
    def committed_bytes(self) -> int:
        """Bytes committed from the start (mapped; on the host populated and, pinned, page-locked): what counts
        and what may be touched."""
        return self._mem.committed

    def release(self) -> None:
        """Free everything now (also done when the range and its views are collected).  Views made by ``tensor``
        must no longer be used."""
        with self._lock:
            self._finalizer()

    def _live(self):
        if not self._mem.start:
            raise VmmError(f"this {type(self).__name__} was released")
        return self._mem

    def __reduce_ex__(self, protocol):
        raise TypeError(f"a {type(self).__name__} is not copied or pickled (a copy would free its memory twice): make "
                        "a new one and copy the committed prefix")

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({self._describe()}, committed {format_bytes(self.committed_bytes)} of "
                f"{format_bytes(self.reserved_bytes)}, chunks of {format_bytes(self.chunk_bytes)})")


# ---- device memory -----------------------------------------------------------------------------------------------
class _DeviceMemory:
    """What a DeviceRange frees (held by its finalizer, so it must not refer to the range)."""

    def __init__(self, index: int, base: int, reserved: int):
        self.index, self.start, self.reserved = index, base, reserved
        self.chunks: list[tuple[int, int, object]] = []  # (address, bytes, allocation handle), in mapping order
        self.committed = 0

    def free(self) -> None:
        """Wait for the device (unmapping does not), then unmap and release every chunk, then free the addresses."""
        if not self.start:
            return
        driver = _driver(self.index)
        _warn_call(driver, "cuCtxSynchronize")
        for at, size, handle in reversed(self.chunks):
            _warn_call(driver, "cuMemUnmap", at, size)
            _warn_call(driver, "cuMemRelease", handle)
        _warn_call(driver, "cuMemAddressFree", self.start, self.reserved)
        self.start, self.chunks, self.committed = 0, [], 0


class DeviceRange(_Range):
    """Device addresses for ``max_bytes`` reserved at once, memory mapped behind them as :meth:`grow_to` asks.

    Args:
        max_bytes: the most the range will hold (rounded up to the granule): the buffer at the model's context.
        device: the CUDA device (index, ``"cuda:1"``, ``torch.device``).
        chunk_bytes: the least one growth maps, rounded up to whole granules (0: one granule, the
            ``CU_MEM_ALLOC_GRANULARITY_RECOMMENDED`` of the device, 2 MiB on Hopper).  Every growth is one allocation.
    """

    def __init__(self, max_bytes: int, device: int | str | torch.device, chunk_bytes: int = 0):
        if max_bytes <= 0 or chunk_bytes < 0:
            raise ValueError(f"a device range holds at least one byte and grows by chunk_bytes >= 0, got max_bytes="
                             f"{max_bytes}, chunk_bytes={chunk_bytes}")
        index = _device_index(device)
        driver = _driver(index)
        self.device = torch.device("cuda", index)
        self._prop = driver.CUmemAllocationProp()
        self._prop.type = driver.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        self._prop.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        self._prop.location.id = index
        self._access = driver.CUmemAccessDesc()
        self._access.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        self._access.location.id = index
        self._access.flags = driver.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self.granularity = int(_call(driver, "cuMemGetAllocationGranularity", self._prop,
                                     driver.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED))
        self.chunk_bytes = round_up(max(chunk_bytes, 1), self.granularity)
        reserved = round_up(max_bytes, self.granularity)
        base = int(_call(driver, "cuMemAddressReserve", reserved, self.granularity, 0, 0))
        self._mem = _DeviceMemory(index, base, reserved)
        self._lock = threading.Lock()
        self._finalizer = weakref.finalize(self, self._mem.free)
        self._finalizer.atexit = False  # at exit the process's memory goes back anyway (the driver may be gone first)

    def grow_to(self, nbytes: int) -> None:
        """Map memory until the first ``nbytes`` are committed (nothing when they are; at least ``chunk_bytes``
        more otherwise, never past the reservation: ValueError).  Out of device memory, torch's cached free blocks
        are given back to the driver and the mapping tried once more (not while a stream captures); then
        DeviceMemoryError, the range unchanged."""
        with self._lock:
            mem = self._live()
            end = commit_end(mem.committed, nbytes, self.granularity, self.chunk_bytes, mem.reserved)
            if end == mem.committed:
                return
            try:
                self._map(end - mem.committed)
            except DeviceMemoryError:
                if not torch.cuda.is_initialized() or torch.cuda.is_current_stream_capturing():
                    raise
                torch.cuda.empty_cache()
                self._map(end - mem.committed)

    def _map(self, size: int) -> None:
        """One allocation of ``size`` bytes mapped at the committed end, read-write for the device; undone on
        failure."""
        mem, driver = self._mem, _driver(self._mem.index)
        at = mem.start + mem.committed
        handle = _call(driver, "cuMemCreate", size, self._prop, 0)
        try:
            _call(driver, "cuMemMap", at, size, 0, handle, 0)
            try:
                _call(driver, "cuMemSetAccess", at, size, [self._access], 1)
            except BaseException:
                driver.cuMemUnmap(at, size)
                raise
        except BaseException:
            driver.cuMemRelease(handle)
            raise
        mem.chunks.append((at, size, handle))
        mem.committed += size

    def tensor(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A CUDA tensor of ``shape`` (one ``-1``: as many as the reservation holds) over the range's start, at the
        same address for the range's life; it keeps the range alive.  Only its committed prefix may be touched.
        Maps the first chunk if nothing is mapped yet (torch looks the address up to place the tensor)."""
        shape = view_shape(shape, dtype.itemsize, self.reserved_bytes)
        if not self.committed_bytes:
            self.grow_to(1)
        return _cuda_view(self._live().start, shape, dtype, self.device, self)

    def _describe(self) -> str:
        return str(self.device)


# ---- host memory -------------------------------------------------------------------------------------------------
class _HostMemory:
    """What a HostRange frees (held by its finalizer, so it must not refer to the range)."""

    def __init__(self, addr: int, reserved: int, device: int | None):
        self.start, self.reserved, self.device = addr, reserved, device
        self.spans: list[tuple[int, int]] = []  # registrations, in order
        self.committed = 0

    def free(self) -> None:
        """Unregister every chunk, then unmap the whole range."""
        if self.start:
            unregister(self.spans, self.device)
            unmap(self.start, self.reserved)
            self.start, self.spans, self.committed = 0, [], 0


class HostRange(_Range):
    """Host addresses for ``max_bytes`` mapped at once (``MAP_NORESERVE``), populated and page-locked chunk by chunk.

    Args:
        max_bytes: the most the range will hold (rounded up to whole pages and ``align``).
        device: the CUDA device whose driver page-locks it (portable: every context sees it pinned; mapped: addressed
            on the devices at its host address), or ``None``: pageable, no CUDA needed (the CPU path).
        chunk_bytes: the least one growth commits (rounded up to whole pages and ``align``).
        align: a copy's row in bytes: a chunk boundary never splits one (rows laid out from the start).
        settings: populating threads and registration pieces (:class:`~flexicache_hf.host_memory.PinSettings`).
        pool: populating threads to use (``None``: the process's pool of ``settings.threads``,
            :func:`~flexicache_hf.host_memory.populate_pool`, for a growth of several tasks).
    """

    def __init__(self, max_bytes: int, device: int | str | torch.device | None = None, chunk_bytes: int = 64 << 20,
                 align: int = 1, settings: PinSettings | None = None, pool: ThreadPoolExecutor | None = None):
        if max_bytes <= 0 or chunk_bytes < 0 or align < 1:
            raise ValueError(f"a host range holds at least one byte, grows by chunk_bytes >= 0, rows of align >= 1, "
                             f"got max_bytes={max_bytes}, chunk_bytes={chunk_bytes}, align={align}")
        self.device = None if device is None else _device_index(device)
        self.settings, self.pool, self.align = settings or PinSettings(), pool, align
        self.unit = math.lcm(PAGE, align)
        self.chunk_bytes = round_up(max(chunk_bytes, 1), self.unit)
        reserved = round_up(max_bytes, self.unit)
        addr = map_anonymous(reserved, self.settings.hugepages, reserve=False,
                             node=pages_node(self.device, self.settings))
        self._mem = _HostMemory(addr, reserved, self.device)
        self._lock = threading.Lock()
        self._finalizer = weakref.finalize(self, self._mem.free)
        self._finalizer.atexit = False
        self.commit_s = 0.0  # seconds spent populating and page-locking so far, on whichever thread grew it

    @property
    def pinned(self) -> bool:
        return self.device is not None

    def grow_to(self, nbytes: int, limit: int | None = None) -> None:
        """Commit until the first ``nbytes`` are (nothing when they are; at least ``chunk_bytes`` more otherwise).

        ``limit``: the most this range may commit (the cache's ``host_memory_limit`` less what the others hold):
        HostMemoryError, before anything changes, when ``nbytes`` (in whole pages) would pass it; a chunk is cut at
        it.  Past the reservation: ValueError.  A failure to populate or page-lock raises HostMemoryError and gives
        the new pages back: the range is as it was."""
        with self._lock:
            mem = self._live()
            if nbytes <= mem.committed:
                return
            cap = mem.reserved
            if limit is not None:
                if round_up(nbytes, self.unit) > limit:
                    raise HostMemoryError(
                        f"a host range would hold {format_bytes(round_up(nbytes, self.unit))}, over its limit of "
                        f"{format_bytes(limit)} (host_memory_limit less what the other buffers hold)")
                cap = min(cap, limit // self.unit * self.unit)
            end = commit_end(mem.committed, nbytes, self.unit, self.chunk_bytes, cap)
            at, size = mem.start + mem.committed, end - mem.committed
            t0 = time.perf_counter()
            try:
                self._commit(at, size)
            except BaseException:
                discard(at, size)
                raise
            finally:
                self.commit_s += time.perf_counter() - t0
            mem.committed = end

    def _commit(self, at: int, size: int) -> None:
        """Populate ``[at, at + size)`` on several threads, then page-lock it (when pinned)."""
        s = self.settings
        if s.threads:
            pool = self.pool
            if pool is None and s.threads > 1 and size > s.chunk_bytes:
                pool = populate_pool(s.threads)
            populate(at, size, s.chunk_bytes, pool)
        if self.device is not None:
            self._mem.spans += register(at, size, self.device, self.align, s.piece_bytes)

    def tensor(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A CPU tensor of ``shape`` (one ``-1``: as many as the reservation holds) over the range's start, at the
        same address for the range's life; it keeps the range alive.  Pinned only in its committed prefix (a copy
        reaching past it is pageable); past that prefix nothing may be touched (pages faulted there are counted by
        nobody)."""
        shape = view_shape(shape, dtype.itemsize, self.reserved_bytes)
        nbytes = math.prod(shape) * dtype.itemsize
        buffer = (ctypes.c_ubyte * self.reserved_bytes).from_address(self._live().start)
        buffer.owner = self  # the storage holds the buffer, the buffer the range
        return torch.frombuffer(buffer, dtype=torch.uint8, count=nbytes).view(dtype).view(shape) if nbytes else \
            torch.empty(shape, dtype=dtype)

    def cuda_tensor(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """:meth:`tensor` as a CUDA tensor on the pinning device, at the same address (unified addressing): what a
        captured graph or a UVA copy kernel takes as a fixed device buffer.  Commits the first chunk if nothing is
        committed yet (torch looks the address up to place the tensor)."""
        if self.device is None:
            raise ValueError("a host range made without a device is not page-locked: it has no CUDA view")
        shape = view_shape(shape, dtype.itemsize, self.reserved_bytes)
        if not self.committed_bytes:
            self.grow_to(1)
        return _cuda_view(self._live().start, shape, dtype, torch.device("cuda", self.device), self)

    def _describe(self) -> str:
        return f"pinned for cuda:{self.device}" if self.pinned else "pageable"
