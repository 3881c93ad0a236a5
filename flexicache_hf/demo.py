"""``make demo``: SmolLM2 on a long real document, generating with FlexiCache, and what it saved.

    python -m flexicache_hf.demo [--prompt-tokens 3000] [--new-tokens 128] [--budget 1024] [--no-dense] [--paper]

Runs on the CPU in a few minutes (2 cores): the embedded SmolLM2-135M-Instruct GGUF, the longest section
of the Python language reference (from the built-in corpus, assembled from this installation on first
use) with an instruction, greedy generation with ``FlexiCache(profile, token_budget=budget)`` -- the profile's
own settings, the budget alone set here -- then the same with ``DynamicCache`` + SDPA for the agreement and speed
comparison.  ``--paper`` runs the paper's settings instead (``FlexiCacheConfig.paper()``, the profile's own heads);
the other selection flags override single settings.
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import DynamicCache

from .cache import FlexiCache
from .config import FlexiCacheConfig
from .corpus import DOCSTRINGS, LICENSES, REFERENCE
from .data import build_prompt, documents_by_source
from .eval.fidelity import Reference, score
from .head_profile import resolve_profile
from .hf_compat import generate_cache_kwarg
from .models import load_default_model

DEMO_PROFILE = "SmolLM2-135M-Instruct"
DEMO_INSTRUCTION = "Summarise the document above in a few paragraphs."
DOCUMENTS = {"reference": REFERENCE, "license": LICENSES, "docstring": DOCSTRINGS}


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-tokens", type=int, default=3000)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--budget", type=int, default=1024, help="token budget per KV head and step (default: 1024, a third "
                    "of the default prompt)")
    ap.add_argument("--paper", action="store_true", help="the paper's settings (FlexiCacheConfig.paper()) instead "
                    "of the profile's, with the profile's own unstable heads")
    ap.add_argument("--page-size", type=int, default=None, help="tokens per page (default: the profile's)")
    ap.add_argument("--rerank-interval", type=int, default=None, help="R (default: the profile's)")
    ap.add_argument("--sink-pages", type=int, default=None, help="first pages every re-rank keeps (default: the "
                    "profile's; paper: 0)")
    ap.add_argument("--recent-pages", type=int, default=None, help="newest pages every re-rank keeps (default: the "
                    "profile's; paper: 0)")
    ap.add_argument("--document", choices=DOCUMENTS, default="reference",
                    help="the built-in corpus's longest document of a source: the language reference (default), "
                    "a license text, a docstring page")
    ap.add_argument("--profile", default=DEMO_PROFILE, help="profile name, path, or shipped model name")
    ap.add_argument("--gguf", default=None, help="path of the SmolLM2 GGUF (default: the embedded one)")
    ap.add_argument("--instruction", default=DEMO_INSTRUCTION, help="the request after the document")
    ap.add_argument("--no-dense", action="store_true", help="skip the DynamicCache comparison run")
    args = ap.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))

    t0 = time.perf_counter()
    model, tok = load_default_model(gguf_path=args.gguf, attn_implementation="flexicache")
    print(f"loaded SmolLM2-135M-Instruct (GGUF) in {time.perf_counter() - t0:.1f} s")
    # The longest language-reference section (~60k characters): long enough for any --prompt-tokens a CPU
    # run takes, and the same document wherever the demo runs on one Python version.
    doc = max(documents_by_source()[DOCUMENTS[args.document]], key=lambda d: (len(d.text), d.id))
    ids = build_prompt(tok, doc, args.instruction, args.prompt_tokens)
    profile = resolve_profile(args.profile)
    fields = {name: value for name, value in (("page_size", args.page_size), ("rerank_interval", args.rerank_interval),
                                              ("sink_pages", args.sink_pages), ("recent_pages", args.recent_pages))
              if value is not None}

    def new_cache() -> FlexiCache:
        if args.paper:
            return FlexiCache(profile, FlexiCacheConfig.paper(token_budget=args.budget, **fields),
                              model_config=model.config, count_pages=True)
        return FlexiCache(profile, token_budget=args.budget, **fields, model_config=model.config, count_pages=True)

    cache = new_cache()
    cfg, used = cache.config, cache.profile  # what the cache uses (the profile re-cut to its settings' fraction)
    gen = dict(max_new_tokens=args.new_tokens, do_sample=False, attention_mask=torch.ones_like(ids))

    t0 = time.perf_counter()
    out = model.generate(ids, **{generate_cache_kwarg(): cache}, **gen)
    t_fc = time.perf_counter() - t0
    new = out[0, ids.shape[1]:]
    print("\n--- FlexiCache output " + "-" * 50)
    print(tok.decode(new, skip_special_tokens=True))

    report = {"document": doc.title, "prompt_tokens": ids.shape[1], "new_tokens": int(new.numel()),
              "token_budget": args.budget, "page_size": cfg.page_size, "rerank_interval": cfg.rerank_interval,
              "sink_pages": cfg.sink_pages, "recent_pages": cfg.recent_pages, "group_score": cfg.group_score,
              "bound_shrink": cfg.bound_shrink, "unstable_group_score": cfg.unstable_group_score,
              "settings_source": cache.settings_source,
              "unstable_heads": len(used.unstable), "heads": used.model.num_layers * used.model.num_kv_heads,
              "seconds_flexicache": t_fc, **cache.memory_report()}
    st = cache.stats
    report["pages_per_head_step"] = st.pages_attended / max(st.head_steps, 1)
    report["pages_in_context"] = -(-cache.get_seq_length() // cfg.page_size)
    report["head_rerank_fraction"] = st.head_reranks / max(st.head_steps, 1)
    report["promoted_pages"] = st.promoted_pages

    if not args.no_dense:
        model.set_attn_implementation("sdpa")
        t0 = time.perf_counter()
        dense = model.generate(ids, **{generate_cache_kwarg(): DynamicCache()}, **gen)[0, ids.shape[1]:]
        report["seconds_dense"] = time.perf_counter() - t0
        model.set_attn_implementation("flexicache")
        print("\n--- DynamicCache output (dense, for comparison) " + "-" * 24)
        print(tok.decode(dense, skip_special_tokens=True))
        n = min(len(dense), len(new))
        diff = (dense[:n] != new[:n]).nonzero()
        report["greedy_agreement_tokens"] = int(diff[0, 0]) if diff.numel() else n
        # Free-running outputs part at their first different token and never meet again; the fair per-step
        # figure feeds FlexiCache dense's own tokens and counts the steps where it predicts dense's next one
        # (the eval's fidelity score; doc_index -1: the demo's document is no corpus row).
        forced = score(model, [Reference(doc_index=-1, prompt=ids, continuation=dense.tolist())],
                       new_cache, free_run=False)
        report["teacher_forced_top1"] = forced[0]["top1_agreement"]

    print("\n--- what FlexiCache did " + "-" * 48)
    print(f"document            {report['document']!r}")
    print(f"prompt / new tokens {report['prompt_tokens']} / {report['new_tokens']}")
    print(f"token budget        {args.budget} tokens = {args.budget // cfg.page_size} pages of {cfg.page_size} "
          f"per KV head (context: {report['pages_in_context']} pages)"
          + (f", {cfg.sink_pages} sink + {cfg.recent_pages} recent pages kept" if cfg.sink_pages or cfg.recent_pages
             else ""))
    print(f"unstable heads      {report['unstable_heads']} of {report['heads']} (profile {used.model.name or args.profile})"
          + (", ranked by exact attention mass" if cfg.unstable_group_score == "exact" else ""))
    print(f"settings            {cache.settings_source}")
    print(f"pages attended      {report['pages_per_head_step']:.1f} per KV head per decode step")
    print(f"heads re-ranked     {100 * report['head_rerank_fraction']:.0f}% of (layer, head) steps; "
          f"{report['promoted_pages']} pages promoted from host")
    print(f"KV on the device    {_mib(report['device_bytes'])} vs {_mib(report['dense_bytes'])} with DynamicCache "
          f"({100 * report['device_saving']:.0f}% saved; host tier {_mib(report['host_bytes'])})")
    print(f"speed (CPU)         {report['new_tokens'] / t_fc:.1f} tokens/s with FlexiCache", end="")
    if "seconds_dense" in report:
        print(f", {len(dense) / report['seconds_dense']:.1f} tokens/s with DynamicCache")
        print(f"agreement           fed dense's {len(dense)} tokens, FlexiCache predicts dense's next token at "
              f"{100 * report['teacher_forced_top1']:.0f}% of the steps; free-running, the first "
              f"{report['greedy_agreement_tokens']} of {n} tokens are identical")
    else:
        print()
    return report


if __name__ == "__main__":
    main()
