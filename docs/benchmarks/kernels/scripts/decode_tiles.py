"""sparse_decode and page_lse: tile, warps, stages and splits swept at the README call's layer (CUDA graph).

    PYTHONPATH=$PWD python3 docs/benchmarks/kernels/scripts/decode_tiles.py OUT.json [B ...]

Shapes (the README call's defaults on Llama-3.1-8B's shape): 32 query / 8 KV heads, D 128, bf16, 8-token pages,
16,384-token rows (2,048 pages, physical pages shuffled), budget 2,048 tokens: every head attends 257 pages;
2 unstable heads of 8 get every page scored by page_lse.  Two layers' pools alternate in a graph of 32 calls (every
pool is larger than L2).  Each row: microseconds a call, GB/s of keys (page_lse) or keys + values (sparse_decode)
read, and whether its output equals the default launch's.
"""
import json
import sys

import torch

from flexicache_hf.bench.decode import time_graph
from flexicache_hf.kernels.page_lse import page_lse
from flexicache_hf.kernels.sparse_decode import sparse_decode


def timed(f, calls=32):
    """Microseconds a call, ``calls`` calls alternating the two layers' pools in one CUDA graph (median of 7)."""
    ms = time_graph(f, 2, calls=calls, reps=7)
    if ms is None:
        raise RuntimeError("graph capture failed")
    return ms * 1e3


def main():
    out_path = sys.argv[1] if len(sys.argv) > 1 else "/dev/null"
    batches = [int(x) for x in sys.argv[2:]] or [8, 16]
    torch.manual_seed(0)
    Hq, H, D, ps, P, W = 32, 8, 128, 8, 2048, 257
    rows = []
    for B in batches:
        N = B * H * P + 1
        kp = [torch.randn(N, ps, D, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
        vp = [torch.randn(N, ps, D, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
        table = (torch.randperm(N - 1, device="cuda")[: B * H * P] + 1).view(B, H, P).to(torch.int32)
        q = torch.randn(B, Hq, D, device="cuda", dtype=torch.bfloat16)
        pages = torch.stack([torch.randperm(P, device="cuda")[:W] for _ in range(B * H)]).view(B, H, W)
        valid_lo = torch.zeros(B, dtype=torch.long, device="cuda")
        seq = torch.tensor([P * ps], device="cuda")
        npages = torch.tensor([P], device="cuda")
        heads = torch.tensor([1, 5], device="cuda")
        scale = D ** -0.5
        # sparse_decode
        base = None
        gb = B * H * W * ps * D * 2 * 2 / 1e9
        for bn in (None, 64, 128, 256):
            for warps in (4, 8):
                for stages in (2, 3):
                    for splits in (None, 4, 8, 16):
                        def f(i=0):
                            return sparse_decode(q, kp[i], vp[i], table, pages, valid_lo, seq, scale, num_splits=splits,
                                                 block_n=bn, num_warps=warps, num_stages=stages)
                        try:
                            o = f()
                            if base is None:
                                base = o.clone()
                            ok = bool(torch.allclose(o.float(), base.float(), rtol=2e-2, atol=2e-2))
                            us = timed(f)
                        except Exception as e:  # e.g. out of shared memory at a large tile
                            rows.append(dict(kernel="sparse_decode", B=B, block_n=bn, warps=warps, stages=stages,
                                             splits=splits, error=type(e).__name__))
                            continue
                        rows.append(dict(kernel="sparse_decode", B=B, block_n=bn, warps=warps, stages=stages,
                                         splits=splits, us=round(us, 2), gbps=round(gb / us * 1e6, 1), ok=ok))
                        print(rows[-1], flush=True)
        # page_lse
        base = None
        gb = B * 2 * P * ps * D * 2 / 1e9
        for bn in (None, 32, 128, 256):
            for warps in (2, 4, 8):
                def f(i=0):
                    return page_lse(q, kp[i], table, heads, npages, valid_lo, seq, scale, block_n=bn, num_warps=warps)
                try:
                    o = f()
                    if base is None:
                        base = o.clone()
                    ok = bool(torch.allclose(o, base, rtol=1e-2, atol=1e-2))
                    us = timed(f)
                except Exception as e:
                    rows.append(dict(kernel="page_lse", B=B, block_n=bn, warps=warps, error=type(e).__name__))
                    continue
                rows.append(dict(kernel="page_lse", B=B, block_n=bn, warps=warps, us=round(us, 2),
                                 gbps=round(gb / us * 1e6, 1), ok=ok))
                print(rows[-1], flush=True)
        del kp, vp
        torch.cuda.empty_cache()
    json.dump(rows, open(out_path, "w"), indent=1)
    for kern in ("sparse_decode", "page_lse"):
        for B in batches:
            rs = sorted((r for r in rows if r["kernel"] == kern and r["B"] == B and "us" in r), key=lambda r: r["us"])
            if rs:
                default = rs[[i for i, r in enumerate(rs) if r.get("block_n") is None and r["warps"] == 4
                              and r.get("stages", 2) == 2 and r.get("splits") is None][0]]
                print(kern, B, "default", default["us"], "best", rs[0])


if __name__ == "__main__":
    main()
