"""Twin of :func:`flexicache_hf.kernels.reference.copy_rows`: token rows between the device and pinned host memory.

A prompt chunk's offload writes ``[B, heads, T, D]`` new states into the host tier ``[B, heads, capacity, D]``
at positions ``start .. start + T - 1`` (and a multi-turn follow-up reads a prefix back).  Every (row, head)
is one contiguous run of ``T * D`` elements on both sides, but the runs are ``capacity * D`` apart on the
host, so the copy is not contiguous as a whole.  torch's ``copy_`` then stages it through a *pageable*
temporary and a synchronous CPU copy (measured: the dominant cost of a long prefill).  One
``cuMemcpy2DAsync`` (cuda-python driver API) instead moves all runs in a single call on the copy engines:
asynchronous on the current stream, no SMs taken from the concurrent prefill, no host staging.

Fallback: without cuda-python, for layouts a 2D copy cannot express, or for host memory registered in pieces (a 2D
copy may not cross a registration: the driver answers ``CUDA_ERROR_INVALID_VALUE``, measured on the H200), one
``copy_(non_blocking=True)`` per contiguous run (still asynchronous into pinned memory).
"""

from __future__ import annotations

import threading
import warnings

import torch


def _row_pitch(t: torch.Tensor) -> int | None:
    """Bytes between consecutive (row, head) runs when ``t [B, H, T, D]`` is such a uniform 2D layout."""
    B, H, T, D = t.shape
    if t.stride(3) != 1 or (T > 1 and t.stride(2) != D):
        return None
    if B > 1 and t.stride(0) != H * t.stride(1):
        return None
    return t.stride(1) * t.element_size()


class RowCopier:
    """``copy_rows`` through ``cuMemcpy2DAsync``; remembers per thread which devices' contexts are current."""

    def __init__(self):
        self._tls = threading.local()
        self.unavailable: str | None = None  # why the driver path is off (then per-run copies are used)

    def _driver(self, device: torch.device):
        """The cuda-python driver module with ``device``'s primary context current in this thread, or None."""
        if self.unavailable is not None:
            return None
        try:
            from cuda.bindings import driver
        except ImportError as e:
            self.unavailable = f"cuda-python (cuda.bindings) not importable: {e}"
            return None
        done = getattr(self._tls, "devices", None)
        if done is None:
            done = self._tls.devices = set()
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index not in done:
            from cuda.core import Device

            Device(index).set_current()  # torch's primary context, made current for the driver API
            done.add(index)
        return driver

    def copy_rows(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst.copy_(src)`` for ``[B, H, T, D]`` tensors, one of them pinned host memory; asynchronous."""
        if dst.shape != src.shape or dst.dtype != src.dtype:
            raise ValueError(f"copy_rows needs equal shapes and dtypes, got {tuple(dst.shape)} {dst.dtype} "
                             f"and {tuple(src.shape)} {src.dtype}")
        if dst.numel() == 0:
            return
        cuda = [t.device for t in (dst, src) if t.device.type == "cuda"]
        host = [t for t in (dst, src) if t.device.type == "cpu"]
        if len(cuda) != 1 or len(host) != 1 or not host[0].is_pinned():
            dst.copy_(src, non_blocking=True)  # device <-> device, or pageable memory: torch handles it
            return
        pitches = (_row_pitch(dst), _row_pitch(src))
        driver = self._driver(cuda[0]) if None not in pitches else None
        if driver is None:
            self._per_run(dst, src)
            return
        B, H, T, D = dst.shape
        p = driver.CUDA_MEMCPY2D()
        unified = driver.CUmemorytype.CU_MEMORYTYPE_UNIFIED  # pinned host pointers are device addresses (UVA)
        p.srcMemoryType, p.srcDevice, p.srcPitch = unified, src.data_ptr(), pitches[1]
        p.dstMemoryType, p.dstDevice, p.dstPitch = unified, dst.data_ptr(), pitches[0]
        p.WidthInBytes, p.Height = T * D * dst.element_size(), B * H
        stream = driver.CUstream(torch.cuda.current_stream(cuda[0]).cuda_stream)
        (err,) = driver.cuMemcpy2DAsync(p, stream)
        if err == driver.CUresult.CUDA_ERROR_INVALID_VALUE:
            # The rows span host memory registered in pieces (a block the driver would not page-lock whole,
            # host_memory.py): one 2D copy may not cross a registration, a run never does (pieces are whole runs).
            self._per_run(dst, src)
        elif err != driver.CUresult.CUDA_SUCCESS:
            self.unavailable = f"cuMemcpy2DAsync failed: {err}"
            warnings.warn(f"FlexiCache: {self.unavailable}; host-tier row copies fall back to one copy per row")
            self._per_run(dst, src)

    @staticmethod
    def _per_run(dst: torch.Tensor, src: torch.Tensor) -> None:
        for b in range(dst.shape[0]):
            for h in range(dst.shape[1]):
                dst[b, h].copy_(src[b, h], non_blocking=True)


copy_rows = RowCopier().copy_rows  # the kernel table's CUDA twin: one copier per process
