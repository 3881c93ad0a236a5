"""Twin of :func:`flexicache_hf.kernels.reference.copy_pages`: a page gather/scatter kernel for tier copies.

``dst[dst_index[i]] = src[src_index[i]]`` for every ``i`` with ``dst_index[i] >= 0``, where either pool may
be pinned host memory.  A CUDA C++ kernel (compiled at run time with NVRTC through ``cuda.core``) reads or
writes the pinned pool **in place** through unified virtual addressing: a pinned torch tensor's
``data_ptr()`` is valid on the device.  That removes the CPU gather/scatter which dominates a torch
fancy-indexing copy of scattered pages (H200, 16k scattered 4 KiB pages: 49.5 GB/s host->device and
50.8 GB/s device->host with this kernel, vs 0.74 GB/s through torch indexing per the workplace notes), and it
needs no host synchronisation: ``-1`` entries are skipped on the device, the indices never visit the host.

Following the paper (§3.3), the copy stays out of the way of the compute kernels:

* it is launched on the *current* torch stream, which the cache sets to its low-priority copy stream;
* host-touching copies use a capped grid (32 blocks), so they never hold many SMs -- also when the host pool
  comes as a CUDA tensor viewing pinned memory (the host tier's ``device_pages``, what a decode step passes):
  the driver says the address is host memory (:func:`host_resident`).  Before run 30 those got the device
  grid, 1,024 blocks waiting on PCIe, which held every SM of the GPU while a re-rank's pages loaded;
* each thread loads four 16-byte vectors of each pool before it stores them, so a block keeps 32 KiB of a K and
  V copy in flight (whole 2 KiB pages at 8 tokens x 128 x bf16).  ``bench.tier_copy`` on an H100 host whose
  contiguous pinned copy moves 55 GB/s (run 30a): 48-50 GB/s at 8-token pages with 32 blocks;
* a block reads a window of the index list at once and gathers the listed entries in shared memory before it
  copies, so a list with nothing to copy (a layer not re-ranking) costs a read per window, not a walk;
* long copies are cut into several short launches (``chunk_pages`` pages each), between which the
  scheduler can run higher-priority compute kernels.

Fallback: without ``cuda.core`` (cuda-python not installed), with tensors it cannot address (non-pinned host
memory, non-contiguous pools, different dtypes or page sizes), or with both pools on the host, the copy goes
through :func:`reference.copy_pages` (torch indexing; correct, but a CPU gather and a host sync).
"""

from __future__ import annotations

import threading
import warnings
from dataclasses import dataclass

import torch

from ..cuda_context import cuda_core, make_current
from . import reference

