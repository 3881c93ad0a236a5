"""What a process's first cache spends before its first token, by what runs beside its prefill (CUDA; a probe, not
a product path).  Runs ``bench.generate`` (its arguments after ``--``) with:

* ``--piece-mib N``: every pinned mapping registered in pieces of at most N MiB (``PinSettings.piece_bytes``, the
  block keeper's and the reserved host ranges'), so launches can interleave with the registrations (run 32e:
  no change against one registration a mapping);
* ``--pin-threads N``: N threads populate a mapping before it is registered (0: the registration faults the pages
  in itself), telling CPU contention from the registrations' effect on the device;
* ``--build-first``: the CUDA backend's build (:func:`~flexicache_hf.kernels.build_ahead`, both stages) joined
  before anything runs, so the first prefill neither makes nor waits for it (run 33j: 0.6 s of it);
* ``--shadow N``: before anything runs, a throwaway 2-layer model of the bench's Llama shape generates 3 tokens
  from an N-token prompt through a cache of the README call's settings (eagerly): every kernel a prompt and an
  eager step launch is then loaded (CUDA loads a kernel at its first launch) and each Triton variant of theirs
  built, so the measured first cache finds what a later one finds, except its own storage (the shadow's is
  freed before the measured rows).

    python docs/benchmarks/host/first_cache.py --build-first -- --model llama8b --cases 1x16384 \
        --rows dynamic,flexicache-unsized --new-tokens 16 --prefill-profile --tag run34
"""
import argparse
import dataclasses
import functools
import gc
import sys
import time

from flexicache_hf import block_keeper, host_memory, release_storage, vmm
from flexicache_hf.bench.generate import main as generate_main
from flexicache_hf.kernels import build_ahead


def shadow_generate(prompt: int) -> float:
    """``--shadow``: a 2-layer model of the bench's Llama shape, a README-call-settings cache, 3 tokens; dropped."""
    import torch
    from transformers import AutoModelForCausalLM

    from flexicache_hf import FlexiCache, HeadProfile
    from flexicache_hf.bench.generate.cli import llama8b_config

    t = time.perf_counter()
    cfg = llama8b_config(layers=2)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="flexicache")
    cache = FlexiCache(HeadProfile.random(cfg, 0.25), FlexiCache("Llama-3.1-8B-Instruct").config)
    ids = torch.randint(0, cfg.vocab_size, (1, prompt), device="cuda")
    model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=3,
                   do_sample=False, disable_compile=True)
    torch.cuda.synchronize()
    del model, cache
    gc.collect()
    release_storage()  # the shadow's storage (kept for a cache of its shape) freed now, not in the measured prefill
    return time.perf_counter() - t


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--piece-mib", type=int, default=0, help="0: one registration a mapping (the default)")
    ap.add_argument("--pin-threads", type=int, default=None, help="populating threads (default: the library's)")
    ap.add_argument("--build-first", action="store_true", help="join the CUDA backend's build before running")
    ap.add_argument("--shadow", type=int, default=0, help="a throwaway cache's prompt tokens first (0: none)")
    ap.add_argument("rest", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    changes = {}
    if args.piece_mib:
        changes["piece_bytes"] = args.piece_mib << 20
    if args.pin_threads is not None:
        changes["threads"] = args.pin_threads
    if changes:
        block_keeper.BLOCKS.settings = dataclasses.replace(block_keeper.BLOCKS.settings, **changes)
        vmm.PinSettings = functools.partial(host_memory.PinSettings, **changes)
    if args.build_first:
        t = time.perf_counter()
        thread = build_ahead()
        if thread is not None:
            thread.join()
        print(f"build_ahead joined in {time.perf_counter() - t:.2f} s", file=sys.stderr)
    if args.shadow:
        print(f"shadow generate in {shadow_generate(args.shadow):.2f} s", file=sys.stderr)
    generate_main(args.rest[1:] if args.rest[:1] == ["--"] else args.rest)


if __name__ == "__main__":
    main()
