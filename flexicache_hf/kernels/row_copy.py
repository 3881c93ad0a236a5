"""Twins of :func:`flexicache_hf.kernels.reference.copy_rows` and ``copy_block``: token rows and blocks of pages
between the device and pinned host memory.

A prompt chunk's offload writes ``[B, heads, T, D]`` new states into the page-major host tier ``[pages, B, heads,
page_size, D]`` at positions ``start .. start + T - 1`` (and a multi-turn follow-up reads a prefix back).  The host
tier cuts the range into at most three spans (a partial first page, the whole pages, a partial last page:
:func:`flexicache_hf.pages.token_spans`), each a ``[B, heads, P, n, D]`` pair of views in which every (row, head,
page) is one contiguous run of ``n * D`` elements on both sides.  The runs are not evenly spaced as a whole (the
page stride differs from the (row, head) one on each side), so torch's ``copy_`` would stage them through a
*pageable* temporary and a synchronous CPU copy (measured: the dominant cost of a long prefill).  Instead a span
is a few ``cuMemcpy2DAsync`` calls (cuda-python driver API), each moving evenly spaced runs on the copy engines:
asynchronous on the current stream, no SMs taken from the concurrent prefill, no host staging.  A span of one
page is one call (its runs: every (row, head)); a span of ``P`` whole pages is ``min(P, B * heads)`` calls, one per
page (runs: every (row, head)) or one per (row, head) (runs: every page), whichever is fewer.

A run of whole pages is contiguous in the tier, so where the tier's side stages it page-major on the device (a
follow-up chunk's prefix read back, a chunk's whole pages written) it moves as one block: :meth:`RowCopier.copy_block`,
one ``cuMemcpyAsync``, cut at OS pages only where it crosses a registration (:func:`split_at_pages`).

Host memory registered in pieces (a block pinned in pieces, a reserved range committed chunk by chunk): one 2D copy
may not cross a registration (the driver answers ``CUDA_ERROR_INVALID_VALUE``, measured on the H200), so such a copy
is cut in halves of rows until each half lies in one registration (pieces never split a run).  Fallback: without
cuda-python, or for layouts a 2D copy cannot express, one ``copy_(non_blocking=True)`` per contiguous run (still
asynchronous into pinned memory).
"""

from __future__ import annotations

import functools
import warnings
from typing import Callable

import torch

from ..cuda_context import make_current
from ..host_memory import PAGE  # registrations of host memory start and end on OS pages


def _row_pitch(t: torch.Tensor) -> int | None:
    """Bytes between consecutive runs when ``t [R, S, n, D]`` holds ``R * S`` runs of ``n * D`` contiguous elements
    evenly spaced (one 2D copy), else None."""
    R, S, n, D = t.shape
    if t.stride(3) != 1 or (n > 1 and t.stride(2) != D):
        return None
    if R > 1 and S > 1 and t.stride(0) != S * t.stride(1):
        return None
    pitch = t.stride(0) if S == 1 else t.stride(1)  # (a dimension of size 1 may have any stride)
    return max(pitch, n * D) * t.element_size()  # one run: any pitch as wide as it does


