"""CPU cost of a decode step against the budget (the reference kernels): FlexiCache vs DynamicCache + SDPA.

``python -m flexicache_hf.bench.cpu_decode [--prompt 300] [--budgets 512 2048 65536] [--out FILE]``

The embedded SmolLM2 generates greedily from a corpus prompt; the cost of one decode token is
``(t(1 + n tokens) - t(1 token)) / n`` in *process CPU time* on one thread (so other load on the machine
barely moves it), the minimum over ``--reps`` interleaved repetitions.  With a budget covering every page,
the selection and the sparse decode must cost what the pages that exist cost, whatever the budget.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from ..hf_compat import generate_cache_kwarg


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompt", type=int, default=300)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--budgets", type=int, nargs="+", default=[512, 2048, 65536])
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)

    from transformers import DynamicCache

    from ..cache import FlexiCache
    from ..config import FlexiCacheConfig
    from ..data import long_prompt
    from ..models import load_default_model

    torch.set_num_threads(1)
    model, tok = load_default_model()
    ids = long_prompt(tok, a.prompt, doc_index=1)

    def cache_for(budget):
        if budget is None:
            model.config._attn_implementation = "sdpa"
            return DynamicCache()
        model.config._attn_implementation = "flexicache"
        return FlexiCache("SmolLM2-135M-Instruct", FlexiCacheConfig(token_budget=budget),  # as cpu_decode.json was
                          model_config=model.config)

    def cpu_seconds(budget, n):
        cache = cache_for(budget)
        t = time.process_time()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                       do_sample=False, **{generate_cache_kwarg(): cache})
        return time.process_time() - t

    cases = [None, *a.budgets]
    ms = {str(b): [] for b in cases}
    try:
        for _ in range(a.reps):
            for b in cases:
                ms[str(b)].append((cpu_seconds(b, 1 + a.new_tokens) - cpu_seconds(b, 1)) / a.new_tokens * 1e3)
    finally:
        model.config._attn_implementation = "flexicache"
    rows = {("dense" if b is None else f"budget {b}"): round(min(ms[str(b)]), 1) for b in cases}
    report = {"prompt_tokens": ids.shape[1], "new_tokens": a.new_tokens, "torch": torch.__version__,
              "ms_per_decode_token_cpu_time": rows}
    text = json.dumps(report, indent=1)
    if a.out is not None:
        a.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
