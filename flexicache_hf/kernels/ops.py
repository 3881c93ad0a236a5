"""The kernels of a decode step as ``torch.library`` custom ops, for ``torch.compile``.

Dynamo cannot trace into a Triton launcher's host code (block-size choices, cached SM counts), a cuda-python
launch or the PyTorch reference's data-dependent shapes, and must not: the decode step it captures in a CUDA
graph has to replay the launches exactly.  Each kernel is therefore one opaque op ``flexicache::<name>`` with
a fake implementation (output shapes only) and its mutated arguments declared; the op runs the Triton /
cuda-python kernel on CUDA tensors and the :mod:`.reference` twin on others (which lets CPU tests compile a
decode step too).  Eagerly, :class:`~flexicache_hf.kernels.KernelOps` calls the kernels directly (an op's
dispatch costs more than some of these kernels); inside a compiled region it calls the op (:func:`traced`).

The host tier reaches these ops as a CUDA tensor aliasing its pinned memory
(:meth:`~flexicache_hf.tiers.HostTier.device_pages`): cudagraph trees only replay buffers that live on the
device, and the alias is one, at a fixed address.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.library import custom_op

from . import reference


def _gpu():
    from . import gpu  # Triton and cuda-python load only for CUDA tensors

    return gpu.GPU_KERNELS


def _impl(name: str, t: Tensor):
    return getattr(_gpu(), name) if t.is_cuda else getattr(reference, name)


@custom_op("flexicache::page_scores", mutates_args=())
def page_scores_op(query: Tensor, kmin: Tensor, kmax: Tensor, heads: Tensor, num_pages: Tensor,
                   active: Tensor, combine: str, scale: float, shrink: float) -> Tensor:
    return _impl("page_scores", query)(query, kmin, kmax, heads, num_pages, active, combine, scale, shrink)


@page_scores_op.register_fake
def _(query, kmin, kmax, heads, num_pages, active, combine, scale, shrink):
    return query.new_empty((query.shape[0], heads.shape[0], kmin.shape[2]), dtype=torch.float32)


@custom_op("flexicache::page_lse", mutates_args=())
def page_lse_op(query: Tensor, k_pool: Tensor, page_table: Tensor, heads: Tensor, num_pages: Tensor,
                valid_lo: Tensor, seq_len: Tensor, scale: float) -> Tensor:
    return _impl("page_lse", query)(query, k_pool, page_table, heads, num_pages, valid_lo, seq_len, scale)


@page_lse_op.register_fake
def _(query, k_pool, page_table, heads, num_pages, valid_lo, seq_len, scale):
    H = page_table.shape[1]
    return query.new_empty((query.shape[0], heads.shape[0], query.shape[1] // H, page_table.shape[2]),
                           dtype=torch.float32)


@custom_op("flexicache::select_pages", mutates_args=("out",))
def select_pages_op(scores: Tensor, k: int, num_pages: Tensor, active: Tensor, out: Tensor) -> None:
    _impl("select_pages", scores)(scores, k, num_pages=num_pages, active=active, out=out)


@select_pages_op.register_fake
def _(scores, k, num_pages, active, out):
    return None


@custom_op("flexicache::sparse_decode", mutates_args=())
def sparse_decode_op(query: Tensor, k_pool: Tensor, v_pool: Tensor, page_table: Tensor, pages: Tensor,
                     valid_lo: Tensor, seq_len: Tensor, scale: float) -> Tensor:
    return _impl("sparse_decode", query)(query, k_pool, v_pool, page_table, pages, valid_lo, seq_len, scale)


@sparse_decode_op.register_fake
def _(query, k_pool, v_pool, page_table, pages, valid_lo, seq_len, scale):
    return torch.empty_like(query)


@custom_op("flexicache::copy_kv_pages", mutates_args=("dst_k", "dst_v"))
def copy_kv_pages_op(dst_k: Tensor, dst_v: Tensor, dst_index: Tensor, src_k: Tensor, src_v: Tensor,
                     src_index: Tensor) -> None:
    _impl("copy_kv_pages", dst_k if dst_k.is_cuda else src_k)(dst_k, dst_v, dst_index, src_k, src_v, src_index)


@copy_kv_pages_op.register_fake
def _(dst_k, dst_v, dst_index, src_k, src_v, src_index):
    return None


@custom_op("flexicache::append_token", mutates_args=("k_pool", "v_pool", "kmin", "kmax"))
def append_token_op(k_pool: Tensor, v_pool: Tensor, kmin: Tensor, kmax: Tensor, key: Tensor, value: Tensor,
                    rows: Tensor, page: Tensor) -> None:
    _impl("append_token", key)(k_pool, v_pool, kmin, kmax, key, value, rows, page)


@append_token_op.register_fake
def _(k_pool, v_pool, kmin, kmax, key, value, rows, page):
    return None


@custom_op("flexicache::reseat_slots", mutates_args=("slot_page", "table_buffer"))
def reseat_slots_op(slot_page: Tensor, wanted: Tensor, slot_phys: Tensor, table_buffer: Tensor, slot_heads: Tensor,
                    num_heads: int, null_page: int, when: Tensor | None) -> tuple[Tensor, Tensor]:
    return _impl("reseat_slots", wanted)(slot_page, wanted, slot_phys, table_buffer, slot_heads, num_heads,
                                         null_page, when)


@reseat_slots_op.register_fake
def _(slot_page, wanted, slot_phys, table_buffer, slot_heads, num_heads, null_page, when):
    return wanted.new_empty(wanted.shape), wanted.new_empty(wanted.shape)  # contiguous, as the kernels return them


@custom_op("flexicache::place_page", mutates_args=("slot_page", "table_buffer", "tail"))
def place_page_op(slot_page: Tensor, slot_phys: Tensor, table_buffer: Tensor, slot_heads: Tensor, num_heads: int,
                  page: Tensor, tail: Tensor, when: Tensor | None) -> None:
    _impl("place_page", slot_page)(slot_page, slot_phys, table_buffer, slot_heads, num_heads, page, tail, when)


@place_page_op.register_fake
def _(slot_page, slot_phys, table_buffer, slot_heads, num_heads, page, tail, when):
    return None


def traced(name: str, eager):
    """``eager`` (a kernel with the :mod:`.reference` signature), or its op while torch.compile traces."""

    def page_scores(query, kmin, kmax, heads, num_pages, active=None, combine="max", scale=None, shrink=1.0):
        if torch.compiler.is_compiling():
            scale = query.shape[-1] ** -0.5 if scale is None else scale
            return page_scores_op(query, kmin, kmax, heads, num_pages, active, combine, float(scale), float(shrink))
        return eager(query, kmin, kmax, heads, num_pages, active, combine, scale, shrink)

    def page_lse(query, k_pool, page_table, heads, num_pages, valid_lo, seq_len, scale):
        if torch.compiler.is_compiling():
            return page_lse_op(query, k_pool, page_table, heads, num_pages, valid_lo, seq_len, float(scale))
        return eager(query, k_pool, page_table, heads, num_pages, valid_lo, seq_len, scale)

    def select_pages(scores, k, *, num_pages=None, active=None, out=None):
        if torch.compiler.is_compiling():
            select_pages_op(scores, k, num_pages, active, out)
            return out
        return eager(scores, k, num_pages=num_pages, active=active, out=out)

    def sparse_decode(query, k_pool, v_pool, page_table, pages, valid_lo, seq_len, scale):
        if torch.compiler.is_compiling():
            return sparse_decode_op(query, k_pool, v_pool, page_table, pages, valid_lo, seq_len, scale)
        return eager(query, k_pool, v_pool, page_table, pages, valid_lo, seq_len, scale)

    def copy_kv_pages(dst_k, dst_v, dst_index, src_k, src_v, src_index):
        if torch.compiler.is_compiling():
            return copy_kv_pages_op(dst_k, dst_v, dst_index, src_k, src_v, src_index)
        return eager(dst_k, dst_v, dst_index, src_k, src_v, src_index)

    def append_token(k_pool, v_pool, kmin, kmax, key, value, rows, page):
        if torch.compiler.is_compiling():
            return append_token_op(k_pool, v_pool, kmin, kmax, key, value, rows, page)
        return eager(k_pool, v_pool, kmin, kmax, key, value, rows, page)

    def reseat_slots(slot_page, wanted, slot_phys, table_buffer, slot_heads, num_heads, null_page, when=None):
        if torch.compiler.is_compiling():
            return reseat_slots_op(slot_page, wanted, slot_phys, table_buffer, slot_heads, num_heads, null_page, when)
        return eager(slot_page, wanted, slot_phys, table_buffer, slot_heads, num_heads, null_page, when)

    def place_page(slot_page, slot_phys, table_buffer, slot_heads, num_heads, page, tail, when=None):
        if torch.compiler.is_compiling():
            return place_page_op(slot_page, slot_phys, table_buffer, slot_heads, num_heads, page, tail, when)
        return eager(slot_page, slot_phys, table_buffer, slot_heads, num_heads, page, tail, when)

    wrapper = locals()[name]
    wrapper.__doc__ = eager.__doc__
    wrapper.eager = eager
    return wrapper