_SOURCE = r"""
// dst[dst_index[i]] = src[src_index[i]] for i in [0, m) with dst_index[i] >= 0; pages of n_vec vectors of T.
// Either pointer may be pinned host memory (UVA). The list is cut into windows of `window` entries (at most
// blockDim.x), taken by the blocks in turn. A block first reads its window's entries at once (one coalesced read
// of the destination indices) and gathers the listed ones into shared memory, so a window with nothing to copy
// (every layer that does not re-rank replays a list of "no page" entries each step) costs one read, not a walk.
// Then it moves the gathered pages in passes of a tile of UNROLL * blockDim.x vectors: as many whole pages as fit
// in it (small pages), or one tile of one page (pages larger than a tile). Each thread issues all its loads of a
// pass (both pools when paired) before its first store, so a block keeps UNROLL x 2 x 16 bytes a thread in
// flight: a host read over PCIe waits ~1-2 us, and the bandwidth a grid gets is the bytes it keeps in flight.
// Own 16-byte type (no header needed under NVRTC): one 128-bit load/store per thread and vector.
struct __align__(16) Vec16 { unsigned long long lo, hi; };
#define UNROLL 4
#define MAX_WINDOW 512  // the most entries a window holds (WINDOW_MAX in Python)

// No __restrict__ on the sources: that would turn reads into ld.global.nc (read-only cache path), and pinned
// host memory reached through UVA is better served by plain loads (PCIe-bound either way).
template <typename T>
__device__ __forceinline__ void copy_list(char* dst_, const long long* __restrict__ dst_index, const char* src_,
                                          const long long* __restrict__ src_index, long long m, unsigned n,
                                          unsigned window, char* dst2_, const char* src2_, long long* to,
                                          long long* from, unsigned& listed) {
    T* dst = reinterpret_cast<T*>(dst_);
    T* dst2 = reinterpret_cast<T*>(dst2_);
    const T* src = reinterpret_cast<const T*>(src_);
    const T* src2 = reinterpret_cast<const T*>(src2_);
    const unsigned tile = blockDim.x * UNROLL;
    const bool small = n <= tile;
    const unsigned per = small ? tile / n : 1;                  // pages a pass takes
    const unsigned span = small ? per * n : tile;               // vectors a pass covers
    const unsigned parts = small ? 1 : (n + tile - 1) / tile;   // passes one page takes (large pages)
    const long long windows = (m + window - 1) / window;
    for (long long w = blockIdx.x; w < windows; w += gridDim.x) {
        if (threadIdx.x == 0) listed = 0;
        __syncthreads();
        const long long i = w * window + threadIdx.x;
        if (threadIdx.x < window && i < m) {
            const long long d = dst_index[i];
            if (d >= 0) {  // "no page": skipped on the device, no host sync needed
                const unsigned slot = atomicAdd(&listed, 1u);
                to[slot] = d;
                from[slot] = src_index[i];
            }
        }
        __syncthreads();
        const unsigned count = listed;
        const unsigned passes = small ? (count + per - 1) / per : count * parts;
        for (unsigned pass = 0; pass < passes; ++pass) {
            const unsigned first = small ? pass * per : pass / parts;
            const unsigned off = small ? 0 : (pass % parts) * tile;
            T a[UNROLL], b[UNROLL];
            long long at[UNROLL];
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                const unsigned l = u * blockDim.x + threadIdx.x;
                const unsigned k = small ? l / n : 0;
                const unsigned j = off + l - k * n;
                at[u] = -1;
                if (l < span && j < n && first + k < count) {
                    const long long s = from[first + k] * n + j;
                    a[u] = src[s];
                    if (dst2 != nullptr) b[u] = src2[s];
                    at[u] = to[first + k] * n + j;
                }
            }
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                if (at[u] >= 0) {
                    dst[at[u]] = a[u];
                    if (dst2 != nullptr) dst2[at[u]] = b[u];
                }
            }
        }
        __syncthreads();  // every thread done with this window's entries before the next window's overwrite them
    }
}

// dst2 / src2 (both null, or both set): a second pool pair copied at the same indices (K and V in one launch).
extern "C" __global__ void flexicache_copy_pages(char* dst, const long long* __restrict__ dst_index,
                                                 const char* src, const long long* __restrict__ src_index,
                                                 long long m, long long page_bytes, int vec, unsigned window,
                                                 char* dst2, const char* src2) {
    __shared__ long long to[MAX_WINDOW], from[MAX_WINDOW];  // a window's listed entries: destination, source
    __shared__ unsigned listed;
#define COPY(T, width) copy_list<T>(dst, dst_index, src, src_index, m, (unsigned)(page_bytes / width), window, \
                                    dst2, src2, to, from, listed)
    switch (vec) {
        case 16: COPY(Vec16, 16); break;
        case 8: COPY(unsigned long long, 8); break;
        case 4: COPY(unsigned int, 4); break;
        default: COPY(unsigned char, 1); break;
    }
#undef COPY
}
"""

_KERNEL_NAME = "flexicache_copy_pages"
WINDOW_MAX = 512  # the kernel's MAX_WINDOW: index entries a block gathers in shared memory at once


@dataclass(frozen=True)
class Launch:
    """One kernel launch of a copy: pages ``[offset, offset + count)`` of the index lists."""

    offset: int
    count: int
    grid: int
    window: int  # entries a block gathers at once (at most its threads)


def vector_width(page_bytes: int, *addresses: int) -> int:
    """Widest access (16/8/4/1 bytes) that divides the page size and keeps every page aligned."""
    for vec in (16, 8, 4):
        if page_bytes % vec == 0 and all(a % vec == 0 for a in addresses):
            return vec
    return 1


