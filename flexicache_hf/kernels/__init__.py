"""Kernels and the one place that picks a backend for a device.

Every kernel is one row of :data:`~.table.KERNELS`: its plain PyTorch reference (:mod:`.reference`, the CPU path
and the test oracle) and its CUDA twin (Triton / cuda-python, in a module of this package).  :func:`ops_for`
returns the CUDA twins for CUDA tensors and the reference everywhere else; ``TRITON_OPS`` (the CUDA backend) is
built on first use, so the CPU path never imports Triton or cuda-python.
"""

from __future__ import annotations

from . import reference
from .table import KERNELS, REFERENCE_OPS, TRITON, KernelOps, build_ahead, ops_for, ops_named

__all__ = ["KERNELS", "REFERENCE_OPS", "TRITON_OPS", "KernelOps", "build_ahead", "ops_for", "ops_named", "reference"]


def __getattr__(name: str):
    if name == "TRITON_OPS":  # built (Triton and cuda-python imported) on first use
        return ops_named(TRITON)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
