"""Step-by-step greedy decoding and teacher-forced scoring with any cache, one row or a batch of rows.

The harness drives the model itself rather than through ``generate``: every policy must take its own
decode path one token at a time (FlexiCache's sparse decode is what is being scored), prefill computes
only the last position's logits (a 8k x 49k logits tensor would dwarf the KV cache), and the same loop
serves every cache type.  Rows of a batch share one prompt length (no padding: the eviction baselines
do not support it), which is what fidelity's equal-length document prompts give.
"""

from __future__ import annotations

import torch

from ..hf_compat import forward_cache_kwarg
from .query_capture import capture_queries


def _forward(model, ids: torch.Tensor, cache) -> torch.Tensor:
    """Logits ``[B, vocab]`` (float32) of the last position after feeding ``ids [B, T]`` into ``cache`` (under the
    name this transformers' forward takes it)."""
    out = model(input_ids=ids.to(model.device), **{forward_cache_kwarg(model): cache}, use_cache=True,
                logits_to_keep=1)
    return out.logits[:, -1].float()


def stop_ids(model, tokenizer) -> set[int]:
    ids = set()
    for src in (getattr(tokenizer, "eos_token_id", None), getattr(model.generation_config, "eos_token_id", None)):
        if isinstance(src, int):
            ids.add(src)
        elif src:
            ids.update(src)
    return ids


@torch.inference_mode()
def greedy(model, prompt: torch.Tensor | tuple[torch.Tensor, ...], cache, max_new_tokens: int,
           stop: set[int] = frozenset()) -> list[list[int]]:
    """Greedy tokens of each row after ``prompt [B, T]`` (or a tuple of prompt chunks, fed one forward each, in
    order); a row ends after a token in ``stop`` (kept) or ``max_new_tokens``.  A finished row keeps being fed its
    last token until every row is done, and its output is not extended."""
    chunks = (prompt,) if isinstance(prompt, torch.Tensor) else tuple(prompt)
    rows: list[list[int]] = [[] for _ in range(chunks[0].shape[0])]
    done = [False] * len(rows)
    with capture_queries(model):
        for chunk in chunks:
            logits = _forward(model, chunk, cache)
        while True:
            toks = logits.argmax(-1).tolist()
            for r, tok in enumerate(toks):
                if not done[r]:
                    rows[r].append(tok)
                    done[r] = tok in stop or len(rows[r]) == max_new_tokens
            if all(done):
                return rows
            logits = _forward(model, torch.tensor([[row[-1]] for row in rows]), cache)


@torch.inference_mode()
def teacher_forced(model, prompt: torch.Tensor, continuations: list[list[int]],
                   cache) -> tuple[list[list[float]], list[list[int]]]:
    """Per-token NLL of each row's continuation after ``prompt [B, T]`` and the model's argmax at each step.

    The prompt is one prefill; the continuations (all of one length) are fed one token per forward, so each
    prediction is a decode step of ``cache``'s own policy.
    """
    if len(continuations) != prompt.shape[0] or len({len(c) for c in continuations}) != 1:
        raise ValueError("one continuation per prompt row, all of the same length")
    B, L = prompt.shape[0], len(continuations[0])
    nll: list[list[float]] = [[] for _ in range(B)]
    argmax: list[list[int]] = [[] for _ in range(B)]
    with capture_queries(model):
        logits = _forward(model, prompt, cache)
        for i in range(L):
            col = torch.tensor([c[i] for c in continuations], device=logits.device)
            step_nll = -torch.log_softmax(logits, -1).gather(1, col[:, None])[:, 0]
            for r, (v, a) in enumerate(zip(step_nll.tolist(), logits.argmax(-1).tolist())):
                nll[r].append(v)
                argmax[r].append(a)
            if i + 1 < L:
                logits = _forward(model, col[:, None].cpu(), cache)
    return nll, argmax
