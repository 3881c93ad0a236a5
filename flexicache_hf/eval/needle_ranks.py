"""Which heads lose the needle?  The rank of the answer's page under each page-scoring rule, per KV head.

One retrieval sample (a ``flexicache_hf.eval.tasks`` task, the question after the context) is run densely (the
oracle cache with a budget covering every page, so every head attends everything) up to the decode step that
writes the answer's first token (the first one with a letter or digit, whether dense answers right or not).  At
that step, for every KV head that puts at least ``min_mass`` of its group's exact attention on the page holding
the answer, it reports the page's rank (0 = first) by the exact mass and by each scoring rule FlexiCache has --
the group maximum of Quest's bound (the paper's) and the group mass, each over the full key box and the box shrunk
by half -- and by the split rule (the unstable heads of a profile by one rule, the stable heads by another).  A
rank at or past the budget's page count means that rule's top-K leaves the answer out of that head.

    python -m flexicache_hf.eval.needle_ranks --model qwen2.5-coder-0.5b --task niah_multikey --length 16184 \\
        --index 12 --budget 1024 --page-size 8 --unstable-fraction 0.375 --out OUT

Reference PyTorch on the exact keys (the MinMax cache's boxes are rebuilt from them, as in
:func:`~flexicache_hf.eval.oracle.page_bound`); float32 scores.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

import torch

from ..config import FlexiCacheConfig
from .decoding import _forward
from .oracle import oracle_cache, page_bound, page_mass
from .query_capture import capture_queries
from .tasks import encode_text, make_samples, render_split

RULES = ("max", "max-shrink0.5", "mass", "mass-shrink0.5")  # ranked unless told otherwise


def parse_rule(name: str) -> tuple[str, float]:
    """``(group_score, bound_shrink)`` of a rule name: ``max`` / ``mass``, optionally ``-shrink<λ>`` with
    ``0 < λ <= 1`` (e.g. ``max-shrink0.75``); a clear error otherwise."""
    group, _, rest = name.partition("-shrink")
    try:
        shrink = float(rest) if rest else 1.0
    except ValueError:
        shrink = float("nan")
    if group not in ("max", "mass") or not 0.0 < shrink <= 1.0 or (not rest and name != group):
        raise ValueError(f"unknown rule {name!r}: 'max' or 'mass', optionally '-shrink<λ>' with 0 < λ <= 1")
    return group, shrink


def answer_token(ids: list[int], tokenizer, answer: str) -> int:
    """Index in ``ids`` of the first token of ``answer`` as the context spells it (with or without a leading
    space); a clear error when the context does not hold it."""
    for text in (" " + answer, answer):
        pat = encode_text(tokenizer, text)
        for i in range(len(ids) - len(pat) + 1):
            if ids[i:i + len(pat)] == pat:
                return i
    raise ValueError(f"the answer {answer!r} is not in the context's tokens")


def rank_of(scores: torch.Tensor, page: int) -> int:
    """Rank (0 = first) of ``page`` in a ``[P]`` score row: how many pages score strictly higher."""
    return int((scores > scores[page]).sum())


def head_ranks(query: torch.Tensor, keys: torch.Tensor, scale: float, page_size: int, page: int,
               unstable: set[int], split: tuple[str, str], min_mass: float,
               rules: tuple[str, ...] = RULES) -> list[dict]:
    """Per KV head with at least ``min_mass`` of exact mass on ``page``: its ranks by the exact mass and by every
    rule of ``rules`` and both of ``split`` (row 0 of the batch).  ``unstable``: this layer's unstable heads;
    ``split``: (stable rule, unstable rule)."""
    mass = page_mass(query, keys, page_size, scale)[0]
    by_rule = {}
    for name in dict.fromkeys((*rules, *split)):
        group, shrink = parse_rule(name)
        by_rule[name] = page_bound(query, keys, page_size, group, scale, shrink)[0]
    rows = []
    for h in range(mass.shape[0]):
        if float(mass[h, page]) < min_mass:
            continue
        ranks = {name: rank_of(s[h], page) for name, s in by_rule.items()}
        ranks["split"] = ranks[split[1] if h in unstable else split[0]]
        rows.append({"head": h, "unstable": h in unstable, "mass_on_page": float(mass[h, page]),
                     "exact": rank_of(mass[h], page), **ranks})
    return rows


@torch.inference_mode()
def needle_ranks(model, tokenizer, sample, *, page_size: int, budget: int, profile,
                 split: tuple[str, str] = ("mass-shrink0.5", "max"), min_mass: float = 0.3,
                 max_steps: int = 8, at_step: int | None = None, rules: tuple[str, ...] = RULES) -> dict:
    """Run ``sample`` densely until it writes the first token of its first answer; rank the answer's page at that
    step (see the module docstring).  ``profile``: the HeadProfile whose unstable heads the split rule scores by
    its unstable rule.  ``rules``: the rule names ranked (see :func:`parse_rule`).  ``at_step``: rank at
    that decode step instead (1 = the first token after the prompt's), whatever it writes."""
    if at_step is not None and not 1 <= at_step <= max_steps:
        raise ValueError(f"at_step must be in 1..max_steps ({max_steps}), got {at_step!r}")
    if len(split) != 2:
        raise ValueError(f"split is (stable rule, unstable rule), got {split!r}")
    for rule in (*rules, *split):
        parse_rule(rule)
    chunks = render_split(tokenizer, sample.context, sample.question, sample.answer_prefix)
    ids = chunks[0][0].tolist()
    answer = sample.answers[0]
    page = answer_token(ids, tokenizer, answer) // page_size
    total = sum(c.shape[1] for c in chunks) + max_steps
    every_page = -(-total // page_size) * page_size
    cache = oracle_cache(model.config.num_hidden_layers, FlexiCacheConfig(page_size=page_size,
                                                                         token_budget=every_page))
    out: list[int] = []
    with capture_queries(model):
        for chunk in chunks:
            logits = _forward(model, chunk, cache)
        for _ in range(max_steps):
            out.append(int(logits.argmax(-1)[0]))
            if at_step is not None and len(out) == at_step + 1:
                break
            if at_step is None and any(c.isalnum() for c in tokenizer.decode(out[-1:])):  # the answer's first token
                break
            logits = _forward(model, torch.tensor([[out[-1]]]), cache)
        else:
            raise RuntimeError(f"no answer token within {max_steps} steps: {tokenizer.decode(out)!r}")
    if len(out) == 1:
        raise RuntimeError("the prompt's last position writes the answer: no decode step selects pages for it")
    heads = []
    for li, layer in enumerate(cache.layers):  # the step that wrote out[-1] is each layer's last decode step
        q, scale = layer.last["query"], layer.last["scale"]
        rows = head_ranks(q, layer.keys, scale, page_size, page, set(profile.unstable_heads(li)), split, min_mass,
                          rules)
        heads += [{"layer": li, **r} for r in rows]
    k = budget // page_size
    names = (*dict.fromkeys((*rules, *split)), "split")
    missed = {name: sum(r[name] >= k for r in heads) for name in names}
    return {"task": sample.task, "index": sample.index, "answer": answer, "answer_page": page,
            "context_tokens": len(ids), "budget_pages": k, "page_size": page_size, "split": list(split),
            "output": tokenizer.decode(out), "heads": heads, "heads_missing_the_page": missed}


def report(result: dict) -> str:
    names = tuple(result["heads_missing_the_page"])
    lines = [f"{result['task']} #{result['index']}: answer {result['answer']!r} on page {result['answer_page']} "
             f"of {result['context_tokens']} context tokens; budget {result['budget_pages']} pages of "
             f"{result['page_size']}; dense wrote {result['output']!r}; split = stable by {result['split'][0]}, "
             f"unstable by {result['split'][1]}", "",
             "| layer | KV head | unstable | mass on the page | exact rank | " + " | ".join(names) + " |",
             "|---" * (5 + len(names)) + "|"]
    for r in result["heads"]:
        lines.append(f"| {r['layer']} | {r['head']} | {'yes' if r['unstable'] else ''} | {r['mass_on_page']:.2f} | "
                     f"{r['exact']} | " + " | ".join(str(r[n]) for n in names) + " |")
    miss = result["heads_missing_the_page"]
    lines += ["", "Heads whose top-K leaves the page out: " + ", ".join(f"{n} {miss[n]}" for n in names)]
    return "\n".join(lines)


def main(argv=None) -> int:
    from ..head_profile import resolve_profile
    from ..models import canonical_name, load_model
    from .__main__ import TITLES

    ap = argparse.ArgumentParser(prog="python -m flexicache_hf.eval.needle_ranks", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--gguf", default=None)
    ap.add_argument("--task", default="niah_multikey")
    ap.add_argument("--length", type=int, required=True, help="the task's prompt tokens (the eval's task_length)")
    ap.add_argument("--index", type=int, required=True, help="the sample's index (seed 0, as the eval's grids)")
    ap.add_argument("--budget", type=int, required=True, help="token budget: its pages are the top-K")
    ap.add_argument("--page-size", type=int, default=8)
    ap.add_argument("--unstable-fraction", type=float, default=0.375,
                    help="the split rule's unstable heads: the measured profile's least-stable fraction")
    ap.add_argument("--min-mass", type=float, default=0.3)
    ap.add_argument("--rules", default=",".join(RULES),
                    help="comma-separated rules to rank by: max / mass, optionally -shrink<λ> (e.g. max-shrink0.75)")
    ap.add_argument("--split", default="mass-shrink0.5,max", help="the split rule: stable heads' rule,unstable's")
    ap.add_argument("--at-step", type=int, default=None,
                    help="rank at this decode step (1 = the first after the prompt) instead of the answer's first")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", type=Path, default=None, help="directory for needle_ranks.json / .md")
    args = ap.parse_args(argv)
    model, tok = load_model(args.model, gguf_path=args.gguf, dtype=torch.float32, device=args.device)
    profile = resolve_profile(TITLES[canonical_name(args.model)]).least_stable(args.unstable_fraction)
    sample = make_samples(tok, args.task, args.length, args.index + 1, 0)[args.index]
    result = needle_ranks(model, tok, sample, page_size=args.page_size, budget=args.budget,
                          profile=profile, min_mass=args.min_mass, at_step=args.at_step,
                          rules=tuple(args.rules.split(",")), split=tuple(args.split.split(",")))
    command = "python -m flexicache_hf.eval.needle_ranks " + shlex.join(sys.argv[1:] if argv is None else argv)
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else f"CPU ({torch.get_num_threads()} threads)"
    text = f"Command: `{command}` (float32, {device})\n\n" + report(result)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "needle_ranks.json").write_text(json.dumps({"command": command, **result}, indent=1))
        (args.out / "needle_ranks.md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
