"""How much of a stable head's top-K a re-rank replaces: trained weights against random ones (CPU).

    python -m flexicache_hf.bench.promotion [--prompt-tokens 3000] [--new-tokens 129] [--budgets 512 1024]
        [--gguf PATH] [--out FILE]

The speed benchmarks at Llama-3.1-8B scale (:mod:`flexicache_hf.bench.generate`) run random weights, and
every page a stable head's re-rank promotes crosses PCIe. This measures the share of the top-K one re-rank
replaces, on the embedded SmolLM2-135M-Instruct with its trained weights and with random weights of the
same config (``from_config``, seeded), greedy ``generate`` of the same long corpus prompt, the shipped
SmolLM2 profile, R = 16: ``promoted / (stable re-ranks x pages in the budget)``. The paper's premise is that a
stable head's top-K barely moves; random weights read how far a speed benchmark overstates the copies.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from ..hf_compat import generate_cache_kwarg

DEFAULT_PROFILE = "SmolLM2-135M-Instruct"


def promotion_share(model, ids: torch.Tensor, profile, *, budget: int, new_tokens: int,
                    rerank_interval: int = 16) -> dict:
    """One greedy ``generate`` of exactly ``new_tokens`` tokens with a fresh FlexiCache; what its stable heads'
    re-ranks promoted."""
    from ..cache import FlexiCache
    from ..config import FlexiCacheConfig

    cfg = FlexiCacheConfig(token_budget=budget, rerank_interval=rerank_interval)
    cache = FlexiCache(profile, cfg, model_config=model.config)
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                   do_sample=False, **{generate_cache_kwarg(): cache})
    st = cache.stats
    stable_reranks = st.head_reranks - len(profile.unstable) * st.decode_steps
    pages = budget // cfg.page_size
    per = st.promoted_pages / stable_reranks if stable_reranks else 0.0
    return {"budget": budget, "page_size": cfg.page_size, "budget_pages": pages, "decode_steps": st.decode_steps,
            "stable_reranks": stable_reranks, "promoted_pages": st.promoted_pages,
            "promoted_per_stable_rerank": per, "replaced_share": per / pages}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-tokens", type=int, default=3000)
    ap.add_argument("--new-tokens", type=int, default=129, help="129: eight phase re-ranks at R = 16")
    ap.add_argument("--budgets", type=int, nargs="+", default=[512, 1024])
    ap.add_argument("--gguf", default=None, help="path of the SmolLM2 GGUF (default: the embedded one)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    a = ap.parse_args(argv)

    from transformers import AutoModelForCausalLM

    from ..data import long_prompt
    from ..head_profile import resolve_profile
    from ..models import load_default_model

    trained, tok = load_default_model(gguf_path=a.gguf)
    torch.manual_seed(a.seed)
    random = AutoModelForCausalLM.from_config(trained.config, attn_implementation="flexicache",
                                              dtype=torch.float32).eval()
    ids = long_prompt(tok, a.prompt_tokens)
    profile = resolve_profile(DEFAULT_PROFILE)
    rows = [{"weights": name, **promotion_share(m, ids, profile, budget=b, new_tokens=a.new_tokens)}
            for name, m in (("trained", trained), ("random", random)) for b in a.budgets]
    report = {"model": DEFAULT_PROFILE, "prompt_tokens": ids.shape[1], "new_tokens": a.new_tokens,
              "unstable_heads": len(profile.unstable), "seed": a.seed, "rows": rows}
    if a.out is not None:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"{'weights':>8} {'budget':>6} {'stable re-ranks':>15} {'promoted':>8} {'per re-rank':>11} {'replaced':>8}")
    for r in rows:
        print(f"{r['weights']:>8} {r['budget']:>6} {r['stable_reranks']:>15} {r['promoted_pages']:>8} "
              f"{r['promoted_per_stable_rerank']:>11.2f} {100 * r['replaced_share']:>7.1f}%")
    return report


if __name__ == "__main__":
    main()
