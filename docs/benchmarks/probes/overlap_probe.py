"""Can the UVA page-copy kernel run beside decode GEMMs inside one CUDA graph? (run 30 probe, not shipped)

Compute: 32 layers of a Llama-3.1-8B decode step's GEMMs at 16 rows (bf16).  Copies: 16,384 pages of 8 tokens x 128
(K and V, 64 MiB) from pinned host memory, one launch.  Graphs: compute alone, copies alone, both (copies forked on a
side stream at the start, joined at the end), copies as 4 launches forked at layers 0/8/16/24, and the copy engine
(one contiguous 64 MiB cudaMemcpyAsync) forked.  Prints ms per replay (median of 20)."""
import json, sys, statistics, torch
from flexicache_hf.kernels.uva_copy import PageCopier

torch.manual_seed(0)
dev = "cuda"
B, Dm, F, L = 16, 4096, 14336, 32
W = [(torch.randn(Dm, 6144, device=dev, dtype=torch.bfloat16) * .01, torch.randn(4096, Dm, device=dev, dtype=torch.bfloat16) * .01,
      torch.randn(Dm, 2 * F, device=dev, dtype=torch.bfloat16) * .01, torch.randn(F, Dm, device=dev, dtype=torch.bfloat16) * .01) for _ in range(L)]
x0 = torch.randn(B, Dm, device=dev, dtype=torch.bfloat16)
page, D, M = 8, 128, 16384
host_pages = 400_000
hk, hv = (torch.randn(host_pages, page, D).to(torch.bfloat16).pin_memory() for _ in "kv")
dk, dv = (torch.zeros(40_000, page, D, dtype=torch.bfloat16, device=dev) for _ in "kv")
di = torch.randperm(40_000, device=dev)[:M]
si = torch.randint(0, host_pages, (M,), device=dev)
contig_src = torch.empty(64 << 20, dtype=torch.uint8).pin_memory()
contig_dst = torch.empty(64 << 20, dtype=torch.uint8, device=dev)
grid = int(sys.argv[1]) if len(sys.argv) > 1 else 32
cp = PageCopier(host_grid=grid)
side = torch.cuda.Stream(priority=0)
side_hi = torch.cuda.Stream(priority=-3)

def layer(x, w):
    h = x @ w[0]; a = h[:, :4096] @ w[1]; x = x + a
    g = x @ w[2]; x = x + (torch.nn.functional.silu(g[:, :F]) * g[:, F:]) @ w[3]
    return x

def compute(fork_at=None, copy_fn=None, stream=None):
    x = x0
    for l in range(L):
        if fork_at is not None and l in fork_at:
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                copy_fn(fork_at[l])
        x = layer(x, W[l])
    if fork_at is not None:
        torch.cuda.current_stream().wait_stream(stream)
    return x

def copies(part=None):
    d, s = (di, si) if part is None else (di[part], si[part])
    cp.copy_kv_pages(dk, dv, d, hk, hv, s)

def ce(part=None):
    contig_dst.copy_(contig_src, non_blocking=True)

quarters = [slice(i * M // 4, (i + 1) * M // 4) for i in range(4)]
variants = {
    "compute": lambda: compute(),
    "copies": lambda: copies(),
    "both_fork0": lambda: compute({0: None}, copies, side),
    "both_fork0_hiprio": lambda: compute({0: None}, copies, side_hi),
    "both_4forks": lambda: compute({0: quarters[0], 8: quarters[1], 16: quarters[2], 24: quarters[3]}, copies, side),
    "copy_engine_alone": lambda: ce(),
    "both_copy_engine": lambda: compute({0: None}, ce, side),
}
res = {}
for name, fn in variants.items():
    for mode in ("graph", "eager"):
        if mode == "graph":
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(2): fn()
            torch.cuda.current_stream().wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                fn()
            run = g.replay
        else:
            run = fn
        ts = []
        for _ in range(25):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record(); run(); b.record(); torch.cuda.synchronize(); ts.append(a.elapsed_time(b))
        res[f"{name}/{mode}"] = round(statistics.median(ts[5:]), 3)
        print(name, mode, res[f"{name}/{mode}"], flush=True)
ok = torch.equal(dk[di[:100]].cpu(), hk[si[:100].cpu()])
print(json.dumps({"grid": grid, "exact": ok, "ms": res}))
