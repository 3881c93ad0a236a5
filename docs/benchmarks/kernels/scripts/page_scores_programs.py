"""page_scores: the per-row program cap, tile and warps swept at the README call's layer (CUDA graph of 20 calls).

    PYTHONPATH=$PWD python3 docs/benchmarks/kernels/scripts/page_scores_programs.py OUT.json

Run 29a (H100): docs/benchmarks/kernels/run29a-page-scores-programs-h100.json. Rows: B 8 and 16 x 5 stable heads of 8,
32 query heads, D 128, rows reserved for 16,384 pages with 2,048 live, "mass" scores, shrink 0.5, heads active or not.
"""
import json, sys, torch
from flexicache_hf.kernels.scores import page_scores
torch.manual_seed(0)
rows = []
for B in (8, 16):
    H, Hq, D, Pcap, live = 8, 32, 128, 16384, 2048
    q = torch.randn(B, Hq, D, device="cuda", dtype=torch.bfloat16)
    kmin = torch.full((B, H, Pcap, D), float("-inf"), device="cuda", dtype=torch.bfloat16)
    kmax = kmin.clone()
    a = torch.randn(B, H, live, D, device="cuda", dtype=torch.bfloat16)
    kmin[:, :, :live] = a - 0.5; kmax[:, :, :live] = a + 0.5
    heads = torch.tensor([0, 2, 3, 5, 6], device="cuda")
    n = torch.tensor([live], device="cuda")
    for on in (True, False):
        active = torch.full((5,), on, device="cuda")
        base = None
        for bp, w in ((64, 8), (32, 4), (64, 4)):
            for prog in (None, 64, 32, 16, 8, 4):
                f = lambda: page_scores(q, kmin, kmax, heads, n, active, "mass", 0.088, 0.5, block_p=bp, num_warps=w, programs=prog)
                out = f(); torch.cuda.synchronize()
                ok = True
                if on:
                    if base is None: base = out[..., :live].clone()
                    ok = bool(torch.allclose(out[..., :live], base, rtol=1e-4, atol=1e-4))
                s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(s):
                    for _ in range(3): f()
                torch.cuda.current_stream().wait_stream(s)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    for _ in range(20): f()
                g.replay(); torch.cuda.synchronize()
                e0, e1 = torch.cuda.Event(True), torch.cuda.Event(True)
                e0.record()
                for _ in range(5): g.replay()
                e1.record(); torch.cuda.synchronize()
                us = e0.elapsed_time(e1) / 100 * 1e3
                rows.append(dict(B=B, active=on, block_p=bp, warps=w, programs=prog, us=round(us, 2), ok=ok))
                print(rows[-1], flush=True)
json.dump(rows, open(sys.argv[1] if len(sys.argv) > 1 else "/dev/null", "w"), indent=1)
