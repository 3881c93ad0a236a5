"""Small host-side helpers shared by the Triton kernels (no kernels live here)."""

from __future__ import annotations

import functools
import os

import torch
import triton


def interpreting() -> bool:
    """True when Triton runs kernels on the CPU interpreter (``TRITON_INTERPRET=1``, tests only).

    Read per call, not cached: the interpreter is chosen when a kernel is defined, and tests set the variable
    in a child process before importing the kernel modules.
    """
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def pow2(n: int, floor: int = 1) -> int:
    """Smallest power of two >= max(n, floor) (Triton block shapes must be powers of two)."""
    return max(floor, triton.next_power_of_2(max(int(n), 1)))


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Multiprocessors of ``device`` (cached per device); 8 off CUDA so interpreted tests exercise split-K."""
    device = torch.device(device)
    if device.type != "cuda":
        return 8
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


# Programs a launch over rows reserved for a whole context starts per dimension-0 sweep, at most (summed over its rows):
# enough to fill the GPU several times; each program strides over the row's blocks, so a block past the pages that
# exist costs a loop turn of one program instead of a program of its own.
ROW_PROGRAMS = 4096


def strided_grid(blocks: int, rows: int) -> int:
    """Programs along a row of ``blocks`` blocks when ``rows`` rows launch together: all of them, or as many as
    :data:`ROW_PROGRAMS` allows over the rows (at least one); each program takes blocks ``pid, pid + n, ...``."""
    return max(1, min(blocks, -(-ROW_PROGRAMS // max(rows, 1))))


def dot_upcast(dtype: torch.dtype) -> bool:
    """Whether tl.dot operands go through fp32 (with IEEE products) instead of the storage dtype.

    fp32 storage: ``tf32`` would lose ~3 decimal digits against the fp32 reference.  bf16 under the CPU
    interpreter: its numpy-backed ``tl.dot`` mis-reads bf16 operands (measured: garbage), so interpreted bf16
    tests upcast; on the GPU bf16 runs the tensor cores natively (covered by the GPU tests).
    """
    return dtype == torch.float32 or (dtype == torch.bfloat16 and interpreting())
