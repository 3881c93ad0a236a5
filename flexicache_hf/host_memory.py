"""Page-locked host memory for the host tier: blocks of exactly the size asked for, pinned fast.

torch's ``pin_memory=True`` page-locks inside ``cudaHostAlloc``, single-threaded (a first 16 x 16k prefill on the
Llama-3.1-8B shape, ~30 GB of host tier, took 56 s to its first token against 9.2 s for a later cache, which reused
torch's cached blocks), and rounds every block up to a power of two (host memory, not need, bounded the batch: 19
rows at 30k where exact sizes fit ~29).  A :class:`PinnedBlock` is instead

1. an anonymous private mapping of exactly the bytes asked for (the OS rounds it up to whole 4 KiB pages);
2. placed on the NUMA node nearest the GPU where the host has several (``mbind``, ``MPOL_PREFERRED``: the GPU's
   UVA reads of a promoted page then stay off the link between sockets; a full node spills to another), and
   populated by several threads at once, each faulting a disjoint chunk in (``madvise(MADV_POPULATE_WRITE)``,
   Linux 5.14+; a write to every byte on older kernels): faulting pages in is the part that parallelises;
3. registered with CUDA once (``cuMemHostRegister``, portable and mapped): page-locked for every context, and, with
   unified addressing, addressed on the device at its host address (checked: the copy kernels and the tier's CUDA
   alias rely on it).  A block over 2 GiB that one call refuses (Linux 6.11-6.13 pin at most 2 GiB at once) is
   registered in pieces that never split a page or a copy's row.

A block is lent as a CPU tensor (:meth:`PinnedBlock.lend`) and comes back to its lender when the last view of that
tensor dies; :mod:`flexicache_hf.block_keeper` lends them, keeps them for the next tier of their size and pins a
forward's blocks in the background.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import glob
import math
import mmap
import os
import platform
import threading
import time
import warnings
import weakref
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Callable

import torch

from .cuda_context import cuda_core, make_current

PAGE = mmap.PAGESIZE
MADV_POPULATE_WRITE = 23  # <linux/mman.h> (asm-generic), Linux 5.14+; not in Python's mmap module
MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)  # <linux/mman.h> (x86, arm64); not in every Python
SPLIT_ABOVE = 2 << 30  # a block larger than this that one registration refuses is registered in pieces
PIECE = 1 << 30  # the most one piece of such a block covers


class HostMemoryError(MemoryError):
    """The host tier cannot grow: over ``FlexiCacheConfig.host_memory_limit``, or allocating or page-locking host
    memory failed."""


def format_bytes(n: int) -> str:
    """``n`` bytes for a message: exact below 1 MiB (a small limit must not read as 0.0 MiB), else MiB."""
    if n < 2**20:
        return "1 byte" if n == 1 else f"{n:,} bytes"
    return f"{n / 2**20:.1f} MiB"


def default_threads() -> int:
    """Populating threads: half the processors this process may run on (the other half keep launching the
    forward's kernels), at most 16."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 2
    return max(1, min(16, cpus // 2))


@dataclass(frozen=True)
class PinSettings:
    """How blocks are pinned (the defaults are the library's; ``python -m flexicache_hf.bench.pinning`` compares).

    Args:
        threads: threads populating a block's chunks at once (0: none; the registration faults the pages in).
        chunk_bytes: bytes one populating task covers (a multiple of the page size).
        pinners: blocks pinned at once in the background (:meth:`BlockKeeper.prefetch`): one registers while the
            next is populated.
        hugepages: ``True`` (the default) advises transparent huge pages: 2 MiB pages fault, page-lock and unlock
            about twice as fast (H200 host, 26 GB: registered in 1.44 s against 2.64 with 4 KiB pages, unregistered
            in 0.62 s against 1.77; run 25), which a first cache's prefill waits for; on a fragmented host direct
            compaction may stall a fault instead.  ``None`` keeps the system's policy (on that host: ``madvise``, i.e.
            4 KiB pages); ``False`` advises against.
        piece_bytes: register a block in pieces of at most this many bytes (``None``: in one call, in pieces only
            when that is refused); the pieces never split a page or a copy's row.
        numa: ``True`` (the default) prefers the NUMA node nearest the pinning GPU for the pages (on a host of
            several nodes; see :func:`device_numa_node`); ``False`` leaves them where the populating threads touch
            them first.
    """

    threads: int = field(default_factory=default_threads)
    chunk_bytes: int = 64 << 20
    pinners: int = 2
    hugepages: bool | None = True
    piece_bytes: int | None = None
    numa: bool = True

    def __post_init__(self) -> None:
        if self.threads < 0 or self.pinners < 1 or self.chunk_bytes < PAGE or self.chunk_bytes % PAGE:
            raise ValueError(f"PinSettings needs threads >= 0, pinners >= 1 and chunk_bytes a positive multiple of "
                             f"{PAGE}, got {self}")


# ---- the mapping: anonymous memory of the process, populated in parallel ------------------------------------------
_libc = ctypes.CDLL(None, use_errno=True)  # the process's C library
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.syscall.restype = ctypes.c_long
_MAP_FAILED = ctypes.c_void_p(-1).value
_SYS_MBIND = {"x86_64": 237, "aarch64": 235}.get(platform.machine())  # <asm/unistd.h>; glibc exports no mbind
MPOL_PREFERRED = 1  # <linux/mempolicy.h>
_populate_write = [True]  # whether the kernel has MADV_POPULATE_WRITE (a probe's result, learnt once)


def map_anonymous(nbytes: int, hugepages: bool | None = None, reserve: bool = True, node: int | None = None) -> int:
    """The address of a new private anonymous read-write mapping of ``nbytes`` (page-aligned, not yet populated).
    ``reserve=False`` maps with ``MAP_NORESERVE``: address space only, no swap or overcommit charge until populated
    (:class:`~flexicache_hf.vmm.HostRange` reserves a whole context this way).  ``node``: the NUMA node its pages
    prefer (:func:`prefer_node`)."""
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | (0 if reserve else MAP_NORESERVE)
    addr = _libc.mmap(None, nbytes, mmap.PROT_READ | mmap.PROT_WRITE, flags, -1, 0)
    if addr is None or addr == _MAP_FAILED:
        err = ctypes.get_errno()
        raise HostMemoryError(f"mapping {format_bytes(nbytes)} of host memory failed: {os.strerror(err)}")
    if hugepages is not None:  # advice only: a kernel without transparent huge pages refuses, and nothing changes
        _libc.madvise(addr, nbytes, mmap.MADV_HUGEPAGE if hugepages else mmap.MADV_NOHUGEPAGE)
    if node is not None:
        prefer_node(addr, nbytes, node)
    return addr


def prefer_node(addr: int, nbytes: int, node: int) -> bool:
    """Ask the kernel to place the pages of ``[addr, addr + nbytes)`` (page-aligned, not yet populated) on NUMA node
    ``node`` (``mbind``, ``MPOL_PREFERRED``: on another node when that one is full, never a failure).  Advice only:
    False where the platform or the kernel refuses, and nothing changes."""
    if _SYS_MBIND is None or not 0 <= node < 64:
        return False
    mask = ctypes.c_ulong(1 << node)  # maxnode counts one past the mask's bits, as numactl passes it
    return _libc.syscall(_SYS_MBIND, ctypes.c_void_p(addr), ctypes.c_ulong(nbytes), ctypes.c_int(MPOL_PREFERRED),
                         ctypes.byref(mask), ctypes.c_ulong(65), ctypes.c_uint(0)) == 0


def numa_nodes() -> int:
    """The host's NUMA nodes (1 where the kernel lists none)."""
    return max(1, len(glob.glob("/sys/devices/system/node/node[0-9]*")))


@functools.cache
def device_numa_node(device: int) -> int | None:
    """The host NUMA node nearest CUDA device ``device``: the driver's ``HOST_NUMA_ID``, else the node the kernel
    gives the device's PCI function; ``None`` on a host of one node or where neither says (a hardware fact,
    learnt once per device)."""
    if numa_nodes() < 2:
        return None
    try:
        return _nearest_node(_driver(device), device)
    except Exception as e:  # noqa: BLE001  (placement is advice: pages then go where they are first touched)
        warnings.warn(f"FlexiCache: the NUMA node nearest cuda:{device} is unknown ({e}); the host tier's pages go "
                      "where they are first touched")
        return None


def _nearest_node(driver, device: int) -> int | None:
    attr = driver.CUdevice_attribute
    err, node = driver.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID, device)
    if err == driver.CUresult.CUDA_SUCCESS and node >= 0:
        return node
    ids = [driver.cuDeviceGetAttribute(a, device) for a in (attr.CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID,
                                                           attr.CU_DEVICE_ATTRIBUTE_PCI_BUS_ID,
                                                           attr.CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID)]
    if any(e != driver.CUresult.CUDA_SUCCESS for e, _ in ids):
        return None
    (_, dom), (_, bus), (_, dev) = ids
    try:
        with open(f"/sys/bus/pci/devices/{dom:04x}:{bus:02x}:{dev:02x}.0/numa_node") as f:
            node = int(f.read())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None


def pages_node(device: int | None, settings: PinSettings) -> int | None:
    """The node a pinned mapping for ``device`` prefers under ``settings`` (None: first touch decides)."""
    return device_numa_node(device) if settings.numa and device is not None else None


def unmap(addr: int, nbytes: int) -> None:
    """Give a mapping made by :func:`map_anonymous` back to the OS."""
    if _libc.munmap(addr, nbytes) != 0:
        warnings.warn(f"FlexiCache: munmap of {format_bytes(nbytes)} failed: {os.strerror(ctypes.get_errno())}")


def discard(addr: int, nbytes: int) -> None:
    """Give the pages of ``[addr, addr + nbytes)`` back to the OS, keeping the mapping (``MADV_DONTNEED``: they read
    as zeros when touched again)."""
    _libc.madvise(addr, nbytes, mmap.MADV_DONTNEED)


def populate_span(addr: int, nbytes: int) -> None:
    """Fault the pages of ``[addr, addr + nbytes)`` in, writable (``addr`` page-aligned).  ``madvise`` and ``memset``
    run without the GIL, so threads populating disjoint spans run in parallel."""
    while _populate_write[0]:
        if _libc.madvise(addr, nbytes, MADV_POPULATE_WRITE) == 0:
            return
        err = ctypes.get_errno()
        if err == errno.EINTR:  # a signal arrived part-way: what is populated stays, go on
            continue
        if err != errno.EINVAL:
            raise HostMemoryError(f"populating {format_bytes(nbytes)} of host memory failed: {os.strerror(err)}")
        _populate_write[0] = False  # Linux before 5.14
    ctypes.memset(addr, 0, nbytes)  # fresh anonymous pages are zero already: the write only faults them in


_pools: dict[tuple[int, int], ThreadPoolExecutor] = {}  # (process id, threads) -> the populating pool
_pools_lock = threading.Lock()


def populate_pool(threads: int) -> ThreadPoolExecutor:
    """This process's pool of ``threads`` populating threads, made on first use and kept (as torch keeps its streams):
    every growth of a host range populates on it.  A pool made for each growth pays its threads' start every time and,
    beside a prefill, stalled the launching thread (H200, run 24c: one growth at 3.0 GB/s with a pool of its own
    against 7.9 GB/s on a kept pool; two growths at once 4.7 against 16.5 GB/s, and the launching thread's longest wait
    339 against 19 ms).  Keyed by process: a forked child makes its own (its parent's threads are not in it)."""
    key = (os.getpid(), threads)
    with _pools_lock:
        pool = _pools.get(key)
        if pool is None:
            pool = _pools[key] = ThreadPoolExecutor(threads, thread_name_prefix="flexicache-populate")
        return pool


def populate(addr: int, nbytes: int, chunk_bytes: int, pool: ThreadPoolExecutor | None) -> None:
    """Populate ``[addr, addr + nbytes)`` in chunks of ``chunk_bytes``, on ``pool``'s threads when given; returns once
    every chunk is done (the first error is raised then, never while a chunk still runs)."""
    spans = [(addr + off, min(chunk_bytes, nbytes - off)) for off in range(0, nbytes, chunk_bytes)]
    if pool is None or len(spans) == 1:
        for span in spans:
            populate_span(*span)
        return
    futures = [pool.submit(populate_span, *span) for span in spans]
    wait(futures)
    for f in futures:
        f.result()


# ---- registration with CUDA (cuda-python's driver API, as kernels/row_copy.py uses it) ----------------------------


def _driver(device: int):
    """cuda-python's driver module with ``device``'s primary context (torch's) current in this thread."""
    try:
        from cuda.bindings import driver
        cuda_core()  # make_current's
    except ImportError as e:
        raise HostMemoryError(f"page-locking the host tier needs cuda-python (cuda.bindings, cuda.core): {e}") from e
    make_current(device)
    return driver


def pieces(addr: int, nbytes: int, align: int, piece_bytes: int | None) -> list[tuple[int, int]]:
    """``[addr, addr + nbytes)`` cut into registrations of at most ``piece_bytes`` (one when ``None`` or when it fits),
    each a whole number of pages and of ``align`` bytes (the unit a copy's row lies within: no row spans two
    registrations), from ``addr`` (page-aligned) on; a single unit longer than ``piece_bytes`` makes a longer piece."""
    if piece_bytes is None or nbytes <= piece_bytes:
        return [(addr, nbytes)]
    unit = math.lcm(PAGE, max(1, align))
    step = max(1, piece_bytes // unit) * unit
    return [(addr + off, min(step, nbytes - off)) for off in range(0, nbytes, step)]


def unregister(spans: list[tuple[int, int]], device: int) -> None:
    """Undo :func:`register` (failures only warn: the memory is unmapped next either way)."""
    if not spans:
        return
    driver = _driver(device)
    for addr, _ in spans:
        (err,) = driver.cuMemHostUnregister(addr)
        if err != driver.CUresult.CUDA_SUCCESS:
            warnings.warn(f"FlexiCache: cuMemHostUnregister failed: {err}")


def register(addr: int, nbytes: int, device: int, align: int = 1, piece_bytes: int | None = None
             ) -> list[tuple[int, int]]:
    """Page-lock ``[addr, addr + nbytes)`` for every CUDA context and map it for the devices (one registration, or
    :func:`pieces` of it); returns the registered spans.  Raises HostMemoryError, registering nothing, when the
    driver refuses or a span's device address is not its host address (no unified addressing)."""
    driver = _driver(device)
    flags = driver.CU_MEMHOSTREGISTER_PORTABLE | driver.CU_MEMHOSTREGISTER_DEVICEMAP
    spans, done = pieces(addr, nbytes, align, piece_bytes), []
    for a, n in spans:
        (err,) = driver.cuMemHostRegister(a, n, flags)
        if err != driver.CUresult.CUDA_SUCCESS:
            unregister(done, device)
            if len(spans) == 1 and nbytes > SPLIT_ABOVE:  # Linux 6.11-6.13 pin at most 2 GiB in one call
                return register(addr, nbytes, device, align, PIECE)
            raise HostMemoryError(f"page-locking {format_bytes(n)} of host memory failed (cuMemHostRegister: "
                                  f"{err.name if hasattr(err, 'name') else err})")
        done.append((a, n))
        err, dptr = driver.cuMemHostGetDevicePointer(a, 0)
        if err != driver.CUresult.CUDA_SUCCESS or int(dptr) != a:
            unregister(done, device)
            raise HostMemoryError("registered host memory has another address on the device (no unified "
                                  f"addressing: {err}); the host tier needs a 64-bit platform with unified addressing")
    return done


# ---- one block --------------------------------------------------------------------------------------------------
class PinnedBlock:
    """``nbytes`` of page-locked host memory in a mapping of its own, lent to one tier at a time.

    ``align``: the unit every row a 2D copy moves lies within (the host tier's: one page of one (row, head), see
    :func:`pieces`).  ``device=None`` maps and populates without registering (the CPU tests of the keeper).
    ``pool``: the populating threads (``None``: this thread)."""

    def __init__(self, nbytes: int, align: int = 1, device: int | None = None, settings: PinSettings | None = None,
                 pool: ThreadPoolExecutor | None = None):
        if nbytes <= 0:
            raise ValueError(f"a pinned block holds at least one byte, got {nbytes}")
        settings = settings or PinSettings()
        self.nbytes, self.align, self.device = nbytes, align, device
        self.key = (nbytes, align, device)  # a block registered under one device is lent to tiers on it only
        self.spans: list[tuple[int, int]] = []
        t0 = time.perf_counter()
        self.addr = map_anonymous(nbytes, settings.hugepages, node=pages_node(device, settings))
        try:
            if settings.threads:
                populate(self.addr, nbytes, settings.chunk_bytes, pool)
            t1 = time.perf_counter()
            if device is not None:
                self.spans = register(self.addr, nbytes, device, align, settings.piece_bytes)
        except BaseException:
            unmap(self.addr, nbytes)
            self.addr = 0
            raise
        t2 = time.perf_counter()
        self.populate_s, self.register_s = t1 - t0, t2 - t1

    def lend(self, on_return: Callable[[PinnedBlock], None]) -> torch.Tensor:
        """The block as a ``uint8`` CPU tensor; ``on_return(self)`` is called once the tensor and every view of it
        are gone (the storage holds the buffer object, whose finalizer calls it)."""
        buffer = (ctypes.c_ubyte * self.nbytes).from_address(self.addr)
        weakref.finalize(buffer, on_return, self).atexit = False
        return torch.frombuffer(buffer, dtype=torch.uint8)

    def free(self) -> None:
        """Unregister and unmap (never while lent: nothing may view the memory any more)."""
        if self.addr:
            unregister(self.spans, self.device)
            unmap(self.addr, self.nbytes)
            self.addr, self.spans = 0, []
