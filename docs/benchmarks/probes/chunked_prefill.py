"""A prompt filled in chunks, the README call's cache, with each follow-up chunk's attention made two ways in one
process: ``masked`` (an explicit causal mask, so SDPA's memory-efficient kernel with every KV head repeated per
query head: the path before ``dense.flash_lower_right``) and ``flash`` (``causal_lower_right``, grouped KV heads).

Run 33 on an H100: at 24 x 30k in 4,096-token chunks the README call waited 72.7 s for its first token against
StaticCache's 24.1 s at 14 rows (3.0 s a row against 1.7), and 28 rows ran out of device memory with 22 GB of
PyTorch's peak above the weights.  Prints one JSON line a run (A B A B after a small warm-up):

    python docs/benchmarks/probes/chunked_prefill.py --batch 8 --tokens 30720 --chunk 4096
"""
import argparse
import gc
import json
import time

import torch

import flexicache_hf.dense as dense
from flexicache_hf import FlexiCache
from flexicache_hf.bench.generate.cli import llama8b_config
from flexicache_hf import prefill_in_chunks
from flexicache_hf.head_profile import resolve_profile

ap = argparse.ArgumentParser()
ap.add_argument("--batch", type=int, default=8)
ap.add_argument("--tokens", type=int, default=30720)
ap.add_argument("--chunk", type=int, default=4096)
args = ap.parse_args()

from transformers import AutoModelForCausalLM  # noqa: E402

torch.manual_seed(0)
with torch.device("cuda"):
    model = AutoModelForCausalLM.from_config(llama8b_config(), dtype=torch.bfloat16,
                                             attn_implementation="flexicache").eval()
profile = resolve_profile("Llama-3.1-8B-Instruct")
flash = dense.flash_lower_right


def run(path: str, batch: int, tokens: int) -> dict:
    dense.flash_lower_right = flash if path == "flash" else (lambda *a: False)
    ids = torch.randint(100, 120000, (batch, tokens + 1), device="cuda")
    cache = FlexiCache(profile)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    t = time.perf_counter()
    prefill_in_chunks(model, ids, cache, args.chunk)
    torch.cuda.synchronize()
    out = {"path": path, "batch": batch, "tokens": tokens, "chunk": args.chunk,
           "prefill_s": round(time.perf_counter() - t, 3),
           "peak_above_start_gb": round((torch.cuda.max_memory_allocated() - base) / 1e9, 2)}
    del cache
    gc.collect()
    torch.cuda.empty_cache()
    return out


for path in ("flash", "masked"):
    run(path, 1, 2 * args.chunk)  # kernels built, host tier pinned
for path in ("masked", "flash", "masked", "flash"):
    print(json.dumps(run(path, args.batch, args.tokens)), flush=True)
