"""Does page-locking host memory on another thread slow this thread's GPU work? (a first cache's prefill, run 34)

Run 34 (H100, 1 x 16k): with the kernels loaded first, a first FlexiCache cache's prefill still took ~0.5 s more than
a later cache's, while its host tier (1.6 GB) was populated and registered on background threads and the prefill's
own thread waited only 3 ms for it. This times a prefill-like loop of GEMMs and SDPA launched from the main thread
(wall time, and device time between CUDA events; with and without a wait for the device after each layer) alone,
and while another thread does one of:

* ``populate``: fault the pages in (CPU and memory bandwidth);
* ``register``: ``cuMemHostRegister`` of memory already populated (the driver);
* ``both``: what a first cache's host tier does, populate then register;
* ``alloc``: ``torch.empty(..., pin_memory=True)`` (``cudaHostAlloc``).

Each line a JSON record.

    python docs/benchmarks/probes/register_stall.py --gb 1.6 --repeat 2
"""
import argparse
import itertools
import json
import threading
import time

import torch
import torch.nn.functional as F

from flexicache_hf.host_memory import (PinSettings, map_anonymous, populate, populate_pool, register, unmap,
                                       unregister)

ap = argparse.ArgumentParser()
ap.add_argument("--gb", type=float, default=1.6, help="host bytes the other thread handles (GB)")
ap.add_argument("--layers", type=int, default=32)
ap.add_argument("--tokens", type=int, default=16384)
ap.add_argument("--repeat", type=int, default=2)
ap.add_argument("--piece-mib", type=int, default=0, help="register in pieces of this many MiB (0: one call)")
args = ap.parse_args()
dev = torch.device("cuda")
T, H, KV, D, F_ = args.tokens, 32, 8, 128, 14336
x = torch.randn(T, H * D, device=dev, dtype=torch.bfloat16)
w_qkv = torch.randn(H * D, (H + 2 * KV) * D, device=dev, dtype=torch.bfloat16) * 0.01
w_up = torch.randn(H * D, F_, device=dev, dtype=torch.bfloat16) * 0.01
w_down = torch.randn(F_, H * D, device=dev, dtype=torch.bfloat16) * 0.01
nbytes = int(args.gb * 1e9) // 4096 * 4096
settings = PinSettings()
piece = args.piece_mib << 20 or None


def prefill(sync: bool) -> tuple[float, float, float]:
    """(wall s, device s, longest single launch s) of one prefill-like pass (``sync``: waiting for the device after
    each layer, as a prefill that reads a result back per layer does)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    t0, longest = time.perf_counter(), 0.0
    start.record()
    for _ in range(args.layers):
        t = time.perf_counter()
        qkv = x @ w_qkv
        q = qkv[:, :H * D].view(1, T, H, D).transpose(1, 2)
        k = qkv[:, H * D:(H + KV) * D].view(1, T, KV, D).transpose(1, 2)
        v = qkv[:, (H + KV) * D:].view(1, T, KV, D).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        y = o.transpose(1, 2).reshape(T, H * D) + (F.silu(x @ w_up) @ w_down)
        longest = max(longest, time.perf_counter() - t)
        del y
        if sync:
            torch.cuda.synchronize()
    end.record()
    torch.cuda.synchronize()
    return time.perf_counter() - t0, start.elapsed_time(end) / 1e3, longest


def other(kind: str, ready: threading.Event, out: dict) -> None:
    addr = map_anonymous(nbytes, settings.hugepages, reserve=False)
    spans, held = [], None
    if kind == "register":  # populated before the timed pass starts
        populate(addr, nbytes, settings.chunk_bytes, populate_pool(settings.threads))
    ready.set()
    t = time.perf_counter()
    if kind in ("populate", "both"):
        populate(addr, nbytes, settings.chunk_bytes, populate_pool(settings.threads))
    if kind in ("register", "both"):
        spans = register(addr, nbytes, 0, 1, piece)
    if kind == "alloc":
        held = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    out["other_s"] = round(time.perf_counter() - t, 4)
    unregister(spans, 0)
    unmap(addr, nbytes)
    del held


prefill(True)  # warm: kernels chosen, launchers built
for rep, sync, kind in itertools.product(range(args.repeat), (False, True),
                                         ("alone", "populate", "register", "both", "alloc")):
    rec = {"kind": kind, "sync": sync, "rep": rep, "gb": args.gb, "piece_mib": args.piece_mib}
    if kind != "alone":
        ready = threading.Event()
        th = threading.Thread(target=other, args=(kind, ready, rec))
        th.start()
        ready.wait()
    wall, device, longest = prefill(sync)
    if kind != "alone":
        th.join()
    rec.update(wall_s=round(wall, 4), device_s=round(device, 4), longest_launch_s=round(longest, 4))
    print(json.dumps(rec), flush=True)
