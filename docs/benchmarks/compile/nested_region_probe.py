"""Can a repeated layer body that mutates its buffers compile once (``torch.compiler.nested_compile_region``)?

Issue 35 asks the decode step's compile within 1.5x StaticCache's; one direction is compiling a layer's FlexiCache
work once instead of 32 times. A toy 32-layer loop whose body mutates per-layer buffers: ``MODE=none`` (no mutation),
``copy`` (an aten in-place ``copy_``), ``op`` (a mutating custom op, as every FlexiCache kernel that writes its
buffers is), ``both``; each compiled with inductor plainly and with the body as a nested compile region, checked
against eager (CPU; NOTES, "Compiling a layer once").

    MODE=copy TORCHINDUCTOR_FORCE_DISABLE_CACHES=1 python docs/benchmarks/compile/nested_region_probe.py
"""
import os
import time

import torch
from torch._dynamo.utils import counters

MODE = os.environ.get("MODE", "both")


@torch.library.custom_op("toy::bump", mutates_args=("buf",))
def bump(buf: torch.Tensor, pos: torch.Tensor, val: torch.Tensor) -> None:
    buf.index_copy_(0, pos, val)


@bump.register_fake
def _(buf, pos, val):
    return None


def layer_body(q, kbuf, mins, pos, val):
    if MODE in ("both", "op"):
        bump(kbuf, pos, val)
    if MODE in ("both", "copy"):
        mins.copy_(torch.minimum(mins, val.amin(0, keepdim=True)))
    s = (q @ kbuf.transpose(0, 1).contiguous()).softmax(-1)
    return s @ kbuf


region = torch.compiler.nested_compile_region(layer_body)


class Layers:
    def __init__(self, n):
        self.k = [torch.randn(64, 32) for _ in range(n)]
        self.m = [torch.full((1, 32), 9.0) for _ in range(n)]


def step(q, pos, val, layers, fn):
    for k, m in zip(layers.k, layers.m):
        q = fn(q, k, m, pos, val) + q
    return q


for name, fn in (("plain", layer_body), ("region", region)):
    torch._dynamo.reset()
    counters.clear()
    layers, ref_layers = Layers(32), Layers(32)
    for a, b in zip(ref_layers.k, layers.k):
        a.copy_(b)
    q, pos, val = torch.randn(4, 32), torch.tensor([3]), torch.randn(1, 32)
    t = time.time()
    out = torch.compile(step, backend="inductor", fullgraph=True)(q, pos, val, layers, fn)
    dt = time.time() - t
    ref = step(q, pos, val, ref_layers, layer_body)
    ok = (torch.allclose(out, ref, rtol=1e-3, atol=1e-3)
          and all(torch.equal(a, b) for a, b in zip(layers.k, ref_layers.k))
          and all(torch.equal(a, b) for a, b in zip(layers.m, ref_layers.m)))
    print(name, f"{dt:.1f}s", "ok" if ok else "MISMATCH", dict(counters["stats"]))
