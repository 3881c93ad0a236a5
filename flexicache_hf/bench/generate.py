"""``model.generate`` end to end, FlexiCache against the dense caches a transformers user has (CUDA).

    python -m flexicache_hf.bench.generate [--model llama8b|smollm2] [--cases 1x16384,16x16384,16x30720]
        [--rows dynamic,static,offloaded,flexicache] [--new-tokens 256] [--budget 1024] [--out DIR]

One ``generate`` call per (case, row), greedy, exactly ``--new-tokens`` tokens.  A logits processor
synchronises and stamps every step, so the first stamp is the **time to first token** (the prefill) and the
differences are the **decode steps** (first, median, p99, max).  Also recorded: output tokens/s over the
whole call, peak GPU memory (``max_memory_allocated``, weights included), pinned host bytes and pinned
allocations made during the call (``torch.cuda.host_memory_stats``), FlexiCache's pages promoted from host.

Rows:

* ``dynamic``: ``DynamicCache`` + SDPA, eager (transformers' default).
* ``static``: ``StaticCache`` + SDPA through ``cache_implementation="static"``: ``generate`` compiles the
  decode step itself (``torch.compile``, CUDA graphs), the fastest dense path transformers has.
* ``offloaded``: ``cache_implementation="offloaded"`` (``DynamicCache`` with layer-wise CPU offload);
  fewer steps (``--offloaded-tokens``) since each costs ~1 s at long contexts.
* ``flexicache``: ``FlexiCache(profile, token_budget=..., max_cache_len=prompt + new)``, eager, run twice
  with a fresh cache each time (``flexicache`` and ``flexicache-again``: the second shows the pinned-memory
  pool reused and no warm-up left).

Every row first runs a short warm-up call of the same shapes (stopped after a few steps, so a compiling row
has compiled and captured), then the measured call.  ``--followup`` adds a multi-turn case: a prefix of the
first case's length, then a follow-up turn of ``--followup-tokens`` new prompt tokens on the same cache,
timing the follow-up's first token.  Models: ``llama8b`` is Llama-3.1-8B's shape with random bf16 weights
(speed only) and the shipped Llama-3.1-8B-Instruct profile; ``smollm2`` is the embedded SmolLM2-135M-Instruct
(real weights; ``--gguf`` or ``FLEXICACHE_GGUF``) with its measured profile, on real text.

Writes ``generate-<model>.json`` and ``generate-<model>.png`` to ``--out`` and prints a table last.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from pathlib import Path

import torch

DEFAULT_OUT = Path(__file__).resolve().parents[2] / "docs" / "benchmarks"
ROWS = ("dynamic", "static", "offloaded", "flexicache")


class StepClock:
    """Logits processor: synchronise and stamp every generated token; stop after ``stop_after`` if given."""

    def __init__(self, stop_after: int | None = None):
        self.stamps: list[float] = []
        self.stop_after = stop_after
        self.t0 = time.perf_counter()

    def __call__(self, input_ids, scores):
        torch.cuda.synchronize()
        self.stamps.append(time.perf_counter())
        return scores

    def stop(self, input_ids, scores, **kwargs):  # a StoppingCriteria (warm-up calls only)
        done = self.stop_after is not None and len(self.stamps) >= self.stop_after
        return torch.full((input_ids.shape[0],), done, dtype=torch.bool, device=input_ids.device)


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def summarise(clock: StepClock) -> dict:
    s = clock.stamps
    steps = [1e3 * (b - a) for a, b in zip(s, s[1:])]
    out = {"ttft_s": s[0] - clock.t0, "tokens": len(s), "total_s": s[-1] - clock.t0,
           "tokens_per_s": len(s) / (s[-1] - clock.t0)}
    if steps:
        out.update(first_step_ms=steps[0], median_step_ms=statistics.median(steps), p99_step_ms=_pct(steps, 0.99),
                   max_step_ms=max(steps), decode_tokens_per_s=len(steps) / (s[-1] - s[0]))
    return out


def pinned_stats() -> dict:
    st = torch.cuda.host_memory_stats() if hasattr(torch.cuda, "host_memory_stats") else {}
    return {"pinned_bytes": st.get("allocated_bytes.current", 0), "pinned_allocs": st.get("num_host_alloc", 0)}


def new_cache(row: str, model, profile, args, max_cache_len: int):
    """The cache object a row passes to ``generate`` (``None``: generate makes it from cache_implementation)."""
    from transformers import DynamicCache

    from ..cache import FlexiCache

    if row == "flexicache":
        return FlexiCache(profile, token_budget=args.budget, rerank_interval=args.rerank_interval,
                          max_cache_len=max_cache_len, model_config=model.config)
    return DynamicCache() if row == "dynamic" else None


def generate_once(model, ids, row: str, args, new: int, *, profile=None, stop_after=None, cache=None):
    """One timed generate call of ``new`` tokens; returns (summary dict, cache used, output ids)."""
    from transformers import StoppingCriteriaList

    clock = StepClock(stop_after)
    kw = dict(max_new_tokens=new, min_new_tokens=new if stop_after is None else None, do_sample=False,
              attention_mask=torch.ones_like(ids), logits_processor=[clock],
              stopping_criteria=StoppingCriteriaList([clock.stop]), pad_token_id=0)
    model.set_attn_implementation("flexicache" if row == "flexicache" else "sdpa")
    cache = cache if cache is not None else new_cache(row, model, profile, args, ids.shape[1] + new)
    if cache is not None:
        kw["past_key_values"] = cache
    else:
        kw["cache_implementation"] = row
    before = pinned_stats()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.synchronize()
    clock.t0 = time.perf_counter()
    out = model.generate(ids, **kw)
    torch.cuda.synchronize()
    res = summarise(clock)
    after = pinned_stats()
    res.update(peak_gpu_bytes=torch.cuda.max_memory_allocated(), pinned_bytes=after["pinned_bytes"],
               pinned_allocs_during=after["pinned_allocs"] - before["pinned_allocs"])
    if row == "flexicache":
        res.update(promoted_pages=cache.stats.promoted_pages(), host_tier_bytes=cache.host_bytes(),
                   device_kv_bytes=cache.device_bytes(), dense_kv_bytes=cache.dense_bytes())
    return res, cache, out


def run_row(model, ids, row, args, profile, warmed: set) -> list[tuple[str, dict]]:
    """Warm-up, then the measured call(s) of one row.

    The compiling row warms up at the very shapes it is measured at (a compiled step is specialised to the
    cache's shape), stopped after a few steps; the eager rows once per process on a short prompt (kernel
    builds, allocator), so no row's measured call pays a one-time cost.
    """
    results = []
    new = args.offloaded_tokens if row == "offloaded" else args.new_tokens
    try:
        if row == "static":
            generate_once(model, ids, row, args, new, profile=profile, stop_after=4)
        elif row not in warmed:
            generate_once(model, ids[:1, :1024], row, args, 8, profile=profile)
            warmed.add(row)
        names = ("flexicache", "flexicache-again") if row == "flexicache" else (row,)
        for name in names:
            gc.collect()
            res, _, _ = generate_once(model, ids, row, args, new, profile=profile)
            results.append((name, res))
    except torch.OutOfMemoryError as e:
        results.append((row, {"error": "out of memory", "detail": str(e).splitlines()[0]}))
    gc.collect()
    torch.cuda.empty_cache()
    return results


def run_followup(model, ids, args, profile, make_prompt) -> list[tuple[str, dict]]:
    """Multi-turn: a prefix turn, then a ``--followup-tokens`` new prompt on the same cache (its TTFT)."""
    out = []
    extra = make_prompt(ids.shape[0], args.followup_tokens)
    for row in ("dynamic", "flexicache"):
        try:
            for attempt in range(2):  # the first pass warms up, the second is measured
                total = ids.shape[1] + 8 + args.followup_tokens + args.new_tokens
                cache = new_cache(row, model, profile, args, total)
                _, cache, first = generate_once(model, ids, row, args, 8, profile=profile, cache=cache)
                turn = torch.cat([first, extra], dim=1)
                res, _, _ = generate_once(model, turn, row, args, args.new_tokens, profile=profile, cache=cache,
                                          stop_after=4)
            out.append((f"{row}-followup", {**res, "prefix_tokens": ids.shape[1] + 8,
                                            "followup_tokens": args.followup_tokens}))
        except torch.OutOfMemoryError as e:
            out.append((f"{row}-followup", {"error": "out of memory", "detail": str(e).splitlines()[0]}))
        gc.collect()
        torch.cuda.empty_cache()
    return out


def load(args):
    """(model, profile, make_prompt) for ``--model``."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    import flexicache_hf  # noqa: F401  (registers the attention)
    from ..head_profile import resolve_profile

    if args.model == "llama8b":
        cfg = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                          num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
                          rope_theta=500000.0)
        torch.manual_seed(0)
        with torch.device("cuda"):
            model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="flexicache")
        profile = resolve_profile("Llama-3.1-8B-Instruct")

        def prompt(batch, length):
            return torch.randint(100, 120000, (batch, length), device="cuda")
    else:
        from ..data import long_prompt
        from ..models import load_default_model

        model, tok = load_default_model(gguf_path=args.gguf, dtype=torch.bfloat16, device="cuda")
        profile = resolve_profile("SmolLM2-135M-Instruct")

        def prompt(batch, length):
            return torch.cat([long_prompt(tok, length, doc_index=i) for i in range(batch)]).cuda()
    model.generation_config.pad_token_id = 0
    return model.eval(), profile, prompt


