"""Stability-aware vs naive re-ranking cost per layer and decode step (paper Fig. 8 analog).

``python -m flexicache_hf.bench.rerank [--out DIR]`` (CUDA only), Llama-3.1-8B shape, 10k-token context:

* **naive**: every KV head is scored (``page_scores``) and re-selected (``select_pages``) every step;
* **stability-aware**: the unstable 25% of heads every step, all heads every R-th step:
  ``((R-1) * t(unstable) + t(all)) / R``.

Also times ``select_pages`` through the Triton kernel and through ``torch.topk`` + ``sort`` (the reference)
at the same shapes: the evidence behind ``TRITON_OPS.select_pages``.  Timing as in
:mod:`flexicache_hf.bench.decode` (CUDA graphs and eager, medians, L2-sized input rotation).

Writes ``rerank.json`` and ``rerank.png`` to ``--out`` (default ``docs/benchmarks/``), prints a table last.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from .decode import DEFAULT_OUT, ModelShape, timed


def run(batches, context: int, budget: int, R: int, unstable_frac: float, out_dir: Path, dtype: torch.dtype) -> dict:
    from flexicache_hf.kernels import reference
    from flexicache_hf.kernels import TRITON_OPS as ops
    from flexicache_hf.kernels.select import select_pages as triton_select

    m = ModelShape(dtype=dtype)
    H, D, ps = m.kv_heads, m.head_dim, m.page_size
    P = context // ps
    K = budget // ps
    n_unstable = max(1, round(unstable_frac * H))
    unstable = sorted(torch.randperm(H, generator=torch.Generator().manual_seed(1))[:n_unstable].tolist())
    uh = torch.tensor(unstable, device="cuda")
    all_heads = torch.arange(H, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    result = {"device": props.name, "torch": torch.__version__, "dtype": str(dtype).replace("torch.", ""),
              "context": context, "budget_tokens": budget, "rerank_interval": R, "unstable_heads": unstable,
              "configs": []}
    for B in batches:
        mm_bytes = 2 * B * H * P * D * m.elt
        n_sets = max(1, min(4, math.ceil(256 * 2**20 / mm_bytes)))
        sets = []
        for _ in range(n_sets):
            keys = torch.randn(B, H, context, D, device="cuda", dtype=dtype, generator=gen)
            kmin = torch.full((P, B, H, D), float("inf"), device="cuda", dtype=dtype).permute(1, 2, 0, 3)  # page-major
            kmax = torch.full_like(kmin, float("-inf"))
            ops.minmax_update(kmin, kmax, keys, 0, torch.zeros(B, dtype=torch.long, device="cuda"), ps)
            del keys
            q = torch.randn(B, m.q_heads, D, device="cuda", dtype=dtype, generator=gen)
            sets.append({"q": q, "kmin": kmin, "kmax": kmax,
                         "s_u": ops.page_scores(q, kmin, kmax, uh, P), "s_a": ops.page_scores(q, kmin, kmax, all_heads, P)})

        def rerank(i, heads):
            s = sets[i]
            return ops.select_pages(ops.page_scores(s["q"], s["kmin"], s["kmax"], heads, P), K)

        t_u = timed(lambda i: rerank(i, uh), n_sets)
        t_a = timed(lambda i: rerank(i, all_heads), n_sets)
        sel = {}
        for name, fn in (("triton", triton_select), ("torch", reference.select_pages)):
            for which in ("s_u", "s_a"):
                sel[f"{name}_{'unstable' if which == 's_u' else 'all'}"] = timed(
                    lambda i, fn=fn, which=which: fn(sets[i][which], K), n_sets)
        for warps, block in ((4, 512), (4, 1024), (8, 1024), (8, 2048), (16, 2048)):  # default: launch_config
            for which in ("s_u", "s_a"):
                sel[f"triton_{'unstable' if which == 's_u' else 'all'}_w{warps}_p{block}"] = timed(
                    lambda i, warps=warps, block=block, which=which: triton_select(
                        sets[i][which], K, num_warps=warps, block=block), n_sets)
        for bp, warps in ((32, 4), (64, 4), (128, 8), (16, 2)):  # page_scores tiles (default: 64 pages, 8 warps)
            for name, hh in (("unstable", uh), ("all", all_heads)):
                sel[f"scores_{name}_p{bp}_w{warps}"] = timed(
                    lambda i, bp=bp, warps=warps, hh=hh: ops.page_scores(
                        sets[i]["q"], sets[i]["kmin"], sets[i]["kmax"], hh, P, block_p=bp, num_warps=warps), n_sets)
        scores = {"unstable": timed(lambda i: ops.page_scores(sets[i]["q"], sets[i]["kmin"], sets[i]["kmax"], uh, P), n_sets),
                  "all": timed(lambda i: ops.page_scores(sets[i]["q"], sets[i]["kmin"], sets[i]["kmax"], all_heads, P),
                               n_sets)}
        cfg = {"batch": B, "input_sets": n_sets, "unstable_step": t_u, "all_step": t_a, "select": sel,
               "scores": scores}
        for mode in ("graph_ms", "eager_ms"):
            if t_u[mode] is None or t_a[mode] is None:
                continue
            aware = ((R - 1) * t_u[mode] + t_a[mode]) / R
            cfg[mode.replace("_ms", "")] = {"aware_ms": aware, "naive_ms": t_a[mode], "speedup": t_a[mode] / aware}
        cfg["aware_ms"] = ((R - 1) * t_u["ms"] + t_a["ms"]) / R
        cfg["naive_ms"] = t_a["ms"]
        cfg["speedup"] = cfg["naive_ms"] / cfg["aware_ms"]
        cfg["bytes_read_naive"] = mm_bytes
        cfg["bytes_read_aware"] = mm_bytes * ((R - 1) * n_unstable + H) / (R * H)
        result["configs"].append(cfg)
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "rerank.json").write_text(json.dumps(result, indent=1))  # after every batch size
        print(f"B={B:3d}: aware {cfg['aware_ms']:.4f} ms, naive {cfg['naive_ms']:.4f} ms, x{cfg['speedup']:.2f}",
              flush=True)
        sets = None
        torch.cuda.empty_cache()
    plot(result, out_dir / "rerank.png")
    print_table(result)
    return result


def plot(result: dict, path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 4), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    rows = result["configs"]
    xs = list(range(len(rows)))
    ax.bar([x - 0.2 for x in xs], [c["naive_ms"] * 1e3 for c in rows], 0.4, label="naive (all heads every step)")
    ax.bar([x + 0.2 for x in xs], [c["aware_ms"] * 1e3 for c in rows], 0.4,
           label=f"stability-aware (25% every step, all every {result['rerank_interval']})")
    for x, c in zip(xs, rows):
        ax.text(x + 0.2, c["aware_ms"] * 1e3, f"x{c['speedup']:.2f}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(xs, [str(c["batch"]) for c in rows])
    ax.set_xlabel("batch size")
    ax.set_ylabel("scoring + top-k per layer and step (µs)")
    ax.set_title(f"{result['context'] // 1000}k context, budget {result['budget_tokens']}, {result['device']}")
    ax.legend(fontsize=8)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def print_table(result: dict) -> None:
    print(f"\nre-rank per layer and step, {result['device']}, {result['context']} tokens, budget "
          f"{result['budget_tokens']}, R={result['rerank_interval']} (graph-replay GPU time; eager in the JSON)")
    print(f"{'B':>3} {'naive us':>9} {'aware us':>9} {'speedup':>7} {'sel triton us':>13} {'sel torch us':>12}")
    for c in result["configs"]:
        st, so = c["select"]["triton_all"]["ms"], c["select"]["torch_all"]["ms"]
        print(f"{c['batch']:>3} {c['naive_ms'] * 1e3:>9.1f} {c['aware_ms'] * 1e3:>9.1f} {c['speedup']:>7.2f} "
              f"{st * 1e3:>13.1f} {so * 1e3:>12.1f}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 16, 40, 64])
    ap.add_argument("--context", type=int, default=10_000)
    ap.add_argument("--budget", type=int, default=2048)
    ap.add_argument("--rerank-interval", type=int, default=16)
    ap.add_argument("--unstable-fraction", type=float, default=0.25)
    ap.add_argument("--dtype", choices=["float16", "bfloat16"], default="float16")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA device")
    run(args.batches, args.context, args.budget, args.rerank_interval, args.unstable_fraction, args.out,
        getattr(torch, args.dtype))


if __name__ == "__main__":
    main()
