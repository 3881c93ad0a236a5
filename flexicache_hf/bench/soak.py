"""Soak: many ``generate`` calls, each with a fresh FlexiCache; does anything stay behind?

``python -m flexicache_hf.bench.soak [--calls 1000] [--model tiny|smollm2] [--device cpu|cuda] [--out FILE]``

Every ``--every`` calls it records, after ``gc.collect()``: live objects by type (FlexiCache, FlexiCacheLayer,
tensors, all gc-tracked objects), the layers of the last dropped cache kept for the next one (``kept_layers``,
:mod:`~flexicache_hf.recycling`: at most one cache's), how many caches were still alive *before* the collection (those only a
reference cycle keeps: their tensors wait for the cyclic collector), the process RSS before and after
``malloc_trim(0)`` (glibc: memory freed but kept by the allocator is handed back), and on CUDA the device bytes
allocated / reserved, the pinned host bytes of torch's caching host allocator
(``torch.cuda.host_memory_stats()``) and the host tiers' page-locked blocks, lent and kept
(``block_keeper.BLOCKS.stats()``).  The first sample is taken after ``--warmup`` calls, so one-time costs
(kernel compilation, allocator pools, transformers' lazy imports) are not counted as growth.

Prints and writes JSON: the settings, every sample, and the growth from the first sample to the last.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import sys
import time
import weakref
from pathlib import Path

import torch

from ..hf_compat import generate_cache_kwarg


def _libc():
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc: no malloc_trim
        return None


def rss_bytes() -> int:
    """Resident set size of this process now (Linux /proc), 0 where unavailable."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
    except OSError:
        return 0
    import resource

    return pages * resource.getpagesize()


def live_counts() -> dict:
    from ..cache import FlexiCache, FlexiCacheLayer

    counts = {"FlexiCache": 0, "FlexiCacheLayer": 0, "Tensor": 0, "tensor_bytes_cpu": 0, "gc_objects": 0}
    for obj in gc.get_objects():
        counts["gc_objects"] += 1
        kind = type(obj)  # not isinstance: that would ask lazy module proxies for their __class__
        if issubclass(kind, FlexiCache):
            counts["FlexiCache"] += 1
        elif issubclass(kind, FlexiCacheLayer):
            counts["FlexiCacheLayer"] += 1
        elif issubclass(kind, torch.Tensor):
            counts["Tensor"] += 1
            if obj.device.type == "cpu" and not obj.is_meta:
                counts["tensor_bytes_cpu"] += obj.untyped_storage().nbytes()
    return counts


def cuda_memory(device: torch.device) -> dict:
    torch.cuda.synchronize(device)
    out = {"device_allocated": torch.cuda.memory_allocated(device),
           "device_reserved": torch.cuda.memory_reserved(device)}
    stats = getattr(torch.cuda, "host_memory_stats", None)
    if stats is not None:
        host = stats()
        for key in ("allocated_bytes.current", "reserved_bytes.current", "allocations.current",
                    "segment.current", "active_bytes.current"):
            if key in host:
                out[f"pinned_{key}"] = host[key]
    from ..block_keeper import BLOCKS

    blocks = BLOCKS.stats()
    out.update(blocks_lent_bytes=blocks["lent_bytes"], blocks_kept_bytes=blocks["kept_bytes"])
    return out


