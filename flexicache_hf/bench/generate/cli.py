"""The command line: its flags, the model a run loads, and ``main`` (cases or the largest-batch search, then the
JSON, the figure and the table)."""

from __future__ import annotations

import argparse
import json
from functools import partial
from pathlib import Path

import torch

from .device import default_host_limit_gb, empty_host_cache
from .report import add_ratios, figure, format_table
from .rows import DEFAULT_ROWS, ROWS, check_rows, expand_rows
from .run import run_followup, run_row
from .search import run_largest

DEFAULT_OUT = Path(__file__).resolve().parents[3] / "docs" / "benchmarks"
DESCRIPTION = """\
model.generate end to end, FlexiCache against the dense caches a transformers user has (CUDA).

One greedy generate call per (case, row) of exactly --new-tokens tokens; a logits processor stamps every step:
time to first token, decode steps (first, median, p99, max), tokens/s, peak GPU memory, pinned host memory.
Writes generate-<tag>.json (after every row) and generate-<tag>.png to --out, and prints a table last.
Rows, warm-up, profiling and the batch search: docs/benchmarks/bench-generate.md."""


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m flexicache_hf.bench.generate", description=DESCRIPTION,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=("llama8b", "smollm2", "qwen"), default="llama8b",
                    help="llama8b: Llama-3.1-8B's shape with random bf16 weights (speed only) and its shipped profile; "
                         "smollm2: the embedded SmolLM2-135M-Instruct on real text; qwen: Qwen2.5-Coder-0.5B-Instruct "
                         "(make qwen) on real text (default: llama8b)")
    ap.add_argument("--gguf", default=None, help="the real model's GGUF (default: FLEXICACHE_GGUF / "
                                                 "FLEXICACHE_QWEN_GGUF or the installed packages)")
    ap.add_argument("--task", choices=("text", "copy"), default="text",
                    help="real models' prompts: text (plain long text to continue) or copy (a chat turn: a long "
                         "document, then 'repeat it word for word': output copied from the prompt, where prompt-lookup "
                         "decoding helps) (default: text)")
    ap.add_argument("--cases", default="1x16384,16x16384,16x30720",
                    help="BATCHxPROMPT, comma separated (a prompt too long for the model's context is shortened)")
    ap.add_argument("--rows", default=",".join(DEFAULT_ROWS), help=f"comma separated, of {ROWS} (or static-<impl>)")
    ap.add_argument("--static-variants", default="sdpa",
                    help="attention implementations of the static row, comma separated (sdpa,eager,flex_attention)")
    ap.add_argument("--static-prefill-chunk", type=int, default=0, metavar="TOKENS",
                    help="static rows prefill in eager chunks of this many tokens before generate (0: at once)")
    ap.add_argument("--prefill-chunk", type=int, default=0, metavar="TOKENS",
                    help="flexicache rows prefill in eager chunks of this many tokens before generate (0: at once)")
    ap.add_argument("--new-tokens", type=int, default=256, help="tokens per measured call (default: 256)")
    ap.add_argument("--prompt-lookup", type=int, default=0, metavar="N",
                    help="greedy prompt-lookup decoding, N draft tokens from the prompt (transformers' assisted "
                         "decoding; FlexiCache crops rejected drafts): batch 1, eager (drafts are verified in "
                         "multi-token forwards); step times then count tokens, several per forward")
    ap.add_argument("--offloaded-tokens", type=int, default=16,
                    help="tokens of the offloaded row, whose steps take ~1 s at long contexts (default: 16)")
    ap.add_argument("--budget", type=int, default=None,
                    help="FlexiCacheConfig.token_budget of the sized flexicache rows (default: the profile's settings)")
    ap.add_argument("--rerank-interval", type=int, default=None,
                    help="FlexiCacheConfig.rerank_interval (default: the profile's settings)")
    ap.add_argument("--stagger-reranks", action=argparse.BooleanOptionalAction, default=None,
                    help="FlexiCacheConfig.stagger_reranks (default: the profile's settings, True since run 18: layers "
                         "re-rank their stable heads on different steps; --no-stagger-reranks: the paper's schedule)")
    ap.add_argument("--offload", action=argparse.BooleanOptionalAction, default=None,
                    help="FlexiCacheConfig.offload (--no-offload: every page on the device, no host tier or copies)")
    ap.add_argument("--group-score", choices=("max", "mass"), default=None, help="FlexiCacheConfig.group_score")
    ap.add_argument("--page-size", type=int, default=None, help="FlexiCacheConfig.page_size")
    ap.add_argument("--bound-shrink", type=float, default=None, help="FlexiCacheConfig.bound_shrink")
    ap.add_argument("--unstable-group-score", choices=("max", "mass", "exact"), default=None,
                    help="FlexiCacheConfig.unstable_group_score (exact: the unstable heads by the exact mass)")
    ap.add_argument("--exact-candidates", type=int, default=None,
                    help="FlexiCacheConfig.exact_candidates (with exact: pages scored exactly, x budget; 0: all)")
    ap.add_argument("--keep-margin", type=float, default=None,
                    help="FlexiCacheConfig.keep_margin (a stable head keeps a selected page unless outscored by 1 + m)")
    ap.add_argument("--unstable-fraction", type=float, default=None,
                    help="re-cut the model's shipped profile to its least-stable fraction of heads")
    ap.add_argument("--prefill-profile", action="store_true",
                    help="sample the calling thread's stack through the warm-up call's prefill (the first cache of "
                         "a compiled row): its top functions by inclusive time in warmup_prefill_profile "
                         "([inclusive s, own s, samples, where]), the lines it sat at longest in warmup_prefill_lines")
    ap.add_argument("--profile-steps", type=int, default=0,
                    help="profile N+8 more tokens of the compiled rows (GPU busy fraction, kernels per step)")
    ap.add_argument("--largest-batch", type=int, default=None, metavar="PROMPT_LEN",
                    help="search each row's largest batch at this prompt length instead of --cases")
    ap.add_argument("--probe-tokens", type=int, default=16, help="new tokens per probe of the search (default: 16)")
    ap.add_argument("--probe-start", type=int, default=16, help="the search's first batch, then doubled (default: 16)")
    ap.add_argument("--probe-step", type=int, default=8,
                    help="the bisection stops at this many rows between success and failure (default: 8)")
    ap.add_argument("--max-probes", type=int, default=8, help="probes per row at most (default: 8)")
    ap.add_argument("--probe-compiled", action="store_true", help="probe the compiled rows compiled (~30 s each)")
    ap.add_argument("--host-limit-gb", type=float, default=None,
                    help="FlexiCache host_memory_limit and offloaded rows' cap (default 70%% of RAM; 0: none)")
    ap.add_argument("--followup", action="store_true", help="add the multi-turn follow-up case")
    ap.add_argument("--followup-tokens", type=int, default=512,
                    help="new prompt tokens of the follow-up turn (default: 512)")
    ap.add_argument("--followup-repeats", type=int, default=5, help="measured follow-up turns per row (median)")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output directory (default: docs/benchmarks)")
    ap.add_argument("--tag", default=None, help="file name suffix (default: the model)")
    return ap


