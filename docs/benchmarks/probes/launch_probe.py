"""What makes a CUDA graph's launch slow? (run 30 probe, not shipped)  Graphs of ~1,500 tiny kernels: one stream;
with 32 forks to a side stream and joins; with the forks' side kernels being the cuda.core UVA page copy (pinned
host source); with 32 memcpy DtoD nodes.  Per graph: host microseconds in replay() (device idle before), and device
ms from an event before replay to one after (median of 30)."""
import json, statistics, time, torch
from flexicache_hf.kernels.uva_copy import PageCopier

dev = "cuda"
xs = [torch.zeros(64, device=dev) for _ in range(8)]
side = torch.cuda.Stream(priority=0)
cp = PageCopier(host_grid=32)
hk, hv = (torch.randn(1000, 8, 128).to(torch.bfloat16).pin_memory() for _ in "kv")
dk, dv = (torch.zeros(1000, 8, 128, dtype=torch.bfloat16, device=dev) for _ in "kv")
di = torch.full((1024,), -1, device=dev, dtype=torch.long); si = torch.zeros(1024, device=dev, dtype=torch.long)
a, b = torch.zeros(1 << 16, device=dev), torch.zeros(1 << 16, device=dev)

def body(forks=0, side_kind=None, memcpys=0, n=1500):
    for i in range(n):
        xs[i % 8].add_(1)
        if forks and i % (n // forks) == 0:
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                if side_kind == "copy":
                    cp.copy_kv_pages(dk, dv, di, hk, hv, si)
                else:
                    xs[7].mul_(1)
            torch.cuda.current_stream().wait_stream(side)
        if memcpys and i % (n // memcpys) == 0:
            a.copy_(b)

variants = {"one_stream": dict(), "forks32_kernel": dict(forks=32), "forks32_uva_copy": dict(forks=32, side_kind="copy"),
            "memcpy32": dict(memcpys=32), "one_stream_750": dict(n=750), "one_stream_3000": dict(n=3000)}
out = {}
for name, kw in variants.items():
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        body(**kw)
    torch.cuda.current_stream().wait_stream(s); torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        body(**kw)
    g.replay(); torch.cuda.synchronize()
    host, devms = [], []
    for _ in range(30):
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        t = time.perf_counter(); g.replay(); host.append(1e6 * (time.perf_counter() - t))
        e1.record(); torch.cuda.synchronize(); devms.append(e0.elapsed_time(e1))
    out[name] = {"replay_host_us": round(statistics.median(host), 1), "device_ms": round(statistics.median(devms), 3)}
    print(name, out[name], flush=True)
print(json.dumps(out))