def plan_launches(m: int, touches_host: bool, *, host_grid: int, device_grid: int,
                  chunk_pages: int | None, threads: int = 256) -> list[Launch]:
    """Cut a copy of ``m`` index entries into launches of at most ``chunk_pages`` entries (``None``: one launch).

    Host copies get a capped grid of ``host_grid`` blocks (PCIe saturates at ~32, more would only hold SMs);
    device copies get up to ``device_grid`` blocks.  A block takes ``window`` entries at a time (at most ``threads``
    and ``WINDOW_MAX``), the windows sized so that every block takes as many (a launch never has more blocks than
    windows).
    """
    cap, most = (host_grid if touches_host else device_grid), min(threads, WINDOW_MAX)
    chunk_pages = chunk_pages or max(m, 1)
    out = []
    for off in range(0, m, chunk_pages):
        n = min(chunk_pages, m - off)
        rounds = -(-n // (cap * most))  # windows each block takes
        window = -(-n // (cap * rounds))
        out.append(Launch(off, n, min(cap, -(-n // window)), window))
    return out


def host_resident(t: torch.Tensor) -> bool:
    """Whether ``t``'s memory is host memory: a CPU tensor, or a CUDA tensor viewing page-locked host memory in place
    (the host tier's :meth:`~flexicache_hf.tiers.HostTier.device_pages`, what every copy of a decode step is handed),
    which the driver reports as host memory.  It decides the grid only: the kernel reaches either through UVA.
    Needs the device's context current (``make_current``)."""
    if t.device.type == "cpu":
        return True
    from cuda.bindings import driver

    err, kind = driver.cuPointerGetAttribute(driver.CUpointer_attribute.CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
                                             t.data_ptr())
    return err == driver.CUresult.CUDA_SUCCESS and int(kind) == int(driver.CUmemorytype.CU_MEMORYTYPE_HOST)


def compile_copy_kernel(arch: str, *, cached: bool = True):
    """NVRTC-compile the copy kernel for ``arch`` (e.g. ``"sm_90"``) and return its ``cuda.core`` Kernel.

    ``cached``: through ``cuda.core``'s persistent program cache where the installed ``cuda.core`` has one
    (``FileStreamProgramCache``, in the ``cuda-python`` user cache; its keys pin the source, the options and the
    NVRTC version), so only a machine's first process pays the NVRTC build (~0.4 s on an H100 host, inside its
    first cache's first prefill, run 31d) and later ones load the cubin.  A cache that cannot be opened or
    written, or an entry that does not load, is skipped: the kernel is then compiled as without it
    (``tests/gpu/test_kernels_gpu.py::test_the_copy_kernel_is_built_once_per_machine``, passed on an H200 in run 31g).
    """
    core = cuda_core()
    opts = core.ProgramOptions(arch=arch, name="flexicache_uva_copy")
    program = core.Program(_SOURCE, code_type="c++", options=opts)
    cache = _program_cache() if cached else None
    if cache is not None:
        try:
            with cache:
                return program.compile("cubin", cache=cache).get_kernel(_KERNEL_NAME)
        except Exception:  # noqa: BLE001 - an unwritable cache, a damaged entry, a compile without `cache=`:
            pass  # build it as without a cache (a real NVRTC error raises again there)
    return program.compile("cubin").get_kernel(_KERNEL_NAME)


def _program_cache():
    """``cuda.core``'s persistent program cache at its default place, or ``None`` (too old a ``cuda.core``, or a
    cache directory that cannot be made)."""
    try:
        from cuda.core.utils import FileStreamProgramCache

        return FileStreamProgramCache()
    except (ImportError, OSError):
        return None


class _TorchStream:
    """A torch CUDA stream seen through the ``__cuda_stream__`` protocol (for ``Device.create_stream``)."""

    __slots__ = ("handle",)

    def __init__(self, handle: int):
        self.handle = handle

    def __cuda_stream__(self):
        return (0, self.handle)


class PageCopier:
    """``copy_pages`` / ``copy_kv_pages`` with their compiled kernel cached on this object, one per device.

    The module's ``copy_pages`` / ``copy_kv_pages`` are one instance's bound methods (the CUDA twins of the kernel
    table), so the NVRTC compile happens once per process and device, on first use; a lock makes the first use
    safe from several threads.

    Args:
        host_grid: blocks for copies that touch pinned host memory (PCIe-bound; 32 measured to saturate).
        device_grid: blocks for device <-> device copies (HBM-bound: fill the chip).
        chunk_pages: pages per launch (16 MiB of 4 KiB pages): short launches let compute interleave.
        threads: threads per block (a pass of a block moves 4 x threads vectors of each pool: 16 KiB of 16 B).
    """

    def __init__(self, *, host_grid: int = 32, device_grid: int = 1024, chunk_pages: int = 4096, threads: int = 256):
        self.host_grid, self.device_grid, self.chunk_pages, self.threads = host_grid, device_grid, chunk_pages, threads
        self._kernels: dict[int, object] = {}
        self._lock = threading.Lock()
        self._streams: dict[int, object] = {}  # torch stream handle -> borrowed cuda.core Stream
        self.unavailable: str | None = None  # why the kernel cannot be used (then torch indexing is)

    def _kernel(self, index: int):
        """The compiled kernel for device ``index`` (NVRTC on first use), or ``None`` if it cannot be built."""
        kern = self._kernels.get(index)
        if kern is not None:
            return kern
        with self._lock:
            kern = self._kernels.get(index)
            if kern is None and self.unavailable is None:
                try:
                    dev = cuda_core().Device(index)
                    dev.set_current()
                    cc = dev.compute_capability
                    kern = compile_copy_kernel(f"sm_{cc.major}{cc.minor}")
                    self._kernels[index] = kern
                except Exception as e:  # noqa: BLE001 - NVRTC / driver trouble: torch indexing still works
                    self.unavailable = f"building the copy kernel failed: {type(e).__name__}: {e}"
                    warnings.warn(f"FlexiCache: {self.unavailable}; tier copies fall back to torch indexing")
                    kern = None
        return kern

    def prepare(self, index: int) -> bool:
        """Build (or load from the program cache) the kernel for device ``index`` now, ahead of a first copy;
        whether it can be used."""
        return self._kernel(index) is not None

    def _stream(self, index: int, handle: int):
        """The cuda.core Stream borrowing torch's stream ``handle`` (wrapped once, then reused)."""
        st = self._streams.get(handle)
        if st is None:
            core = cuda_core()
            Device, Stream = core.Device, core.Stream
            try:  # explicit conversion (passing protocol objects to launch is deprecated in cuda.core 1.2)
                from_handle = getattr(Stream, "from_handle", None)
                st = from_handle(handle) if from_handle else Device(index).create_stream(_TorchStream(handle))
            except Exception:  # noqa: BLE001 - older/newer cuda.core: launch still takes the protocol object
                st = _TorchStream(handle)
            self._streams[handle] = st
        return st

    def launch_chunk(self, capturing: bool) -> int | None:
        """Pages per launch: ``chunk_pages`` eagerly (short launches let the compute queued on other streams
        interleave), one launch inside a captured graph.  A captured step's index lists are as long as the most
        pages it may copy (every stable head's top-K, ~24k entries a layer at 16 rows), mostly "no page" on a step
        the layer does not re-rank, and every launch of it is replayed every step: at 4,096 pages a launch a
        promotion was six launches a layer at 16 x 16k (with the offload's one: the 224 launches a step of run 20c's
        profile), where one does the same work."""
        return None if capturing else self.chunk_pages

    def usable(self, dst: torch.Tensor, src: torch.Tensor) -> torch.device | None:
        """The CUDA device that runs the copy, or ``None`` when only the torch fallback can do it."""
        if self.unavailable is not None:
            return None
        devices = [t.device for t in (dst, src) if t.device.type == "cuda"]
        if not devices or len(set(devices)) > 1:
            return None
        for t in (dst, src):
            if t.device.type == "cpu" and not t.is_pinned():
                return None  # pageable host memory has no device address
        if dst.dtype != src.dtype or dst.shape[1:] != src.shape[1:]:
            return None
        if not (dst.is_contiguous() and src.is_contiguous()):
            return None
        try:
            cuda_core()
        except ImportError as e:
            self.unavailable = f"cuda-python (cuda.core) not importable: {e}"
            return None
        return devices[0]

    def copy_pages(
        self,
        dst: torch.Tensor,  # [N_dst, page_size, D]
        dst_index: torch.Tensor,  # [M] int64 destination pages; -1 = skip
        src: torch.Tensor,  # [N_src, page_size, D] (may be pinned host memory)
        src_index: torch.Tensor,  # [M] int64 source pages; ignored where dst_index is -1
    ) -> None:
        """Same contract as :func:`reference.copy_pages`; asynchronous on the current stream."""
        self._copy(dst, dst_index, src, src_index, None, None)

    def copy_kv_pages(self, dst_k: torch.Tensor, dst_v: torch.Tensor, dst_index: torch.Tensor, src_k: torch.Tensor,
                      src_v: torch.Tensor, src_index: torch.Tensor) -> None:
        """Same contract as :func:`reference.copy_kv_pages`: both pool pairs at the same indices, one launch."""
        self._copy(dst_k, dst_index, src_k, src_index, dst_v, src_v)

    def _copy(self, dst, dst_index, src, src_index, dst2, src2) -> None:
        m = dst_index.numel()
        if m == 0:
            return
        device = self.usable(dst, src)
        if device is not None and dst2 is not None:
            same = (dst2.device, src2.device, dst2.dtype, src2.dtype, dst2.shape, src2.shape) == \
                (dst.device, src.device, dst.dtype, src.dtype, dst.shape, src.shape)
            device = device if same and self.usable(dst2, src2) == device else None
        kern = None
        if device is not None:
            index = device.index if device.index is not None else torch.cuda.current_device()
            kern = self._kernel(index)
        if kern is None:  # no kernel for these tensors (or none could be built): torch indexing, pool by pool
            for d, sr in ((dst, src), (dst2, src2)):
                if d is not None:
                    reference.copy_pages(d, dst_index, sr, src_index)
            return
        # The kernel reads the index lists on the device: move them there (no-op when already there).
        di = dst_index.to(device=device, dtype=torch.long).contiguous()
        si = src_index.to(device=device, dtype=torch.long).contiguous()
        page_bytes = dst[0].numel() * dst.element_size() if dst.shape[0] else src[0].numel() * src.element_size()
        pair = () if dst2 is None else (dst2.data_ptr(), src2.data_ptr())
        vec = vector_width(page_bytes, dst.data_ptr(), src.data_ptr(), *pair)
        import numpy as np
        core = cuda_core()
        LaunchConfig, launch = core.LaunchConfig, core.launch

        make_current(index)
        touches_host = host_resident(dst) or host_resident(src)  # the host tier's CUDA views are host memory
        stream = self._stream(index, torch.cuda.current_stream(device).cuda_stream)
        plan = plan_launches(m, touches_host, host_grid=self.host_grid, device_grid=self.device_grid,
                             chunk_pages=self.launch_chunk(torch.cuda.is_current_stream_capturing()),
                             threads=self.threads)
        for part in plan:
            cfg = LaunchConfig(grid=part.grid, block=self.threads)
            launch(stream, cfg, kern,
                   np.uint64(dst.data_ptr()), np.uint64(di.data_ptr() + 8 * part.offset),
                   np.uint64(src.data_ptr()), np.uint64(si.data_ptr() + 8 * part.offset),
                   np.int64(part.count), np.int64(page_bytes), np.int32(vec), np.uint32(part.window),
                   np.uint64(0 if dst2 is None else dst2.data_ptr()), np.uint64(0 if src2 is None else src2.data_ptr()))
        # di / si, when freshly moved, were allocated on this same stream: the caching allocator will not
        # hand their memory out again before the kernels queued here have run, so no record_stream needed.


# The CUDA twins of the kernel table: one copier per process (created when the CUDA backend first imports this
# module), so its compiled kernels live as long as the process.
_COPIER = PageCopier()
copy_pages = _COPIER.copy_pages
copy_kv_pages = _COPIER.copy_kv_pages
prepare_copies = _COPIER.prepare