def llama8b_config(layers: int = 32):
    """The speed benchmarks' Llama-3.1-8B shape (random weights are made from it, ``from_config``)."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers,
                       num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
                       rope_theta=500000.0)


def load(args):
    """(model, profile, make_prompt) for ``--model``."""
    from transformers import AutoModelForCausalLM

    # attn_implementation="flexicache" is registered by the package's __init__, imported before this module
    from ...head_profile import resolve_profile

    if args.model == "llama8b":
        cfg = llama8b_config()
        torch.manual_seed(0)
        with torch.device("cuda"):
            model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="flexicache")
        profile = resolve_profile("Llama-3.1-8B-Instruct")

        def prompt(batch, length):
            return torch.randint(100, 120000, (batch, length), device="cuda")
    else:
        from ...models import QWEN_MODEL, load_default_model, load_model

        if args.model == "qwen":
            model, tok = load_model(QWEN_MODEL, gguf_path=args.gguf, dtype=torch.bfloat16, device="cuda")
            profile = resolve_profile("Qwen2.5-Coder-0.5B-Instruct")
        else:
            model, tok = load_default_model(gguf_path=args.gguf, dtype=torch.bfloat16, device="cuda")
            profile = resolve_profile("SmolLM2-135M-Instruct")
        prompt = partial(text_prompt, tok, args.task)
    model.generation_config.pad_token_id = 0
    if args.unstable_fraction is not None:
        profile = profile.least_stable(args.unstable_fraction)
    return model.eval(), profile, prompt


COPY_INSTRUCTION = "Repeat the text above word for word, from its first line."


def text_prompt(tokenizer, task: str, batch: int, length: int) -> torch.Tensor:
    """``[batch, length]`` prompts of real text on CUDA: ``text``, plain text to continue, row ``i`` from document
    ``i`` of the built-in corpus; ``copy``, a chat turn asking to repeat the corpus's longest document (every row
    the same, cut to ``length`` tokens with the template)."""
    from ...data import build_prompt, load_documents, long_prompt

    if task == "text":
        return torch.cat([long_prompt(tokenizer, length, doc_index=i) for i in range(batch)]).cuda()
    doc = max(load_documents(), key=lambda d: len(d.text))
    return build_prompt(tokenizer, doc, COPY_INSTRUCTION, length).expand(batch, -1).contiguous().cuda()


def fit_prompt(length: int, new_tokens: int, max_positions: int | None) -> int:
    """The prompt length that leaves room for ``new_tokens`` in the model's context."""
    if max_positions and length + new_tokens > max_positions:
        return max(1, max_positions - new_tokens)
    return length



