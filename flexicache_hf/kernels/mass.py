"""Triton twin of :func:`flexicache_hf.kernels.reference.group_mass`: a group's summed softmax mass per page.

The ``"mass"`` combine of the stable heads' bounds (:func:`.scores.page_scores`) and the unstable heads' exact
mass (:func:`.reference.exact_page_mass` over :func:`.page_lse.page_lse`) both end here.  The reference's ~8
PyTorch ops over ``[B, h, G, P]`` (max, exp, sums, a division, the finiteness test, the masks) become one launch:

* one program per row ``(b, j)``: its ``[G, P]`` scores are read as ``[G_PAD, BLOCK_P]`` tiles, every query head
  of the group at once;
* pass 1 keeps an online maximum and sum of exponentials per query head over the page blocks that exist (the
  loop bound is ``num_pages``, read on the device, not the row's capacity); pass 2 re-reads those blocks and
  stores ``sum_g exp(scale * s_g - max_g) / sum_g``, ``-inf`` where no query head has a finite score;
* the row past ``num_pages`` and an inactive row (a stable head between its re-ranks, launched anyway inside a
  captured step) are neither read nor written: what the reference stores there (``-inf``) no caller reads (the
  select reads the live pages of the active rows), and storing it cost a write of every reserved row's whole width
  each step (an unsized cache's rows are reserved for the model's context: 8x the live pages at 16k of 128k).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._util import pow2

TILE_ELEMENTS = 4096  # scores per tile: G_PAD x BLOCK_P (32 per thread at 4 warps)
TINY = tl.constexpr(1.1754943508222875e-38)  # torch.finfo(torch.float32).tiny: the reference's clamp of an empty sum


# One variant for every layer (each variant is a compile in a machine's first process): the row flags are read one
# scalar at a time, so their address's alignment (a slice of a layer's flags) changes no code; the scores' strides
# are h * G * width, G * width, width (h: the layer's heads of this kind, width: its page capacity), multiples of 16
# in some layers only, and a decode step's rows (the capacity, 16k + 1 pages) are never aligned anyway.
@triton.jit(do_not_specialize=["width", "n_sel", "s_sb", "s_sh", "s_sg"], do_not_specialize_on_alignment=["active_ptr"])
def _group_mass_kernel(
    s_ptr,  # [B, h, G, width] float32 per query head; -inf = not scorable
    out_ptr,  # [B, h, width] float32, contiguous
    num_pages_ptr,  # [1] int64 pages that exist (read on the device: graph replays see the current count)
    active_ptr,  # [h] bool: rows to combine (False: the row is all -inf, nothing else is read)
    scale,
    width,  # pages per row (the capacity)
    n_sel,  # h
    s_sb, s_sh, s_sg, s_sp,
    GROUP: tl.constexpr,
    G_PAD: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)  # row b * h + j
    b = r // n_sel
    j = r % n_sel
    on = tl.load(active_ptr + j).to(tl.int32) != 0
    # The pages to combine: none on an inactive row (its count is not even read), so its loops never run.
    n = tl.minimum(tl.load(num_pages_ptr, mask=on, other=0), width)
    p = tl.arange(0, BLOCK_P)
    g = tl.arange(0, G_PAD)
    rows = s_ptr + b * s_sb + j * s_sh + (g * s_sg)[:, None]  # [G_PAD, 1] each query head's scores
    g_ok = (g < GROUP)[:, None]
    out_row = out_ptr + r * width
    # Pass 1: per query head, the maximum and the sum of exp(x - maximum), rescaled as the maximum grows.
    top = tl.full([G_PAD], float("-inf"), tl.float32)
    total = tl.zeros([G_PAD], tl.float32)
    for p0 in range(0, n, BLOCK_P):
        pp = p0 + p
        x = tl.load(rows + (pp * s_sp)[None, :], mask=g_ok & (pp < n)[None, :], other=float("-inf")) * scale
        new = tl.maximum(top, tl.max(x, axis=1))
        ref = tl.where(new == float("-inf"), 0.0, new)  # nothing finite yet: every exp below is exp(-inf) = 0
        total = total * tl.exp(top - ref) + tl.sum(tl.exp(x - ref[:, None]), axis=1)
        top = new
    ref = tl.where(top == float("-inf"), 0.0, top)[:, None]
    total = tl.maximum(total, TINY)[:, None]  # a head with nothing finite: 0 / tiny = 0, as the reference
    # Pass 2: the group's summed distribution; -inf where no query head scores the page.
    for p0 in range(0, n, BLOCK_P):
        pp = p0 + p
        x = tl.load(rows + (pp * s_sp)[None, :], mask=g_ok & (pp < n)[None, :], other=float("-inf"))
        mass = tl.sum(tl.exp(x * scale - ref) / total, axis=0)
        scored = tl.max((x > float("-inf")).to(tl.int32), axis=0) != 0
        tl.store(out_row + pp, tl.where(scored, mass, float("-inf")), mask=pp < width)


def group_mass(
    scores: torch.Tensor,  # [B, h, G, P] float32 per query head; -inf = not scorable
    scale: float,
    num_pages: int | torch.Tensor | None = None,  # [1] int64 device tensor (an int or None: P)
    active: torch.Tensor | None = None,  # [h] bool rows to combine (None: all)
    *,
    block_p: int | None = None,  # pages per tile (benchmarks sweep it); None: TILE_ELEMENTS // G_PAD
    num_warps: int = 4,
) -> torch.Tensor:  # [B, h, P] float32
    """Same contract as :func:`reference.group_mass` on the live pages of the active rows (the rest is left
    unwritten: see the module's docstring)."""
    B, h, G, width = scores.shape
    out = torch.empty((B, h, width), dtype=torch.float32, device=scores.device)  # live entries of active rows written
    if B * h == 0 or width == 0:
        return out
    if not isinstance(num_pages, torch.Tensor):
        num_pages = torch.full((1,), width if num_pages is None else num_pages, dtype=torch.long,
                               device=scores.device)
    if active is None:
        active = torch.ones(h, dtype=torch.bool, device=scores.device)
    if scores.dtype != torch.float32:
        scores = scores.float()
    g_pad = pow2(G)
    block_p = block_p or min(pow2(width, 16), max(16, TILE_ELEMENTS // g_pad))
    _group_mass_kernel[(B * h,)](
        scores, out, num_pages, active, float(scale), width, h, *scores.stride(),
        GROUP=G, G_PAD=g_pad, BLOCK_P=block_p, num_warps=num_warps,
    )
    return out