def tiny_model(device: torch.device):
    """A random 2-layer Llama (no download): what the CPU soak and its test run."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    import flexicache_hf  # noqa: F401  (registers attn_implementation="flexicache")
    from ..head_profile import HeadProfile

    cfg = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
                      pad_token_id=0, bos_token_id=1, eos_token_id=96)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="flexicache").to(device).eval()
    return model, HeadProfile.random(cfg, 0.25, seed=0), cfg.vocab_size


def smollm2_model(device: torch.device, dtype: torch.dtype):
    from ..models import load_default_model

    model, tok = load_default_model(dtype=dtype, device=device)
    return model, "SmolLM2-135M-Instruct", model.config.vocab_size


def soak(*, calls: int = 1000, model: str = "tiny", device: str = "cpu", dtype: str = "float32",
         prompt_tokens: int = 256, new_tokens: int = 16, batch: int = 1, page_size: int = 16, budget: int = 64,
         rerank_interval: int = 4, every: int = 50, warmup: int = 10, log=None) -> dict:
    """Run the soak and return its report (see the module docstring)."""
    from ..cache import FlexiCache
    from ..config import FlexiCacheConfig
    from ..recycling import KEEPER

    dev = torch.device(device)
    if model == "tiny":
        net, profile, vocab = tiny_model(dev)
    elif model == "smollm2":
        net, profile, vocab = smollm2_model(dev, getattr(torch, dtype))
    else:
        raise ValueError(f"model must be 'tiny' or 'smollm2', got {model!r}")
    libc = _libc()
    gen = torch.Generator().manual_seed(1)
    # Three prompt lengths in turn, so caches of different sizes come and go (allocator reuse, not one shape).
    lengths = [prompt_tokens, max(2, prompt_tokens * 3 // 4), max(2, prompt_tokens // 2)]
    settings = dict(calls=calls, model=model, device=str(dev), dtype=dtype, prompt_tokens=lengths,
                    new_tokens=new_tokens, batch=batch, page_size=page_size, token_budget=budget,
                    rerank_interval=rerank_interval, every=every, warmup=warmup, torch=torch.__version__)
    import transformers

    settings["transformers"] = transformers.__version__
    samples, lingering = [], 0
    made = weakref.WeakSet()  # the soak's own caches (garbage the process held before the soak is not counted)
    t0 = time.perf_counter()
    for call in range(warmup + calls):
        ids = torch.randint(2, vocab - 1, (batch, lengths[call % 3]), generator=gen).to(dev)
        cache = FlexiCache(profile, FlexiCacheConfig(page_size=page_size, token_budget=budget,  # these knobs only,
                                                     rerank_interval=rerank_interval),  # not the profile's settings
                           model_config=net.config)
        made.add(cache)
        with torch.no_grad():
            net.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                         min_new_tokens=new_tokens, do_sample=False, **{generate_cache_kwarg(): cache})
        del cache, ids
        done = call + 1 - warmup
        if done >= 0 and (done % every == 0 or done == calls):
            lingering = len(made)  # the soak's caches alive before collecting (only a reference cycle keeps them)
            gc.collect()
            row = {"calls": done, "seconds": round(time.perf_counter() - t0, 2),
                   "caches_alive_before_gc": lingering, **live_counts(), "rss": rss_bytes(),
                   "kept_layers": KEEPER.held_layers()}  # the last dropped cache's, kept for the next (recycling.py)
            if libc is not None:
                libc.malloc_trim(0)
                row["rss_after_malloc_trim"] = rss_bytes()
            if dev.type == "cuda":
                row.update(cuda_memory(dev))
            samples.append(row)
            if log is not None:
                log(row)
    first, last = samples[0], samples[-1]
    span = max(1, last["calls"] - first["calls"])
    growth = {k: last[k] - first[k] for k in last if k not in ("calls", "seconds") and isinstance(last[k], int)}
    growth["rss_per_call"] = round(growth["rss"] / span, 1)
    if "rss_after_malloc_trim" in growth:
        growth["rss_after_malloc_trim_per_call"] = round(growth["rss_after_malloc_trim"] / span, 1)
    return {"settings": settings, "samples": samples, "growth_first_to_last": growth,
            "max_caches_alive_before_gc": max(s["caches_alive_before_gc"] for s in samples)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=1000)
    ap.add_argument("--model", choices=["tiny", "smollm2"], default="tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--budget", type=int, default=64)
    ap.add_argument("--every", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--out", type=Path, default=None, help="write the JSON report here (default: stdout only)")
    a = ap.parse_args(argv)
    report = soak(calls=a.calls, model=a.model, device=a.device, dtype=a.dtype, prompt_tokens=a.prompt_tokens,
                  new_tokens=a.new_tokens, batch=a.batch, budget=a.budget, every=a.every, warmup=a.warmup,
                  log=lambda row: print(json.dumps(row), file=sys.stderr, flush=True))
    text = json.dumps(report, indent=1)
    if a.out is not None:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