def figure(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = list(dict.fromkeys(r["case"] for r in results))
    rows = list(dict.fromkeys(r["row"] for r in results))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, label in ((axes[0], "median_step_ms", "decode step, median (ms)"),
                           (axes[1], "ttft_s", "time to first token (s)")):
        width = 0.8 / max(len(rows), 1)
        for j, row in enumerate(rows):
            vals = [next((r.get(key, 0) or 0 for r in results if r["case"] == c and r["row"] == row), 0) for c in cases]
            ax.bar([i + j * width for i in range(len(cases))], vals, width, label=row)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(cases))], cases)
        ax.set_ylabel(label)
    axes[0].legend(fontsize=7)
    fig.suptitle("model.generate end to end (H200); missing bars: out of memory")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=("llama8b", "smollm2"), default="llama8b")
    ap.add_argument("--gguf", default=None)
    ap.add_argument("--cases", default="1x16384,16x16384,16x30720", help="BATCHxPROMPT, comma separated")
    ap.add_argument("--rows", default=",".join(ROWS))
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--offloaded-tokens", type=int, default=16)
    ap.add_argument("--budget", type=int, default=1024)
    ap.add_argument("--rerank-interval", type=int, default=16)
    ap.add_argument("--followup", action="store_true", help="add the multi-turn follow-up case")
    ap.add_argument("--followup-tokens", type=int, default=512)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--tag", default=None, help="file name suffix (default: the model)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench.generate needs a CUDA device")
    rows = [r for r in args.rows.split(",") if r]
    bad = sorted(set(rows) - set(ROWS))
    if bad:
        raise SystemExit(f"unknown rows {bad}; choose from {ROWS}")
    model, profile, make_prompt = load(args)
    results, warmed = [], set()
    args.out.mkdir(parents=True, exist_ok=True)
    tag = args.tag or args.model
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "transformers": __import__("transformers").__version__, "args": {k: str(v) for k, v in vars(args).items()}}

    def record(case, name, res):  # saved after every row: a run cut short keeps what it measured
        results.append({"case": case, "row": name, **res})
        print(json.dumps(results[-1]), flush=True)
        (args.out / f"generate-{tag}.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))

    for case in args.cases.split(","):
        batch, length = (int(x) for x in case.split("x"))
        ids = make_prompt(batch, length)
        for row in rows:
            for name, res in run_row(model, ids, row, args, profile, warmed):
                record(case, name, res)
        if args.followup and case == args.cases.split(",")[0]:
            for name, res in run_followup(model, ids, args, profile, make_prompt):
                record(case, name, res)
        del ids
    figure(results, args.out / f"generate-{tag}.png")
    print(f"\n{'case':<10} {'row':<20} {'TTFT s':>7} {'1st ms':>7} {'med ms':>7} {'p99 ms':>7} {'tok/s':>7} "
          f"{'peak GB':>8} {'pin GB':>7} {'pin+':>5}")
    for r in results:
        if "error" in r:
            print(f"{r['case']:<10} {r['row']:<20} {r['error']}")
            continue
        print(f"{r['case']:<10} {r['row']:<20} {r['ttft_s']:7.2f} {r.get('first_step_ms', 0):7.1f} "
              f"{r.get('median_step_ms', 0):7.1f} {r.get('p99_step_ms', 0):7.1f} {r['tokens_per_s']:7.1f} "
              f"{r['peak_gpu_bytes'] / 1e9:8.1f} {r['pinned_bytes'] / 1e9:7.1f} {r['pinned_allocs_during']:5d}")
    return results


if __name__ == "__main__":
    main()