def blocks(dst: torch.Tensor, src: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``[B, H, P, n, D]`` views (or ``[B, H, T, D]``: ``P = 1``) cut into ``[R, S, n, D]`` pairs, each one 2D copy
    of evenly spaced runs when both sides allow it: the (row, head) runs of each page, or the page runs of each
    (row, head), whichever takes fewer copies."""
    if dst.dim() == 4:
        return [(dst, src)]
    B, H, P = dst.shape[:3]
    if P == 1:
        return [(dst[:, :, 0], src[:, :, 0])]
    if B * H < P:
        return [(dst[b, h][None], src[b, h][None]) for b in range(B) for h in range(H)]
    return [(dst[:, :, p], src[:, :, p]) for p in range(P)]


def copy_2d_args(dst: torch.Tensor, src: torch.Tensor) -> tuple[int, int, int, int, int, int] | None:
    """``(dst address, dst pitch, src address, src pitch, width, height)`` (bytes, rows) of the one 2D copy that
    moves a ``[R, S, n, D]`` block (:func:`blocks`), or None where one side's runs are not evenly spaced."""
    pitches = (_row_pitch(dst), _row_pitch(src))
    if None in pitches:
        return None
    R, S, n, D = dst.shape
    return dst.data_ptr(), pitches[0], src.data_ptr(), pitches[1], n * D * dst.element_size(), R * S


class RowCopier:
    """``copy_rows`` through ``cuMemcpy2DAsync`` (the device's context made current per thread: :mod:`~flexicache_hf.cuda_context`)."""

    def __init__(self):
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
        make_current(device.index if device.index is not None else torch.cuda.current_device())
        return driver

    def copy_rows(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst.copy_(src)`` for ``[B, H, P, n, D]`` (or ``[B, H, T, D]``) views, one of them pinned host memory;
        asynchronous."""
        device = _pinned_pair(dst, src, "copy_rows")
        if device is None:
            dst.copy_(src, non_blocking=True)  # device <-> device, or pageable memory: torch handles it
            return
        driver = self._driver(device)
        for d, s in blocks(dst, src):
            args = copy_2d_args(d, s)
            if driver is None or args is None or not self._copy_split(driver, device, args):
                self._per_run(d, s)

    def _copy_split(self, driver, device: torch.device, args: tuple[int, int, int, int, int, int]) -> bool:
        """:meth:`_copy_2d`, and where the rows cross a registration of host memory pinned in pieces, the rows cut
        in two halves, each copied the same way (a few more calls per registration boundary, never one per run);
        False only where the driver path is off."""
        done = self._copy_2d(driver, device, args)
        if done is not None:
            return done
        dst, dpitch, src, spitch, width, height = args
        if height == 1:  # one run crossing a registration: pieces never split a run, so this is no registration
            self.unavailable = "cuMemcpy2DAsync refused a single row (CUDA_ERROR_INVALID_VALUE)"
            warnings.warn(f"FlexiCache: {self.unavailable}; host-tier row copies fall back to one copy per row")
            return False
        half = height // 2
        return (self._copy_split(driver, device, (dst, dpitch, src, spitch, width, half))
                and self._copy_split(driver, device, (dst + half * dpitch, dpitch, src + half * spitch, spitch,
                                                      width, height - half)))

    def _copy_2d(self, driver, device: torch.device, args: tuple[int, int, int, int, int, int]) -> bool | None:
        """One ``cuMemcpy2DAsync`` (:func:`copy_2d_args`), answered as :meth:`_answer` says."""
        p = driver.CUDA_MEMCPY2D()
        unified = driver.CUmemorytype.CU_MEMORYTYPE_UNIFIED  # pinned host pointers are device addresses (UVA)
        p.dstMemoryType, p.dstDevice, p.dstPitch = unified, args[0], args[1]
        p.srcMemoryType, p.srcDevice, p.srcPitch = unified, args[2], args[3]
        p.WidthInBytes, p.Height = args[4], args[5]
        stream = driver.CUstream(torch.cuda.current_stream(device).cuda_stream)
        (err,) = driver.cuMemcpy2DAsync(p, stream)
        # (refused: the runs span host memory registered in pieces, a block the driver would not page-lock whole or
        # a reserved range committed in growths: one 2D copy may not cross a registration, a run never does)
        return self._answer(driver, err, "cuMemcpy2DAsync")

    def _answer(self, driver, err, call: str) -> bool | None:
        """A copy's driver answer: True when queued; None when ``CUDA_ERROR_INVALID_VALUE`` (the range crossed a
        registration of host memory); False on any other failure, with the driver path off from then on."""
        if err == driver.CUresult.CUDA_SUCCESS:
            return True
        if err == driver.CUresult.CUDA_ERROR_INVALID_VALUE:
            return None
        self.unavailable = f"{call} failed: {err}"
        warnings.warn(f"FlexiCache: {self.unavailable}; host-tier copies fall back to torch's copies")
        return False

    def copy_block(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst.copy_(src)`` for two contiguous tensors of the same bytes, one on the device, one host memory (a run
        of whole pages of the page-major tier and its staging on the device: a follow-up prompt chunk's prefix read
        back, a chunk's whole pages written); asynchronous.  Pinned memory goes through ``cuMemcpyAsync``
        (:meth:`_copy_flat`), the range cut at OS pages where it crosses a registration (:func:`split_at_pages`): a
        few calls whatever the batch, where :meth:`copy_rows` makes one 2D copy per (row, head), each cut again at
        every registration it crosses."""
        if not (dst.is_contiguous() and src.is_contiguous()):
            raise ValueError("copy_block needs contiguous tensors")
        device = _pinned_pair(dst, src, "copy_block")
        driver = None if device is None else self._driver(device)
        if driver is None:
            dst.copy_(src, non_blocking=True)
            return
        host_is_src = src.device.type == "cpu"
        stream = driver.CUstream(torch.cuda.current_stream(device).cuda_stream)
        copy = functools.partial(self._copy_flat, driver, stream)
        if not split_at_pages(copy, dst.data_ptr(), src.data_ptr(), dst.numel() * dst.element_size(), host_is_src):
            dst.copy_(src, non_blocking=True)  # the driver path went off on the way: torch redoes it whole

    def _copy_flat(self, driver, stream, dst: int, src: int, nbytes: int) -> bool | None:
        """One ``cuMemcpyAsync`` of ``nbytes`` (unified addresses), answered as :meth:`_answer` says."""
        (err,) = driver.cuMemcpyAsync(dst, src, nbytes, stream)
        return self._answer(driver, err, "cuMemcpyAsync")

    @staticmethod
    def _per_run(dst: torch.Tensor, src: torch.Tensor) -> None:
        for b in range(dst.shape[0]):
            for h in range(dst.shape[1]):
                dst[b, h].copy_(src[b, h], non_blocking=True)


def _pinned_pair(dst: torch.Tensor, src: torch.Tensor, what: str) -> torch.device | None:
    """The device of a copy between it and pinned host memory (the driver's to make), else None (torch's: device to
    device, pageable memory, or nothing to copy); a copy between unequal shapes or dtypes is refused."""
    if dst.shape != src.shape or dst.dtype != src.dtype:
        raise ValueError(f"{what} needs equal shapes and dtypes, got {tuple(dst.shape)} {dst.dtype} "
                         f"and {tuple(src.shape)} {src.dtype}")
    cuda = [t.device for t in (dst, src) if t.device.type == "cuda"]
    host = [t for t in (dst, src) if t.device.type == "cpu"]
    if dst.numel() == 0 or len(cuda) != 1 or len(host) != 1 or not host[0].is_pinned():
        return None
    return cuda[0]


def split_at_pages(copy: Callable[[int, int, int], bool | None], dst: int, src: int, nbytes: int,
                    host_is_src: bool) -> bool:
    """``copy(dst, src, nbytes)``, and where it answers None (the bytes crossed a registration of host memory: every
    registration starts and ends on an OS page), the range cut at the OS page nearest its middle on the host side,
    each half copied the same way; False where a copy failed otherwise or a range within one page was refused."""
    done = copy(dst, src, nbytes)
    if done is not None:
        return done
    host = src if host_is_src else dst
    cut = (host + nbytes // 2) // PAGE * PAGE - host
    if cut <= 0:
        cut = -(-(host + 1) // PAGE) * PAGE - host  # the first page boundary inside the range
    if cut >= nbytes:
        return False  # within one page: not a registration boundary
    return (split_at_pages(copy, dst, src, cut, host_is_src)
            and split_at_pages(copy, dst + cut, src + cut, nbytes - cut, host_is_src))


_COPIER = RowCopier()  # one per process
copy_rows = _COPIER.copy_rows  # the kernel table's CUDA twins
copy_block = _COPIER.copy_block
