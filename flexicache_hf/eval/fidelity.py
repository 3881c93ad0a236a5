"""Long-generation fidelity: how closely a policy tracks the dense model over a long continuation.

The reference is the dense model's own greedy continuation of a real document.  Each policy is scored on
it three ways: teacher-forced NLL (per token, prompt then continuation as decode steps, so the policy's
sparse decode path makes every prediction), greedy agreement (top-1 match rate under teacher forcing, and
the length of the exact prefix — equal to where a free-running policy would first diverge), and the
similarity of the policy's own free-running output to the dense one (token-level ROUGE-L).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from .decoding import greedy, teacher_forced
from .scorers import agreement_length, rouge_l


@dataclass(frozen=True)
class Reference:
    doc_index: int
    prompt: torch.Tensor  # [1, T]
    continuation: list[int]  # dense greedy tokens


def reference(model, prompt: torch.Tensor, length: int, doc_index: int) -> Reference:
    # EOS is not a stop here: fidelity needs `length` tokens whatever the instruct model thinks of the prose.
    return Reference(doc_index, prompt, greedy(model, prompt, DynamicCache(), length))


def score(model, ref: Reference, make_cache, free_run: bool = True) -> dict:
    """Fidelity of one policy (``make_cache()`` gives a fresh cache of it) against ``ref``."""
    nll, argmax = teacher_forced(model, ref.prompt, ref.continuation, make_cache())
    cont = ref.continuation
    row = {
        "nll": sum(nll) / len(nll),
        "ppl": math.exp(sum(nll) / len(nll)),
        "top1_agreement": sum(a == b for a, b in zip(argmax, cont)) / len(cont),
        "agreement_length": agreement_length(argmax, cont),
    }
    if free_run:
        own = greedy(model, ref.prompt, make_cache(), len(cont))
        row["rouge_l"] = rouge_l(own, cont)
    return row
