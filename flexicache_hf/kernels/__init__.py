"""Kernels and the one place that picks a backend for a device.

Every kernel has a plain PyTorch twin in :mod:`flexicache_hf.kernels.reference` (the CPU path and the
test oracle).  :func:`ops_for` returns the Triton / cuda-python implementations for CUDA tensors and the
reference everywhere else.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from . import reference

MAX_SELECT_PAGES = 32768  # longest score row the Triton select holds in one program (longer rows: torch.topk)


@dataclass(frozen=True)
class KernelOps:
    """The operations FlexiCache runs per step; signatures are those of :mod:`.reference`."""

    name: str
    minmax_update: Callable[..., None]
    append_token: Callable[..., None]
    page_scores: Callable[..., torch.Tensor]
    page_lse: Callable[..., torch.Tensor]
    select_pages: Callable[..., torch.Tensor]
    sparse_decode: Callable[..., torch.Tensor]
    copy_pages: Callable[..., None]
    copy_kv_pages: Callable[..., None]
    copy_rows: Callable[..., None]
    reseat_slots: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    place_page: Callable[..., None]

    def __reduce__(self):  # by name: a copied or unpickled cache uses this process's kernels
        return (ops_named, (self.name,))


from .ops import traced  # noqa: E402 - after the constant the kernels read

REFERENCE_OPS = KernelOps(
    name="reference",
    minmax_update=reference.minmax_update,
    append_token=traced("append_token", reference.append_token),
    page_scores=traced("page_scores", reference.page_scores),
    page_lse=traced("page_lse", reference.page_lse),
    select_pages=traced("select_pages", reference.select_pages),
    sparse_decode=traced("sparse_decode", reference.sparse_decode),
    copy_pages=reference.copy_pages,
    copy_kv_pages=traced("copy_kv_pages", reference.copy_kv_pages),
    copy_rows=reference.copy_rows,
    reseat_slots=traced("reseat_slots", reference.reseat_slots),
    place_page=traced("place_page", reference.place_page),
)


def ops_named(name: str) -> KernelOps:
    """The backend called ``name`` (``"reference"`` or ``"triton"``)."""
    if name == REFERENCE_OPS.name:
        return REFERENCE_OPS
    from .gpu import GPU_OPS

    if name != GPU_OPS.name:
        raise ValueError(f"no kernel backend named {name!r}")
    return GPU_OPS


def ops_for(device: torch.device, *, prefer: str | None = None) -> KernelOps:
    """Kernels for tensors on ``device``: Triton on CUDA, the PyTorch reference elsewhere.

    ``prefer="reference"`` forces the reference (used by tests and to compare backends).
    """
    if prefer == "reference" or torch.device(device).type != "cuda":
        return REFERENCE_OPS
    from .gpu import GPU_OPS  # imported lazily: Triton / cuda-python are only needed on CUDA

    return GPU_OPS
