"""The page-major host tier's CUDA paths against the CPU reference: a prompt chunk's rows in and out through
``cuMemcpy2DAsync`` span by span, and the UVA page copies (incremental offload, promoted pages) at the page-major
flat index.

Skipped without CUDA; from the repository root: ``PYTHONPATH=$PWD python3 -m pytest -q -m gpu
tests/gpu/test_page_major_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DEV = torch.device("cuda")
CPU = torch.device("cpu")


def tiers(B, H, ps, D, dtype, cap):
    """A pinned tier on CUDA (Triton / cuda-python kernels) and its CPU twin (reference kernels)."""
    from flexicache_hf.kernels import REFERENCE_OPS, TRITON_OPS
    from flexicache_hf.tiers import CopyStream, HostTier

    cuda = HostTier(B, H, ps, D, dtype, DEV, None, CopyStream(DEV), TRITON_OPS)
    cpu = HostTier(B, H, ps, D, dtype, CPU, None, CopyStream(CPU), REFERENCE_OPS)
    for t in (cuda, cpu):
        t.grow(cap)
        t.k.zero_()  # a kept pinned block is never zeroed (it may hold NaN from its last use): compared whole below
        t.v.zero_()
    return cuda, cpu


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("B,H,first,T", [(1, 6, 5, 700), (16, 6, 0, 256), (2, 3, 13, 3), (4, 2, 16, 1000)])
def test_host_tier_rows_through_the_driver_equal_the_reference(dtype, B, H, first, T, monkeypatch):
    """write_tokens / read_tokens of a pinned page-major tier on the copy stream: the reference's bytes; written, the
    whole pages one block (one cuMemcpyAsync: one registration) and each partial page one 2D copy, none through the
    per-run fallback; read back, one block."""
    from flexicache_hf.kernels import TRITON_OPS
    from flexicache_hf.kernels.row_copy import RowCopier
    from flexicache_hf.pages import token_spans

    ps, D = 16, 128
    cap = (first + T) // ps + 3
    cuda, cpu = tiers(B, H, ps, D, dtype, cap)
    assert cuda.k.is_pinned() and cuda.k.shape == (cuda.page_capacity, B, H, ps, D)
    k = torch.randn(B, H, T, D, device=DEV).to(dtype)
    v = torch.randn(B, H, T, D, device=DEV).to(dtype)
    calls = {"2d": 0, "flat": 0, "per_run": 0}
    two_d, flat, per_run = RowCopier._copy_2d, RowCopier._copy_flat, RowCopier._per_run
    monkeypatch.setattr(RowCopier, "_copy_2d", lambda *a: calls.__setitem__("2d", calls["2d"] + 1) or two_d(*a))
    monkeypatch.setattr(RowCopier, "_copy_flat", lambda *a: calls.__setitem__("flat", calls["flat"] + 1) or flat(*a))
    monkeypatch.setattr(RowCopier, "_per_run", staticmethod(
        lambda d, s: calls.__setitem__("per_run", calls["per_run"] + 1) or per_run(d, s)))
    with cuda.copies:
        cuda.write_tokens(k, v, first)
    cuda.copies.synchronize()
    cpu.write_tokens(k.cpu(), v.cpu(), first)
    copier = TRITON_OPS.copy_rows.__self__
    assert copier.unavailable is None, copier.unavailable
    spans = token_spans(first, first + T, ps)
    whole = sum(span.hi - span.lo == ps for span in spans)  # (a run of whole pages: at most one span)
    assert calls == {"2d": 2 * (len(spans) - whole), "flat": 2 * whole, "per_run": 0}, calls
    span = slice(first // ps, -(-(first + T) // ps))  # the pages written (positions outside: never read)
    lo, hi = first % ps, (first + T - 1) % ps + 1
    for mine, ref in ((cuda.k, cpu.k), (cuda.v, cpu.v)):
        got, want = mine[span].clone(), ref[span].clone()
        got[0, :, :, :lo] = want[0, :, :, :lo] = 0
        got[-1, :, :, hi:] = want[-1, :, :, hi:] = 0
        assert torch.equal(got, want)
    back = torch.empty_like(k), torch.empty_like(v)
    with cuda.copies:
        cuda.read_tokens(*back, first=first)
    cuda.copies.hand_off()
    torch.cuda.synchronize()
    assert torch.equal(back[0], k) and torch.equal(back[1], v)
    assert calls["flat"] == 2 * whole + 2 and calls["per_run"] == 0  # read back: one block each of K and V


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_offload_and_promoted_pages_at_the_page_major_index_through_uva(dtype):
    """offload_page (a filled page of every (row, head) from its slot) and load_promoted (host pages into slots)
    through the UVA kernel on the tier's CUDA alias, against the reference on a CPU twin; growth keeps the pages."""
    from flexicache_hf.kernels import REFERENCE_OPS, TRITON_OPS
    from flexicache_hf.pages import PagePool, PoolLayout
    from flexicache_hf.tiers import load_promoted, offload_page

    B, H, ps, D, slots, cap = 3, 4, 16, 128, 6, 40
    cuda, cpu = tiers(B, H, ps, D, dtype, cap)
    layout = PoolLayout(B, H, slots, 1, cap)
    pools = {dev: PagePool(layout, torch.tensor([H], device=dev), torch.arange(H, device=dev), H + 1, ps, D, dtype,
                           dev) for dev in (DEV, CPU)}
    g = torch.Generator().manual_seed(0)
    for name in ("k", "v"):
        data = torch.randn(layout.num_physical, ps, D, generator=g).to(dtype)
        getattr(pools[CPU], name).copy_(data)
        getattr(pools[DEV], name).copy_(data.to(DEV))
    phys = 1 + torch.randperm(B * H * slots, generator=g)[: B * H].view(B, H)
    for page in (0, 7, cap - 1):
        offload_page(TRITON_OPS, pools[DEV], cuda, torch.tensor([page], device=DEV), phys.to(DEV))
        offload_page(REFERENCE_OPS, pools[CPU], cpu, page, phys)
    torch.cuda.synchronize()
    assert torch.equal(cuda.k, cpu.k) and torch.equal(cuda.v, cpu.v)
    assert torch.equal(cuda.k[7, 1, 2], pools[CPU].k[int(phys[1, 2])])
    cuda.grow(cap + 30)
    cpu.grow(cap + 30)
    pages = torch.tensor([[[7, -1, 0]] * H] * B)
    pages[1, 2] = torch.tensor([cap - 1, 7, -1])
    dst = torch.where(pages >= 0, 1 + torch.randperm(B * H * slots, generator=g)[: B * H * 3].view(B, H, 3), -1)
    load_promoted(TRITON_OPS, pools[DEV], cuda, pages.to(DEV), dst.to(DEV))
    load_promoted(REFERENCE_OPS, pools[CPU], cpu, pages, dst)
    torch.cuda.synchronize()
    assert torch.equal(pools[DEV].k.cpu(), pools[CPU].k) and torch.equal(pools[DEV].v.cpu(), pools[CPU].v)
