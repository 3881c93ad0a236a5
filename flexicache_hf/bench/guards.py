"""What Dynamo does around a compiled decode step on every call: StaticCache against FlexiCache.

    python -m flexicache_hf.bench.guards [--layers 32] [--rows static,flexicache] [--calls 300] [--json FILE]

The compile benchmark's narrow Llama-3.1-8B shape (:func:`~flexicache_hf.bench.compile_time.narrow_row`: 32 layers,
32 query and 8 KV heads, head dim 16; its two rows and settings), prompt filled eagerly, then the decode step compiled
by Dynamo (``fullgraph``) with a backend that runs the graph once and afterwards returns that run's outputs: every
later call costs only what Dynamo does around the graph — its guards, gathering the graph's inputs from the model and
the cache, replaying side effects.  On a GPU the same runs before each CUDA-graph replay (then come AOTAutograd's and
inductor's wrappers and cudagraph trees, not measured here).  Per row: microseconds a call (median of 5 rounds),
of them the guard check alone (the compiled frame's guards run on its locals), the graph's inputs and nodes, and
the guard tree's size: its lines, tensor matches, the tensors of the no-aliasing
guard, and Python lambda guards (each a Python call).  The CPU measures it.  Prints one JSON object.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import time
from pathlib import Path

from ..hf_compat import forward_cache_kwarg
from . import emit_json
from .compile_time import narrow_row


def compiled_frames(fn):
    """``(function, its Dynamo cache entries)`` for each function of ``fn``'s ``__wrapped__`` chain (bound methods
    unwrapped to their function) that Dynamo compiled a frame of."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    seen = set()
    while fn is not None:
        func = getattr(fn, "__func__", fn)
        code = getattr(func, "__code__", None)
        if code is not None and code not in seen:
            seen.add(code)
            entries = _debug_get_cache_entry_list(code)
            if entries:
                yield func, entries
        fn = getattr(fn, "__wrapped__", None)


def guard_tree(fn) -> str:
    """The text of Dynamo's guard trees for the code objects behind ``fn`` (its ``__wrapped__`` chain)."""
    return "\n".join(str(entry.guard_manager) for _, entries in compiled_frames(fn) for entry in entries)


def guard_check_us(fn, args: tuple, kwargs: dict, calls: int) -> float | None:
    """Microseconds of the guard check alone of the frame Dynamo compiled for ``fn(*args, **kwargs)``: its first
    cache entry's guards run on that frame's locals (the call's arguments bound to the compiled function, its
    closure's cells); None where those locals do not pass (they are not the frame's)."""
    import inspect

    for func, entries in compiled_frames(fn):
        local = dict(inspect.signature(func, follow_wrapped=False).bind(*args, **kwargs).arguments)
        local.update(zip(func.__code__.co_freevars, (c.cell_contents for c in func.__closure__ or ())))
        check = entries[0].guard_manager.check
        if not check(local):
            return None
        t = time.perf_counter()
        for _ in range(calls):
            check(local)
        return 1e6 * (time.perf_counter() - t) / calls
    return None


def guard_counts(text: str) -> dict:
    """Sizes of a guard tree's text (:func:`guard_tree`)."""
    return {"guard_lines": sum(1 for ln in text.splitlines() if ln.strip()),
            "tensor_match": len(re.findall(r"\bTENSOR_MATCH\b", text)),
            "no_aliasing_tensors": len(re.findall(r"\bNO_TENSOR_ALIASING\b", text)),
            "lambda_guards": len(re.findall(r"\bLAMBDA_GUARD\b", text))}


def run_row(row: str, layers: int, calls: int) -> dict:
    import torch

    torch._dynamo.reset()
    model, cache, ids = narrow_row(row, layers, "cpu", 512 + 8)
    L = ids.shape[1]
    graph: dict = {}

    def backend(gm, example_inputs):
        graph.update(inputs=len(example_inputs), nodes=len(gm.graph.nodes))
        out = gm(*example_inputs)
        return lambda *args: out

    cache_kw = {forward_cache_kwarg(model): cache}  # the name this transformers' forward takes
    with torch.no_grad():
        model(ids, cache_position=torch.arange(L), **cache_kw)
        step = torch.compile(model.forward, backend=backend, dynamic=False, fullgraph=True)
        kw = dict(input_ids=ids[:, :1], cache_position=torch.tensor([L]),
                  position_ids=torch.full((ids.shape[0], 1), L), **cache_kw)
        step(**kw)
        rounds, checks = [], []
        for _ in range(5):
            t = time.perf_counter()
            for _ in range(calls):
                step(**kw)
            rounds.append((time.perf_counter() - t) / calls)
            checks.append(guard_check_us(model.forward, (model,), kw, calls))  # the frame gets self first
    known = [c for c in checks if c is not None]
    return {"row": row, "layers": layers, "us_per_call": round(1e6 * statistics.median(rounds), 1),
            "guard_check_us": round(statistics.median(known), 1) if known else None,
            "graph_inputs": graph.get("inputs"), "graph_nodes": graph.get("nodes"),
            **guard_counts(guard_tree(model.forward))}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--rows", default="static,flexicache")
    ap.add_argument("--calls", type=int, default=300, help="calls a round (5 rounds, the median reported)")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args(argv)
    rows = []
    for row in a.rows.split(","):
        rows.append(run_row(row, a.layers, a.calls))
        print(f"{row}: {rows[-1]['us_per_call']} us a call, {rows[-1]['graph_inputs']} graph inputs, "
              f"{rows[-1]['guard_lines']} guard lines", file=sys.stderr)
    import torch

    args = sys.argv[1:] if argv is None else argv
    return emit_json({"command": "python -m flexicache_hf.bench.guards " + " ".join(args), "torch": torch.__version__,
                      "rows": rows}, a.json)


if __name__ == "__main__":
    main()
