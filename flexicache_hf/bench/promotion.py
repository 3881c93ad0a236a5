"""How much of a stable head's top-K a re-rank replaces: trained weights against random ones (CPU).

    python -m flexicache_hf.bench.promotion [--prompt-tokens 3000] [--new-tokens 129] [--budgets 512 1024]
        [--intervals 16] [--profile-settings] [--keep-margins 0] [--llama8b-layers N] [--gguf PATH] [--out FILE]

The speed benchmarks at Llama-3.1-8B scale (:mod:`flexicache_hf.bench.generate`) run random weights, and
every page a stable head's re-rank promotes crosses PCIe. This measures the share of the top-K one re-rank
replaces, on the embedded SmolLM2-135M-Instruct with its trained weights and with random weights of the
same config (``from_config``, seeded), greedy ``generate`` of the same long corpus prompt, the shipped
SmolLM2 profile, R = 16 (``--intervals``: each R given): ``promoted / (stable re-ranks x pages in the budget)``;
``FlexiCacheConfig``'s defaults, or with ``--profile-settings`` the settings the profile ships (its page size,
scoring, sink and recent pages), the budget, R and ``--keep-margins`` (``FlexiCacheConfig.keep_margin``, each given)
on top. The paper's premise is that a stable head's top-K barely moves; random weights read how far a speed
benchmark overstates the copies. ``--llama8b-layers N``: instead, the speed benchmarks' own random weights
(:func:`~flexicache_hf.bench.generate.cli.llama8b_config` with ``N`` layers, ``from_config`` seeded, fp32), a random
prompt of ``--prompt-tokens`` tokens, a random 25 % profile carrying the shipped Llama-3.1-8B-Instruct profile's
settings (R and margin per run as above).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from ..hf_compat import generate_cache_kwarg

DEFAULT_PROFILE = "SmolLM2-135M-Instruct"


def promotion_share(model, ids: torch.Tensor, profile, *, budget: int, new_tokens: int,
                    rerank_interval: int = 16, profile_settings: bool = False, keep_margin: float = 0.0) -> dict:
    """One greedy ``generate`` of exactly ``new_tokens`` tokens with a fresh FlexiCache (``FlexiCacheConfig``'s
    defaults, or the profile's settings); what its stable heads' re-ranks promoted."""
    from ..cache import FlexiCache
    from ..config import FlexiCacheConfig

    fields = {"token_budget": budget, "rerank_interval": rerank_interval, "keep_margin": keep_margin}
    if profile_settings:
        cache = FlexiCache(profile, model_config=model.config, **fields)
        profile = cache.profile  # re-cut to the settings' unstable fraction
    else:
        cache = FlexiCache(profile, FlexiCacheConfig(**fields), model_config=model.config)
    cfg = cache.config
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                   do_sample=False, **{generate_cache_kwarg(): cache})
    st = cache.stats
    stable_reranks = st.head_reranks - len(profile.unstable) * st.decode_steps
    pages = budget // cfg.page_size
    per = st.promoted_pages / stable_reranks if stable_reranks else 0.0
    return {"budget": budget, "rerank_interval": cfg.rerank_interval, "keep_margin": cfg.keep_margin,
            "unstable_heads": len(profile.unstable),
            "page_size": cfg.page_size, "budget_pages": pages, "decode_steps": st.decode_steps,
            "stable_reranks": stable_reranks, "promoted_pages": st.promoted_pages,
            "promoted_per_stable_rerank": per, "replaced_share": per / pages}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-tokens", type=int, default=3000)
    ap.add_argument("--new-tokens", type=int, default=129, help="129: eight phase re-ranks at R = 16")
    ap.add_argument("--budgets", type=int, nargs="+", default=[512, 1024])
    ap.add_argument("--intervals", type=int, nargs="+", default=[16], help="re-rank intervals R (default: 16)")
    ap.add_argument("--profile-settings", action="store_true",
                    help="the profile's shipped settings instead of FlexiCacheConfig's defaults")
    ap.add_argument("--keep-margins", type=float, nargs="+", default=[0.0],
                    help="FlexiCacheConfig.keep_margin values (default: 0; above 0 needs group_score 'mass')")
    ap.add_argument("--llama8b-layers", type=int, default=0, metavar="N",
                    help="the speed benchmarks' Llama-3.1-8B shape with N layers and random weights instead (CPU)")
    ap.add_argument("--gguf", default=None, help="path of the SmolLM2 GGUF (default: the embedded one)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    a = ap.parse_args(argv)

    from transformers import AutoModelForCausalLM

    from ..data import long_prompt
    from ..head_profile import resolve_profile
    from ..models import load_default_model

    settings = a.profile_settings or bool(a.llama8b_layers)  # the Llama shape: the settings its profile carries
    if a.llama8b_layers:
        models, ids, profile, name = _llama8b(a)
    else:
        trained, tok = load_default_model(gguf_path=a.gguf)
        torch.manual_seed(a.seed)
        random = AutoModelForCausalLM.from_config(trained.config, attn_implementation="flexicache",
                                                  dtype=torch.float32).eval()
        models, ids = (("trained", trained), ("random", random)), long_prompt(tok, a.prompt_tokens)
        profile, name = resolve_profile(DEFAULT_PROFILE), DEFAULT_PROFILE
    rows = [{"weights": name, **promotion_share(m, ids, profile, budget=b, new_tokens=a.new_tokens, rerank_interval=r,
                                                profile_settings=settings, keep_margin=k)}
            for name, m in models for b in a.budgets for r in a.intervals for k in a.keep_margins]
    report = {"model": name, "prompt_tokens": ids.shape[1], "new_tokens": a.new_tokens,
              "settings": "profile" if settings else "FlexiCacheConfig defaults",
              "unstable_heads": len(profile.unstable), "seed": a.seed, "rows": rows}
    if a.out is not None:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"{'weights':>8} {'budget':>6} {'R':>3} {'keep':>4} {'stable re-ranks':>15} {'promoted':>8} "
          f"{'per re-rank':>11} {'replaced':>8}")
    for r in rows:
        print(f"{r['weights']:>8} {r['budget']:>6} {r['rerank_interval']:>3} {r['keep_margin']:>4g} "
              f"{r['stable_reranks']:>15} {r['promoted_pages']:>8} "
              f"{r['promoted_per_stable_rerank']:>11.2f} {100 * r['replaced_share']:>7.1f}%")
    return report


def _llama8b(a):
    """``((("random", model),), ids, profile, name)`` for ``--llama8b-layers``."""
    from transformers import AutoModelForCausalLM

    from ..head_profile import HeadProfile, resolve_profile
    from .generate.cli import llama8b_config

    cfg = llama8b_config(a.llama8b_layers)
    torch.manual_seed(a.seed)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="flexicache", dtype=torch.float32).eval()
    ids = torch.randint(100, 120000, (1, a.prompt_tokens), generator=torch.Generator().manual_seed(a.seed))
    shipped = resolve_profile("Llama-3.1-8B-Instruct").settings.to_dict()
    drawn = HeadProfile.random(cfg, 0.25, seed=1)
    profile = HeadProfile(drawn.model, drawn.unstable, settings=shipped)
    return (("random", model),), ids, profile, f"Llama-3.1-8B shape, {a.llama8b_layers} layers"


if __name__ == "__main__":
    main()
