"""The tier-copy kernel's host -> device bandwidth: a re-rank's page loads, K and V pools in one launch (CUDA).

    python -m flexicache_hf.bench.tier_copy [--pages 8,16] [--grids 32,64,128] [--json FILE]

Pinned host pools and device pools of Llama-3.1-8B's head dim (128, bf16), index lists of 10,240 and 20,480 entries
(8 and 16 rows x 5 stable heads x 256 selected pages) with 40 % or 100 % of the entries promoted (the rest -1, as a
captured step's lists are), and an all-skip list (what a layer not re-ranking pays); each list through the pinned
tensors themselves (``via: host``) and through their CUDA views (``via: view``, the host tier's ``device_pages``,
what a decode step passes). Per row: the copy checked exact against torch indexing, microseconds per launch (CUDA
events over 20 launches) and GB/s of pages moved.
The first row is the machine's ceiling: a contiguous 64 MiB pinned host -> device copy.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from . import emit_json

LISTS = ((10_240, 0.4), (10_240, 1.0), (20_480, 0.4), (20_480, 0.0))  # (entries, share promoted)


def run(page: int, copiers: dict, head_dim: int = 128) -> list[dict]:
    """The rows of one page size; ``copiers``: a :class:`~flexicache_hf.kernels.uva_copy.PageCopier` per grid."""
    import torch

    from ..tiers import cuda_alias

    g = torch.Generator().manual_seed(0)
    host_pages, device_pages = 1_600_000 // page, 40_000
    hk, hv = (torch.randn(host_pages, page, head_dim, generator=g).to(torch.bfloat16).pin_memory() for _ in "kv")
    views = {"host": (hk, hv), "view": tuple(cuda_alias(t, torch.device("cuda")) for t in (hk, hv))}
    dk, dv = (torch.zeros(device_pages, page, head_dim, dtype=torch.bfloat16, device="cuda") for _ in "kv")
    page_bytes = page * head_dim * 2
    rows = []
    for m, share in LISTS:
        di = torch.randperm(device_pages, generator=g)[:m]
        di[torch.rand(m, generator=g) >= share] = -1
        si = torch.randint(0, host_pages, (m,), generator=g)
        listed = (di >= 0).nonzero().squeeze(1)
        di_d, si_d = di.cuda(), si.cuda()
        for (grid, copier), via in ((c, v) for c in copiers.items() for v in views):
            sk, sv = views[via]
            dk.zero_()
            dv.zero_()
            copier.copy_kv_pages(dk, dv, di_d, sk, sv, si_d)
            torch.cuda.synchronize()
            exact = all(torch.equal(d[di[listed].cuda()].cpu(), h[si[listed]]) for d, h in ((dk, hk), (dv, hv)))
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(20):
                copier.copy_kv_pages(dk, dv, di_d, sk, sv, si_d)
            end.record()
            torch.cuda.synchronize()
            us = start.elapsed_time(end) / 20 * 1e3
            rows.append({"page_size": page, "entries": m, "promoted": int(listed.numel()), "grid": grid, "via": via,
                         "us": round(us, 1), "gb_s": round(2 * listed.numel() * page_bytes / us / 1e3, 1),
                         "exact": exact})
            print(rows[-1], flush=True)
    return rows


def contiguous_ceiling(mib: int = 64) -> dict:
    """This machine's ceiling: one contiguous pinned host -> device copy (the copy engines, no kernel) in GB/s."""
    import torch

    src = torch.empty(mib << 20, dtype=torch.uint8).pin_memory()
    dst = torch.empty_like(src, device="cuda")
    dst.copy_(src, non_blocking=True)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        dst.copy_(src, non_blocking=True)
    end.record()
    torch.cuda.synchronize()
    us = start.elapsed_time(end) / 10 * 1e3
    row = {"contiguous_mib": mib, "us": round(us, 1), "gb_s": round(src.numel() / us / 1e3, 1)}
    print(row, flush=True)
    return row


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pages", default="8,16", help="page sizes, comma separated (default: 8,16)")
    ap.add_argument("--grids", default="32,64,128", help="blocks of a host copy, comma separated")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("bench.tier_copy needs a CUDA device")
    from ..kernels.uva_copy import PageCopier

    # one launch a copy, as in a captured step (chunk_pages=None), the grid swept
    copiers = {int(x): PageCopier(host_grid=int(x), chunk_pages=None) for x in a.grids.split(",") if x}
    rows = [contiguous_ceiling()] + [r for p in a.pages.split(",") if p for r in run(int(p), copiers)]
    args = sys.argv[1:] if argv is None else argv
    return emit_json({"command": "python -m flexicache_hf.bench.tier_copy " + " ".join(args),
                      "device": torch.cuda.get_device_name(), "rows": rows}, a.json)


if __name__ == "__main__":
    main()
