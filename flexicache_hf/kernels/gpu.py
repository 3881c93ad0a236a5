"""The CUDA backend: Triton kernels for the per-step math, a cuda-python (NVRTC) kernel for tier copies.

Imported lazily by :func:`flexicache_hf.kernels.ops_for` for CUDA tensors only, so the CPU path never needs
Triton or cuda-python.  Every op keeps its :mod:`.reference` twin's signature and semantics.

``select_pages`` dispatches to the Triton radix-select kernel: at every benchmark shape it beat
``torch.topk`` + ``sort`` + padding (the reference) on the H200 -- 7-24 us vs 38-94 us for 8-512 rows of
625-1875 pages (``docs/benchmarks/decode.md``, ``rerank.json``).  The reference stays the fallback for
score vectors longer than one program holds (> 32k pages).

``copy_pages`` (and ``copy_kv_pages``, both pools of a layer in one launch) is the NVRTC kernel of
:mod:`.uva_copy`, which itself falls back to torch indexing when
cuda-python is missing or a tensor is not addressable from the device (pageable host memory).
``copy_rows`` (a prompt's offload, a follow-up's prefix read) is one ``cuMemcpy2DAsync`` of :mod:`.row_copy`.
"""

from __future__ import annotations

from . import KernelOps
from types import SimpleNamespace

from .append import append_token
from .minmax import minmax_update
from .ops import traced
from .page_lse import page_lse
from .row_copy import RowCopier
from .scores import page_scores
from .select import select_pages
from .slots import place_page, reseat_slots
from .sparse_decode import sparse_decode
from .uva_copy import PageCopier

# The kernels themselves (what the custom ops of .ops run on CUDA tensors).  The copier owns the compiled
# NVRTC kernel (one per device, built on first use), so that cache lives exactly as long as this module.
_COPIER = PageCopier()
GPU_KERNELS = SimpleNamespace(append_token=append_token, page_scores=page_scores, page_lse=page_lse,
                              select_pages=select_pages,
                              sparse_decode=sparse_decode, copy_kv_pages=_COPIER.copy_kv_pages,
                              reseat_slots=reseat_slots, place_page=place_page)

# The decode-step kernels go through .ops (direct launches eagerly, custom ops under torch.compile); the
# prompt-side ones (minmax over a chunk, row copies) and the one-pool page copy (benchmarks; the cache copies K
# and V together) run eagerly only.
GPU_OPS = KernelOps(
    name="triton",
    minmax_update=minmax_update,
    append_token=traced("append_token", append_token),
    page_scores=traced("page_scores", page_scores),
    page_lse=traced("page_lse", page_lse),
    select_pages=traced("select_pages", select_pages),
    sparse_decode=traced("sparse_decode", sparse_decode),
    copy_pages=_COPIER.copy_pages,
    copy_kv_pages=traced("copy_kv_pages", GPU_KERNELS.copy_kv_pages),
    copy_rows=RowCopier().copy_rows,
    reseat_slots=traced("reseat_slots", reseat_slots),
    place_page=traced("place_page", place_page),
)
