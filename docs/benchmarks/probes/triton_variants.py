"""Which compiled variants of FlexiCache's Triton kernels a README-call cache needs, and what each costs to compile
for sm_90, on the CPU (no GPU needed).

A machine's first process compiles every variant (Triton's specialisation: the constexprs, and each pointer's
and integer's divisibility by 16) at its first launch: 12.6 s of run 41's first cache on an H100 host (23
variants, inside the warm-up). This replays a README-call cache on a small Llama-8B-shaped model (32 query heads,
8 KV heads of 128 channels, the shipped Llama profile's unstable heads of its first ``--layers`` layers and its
settings, budget 1024): a prompt, then ``--steps`` compiled steps' op bodies, every kernel through Triton's
interpreter (a child process with ``TRITON_INTERPRET=1``), each launch's variant taken from Triton's own argument
binder for an sm_90 target; then compiles each variant for sm_90 (Triton's LLVM and ptxas) and times it.

    python docs/benchmarks/probes/triton_variants.py --batch 2 --prompt 1024 --steps 9

Triton 3.6 (the GPU image's) interprets one kernel's device-scalar loop bound wrongly; with a newer Triton record
the variants (``--record-to FILE``, under ``TRITON_INTERPRET=1``) and compile them under 3.6 (``--variants FILE``).
"""
import argparse
import collections
import importlib
import json
import os
import subprocess
import sys
import time

import torch


def record(args) -> list[dict]:
    """In a child with TRITON_INTERPRET=1: the distinct variants launched, in launch order."""
    from transformers import AutoModelForCausalLM, LlamaConfig
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction, create_function_from_signature

    import flexicache_hf.layer.face as face
    import flexicache_hf.layer.schedule as schedule
    from flexicache_hf import FlexiCache, FlexiCacheConfig, HeadProfile
    from flexicache_hf.graph_step import GraphStep
    from flexicache_hf.kernels import table

    triton_ops = table.ops_named(table.TRITON)  # the Triton kernels on CPU tensors (the interpreter runs them)
    face.ops_for = schedule.ops_for = lambda device, prefer=None: triton_ops
    backend = make_backend(GPUTarget("cuda", 90, 32))
    seen, jits, phase = {}, {}, ["prompt"]
    interpreted_run = InterpretedFunction.run

    def run(self, *a, grid, warmup, **kw):
        jf = jits.get(self.fn)
        if jf is None:
            flags = {k: v for k, v in self.kwargs.items() if k.startswith("do_not_specialize")}
            jf = jits[self.fn] = JITFunction(self.fn, **flags)
            jf.binder = create_function_from_signature(jf.signature, jf.params, backend)
        bound, spec, opts = jf.binder(*a, **kw)
        key = (self.fn.__name__, str(spec), str(opts))
        if key not in seen:
            options, signature, constexprs, attrs = jf._pack_args(backend, dict(kw), bound, spec, opts)
            seen[key] = {"module": self.fn.__module__, "name": self.fn.__name__, "phase": phase[0],
                         "signature": signature, "constexprs": [[list(k), v] for k, v in constexprs.items()],
                         "attrs": [[list(k), v] for k, v in attrs.items()],
                         "options": {"num_warps": options.num_warps, "num_stages": options.num_stages}}
        return interpreted_run(self, *a, grid=grid, warmup=warmup, **kw)

    InterpretedFunction.run = run
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=args.layers,
                      num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=131072)
    torch.manual_seed(0)
    dtype = torch.float16  # bf16's interpreted dot upcasts (another constexpr than on a GPU); fp16's does not
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="flexicache").eval().to(dtype)
    here = os.path.dirname(os.path.abspath(__file__))
    shipped = json.load(open(os.path.join(here, "..", "..", "..", "profiles", "Llama-3.1-8B-Instruct.json")))
    settings = {k: v for k, v in shipped["settings"].items() if k not in ("source", "note")}
    # The shipped profile's unstable heads of the first layers (Llama's leaves some layers with none, some with 5)
    unstable = [(layer, head) for layer, head in shipped["unstable_heads"] if layer < args.layers]
    config = FlexiCacheConfig(token_budget=1024, **settings)
    cache = FlexiCache(HeadProfile.from_unstable(model.config, unstable), config)
    B = args.batch
    ids = torch.randint(1, 128, (B, args.prompt))
    with torch.no_grad():
        model(input_ids=ids, attention_mask=torch.ones_like(ids), past_key_values=cache, use_cache=True)
        phase[0] = "graph-step"
        for _ in range(args.steps):  # the op bodies a compiled step runs (graph_step.py), layer by layer
            for state in cache.states.values():
                state.stale = True
            for i, layer in enumerate(cache.layers):
                k = torch.randn(B, 8, 1, 128, dtype=dtype)
                q = torch.randn(B, 32, 1, 128, dtype=dtype)
                GraphStep(i, k, k.clone(), layer.state.length, layer.storage.pool.k).attend(q, 128 ** -0.5)
    return list(seen.values())


def compile_all(variants: list[dict]) -> dict:
    """Each variant compiled for sm_90 (Triton's disk cache pointed at an empty folder), timed."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend

    backend = make_backend(GPUTarget("cuda", 90, 32))
    by_kernel = collections.defaultdict(list)
    for v in variants:
        jf = getattr(importlib.import_module(v["module"]), v["name"])
        options = backend.parse_options(dict(v["options"]))
        constexprs = {tuple(k): c for k, c in v["constexprs"]}
        src = ASTSource(jf, v["signature"], constexprs, {tuple(k): a for k, a in v["attrs"]})
        t = time.perf_counter()
        triton.compile(src, target=backend.target, options=options.__dict__)
        by_kernel[v["name"]].append({"phase": v["phase"], "compile_s": round(time.perf_counter() - t, 3),
                                     "constexprs": v["constexprs"], "attrs": v["attrs"]})
    return {"triton": triton.__version__, "variants": len(variants),
            "compile_s": round(sum(x["compile_s"] for xs in by_kernel.values() for x in xs), 2),
            "kernels": {k: {"variants": len(xs), "compile_s": round(sum(x["compile_s"] for x in xs), 2), "each": xs}
                        for k, xs in sorted(by_kernel.items(), key=lambda kv: -sum(x["compile_s"] for x in kv[1]))}}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=9, help="compiled steps (R = 8: every layer re-ranks once)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--json", help="write the result here")
    ap.add_argument("--record-to", help="only record the variants into this file (run with TRITON_INTERPRET=1)")
    ap.add_argument("--variants", help="compile the variants recorded in this file (no recording)")
    args = ap.parse_args()
    if args.record_to:
        json.dump(record(args), open(args.record_to, "w"), default=str)
        return
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        recorded = args.variants or os.path.join(tmp, "variants.json")
        if not args.variants:
            subprocess.run([sys.executable, __file__, *sys.argv[1:], "--record-to", recorded], check=True,
                           env={**os.environ, "TRITON_INTERPRET": "1"})
        os.environ["TRITON_CACHE_DIR"] = os.path.join(tmp, "triton-cache")
        result = {"args": vars(args), **compile_all(json.load(open(recorded)))}
    print(f"{result['variants']} variants, {result['compile_s']} s to compile for sm_90 (Triton {result['triton']})")
    for name, k in result["kernels"].items():
        print(f"  {name}: {k['variants']} in {k['compile_s']} s ({', '.join(x['phase'] for x in k['each'])})")
    if args.json:
        json.dump(result, open(args.json, "w"), separators=(",", ":"), default=str)


if __name__ == "__main__":
    main()
