"""Runs a configuration's grid on one model: dense reach curve, task x policy, fidelity x policy."""

from __future__ import annotations

import time

from tqdm import tqdm

from ..data import long_prompt, load_documents
from . import fidelity
from .decoding import greedy, stop_ids
from .grids import EvalConfig
from .policies import Policy, ProfileSource, make_cache
from .tasks import make_samples, render


def _fidelity_docs(tokenizer, cfg: EvalConfig, corpus) -> list[int]:
    """Document indices (evenly spread over the corpus) whose source holds a full fidelity prompt."""
    docs = load_documents(corpus)
    step = max(1, len(docs) // (4 * cfg.fidelity_docs))
    picked = []
    for i in range(0, len(docs), step):
        if len(docs[i].text) > 3 * cfg.fidelity_prompt:  # ~4 chars/token: one document fills the prompt
            picked.append(i)
        if len(picked) == cfg.fidelity_docs:
            break
    return picked


def run(model, tokenizer, cfg: EvalConfig, *, profile_name: str | None, corpus=None, progress: bool = True,
        max_seconds: float | None = None, kernels: str | None = None) -> dict:
    """Every measurement of ``cfg``; returns the raw rows (the report turns them into tables).

    ``max_seconds``: a wall-clock guard for lent machines — once passed, remaining samples are skipped
    (whole samples, so every reported sample has every policy) and ``truncated`` says so.
    """
    profiles = ProfileSource(model.config, profile_name, cfg.seed)
    stop = stop_ids(model, tokenizer)
    task_policies, fid_policies = cfg.task_policies(), cfg.fidelity_policies()
    fid_docs = _fidelity_docs(tokenizer, cfg, corpus) if cfg.fidelity_docs else []
    total = (len(cfg.reach_lengths) * cfg.reach_samples + len(cfg.tasks) * cfg.samples * len(task_policies)
             + len(fid_docs) * len(fid_policies))
    bar = tqdm(total=total, disable=not progress, desc=f"eval {cfg.name}", unit="run")
    t0 = time.time()
    late = lambda: max_seconds is not None and time.time() - t0 > max_seconds  # noqa: E731

    def answer(sample, policy: Policy, ids) -> dict:
        cache = make_cache(policy, model.config, ids.shape[1], profiles, page_size=cfg.page_size,
                           kernels=kernels)
        out = greedy(model, ids, cache, sample.max_new_tokens, stop)
        text = tokenizer.decode(out, skip_special_tokens=True)
        bar.update()
        return {"task": sample.task, "index": sample.index, "policy": policy.label, "family": policy.family,
                "budget": policy.budget, "rerank_interval": policy.rerank_interval,
                "unstable_fraction": policy.unstable_fraction, "context_tokens": ids.shape[1],
                "budget_tokens": None if policy.family == "dense" else policy.budget_tokens(ids.shape[1], cfg.page_size),
                "answers": list(sample.answers), "output": text, "score": sample.score(text)}

    reach = []
    for n in cfg.reach_lengths:
        bar.set_postfix_str(f"reach {n}")
        for s in make_samples(tokenizer, "niah_single", n, cfg.reach_samples, cfg.seed + 1000, corpus):
            row = answer(s, Policy("dense"), render(tokenizer, s.context, s.question, s.answer_prefix))
            reach.append({**row, "target_tokens": n})

    tasks = []
    for task in cfg.tasks:
        for s in make_samples(tokenizer, task, cfg.task_length, cfg.samples, cfg.seed, corpus):
            if late():
                break
            ids = render(tokenizer, s.context, s.question, s.answer_prefix)
            for p in task_policies:
                bar.set_postfix_str(f"{task} {p.label}")
                tasks.append(answer(s, p, ids))

    fid = []
    for d in fid_docs:
        if late():
            break
        prompt = long_prompt(tokenizer, cfg.fidelity_prompt, doc_index=d, path=corpus)
        ref = fidelity.reference(model, prompt, cfg.fidelity_length, d)
        for p in fid_policies:
            bar.set_postfix_str(f"fidelity doc {d} {p.label}")
            row = fidelity.score(model, ref, lambda p=p: make_cache(p, model.config, prompt.shape[1], profiles,
                                                                      page_size=cfg.page_size, kernels=kernels),
                                 free_run=cfg.fidelity_free_run)
            fid.append({"doc_index": d, "policy": p.label, "family": p.family, "budget_tokens": p.budget,
                        "prompt_tokens": prompt.shape[1], "length": len(ref.continuation), **row})
            bar.update()
    bar.close()
    return {"reach": reach, "tasks": tasks, "fidelity": fid, "profiles_used": {str(k): v for k, v in profiles.used.items()},
            "seconds": time.time() - t0, "truncated": late()}
