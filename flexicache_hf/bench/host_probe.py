"""Where a decode step's host time goes: cProfile of steady-state ``generate`` calls per row (CUDA).

``python -m flexicache_hf.bench.host_probe --case 16x4096 --rows flexicache-graph,static-sdpa_grouped,flexicache-unsized``
warms each row up (compiling rows compile here), runs one measured call, then one under cProfile, and writes each
row's profile (by own time, then cumulative) to ``--out/probe-<row>.txt``; prints the median step of both calls.
The rows, model and prompts are :mod:`flexicache_hf.bench.generate`'s (Llama-3.1-8B's shape, random weights).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import pstats
from pathlib import Path


def load_case(case: str, new_tokens: int):
    """``(model, profile, prompt ids, bench.generate's arguments)`` for a ``BATCHxPROMPT`` case: bench.generate's
    Llama-3.1-8B shape (random weights) and prompts, the grouped SDPA of its StaticCache rows registered."""
    import flexicache_hf  # noqa: F401  (registers "flexicache")

    from .generate.cli import build_parser, load
    from .generate.device import default_host_limit_gb
    from .grouped_sdpa import register

    register()
    batch, length = (int(x) for x in case.split("x"))
    gen = build_parser().parse_args(["--cases", case, "--new-tokens", str(new_tokens)])
    gen.host_limit_gb = default_host_limit_gb()
    model, profile, prompt = load(gen)
    return model, profile, prompt(batch, length), gen


def main(argv=None) -> list[tuple]:
    ap = argparse.ArgumentParser(prog="python -m flexicache_hf.bench.host_probe", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", default="16x4096", help="BATCHxPROMPT (default: 16x4096)")
    ap.add_argument("--rows", default="flexicache-graph,static-sdpa_grouped,flexicache-unsized")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--out", type=Path, default=Path("."))
    args = ap.parse_args(argv)

    from .generate.device import release
    from .generate.run import generate_once

    model, profile, ids, gen = load_case(args.case, args.new_tokens)
    args.out.mkdir(parents=True, exist_ok=True)
    summary = []
    for row in args.rows.split(","):
        generate_once(model, ids, row, gen, args.new_tokens, profile=profile)  # warm-up (compile)
        gc.collect()
        res, _, _ = generate_once(model, ids, row, gen, args.new_tokens, profile=profile)
        gc.collect()
        prof = cProfile.Profile()
        prof.enable()
        res2, _, _ = generate_once(model, ids, row, gen, args.new_tokens, profile=profile)
        prof.disable()
        text = io.StringIO()
        stats = pstats.Stats(prof, stream=text)
        stats.sort_stats("tottime").print_stats(22)
        stats.sort_stats("cumulative").print_stats(45)
        (args.out / f"probe-{row}.txt").write_text(text.getvalue())
        summary.append((row, res["median_step_ms"], res2["median_step_ms"]))
        print(f"{row}: median step {res['median_step_ms']:.2f} ms, under cProfile {res2['median_step_ms']:.2f} ms")
        release(model, compiled=True)
    return summary


if __name__ == "__main__":
    main()
