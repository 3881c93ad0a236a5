"""Time per call of the top-k select kernel on rows reserved wider than their live pages (CUDA only).

``python -m flexicache_hf.bench.select [--old FILE] [--out FILE]`` times ``select_pages`` at B=16 x 8 heads,
k=256, for each ``live:width`` case (default: 2049 live pages, a 16k prompt at 8-token pages, in rows 2049 and
16384 wide, the latter reserved for a 128k context; then 16384 live of 16384, and 2049 of 131072 for a 1M
context).  The kernel is timed at its default launch and at a sweep of (block, warps); ``--old`` names a copy of
an earlier ``flexicache_hf/kernels/select.py`` (e.g. ``git show 9135be2:flexicache_hf/kernels/select.py``, the
in-register select), timed beside it at the widths it takes.  Every kernel's selection is checked against the
reference first.  Timing as in :mod:`flexicache_hf.bench.decode` (CUDA-graph replay and eager, medians): the
inputs rotate among 4 sets, L2-resident as a decode step's freshly written scores are.  Prints one JSON object.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

import torch

from .decode import timed

OLD_MAX_PAGES = 32768  # the widest row the in-register select took
SWEEP = ((512, 4), (1024, 4), (1024, 8), (2048, 8), (2048, 16))  # (block, num_warps); default: launch_config


def load_old(path: Path):
    """The module in ``path`` as a sibling of :mod:`flexicache_hf.kernels.select` (its relative imports resolve)."""
    from flexicache_hf.kernels import reference

    if not hasattr(reference, "MAX_SELECT_PAGES"):  # the in-register select's row limit, a default it reads
        reference.MAX_SELECT_PAGES = OLD_MAX_PAGES
    spec = importlib.util.spec_from_file_location("flexicache_hf.kernels._select_old", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run(cases, B: int = 16, h: int = 8, k: int = 256, old_path: Path | None = None, n_sets: int = 4) -> dict:
    from flexicache_hf.kernels import reference
    from flexicache_hf.kernels.select import launch_config, select_pages

    old = load_old(old_path) if old_path is not None else None
    gen = torch.Generator(device="cuda").manual_seed(0)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "B": B, "heads": h, "k": k,
              "input_sets": n_sets, "old": str(old_path) if old_path else None, "cases": []}
    for live, width in cases:
        sets = [torch.randn(B, h, width, device="cuda", generator=gen) for _ in range(n_sets)]
        num_pages = torch.tensor([live], device="cuda")
        active = torch.ones(h, dtype=torch.bool, device="cuda")
        out = torch.empty((B, h, k), dtype=torch.long, device="cuda")
        want = reference.select_pages(sets[0], k, num_pages=num_pages)
        kernels = {"new": lambda s, **kw: select_pages(s, k, num_pages=num_pages, active=active, out=out, **kw)}
        if old is not None and width <= OLD_MAX_PAGES:
            kernels["old"] = lambda s, **kw: old.select_pages_triton(s, k, num_pages=num_pages, active=active,
                                                                     out=out, **kw)
        case = {"live": live, "width": width, "default_launch": list(launch_config(width))}
        for name, fn in kernels.items():
            fn(sets[0])
            if not torch.equal(out, want):
                raise AssertionError(f"{name} select differs from the reference at live {live}, width {width}")
            case[name] = timed(lambda i, fn=fn: fn(sets[i]), n_sets)
        for block, warps in SWEEP:
            case[f"new_p{block}_w{warps}"] = timed(
                lambda i, block=block, warps=warps: kernels["new"](sets[i], block=block, num_warps=warps), n_sets)
        if "old" in case:
            case["old_over_new"] = case["old"]["ms"] / case["new"]["ms"]
        result["cases"].append(case)
        summary = f"live {live:6d} width {width:6d}: new {case['new']['ms'] * 1e3:8.1f} us"
        if "old" in case:
            summary += f", old {case['old']['ms'] * 1e3:8.1f} us"
        print(summary, flush=True)
    return result


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", nargs="+", default=["2049:2049", "2049:16384", "16384:16384", "2049:131072"],
                    help="live:width pairs (live pages, row width)")
    ap.add_argument("--old", type=Path, help="an earlier select.py to time beside the current one")
    ap.add_argument("--out", type=Path, help="also write the JSON here")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--k", type=int, default=256)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA device")
    cases = [tuple(int(x) for x in c.split(":")) for c in args.cases]
    result = run(cases, args.batch, args.heads, args.k, args.old)
    text = json.dumps(result, indent=1)
    if args.out is not None:
        args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
