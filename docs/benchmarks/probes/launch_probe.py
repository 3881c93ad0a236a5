"""What makes a CUDA graph's launch slow? (run 30 probe; PYTHONPATH=<checkout> python3 launch_probe.py [--registered])

Graphs of ~1,500 tiny kernels: one stream; with 32 forks to a side stream and joins; with the forks' side kernels
being the tier-copy kernel reading pinned host memory (torch's ``pin_memory``); with 32 memcpy DtoD nodes.  With
``--registered`` also: the forks' copies reading 64 blocks of host memory page-locked the host tier's way
(``host_memory.PinnedBlock``: mapped, populated, ``cuMemHostRegister``; 100 MiB each) through their CUDA views
(``tiers.cuda_alias``), as a decode step's copies do.  Per graph: host microseconds in ``replay()`` (the device idle
before) and device ms from an event before the replay to one after (median of 30)."""
import json
import statistics
import sys
import time

import torch

from flexicache_hf.kernels.uva_copy import PageCopier

dev = "cuda"
xs = [torch.zeros(64, device=dev) for _ in range(8)]
side = torch.cuda.Stream(priority=0)
cp = PageCopier(host_grid=32)
hk, hv = (torch.randn(1000, 8, 128).to(torch.bfloat16).pin_memory() for _ in "kv")
dk, dv = (torch.zeros(1000, 8, 128, dtype=torch.bfloat16, device=dev) for _ in "kv")
di = torch.full((1024,), -1, device=dev, dtype=torch.long)
di[::64] = torch.arange(16, device=dev)
si = torch.zeros(1024, device=dev, dtype=torch.long)
a, b = torch.zeros(1 << 16, device=dev), torch.zeros(1 << 16, device=dev)
sources = [(hk, hv)] * 32
if "--registered" in sys.argv:
    from flexicache_hf.host_memory import PinnedBlock
    from flexicache_hf.tiers import cuda_alias

    blocks = [PinnedBlock(100 << 20, align=2048, device=0) for _ in range(64)]
    lent = [blk.lend(lambda _b: None) for blk in blocks]
    views = [cuda_alias(t.view(torch.bfloat16).view(-1, 8, 128), torch.device(dev)) for t in lent]
    registered = [(views[2 * i], views[2 * i + 1]) for i in range(32)]


def body(forks=0, side_kind=None, memcpys=0, n=1500, srcs=None):
    for i in range(n):
        xs[i % 8].add_(1)
        if forks and i % (n // forks) == 0:
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                if side_kind == "copy":
                    k, v = (srcs or sources)[(i // (n // forks)) % 32]
                    cp.copy_kv_pages(dk, dv, di, k, v, si)
                else:
                    xs[7].mul_(1)
            torch.cuda.current_stream().wait_stream(side)
        if memcpys and i % (n // memcpys) == 0:
            a.copy_(b)


variants = {"one_stream": dict(), "forks32_kernel": dict(forks=32), "forks32_uva_copy": dict(forks=32, side_kind="copy"),
            "memcpy32": dict(memcpys=32), "one_stream_750": dict(n=750), "one_stream_3000": dict(n=3000)}
if "--registered" in sys.argv:
    variants["forks32_uva_copy_registered_views"] = dict(forks=32, side_kind="copy", srcs=registered)
out = {}
for name, kw in variants.items():
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        body(**kw)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        body(**kw)
    g.replay()
    torch.cuda.synchronize()
    host, devms = [], []
    for _ in range(30):
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        t = time.perf_counter()
        g.replay()
        host.append(1e6 * (time.perf_counter() - t))
        e1.record()
        torch.cuda.synchronize()
        devms.append(e0.elapsed_time(e1))
    out[name] = {"replay_host_us": round(statistics.median(host), 1), "device_ms": round(statistics.median(devms), 3)}
    print(name, out[name], flush=True)
print(json.dumps(out))
