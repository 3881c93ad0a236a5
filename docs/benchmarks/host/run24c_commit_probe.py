"""run 24c probe: committing host ranges (populate + cuMemHostRegister) with the GPU idle and busy."""
import time, threading
from concurrent.futures import ThreadPoolExecutor
import torch
from flexicache_hf import host_memory as hm
from flexicache_hf.vmm import HostRange
from flexicache_hf.host_memory import PinnedBlock, PinSettings

torch.cuda.init(); dev = 0
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
N, SZ = 8, 400 << 20
t_pop = t_reg = 0.0
_pop, _reg = hm.populate, hm.register
def pop(*x, **k):
    global t_pop; t = time.perf_counter(); r = _pop(*x, **k); t_pop += time.perf_counter() - t; return r
def reg(*x, **k):
    global t_reg; t = time.perf_counter(); r = _reg(*x, **k); t_reg += time.perf_counter() - t; return r
import flexicache_hf.vmm as vmm
vmm.populate, vmm.register, hm.populate, hm.register = pop, reg, pop, reg
def busy(n):
    for _ in range(n):
        a @ a
def run(name, load, fn):
    global t_pop, t_reg
    t_pop = t_reg = 0.0
    torch.cuda.synchronize()
    if load:
        busy(load)
    t = time.perf_counter(); keep = fn(); dt = time.perf_counter() - t
    torch.cuda.synchronize(); total = time.perf_counter() - t
    print(f"{name:<40} load={load:<5} {dt:6.2f} s ({N * SZ / dt / 1e9:5.1f} GB/s) populate {t_pop:5.2f} register {t_reg:5.2f}"
          f" gpu-done {total:5.2f}", flush=True)
    return keep
def ranges(pool=None, parallel=1):
    rs = [HostRange(SZ * 8, dev, chunk_bytes=0, pool=pool) for _ in range(N)]
    if parallel == 1:
        for r in rs: r.grow_to(SZ)
    else:
        with ThreadPoolExecutor(parallel) as ex: list(ex.map(lambda r: r.grow_to(SZ), rs))
    return rs
def blocks(pool):
    return [PinnedBlock(SZ, 1, dev, PinSettings(), pool) for _ in range(N)]
shared = ThreadPoolExecutor(8)
busy(50); torch.cuda.synchronize()
t = time.perf_counter(); busy(1000); torch.cuda.synchronize(); print(f"1000 matmuls alone: {time.perf_counter() - t:.2f} s")
for load in (0, 1000):
    run("HostRange serial, own pool", load, ranges)
    run("HostRange serial, shared pool", load, lambda: ranges(shared))
    run("HostRange 2 parallel, own pools", load, lambda: ranges(None, 2))
    run("HostRange 2 parallel, shared pool", load, lambda: ranges(shared, 2))
    run("PinnedBlock serial, shared pool", load, lambda: blocks(shared))
# the main thread's launch rate while 2 background jobs commit (as reserve.host_ahead)
for label, pool in (("own pools", None), ("shared pool", shared)):
    rs = [HostRange(SZ * 8, dev, chunk_bytes=0, pool=pool) for _ in range(N)]
    ex = ThreadPoolExecutor(2); fut = [ex.submit(r.grow_to, SZ) for r in rs]
    t = time.perf_counter(); n = 0; worst = 0.0
    while not all(f.done() for f in fut):
        s = time.perf_counter(); torch.cuda.synchronize(); a[:1, :1].add_(1); n += 1; worst = max(worst, time.perf_counter() - s)
    print(f"main thread during 2 background commits ({label}): {n} launches in {time.perf_counter() - t:.2f} s, "
          f"worst {worst * 1e3:.1f} ms", flush=True)
