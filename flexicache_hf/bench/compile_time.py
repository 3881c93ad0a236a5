"""How long ``generate`` takes to compile its decode step: StaticCache against FlexiCache, phase by phase.

    python -m flexicache_hf.bench.compile_time [--layers 32] [--rows static,flexicache] [--device cpu] [--mode M]
        [--json FILE]

A Llama-3.1-8B-shaped model in its layer count and heads (32 layers, 32 query and 8 KV heads) but narrow (head
dim 16, hidden 512; random weights), so the compile, not the weights, is what is measured and a CPU measures it
too.  Each row runs in a fresh interpreter with a fresh, empty inductor cache folder: a cold compile, as a user's
first ``generate`` on a machine pays it.  The row's cache is passed to ``generate`` with a ``CompileConfig`` using
inductor, ``fullgraph=True`` (on the CPU generate compiles only when told, so ``_compile_all_devices``); rows:

* ``static``: ``StaticCache`` and SDPA (what transformers compiles for its users);
* ``flexicache``: ``FlexiCache`` with the shipped defaults' scoring (8-token pages, group mass, shrink 0.5, the
  unstable heads ranked exactly; a random 25 % profile), sized with ``max_cache_len``;
* ``flexicache-unsized``: the same without ``max_cache_len``, as the README's call (its storage reserved for the
  model's context).

``--mode reduce-overhead`` compiles as ``generate`` does on CUDA (CUDA graphs, cudagraph trees); the default
(``None``) leaves the graphs out.

Reports the wall time of the ``generate`` call (prompt, compile and 8 steps) and Dynamo's compile phases
(``bench.generate``'s ``compile_phases``: ``_compile.compile_inner`` is the whole compile; ``Scheduler.__init__``
holds inductor's fusion search; ``compile_file`` is the CPU's C++ builds, which a GPU replaces by Triton's).
Prints one JSON object (``--json`` writes it too).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from . import emit_json

PHASES = ("_compile.compile_inner", "bytecode_tracing", "create_aot_dispatcher_function", "_recursive_post_grad_passes",
          "pass.post_grad_passes.decompose_auto_functionalized", "GraphLowering.run", "GraphLowering.codegen",
          "Scheduler.__init__", "Scheduler.fused_nodes", "compile_file", "async_compile.wait")


def narrow_row(row: str, layers: int, device: str, max_cache_len: int):
    """(model, empty cache, ``[2, 512]`` prompt) of one row on the narrow shape (random weights, seed 0)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, StaticCache

    from .. import FlexiCache, FlexiCacheConfig, HeadProfile

    cfg = LlamaConfig(vocab_size=256, hidden_size=512, intermediate_size=1024, num_hidden_layers=layers,
                      num_attention_heads=32, num_key_value_heads=8, head_dim=16, max_position_embeddings=4096,
                      pad_token_id=0, eos_token_id=255, bos_token_id=1)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa" if row == "static" else "flexicache")
    model = model.to(device).eval()
    ids = torch.randint(2, 250, (2, 512), device=device)
    if row == "static":
        return model, StaticCache(config=cfg, max_cache_len=max_cache_len), ids
    settings = FlexiCacheConfig(page_size=8, token_budget=128, group_score="mass", bound_shrink=0.5,
                                unstable_group_score="exact")
    sized = dict(max_cache_len=max_cache_len) if row == "flexicache" else {}  # flexicache-unsized: the README's call
    return model, FlexiCache(HeadProfile.random(cfg), settings, model_config=cfg, **sized), ids


def run_row(row: str, layers: int, device: str, mode: str | None = None) -> dict:
    """One row's compile, in this process (``main`` runs each in a fresh one)."""
    import torch
    from torch._dynamo.utils import counters
    from transformers import CompileConfig

    from .generate.device import compile_phases

    new = 8
    model, cache, ids = narrow_row(row, layers, device, 512 + new)
    if not getattr(cache, "is_compileable", True):
        raise SystemExit(f"{row}: this cache is not compileable here (an unsized one needs CUDA's virtual memory)")
    cc = CompileConfig(backend="inductor", fullgraph=True, mode=mode)
    cc._compile_all_devices = True
    t0 = time.perf_counter()
    with torch.no_grad():
        model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=new,
                       min_new_tokens=new, do_sample=False, compile_config=cc)
    wall = time.perf_counter() - t0
    phases = {k: round(v, 3) for k, v in compile_phases().items() if k in PHASES}
    return {"row": row, "layers": layers, "device": device, "mode": mode, "generate_s": round(wall, 3),
            "graphs": int(counters["stats"]["unique_graphs"]), "phases": phases}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--rows", default="static,flexicache")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--mode", default=None, help="torch.compile mode (generate's own on CUDA: reduce-overhead, "
                    "CUDA graphs); default None, inductor without graphs")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--row", default=None, help=argparse.SUPPRESS)  # a child's one row
    a = ap.parse_args(argv)
    if a.row is not None:
        print("ROW " + json.dumps(run_row(a.row, a.layers, a.device, a.mode)))
        return {}
    rows = []
    for row in a.rows.split(","):
        with tempfile.TemporaryDirectory(prefix="flexicache-inductor-") as cache_dir:
            env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache_dir, TORCHINDUCTOR_FX_GRAPH_CACHE="0",
                       TORCHINDUCTOR_AUTOGRAD_CACHE="0", TRITON_CACHE_DIR=os.path.join(cache_dir, "triton"))
            mode = ["--mode", a.mode] if a.mode else []
            done = subprocess.run([sys.executable, "-m", __spec__.name, "--row", row, "--layers", str(a.layers),
                                   "--device", a.device, *mode], env=env, capture_output=True, text=True, check=True)
        rows.append(json.loads(next(ln for ln in done.stdout.splitlines() if ln.startswith("ROW "))[4:]))
        print(f"{row}: generate {rows[-1]['generate_s']:.1f} s, compile "
              f"{rows[-1]['phases'].get('_compile.compile_inner', 0):.1f} s", file=sys.stderr)
    import torch

    args = sys.argv[1:] if argv is None else argv
    out = {"command": "python -m flexicache_hf.bench.compile_time " + " ".join(args), "torch": torch.__version__,
           "rows": rows}
    return emit_json(out, a.json)


if __name__ == "__main__":
    main()
