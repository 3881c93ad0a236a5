"""How long a process's first causal GQA SDPA call takes (the prefill FlexiCache's attention makes), by backend.

Run 33h: a first FlexiCache cache after a DynamicCache row spent ~0.65 s more before its first token than a later
cache, without a host tier and without a kernel build; cProfile put it inside ``scaled_dot_product_attention``.
This times, in a fresh process, the first and second call at the prefill's shape (``--backend default`` lets torch
choose; ``flash`` / ``cudnn`` / ``efficient`` force one), and names the kernels the default ran.

    python docs/benchmarks/probes/sdpa_first_call.py --backend default
"""
import argparse
import json
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

ap = argparse.ArgumentParser()
ap.add_argument("--backend", default="default", choices=["default", "flash", "cudnn", "efficient"])
ap.add_argument("--tokens", type=int, default=16384)
ap.add_argument("--mask-first", action="store_true", help="first a masked call, as DynamicCache's prefill makes")
args = ap.parse_args()
dev = torch.device("cuda")
q = torch.randn(1, args.tokens, 32, 128, device=dev, dtype=torch.bfloat16).transpose(1, 2)
k = torch.randn(1, args.tokens, 8, 128, device=dev, dtype=torch.bfloat16).transpose(1, 2)
v = torch.randn_like(k)
torch.cuda.synchronize()
out = {"backend": args.backend, "tokens": args.tokens}
if args.mask_first:
    m = torch.ones(args.tokens, args.tokens, device=dev, dtype=torch.bool).tril()[None, None]
    t = time.perf_counter()
    F.scaled_dot_product_attention(q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1), attn_mask=m)
    torch.cuda.synchronize()
    out["masked_first_s"] = round(time.perf_counter() - t, 4)
backends = {"flash": [SDPBackend.FLASH_ATTENTION], "cudnn": [SDPBackend.CUDNN_ATTENTION],
            "efficient": [SDPBackend.EFFICIENT_ATTENTION]}


def call():
    if args.backend == "default":
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    with sdpa_kernel(backends[args.backend]):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


try:
    for i in range(3):
        t = time.perf_counter()
        call()
        torch.cuda.synchronize()
        out[f"call{i}_s"] = round(time.perf_counter() - t, 4)
except RuntimeError as e:  # e.g. the efficient kernel takes no grouped KV heads
    print(json.dumps({**out, "error": f"RuntimeError: {e}"}))
    raise SystemExit(0)
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
    call()
    torch.cuda.synchronize()
out["kernels"] = sorted({e.name[:60] for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA})
print(json.dumps(out))
