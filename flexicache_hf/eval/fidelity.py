"""Long-generation fidelity: how closely a policy tracks the dense model over a long continuation.

The reference is the dense model's own greedy continuation of a real document.  Each policy is scored on
it three ways: teacher-forced NLL (per token, prompt then continuation as decode steps, so the policy's
sparse decode path makes every prediction), greedy agreement (top-1 match rate under teacher forcing, and
the length of the exact prefix — equal to where a free-running policy would first diverge), and the
similarity of the policy's own free-running output to the dense one (token-level ROUGE-L).

Documents are scored as one batch (their prompts have one length), so a policy costs one pass over the
continuation whatever the number of documents.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from ..data import load_documents
from .decoding import greedy, teacher_forced
from .scorers import agreement_length, rouge_l


@dataclass(frozen=True)
class Reference:
    doc_index: int
    prompt: torch.Tensor  # [1, T]
    continuation: list[int]  # dense greedy tokens


def pick_documents(n: int, prompt_tokens: int, corpus=None) -> list[int]:
    """``n`` corpus documents that each fill a ``prompt_tokens`` prompt alone, spread over the sources.

    Sources take turns (in corpus order) until ``n`` are chosen; within a source the chosen documents are
    evenly spaced.  Deterministic: depends only on the corpus.
    """
    by_source: dict[str, list[int]] = {}
    for i, d in enumerate(load_documents(corpus)):
        if len(d.text) > 3 * prompt_tokens:  # ~4 chars/token: one document fills the prompt
            by_source.setdefault(d.source, []).append(i)
    pools = list(by_source.values())
    counts = [0] * len(pools)
    while sum(counts) < n and any(c < len(p) for c, p in zip(counts, pools)):
        for j, pool in enumerate(pools):
            if sum(counts) < n and counts[j] < len(pool):
                counts[j] += 1
    if sum(counts) < n:
        raise ValueError(f"the corpus has only {sum(counts)} documents long enough for {prompt_tokens}-token prompts")
    return [pool[m * len(pool) // c] for pool, c in zip(pools, counts) for m in range(c)]


def references(model, prompts: torch.Tensor, length: int, doc_indices: list[int]) -> list[Reference]:
    """The dense greedy continuation of each row of ``prompts [B, T]``."""
    # EOS is not a stop here: fidelity needs `length` tokens whatever the instruct model thinks of the prose.
    outs = greedy(model, prompts, DynamicCache(), length)
    return [Reference(d, prompts[r:r + 1], out) for r, (d, out) in enumerate(zip(doc_indices, outs))]


def score(model, refs: list[Reference], make_cache, free_run: bool = True) -> list[dict]:
    """Fidelity of one policy (``make_cache()`` gives a fresh cache of it) against each of ``refs``."""
    prompts = torch.cat([r.prompt for r in refs])
    conts = [r.continuation for r in refs]
    cache = make_cache()
    nlls, argmaxes = teacher_forced(model, prompts, conts, cache)
    # Caches that measure something of their own per row (the oracle: attention mass kept) report it too.
    stats = cache.row_stats() if hasattr(cache, "row_stats") else []
    stats = stats or [{} for _ in refs]
    owns = greedy(model, prompts, make_cache(), len(conts[0])) if free_run else [None] * len(refs)
    rows = []
    for nll, argmax, cont, own, extra in zip(nlls, argmaxes, conts, owns, stats):
        row = {
            **extra,
            "nll": sum(nll) / len(nll),
            "ppl": math.exp(sum(nll) / len(nll)),
            "top1_agreement": sum(a == b for a, b in zip(argmax, cont)) / len(cont),
            "agreement_length": agreement_length(argmax, cont),
        }
        if own is not None:
            row["rouge_l"] = rouge_l(own, cont)
        rows.append(row)
    return rows