def run_cases(model, make_prompt, rows, args, profile, warmed, record, max_pos) -> None:
    """``--cases``: every row on each case's prompt (made once per case), then the follow-up case if asked."""
    for i, case in enumerate(c for c in args.cases.split(",") if c):
        batch, length = (int(x) for x in case.split("x"))
        fitted = fit_prompt(length, args.new_tokens, max_pos)
        if fitted != length:
            print(f"case {case}: prompt shortened to {fitted} tokens ({max_pos} positions, {args.new_tokens} new)",
                  flush=True)
        empty_host_cache()
        ids = make_prompt(batch, fitted)
        for row in rows:
            for name, res in run_row(model, ids, row, args, profile, warmed):
                record(case, name, res)
        if args.followup and i == 0:
            for name, res in run_followup(model, ids, args, profile, make_prompt):
                record(case, name, res)
        del ids


def main(argv=None) -> list[dict]:
    args = build_parser().parse_args(argv)
    rows = expand_rows([r for r in args.rows.split(",") if r], [v for v in args.static_variants.split(",") if v])
    bad = check_rows(rows)
    if bad:
        raise SystemExit(f"unknown rows {bad}; choose from {ROWS} (or static-<impl>)")
    if not torch.cuda.is_available():
        raise SystemExit("bench.generate needs a CUDA device")
    if args.host_limit_gb is None:
        args.host_limit_gb = default_host_limit_gb()
    from ..grouped_sdpa import register
    register()  # the static-sdpa_grouped row's attention
    model, profile, make_prompt = load(args)
    max_pos = getattr(model.config, "max_position_embeddings", None)
    results, warmed = [], set()
    args.out.mkdir(parents=True, exist_ok=True)
    tag = args.tag or (args.model if args.largest_batch is None else f"{args.model}-largest{args.largest_batch}")
    weights = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "transformers": __import__("transformers").__version__, "rows": rows,
            "weights_bytes": weights,  # the model's own GPU bytes: every row's peak includes them
            "args": {k: str(v) for k, v in vars(args).items()}}
    json_path = args.out / f"generate-{tag}.json"

    def save():
        add_ratios(results)
        json_path.write_text(json.dumps({"meta": meta, "results": results}, indent=1))

    def record(case, name, res):  # saved after every row: a run cut short keeps what it measured
        if res.get("peak_gpu_bytes") is not None:  # what the cache and activations took beyond the weights
            res = {**res, "peak_above_weights_bytes": res["peak_gpu_bytes"] - weights}
        results.append({"case": case, "row": name, **res})
        print(json.dumps(results[-1]), flush=True)
        save()

    if args.largest_batch is not None:
        length = fit_prompt(args.largest_batch, args.new_tokens, max_pos)
        run_largest(model, make_prompt, length, rows, args, profile, warmed, record)
    else:
        run_cases(model, make_prompt, rows, args, profile, warmed, record, max_pos)
    save()
    figure(results, args.out / f"generate-{tag}.png")
    print()
    print(format_table(results))
    return results
