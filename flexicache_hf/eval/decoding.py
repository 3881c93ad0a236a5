"""Step-by-step greedy decoding and teacher-forced scoring with any cache.

The harness drives the model itself rather than through ``generate``: every policy must take its own
decode path one token at a time (FlexiCache's sparse decode is what is being scored), prefill computes
only the last position's logits (a 8k x 49k logits tensor would dwarf the KV cache), and the same loop
serves every cache type.
"""

from __future__ import annotations

import warnings

import torch

from .query_capture import capture_queries


def _forward(model, ids: torch.Tensor, cache) -> torch.Tensor:
    """Logits ``[vocab]`` (float32) of the last position after feeding ``ids [1, T]`` into ``cache``."""
    with warnings.catch_warnings():
        # `past_key_values` is renamed `cache` in newer transformers; the old name works on every version we run.
        warnings.simplefilter("ignore", FutureWarning)
        out = model(input_ids=ids.to(model.device), past_key_values=cache, use_cache=True, logits_to_keep=1)
    return out.logits[0, -1].float()


def stop_ids(model, tokenizer) -> set[int]:
    ids = set()
    for src in (getattr(tokenizer, "eos_token_id", None), getattr(model.generation_config, "eos_token_id", None)):
        if isinstance(src, int):
            ids.add(src)
        elif src:
            ids.update(src)
    return ids


@torch.inference_mode()
def greedy(model, prompt: torch.Tensor, cache, max_new_tokens: int, stop: set[int] = frozenset()) -> list[int]:
    """Greedy tokens after ``prompt [1, T]``, stopping after a token in ``stop`` or ``max_new_tokens``."""
    out: list[int] = []
    with capture_queries(model):
        logits = _forward(model, prompt, cache)
        for _ in range(max_new_tokens):
            tok = int(logits.argmax())
            out.append(tok)
            if tok in stop or len(out) == max_new_tokens:
                break
            logits = _forward(model, torch.tensor([[tok]]), cache)
    return out


@torch.inference_mode()
def teacher_forced(model, prompt: torch.Tensor, continuation: list[int], cache) -> tuple[list[float], list[int]]:
    """Per-token NLL of ``continuation`` after ``prompt`` and the model's argmax at each step.

    The prompt is one prefill; the continuation is fed one token per forward, so each prediction is a
    decode step of ``cache``'s own policy.
    """
    nll, argmax = [], []
    with capture_queries(model):
        logits = _forward(model, prompt, cache)
        for i, tok in enumerate(continuation):
            nll.append(float(-torch.log_softmax(logits, -1)[tok]))
            argmax.append(int(logits.argmax()))
            if i + 1 < len(continuation):
                logits = _forward(model, torch.tensor([[tok]]), cache)
    return nll, argmax
