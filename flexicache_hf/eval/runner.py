"""Runs a configuration's grid on one model: dense reach curve, task x policy, fidelity x policy."""

from __future__ import annotations

import time

import torch

from tqdm import tqdm

from ..data import long_prompt
from . import fidelity
from .decoding import greedy, stop_ids
from .grids import EvalConfig
from .policies import Policy, ProfileSource, make_cache
from .tasks import make_samples, render, render_split


def run(model, tokenizer, cfg: EvalConfig, *, profile_name: str | None, corpus=None, progress: bool = True,
        max_seconds: float | None = None, kernels: str | None = None) -> dict:
    """Every measurement of ``cfg``; returns the raw rows (the report turns them into tables).

    ``max_seconds``: a wall-clock guard for machines with a time limit per command — once passed, remaining samples are skipped
    (whole samples, so every reported sample has every policy; whole fidelity policies) and ``truncated``
    lists what was left out.
    """
    profiles = ProfileSource(model.config, profile_name, cfg.seed)
    stop = stop_ids(model, tokenizer)
    task_policies, fid_policies = cfg.task_policies(), cfg.fidelity_policies()
    if cfg.fidelity_doc_indices is not None:
        fid_docs = list(cfg.fidelity_doc_indices)
    else:
        fid_docs = fidelity.pick_documents(cfg.fidelity_docs, cfg.fidelity_prompt, corpus)
    indices = list(range(cfg.samples)) if cfg.task_indices is None else list(cfg.task_indices)
    if any(not 0 <= i < cfg.samples for i in indices):
        raise ValueError(f"task_indices {cfg.task_indices} must lie in 0..{cfg.samples - 1}")
    total = (len(cfg.reach_lengths) * cfg.reach_samples + len(cfg.tasks) * len(indices) * len(task_policies)
             + len(fid_docs) * len(fid_policies))
    bar = tqdm(total=total, disable=not progress, desc=f"eval {cfg.name}", unit="run")
    t0 = time.time()
    late = lambda: max_seconds is not None and time.time() - t0 > max_seconds  # noqa: E731

    def answer(sample, policy: Policy, chunks: tuple[torch.Tensor, ...]) -> dict:
        n = sum(c.shape[1] for c in chunks)
        cache = make_cache(policy, model.config, n, profiles, page_size=cfg.page_size, kernels=kernels)
        (out,) = greedy(model, chunks, cache, sample.max_new_tokens, stop)
        text = tokenizer.decode(out, skip_special_tokens=True)
        bar.update()
        return {"task": sample.task, "index": sample.index, "policy": policy.label, "family": policy.family,
                "budget": policy.budget, "rerank_interval": policy.rerank_interval,
                "unstable_fraction": policy.unstable_fraction, "context_tokens": n,
                "question_tokens": chunks[-1].shape[1] if len(chunks) > 1 else None,
                "budget_tokens": None if policy.family == "dense" else policy.budget_tokens(n, cfg.page_size),
                "answers": list(sample.answers), "output": text, "score": sample.score(text)}

    reach = []
    for n in cfg.reach_lengths:
        bar.set_postfix_str(f"reach {n}")
        for s in make_samples(tokenizer, "niah_single", n, cfg.reach_samples, cfg.seed + 1000, corpus):
            row = answer(s, Policy("dense"), (render(tokenizer, s.context, s.question, s.answer_prefix),))
            reach.append({**row, "target_tokens": n})

    skipped: list[str] = []  # what the time limit left out
    tasks = []
    samples = {t: make_samples(tokenizer, t, cfg.task_length, cfg.samples, cfg.seed, corpus) for t in cfg.tasks}
    for n, i in enumerate(indices):  # sample-major: a time limit leaves every task with the same sample count
        if late():
            skipped.append(f"task samples {i + 1}..{cfg.samples}" if cfg.task_indices is None
                           else f"task sample indices {indices[n:]}")
            break
        for task in cfg.tasks:
            s = samples[task][i]
            parts = (s.context, s.question, s.answer_prefix)
            chunks = render_split(tokenizer, *parts) if cfg.question_after_context else (render(tokenizer, *parts),)
            for p in task_policies:
                bar.set_postfix_str(f"{task} #{i} {p.label}")
                tasks.append(answer(s, p, chunks))

    fid = []
    if fid_docs and late():
        skipped.append("fidelity")
    elif fid_docs:
        # All documents as one batch: each prompt is exactly `fidelity_prompt` tokens.
        prompts = torch.cat([long_prompt(tokenizer, cfg.fidelity_prompt, doc_index=d, path=corpus) for d in fid_docs])
        refs = fidelity.references(model, prompts, cfg.fidelity_length, fid_docs)
        for p in fid_policies:  # in grid order, so a time limit drops the last-listed policies first
            if late():
                skipped.append("fidelity policies from " + p.label)
                break
            bar.set_postfix_str(f"fidelity {len(refs)} docs {p.label}")
            rows = fidelity.score(model, refs, lambda p=p: make_cache(p, model.config, prompts.shape[1], profiles,
                                                                        page_size=cfg.page_size, kernels=kernels),
                                  free_run=cfg.fidelity_free_run)
            for ref, row in zip(refs, rows):
                fid.append({"doc_index": ref.doc_index, "policy": p.label, "family": p.family,
                            "budget_tokens": p.budget, "prompt_tokens": prompts.shape[1],
                            "length": len(ref.continuation), **row})
            bar.update(len(refs))
    bar.close()
    return {"question_after_context": cfg.question_after_context, "reach": reach, "tasks": tasks, "fidelity": fid,
            "profiles_used": {str(k): v for k, v in profiles.used.items()}, "seconds": time.time() - t0,
            "truncated": skipped}
