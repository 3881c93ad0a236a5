"""The named run configurations (``--config tiny|full|...``) and the policy grid each one expands to."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from .policies import Policy

ALL_TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery", "variable_tracking",
             "frequent_words")


@dataclass(frozen=True)
class EvalConfig:
    name: str
    tasks: tuple[str, ...] = ALL_TASKS
    task_length: int = 800  # prompt tokens of the retrieval tasks: where dense SmolLM2-135M still scores
    # Task prompts fed as two chunks, the context and then the question (tasks.render_split): the cache holds (an
    # eviction baseline compresses) the context before the question is known.  False: one prompt forward.
    question_after_context: bool = False
    samples: int = 4  # per task
    task_indices: tuple[int, ...] | None = None  # run only these of the `samples` drawn per task (None: all)
    budgets: tuple[float, ...] = (1 / 16, 1 / 8, 1 / 4)  # fractions of each task prompt
    families: tuple[str, ...] = ("flexicache", "quest", "streaming", "snapkv", "lserve")
    sweep_budget: float = 1 / 8  # where FlexiCache's R and unstable-fraction sweeps run
    rerank_intervals: tuple[int, ...] = (8, 16, 32)
    unstable_fractions: tuple[float, ...] = (0.0, 0.25, 0.5)
    reach_lengths: tuple[int, ...] = (400, 800, 1600, 3200)  # dense niah_single accuracy curve
    reach_samples: int = 4
    fidelity_docs: int = 1  # documents picked by fidelity.pick_documents (spread over the corpus sources)
    fidelity_doc_indices: tuple[int, ...] | None = None  # explicit documents instead (earlier runs' picks)
    fidelity_prompt: int = 4096
    fidelity_length: int = 512
    fidelity_budgets: tuple[int, ...] = (256, 512, 1024, 2048)
    fidelity_families: tuple[str, ...] = ("flexicache", "quest", "streaming", "snapkv", "lserve")
    fidelity_free_run: bool = True
    fidelity_extra: tuple[Policy, ...] = ()  # policies scored on fidelity beyond the budget x family grid
    task_extra: tuple[Policy, ...] = ()  # policies run on the tasks beyond the budget x family grid and sweeps
    page_size: int = 16
    model: str = "smollm2-135m"  # flexicache_hf.models.load_model name the CLI loads (--model overrides)
    dense_floor: float = 0.1  # tasks where dense scores below this are reported but left out of means
    seed: int = 0
    extra: dict = field(default_factory=dict, compare=False)

    def task_policies(self) -> list[Policy]:
        out = [Policy("dense")]
        for b in self.budgets:
            for fam in self.families:
                out.append(Policy(fam, b) if fam != "flexicache" else Policy(fam, b, 16, 0.25))
        if "flexicache" in self.families:
            for r in self.rerank_intervals:
                for u in self.unstable_fractions:
                    p = Policy("flexicache", self.sweep_budget, r, u)
                    if p not in out:
                        out.append(p)
        return out + [p for p in self.task_extra if p not in out]

    def fidelity_policies(self) -> list[Policy]:
        out = [Policy("dense")]
        for b in self.fidelity_budgets:
            out += [Policy(f, b) for f in self.fidelity_families]
        return out + [p for p in self.fidelity_extra if p not in out]


def tiny() -> EvalConfig:
    """CPU-sized (SmolLM2-135M on 2 shared cores, ~10 min): every task and family once, one budget, no sweeps.

    One sample per task: a smoke test of the whole pipeline on the real model, not a measurement.
    """
    return EvalConfig(name="tiny", task_length=384, samples=1, budgets=(1 / 4,), sweep_budget=1 / 4,
                      rerank_intervals=(16,), unstable_fractions=(0.25,), reach_lengths=(256, 512), reach_samples=2,
                      fidelity_prompt=512, fidelity_length=24, fidelity_budgets=(64,))


def full() -> EvalConfig:
    """The configuration of the brief.  Tasks: budgets 1/16..1/4 of ~800-token prompts (where dense SmolLM2-135M
    still scores on most tasks), 8 samples, the R x unstable-fraction sweep, and the paper's selection with a
    sink page and two recent pages as an extra row.  Fidelity: 4 documents (spread over the corpus sources)
    of 7,680 prompt tokens + 512 dense tokens — the model's whole 8k context — at budgets 1024/2048/512/256
    (in that order, so a time limit drops the smallest budgets first), teacher-forced.

    Too long for one 10-minute GPU command: run it as ``--part tasks`` and ``--part fidelity``.
    """
    extra = tuple(Policy("flexicache", b, 16, 0.25, "measured", 1, 2) for b in (1 / 8, 1 / 4))
    return EvalConfig(name="full", samples=8, reach_lengths=(400, 800, 1200, 2000, 3500), reach_samples=8,
                      task_extra=extra, fidelity_docs=4, fidelity_prompt=7680, fidelity_length=512,
                      fidelity_budgets=(1024, 2048, 512, 256), fidelity_free_run=False)


def gpu_short() -> EvalConfig:
    """What fits a few minutes of a shared H200: ``full``'s budgets and families, fewer samples, a smaller
    sweep, one 4k-token fidelity document scored teacher-forced only."""
    return replace(full(), name="gpu-short", samples=2, rerank_intervals=(8, 32), unstable_fractions=(0.0, 0.5),
                   reach_samples=4, task_extra=(), fidelity_docs=1, fidelity_prompt=4096, fidelity_length=256,
                   fidelity_budgets=(256, 1024))


def fidelity_3k() -> EvalConfig:
    """Generation fidelity only, CPU-sized: a 3k-token document, 128 dense tokens, budgets 256/512/1024 —
    FlexiCache against Quest-like (same selection, no tiers) and StreamingLLM (permanent eviction)."""
    return EvalConfig(name="fidelity-3k", tasks=(), reach_lengths=(), fidelity_doc_indices=(0, 22), fidelity_prompt=3072,
                      fidelity_length=128, fidelity_budgets=(256, 512, 1024),
                      fidelity_families=("flexicache", "quest", "streaming"))


def profiles_3k() -> EvalConfig:
    """Does the measured profile matter?  FlexiCache at budgets 256 and 512 of a 3k-token document with the
    measured profile, a random profile of the same size, all heads stable, and all heads unstable."""
    variants = tuple(
        Policy("flexicache", b, 16, u, kind)
        for b in (256, 512)
        for u, kind in ((0.25, "measured"), (0.25, "random"), (0.0, "measured"), (1.0, "measured"))
    )
    return EvalConfig(name="profiles-3k", tasks=(), reach_lengths=(), fidelity_doc_indices=(0, 22), fidelity_prompt=3072,
                      fidelity_length=128, fidelity_budgets=(), fidelity_families=(), fidelity_free_run=False,
                      fidelity_extra=variants)


def sinks_3k() -> EvalConfig:
    """FlexiCache's selection as in the paper vs keeping the first page and the 4 newest in every re-rank."""
    variants = tuple(Policy("flexicache", b, 16, 0.25, "measured", sink, recent)
                     for b in (256, 512) for sink, recent in ((0, 0), (1, 4)))
    return EvalConfig(name="sinks-3k", tasks=(), reach_lengths=(), fidelity_docs=1, fidelity_prompt=3072,
                      fidelity_length=128, fidelity_budgets=(), fidelity_families=(), fidelity_free_run=False,
                      fidelity_extra=variants)


PARTS = ("all", "tasks", "fidelity")


def only(cfg: EvalConfig, part: str) -> EvalConfig:
    """``cfg`` restricted to one part: ``tasks`` (reach curve + task grid) or ``fidelity`` — so a configuration
    too long for one sitting (a GPU machine's per-command time limit) runs as two commands with two reports."""
    if part not in PARTS:
        raise ValueError(f"part must be one of {PARTS}, got {part!r}")
    if part == "tasks":
        return replace(cfg, name=f"{cfg.name}/tasks", fidelity_docs=0, fidelity_doc_indices=None)
    if part == "fidelity":
        return replace(cfg, name=f"{cfg.name}/fidelity", tasks=(), reach_lengths=())
    return cfg


def recency_8k() -> EvalConfig:
    """``full``'s fidelity documents (8k context) with FlexiCache keeping a sink page and a window of recent
    pages in every re-rank — does recency close the gap to StreamingLLM on prose continuation?"""
    variants = tuple(Policy("flexicache", b, 16, 0.25, "measured", 1, r)
                     for b, r in ((1024, 4), (1024, 16), (512, 4), (512, 8), (256, 4), (2048, 16)))
    return replace(full(), name="recency-8k", tasks=(), reach_lengths=(), fidelity_budgets=(),
                   fidelity_families=(), fidelity_extra=variants)


def free_8k() -> EvalConfig:
    """Free-running ROUGE-L at 8k, budget 1024 (CPU-sized: one document): the paper's selection, the same with
    a sink page and 4 recent pages, and every permanent-eviction baseline."""
    extra = (Policy("flexicache", 1024, 16, 0.25, "measured", 1, 4),)
    return replace(full(), name="free-8k", tasks=(), reach_lengths=(), fidelity_docs=1, fidelity_budgets=(1024,),
                   fidelity_families=("flexicache", "streaming", "snapkv", "lserve"), fidelity_extra=extra,
                   fidelity_free_run=True)


def pages8_tasks() -> EvalConfig:
    """``full``'s tasks with 8-token pages: does a finer page grain lift the min/max selection at 6-12 pages'
    worth of budget?  FlexiCache (R16 u25) and Quest-like at 1/8 and 1/4."""
    return replace(full(), name="pages8-tasks", page_size=8, reach_lengths=(), budgets=(1 / 8, 1 / 4),
                   families=("flexicache", "quest"), rerank_intervals=(), unstable_fractions=(), task_extra=(),
                   fidelity_docs=0)


def _oracle_variants(budgets: tuple[int, ...]) -> tuple[Policy, ...]:
    """Per budget (budget-major, so a time limit drops whole budgets): Quest-like, FlexiCache as in the paper and
    with a sink page + 4 recent pages (a *random* profile of 25 % unstable heads), the oracle without and with the
    same forced pages, and the Quest-like selection through the oracle's reference path (same NLL as quest, plus
    the attention mass its pages keep); then the same bound with ``group_score="mass"`` (each query head's bounds
    as a softmax over pages, summed over the group): Quest-like, quest-ref and FlexiCache + sink / recent."""
    out: list[Policy] = []
    for b in budgets:
        out += [Policy("quest", b), Policy("flexicache", b, 16, 0.25, "random"),
                Policy("flexicache", b, 16, 0.25, "random", 1, 4), Policy("oracle", b),
                Policy("oracle", b, sink_pages=1, recent_pages=4), Policy("quest-ref", b),
                Policy("quest", b, group_score="mass"), Policy("quest-ref", b, group_score="mass"),
                Policy("flexicache", b, 16, 0.25, "random", 1, 4, "mass")]
    return tuple(out)


def _qwen_long(length: int, budgets: tuple[int, ...], samples: int) -> EvalConfig:
    """Issue 14's harness on Qwen2.5-Coder-0.5B at one context ``length`` (GPU-sized; ``--part tasks`` /
    ``--part fidelity`` as separate commands).

    Tasks: niah_single / niah_multikey at ~``length`` tokens, ``samples`` each, at token ``budgets``: FlexiCache
    (the *measured* profile when ``profiles/Qwen2.5-Coder-0.5B-Instruct.json`` exists, else the random fallback
    named in the report), Quest-like, StreamingLLM, SnapKV-style, LServe-like; per budget also FlexiCache with
    a random profile of the same size (the control), and FlexiCache / Quest-like with a sink page, 4 recent pages
    and ``group_score="mass"``.  Fidelity: 8 documents of ``length`` prompt tokens + 256 dense tokens,
    teacher-forced, the same policies.
    """
    extra: list[Policy] = []
    for b in budgets:
        extra += [Policy("flexicache", b, 16, 0.25, "random"), Policy("flexicache", b, 16, 0.25, "measured", 1, 4),
                  Policy("flexicache", b, 16, 0.25, "measured", 1, 4, "mass"),
                  Policy("quest", b, sink_pages=1, recent_pages=4, group_score="mass")]
    return EvalConfig(name=f"qwen-{length // 1000}k", model="qwen2.5-coder-0.5b",
                      tasks=("niah_single", "niah_multikey"), task_length=length - 200, samples=samples,
                      budgets=budgets, families=("flexicache", "quest", "streaming", "snapkv", "lserve"),
                      rerank_intervals=(), unstable_fractions=(), reach_lengths=(), task_extra=tuple(extra),
                      fidelity_docs=8, fidelity_prompt=length, fidelity_length=256, fidelity_budgets=budgets,
                      fidelity_families=("flexicache", "quest", "streaming", "snapkv", "lserve"),
                      fidelity_free_run=False, fidelity_extra=tuple(extra))


def qwen_8k() -> EvalConfig:
    """:func:`_qwen_long` at 8k: budgets 512 (1/16), 1024 (1/8), 2048."""
    return _qwen_long(8192, (512, 1024, 2048), 4)


def qwen_16k() -> EvalConfig:
    """:func:`_qwen_long` at 16k: budgets 1024 (1/16) and 2048 (1/8)."""
    return _qwen_long(16384, (1024, 2048), 4)


def qwen_32k() -> EvalConfig:
    """:func:`_qwen_long` at 32k (the model's whole context): budgets 2048 (1/16) and 4096 (1/8), 3 samples a
    task.  Tasks only: the built-in corpus has no document long enough for a 32k-token fidelity prompt."""
    return _qwen_long(32768, (2048, 4096), 3)


def oracle_16k() -> EvalConfig:
    """Issue 14: why does long generation degrade at 16k with budgets 1024 / 2048 on Qwen2.5-Coder-0.5B?
    (GPU-sized; ``--model`` defaults to ``qwen2.5-coder-0.5b`` here.)

    Fidelity: 8 documents (``fidelity.pick_documents``, spread over the corpus sources) of 16,384 prompt tokens
    + 512 dense greedy tokens, teacher-forced, at budgets 1024 and 2048: dense, Quest-like, FlexiCache (paper:
    R16, no forced pages), FlexiCache + sink 1 / recent 4, the oracle (exact attention mass ranking, same budget
    and page rules, re-ranked every step) without and with sink 1 / recent 4, and quest-ref.  If the oracle
    stays near dense while FlexiCache / Quest-like degrade, the min/max bound over a query-head group (7 query
    heads per KV head on Qwen2.5-0.5B) is the limit; if not, the budget is.

    **No measured Qwen profile exists yet**: FlexiCache rows use ``HeadProfile.random`` with 25 % unstable heads
    (seed 0), labelled ``-random``; a control, not the paper's claim.

    Tasks (``--part tasks``): niah_single / niah_multikey at ~16k tokens, 4 samples, budgets 1024 / 2048, the
    same families (FlexiCache there with the random fallback too, named in the report's profile line).
    ~5 min per part on an H200 (estimate); run the parts as separate commands with ``--max-minutes 9``.
    """
    return EvalConfig(name="oracle-16k", model="qwen2.5-coder-0.5b", tasks=("niah_single", "niah_multikey"),
                      task_length=16000, samples=4, budgets=(1024, 2048),
                      families=("quest", "flexicache", "oracle", "quest-ref"), rerank_intervals=(),
                      unstable_fractions=(), reach_lengths=(), fidelity_docs=8, fidelity_prompt=16384,
                      fidelity_length=512, fidelity_budgets=(), fidelity_families=(), fidelity_free_run=False,
                      fidelity_extra=_oracle_variants((1024, 2048)))


def oracle_16k_pages8() -> EvalConfig:
    """``oracle-16k`` with 8-token pages (same token budgets, twice the pages): does a finer page grain close the
    gap between the min/max selection and the oracle?"""
    return replace(oracle_16k(), name="oracle-16k-pages8", page_size=8)


def oracle_cpu() -> EvalConfig:
    """CPU-sized evidence for the oracle question on the embedded SmolLM2: 2 documents of 2,048 prompt tokens,
    64 dense tokens, teacher-forced, budget 256: Quest-like, FlexiCache (measured profile), oracle, quest-ref, then
    FlexiCache and the oracle with a sink page + 4 recent pages.  A smoke-sized measurement (~5 min on 2 cores)."""
    extra = (Policy("flexicache", 256, 16, 0.25, "measured", 1, 4), Policy("oracle", 256, sink_pages=1, recent_pages=4))
    return EvalConfig(name="oracle-cpu", tasks=(), reach_lengths=(), fidelity_docs=2, fidelity_prompt=2048,
                      fidelity_length=64, fidelity_budgets=(256,), fidelity_families=("quest", "flexicache", "oracle",
                                                                                       "quest-ref"),
                      fidelity_free_run=False, fidelity_extra=extra)


def oracle_qwen_cpu() -> EvalConfig:
    """The oracle question on Qwen2.5-Coder-0.5B itself (7 query heads per KV head), CPU-sized: 2 documents of
    8,192 prompt tokens + 32 dense tokens, teacher-forced, budget 512 (1/16 of the context): Quest-like, FlexiCache
    (paper; *random* 25 % profile, no measured Qwen profile exists yet), oracle, quest-ref, and FlexiCache / the
    oracle with a sink page + 4 recent pages.  Slow on a CPU: it did not finish within 45 min on 2 cores (14 prefills
    of 8k tokens); the GPU grid ``oracle-16k`` is the measurement."""
    return EvalConfig(name="oracle-qwen-cpu", model="qwen2.5-coder-0.5b", tasks=(), reach_lengths=(),
                      fidelity_docs=2, fidelity_prompt=8192, fidelity_length=32, fidelity_budgets=(),
                      fidelity_families=(), fidelity_free_run=False, fidelity_extra=_oracle_variants((512,)))


def select_16k() -> EvalConfig:
    """Issue 14, after ``oracle-16k`` (the oracle at 1/16 stays within 4 % of dense NLL, Quest-like 53 % off: the
    ranking is the limit): does the measured profile bring FlexiCache's R16 schedule to its every-step twin, and
    does ``group_score="mass"`` carry over to FlexiCache?  8 documents of 16,384 prompt tokens + 256 dense tokens,
    teacher-forced; at 1024 and 2048: FlexiCache (measured profile) with the group maximum and with the mass,
    Quest-like with both; at 1024 also FlexiCache with a random profile and the mass (the control).  The most
    wanted rows come first, so a time limit drops the others.  ``select-16k-pages8``: 8-token pages."""
    out = (Policy("flexicache", 1024), Policy("flexicache", 1024, group_score="mass"),
           Policy("quest", 1024, group_score="mass"), Policy("flexicache", 1024, 16, 0.25, "random", group_score="mass"),
           Policy("flexicache", 2048, group_score="mass"), Policy("quest", 2048, group_score="mass"),
           Policy("flexicache", 2048), Policy("quest", 2048), Policy("quest", 1024))  # most wanted first
    return EvalConfig(name="select-16k", model="qwen2.5-coder-0.5b", tasks=(), reach_lengths=(), fidelity_docs=8,
                      fidelity_prompt=16384, fidelity_length=256, fidelity_budgets=(), fidelity_families=(),
                      fidelity_free_run=False, fidelity_extra=tuple(out))


def select_16k_pages8() -> EvalConfig:
    """:func:`select_16k` with 8-token pages, mass only (FlexiCache measured and Quest-like, 1024 then 2048)."""
    out = tuple(Policy(f, b, group_score="mass") for b in (1024, 2048) for f in ("flexicache", "quest"))
    return replace(select_16k(), name="select-16k-pages8", page_size=8, fidelity_extra=out)


def select_16k_rest() -> EvalConfig:
    """What :func:`select_16k_pages8` left unmeasured (8-token pages, mass): the every-step twin at 2048 (is R16
    within 0.02 of it?), a random profile of the same size at 1024 and 2048 (does the measured one beat it?), and
    the measured row at 2048 again, for a same-run comparison."""
    out = (Policy("quest", 2048, group_score="mass"), Policy("flexicache", 1024, 16, 0.25, "random", group_score="mass"),
           Policy("flexicache", 2048, group_score="mass"),
           Policy("flexicache", 2048, 16, 0.25, "random", group_score="mass"))  # most wanted first
    return replace(select_16k(), name="select-16k-rest", page_size=8, fidelity_extra=out)


def select_16k_seat() -> EvalConfig:
    """The headline rows of :func:`select_16k_pages8` / :func:`select_16k_rest` (8-token pages, mass, measured
    profile, 2048 then 1024) again, after the prompt's last query became the stable heads' step-0 re-rank, beside
    the every-step twin at 2048 (it has no stable heads, so it is unchanged: the same-run anchor)."""
    out = (Policy("flexicache", 2048, group_score="mass"), Policy("quest", 2048, group_score="mass"),
           Policy("flexicache", 1024, group_score="mass"))  # most wanted first
    return replace(select_16k(), name="select-16k-seat", page_size=8, fidelity_extra=out)


def select_16k_shrink() -> EvalConfig:
    """Does ``bound_shrink=0.5`` (the narrowed key box, an estimate instead of Quest's upper bound) close part of the
    gap to the oracle in generation?  :func:`select_16k_seat`'s setting (8-token pages, mass, 16k, 256 tokens): the
    every-step twin and FlexiCache at 2048 and 1024 with the shrink, then the same without it (the same-run anchor)."""
    out = (Policy("quest", 2048, group_score="mass", bound_shrink=0.5),
           Policy("flexicache", 2048, group_score="mass", bound_shrink=0.5),
           Policy("quest", 1024, group_score="mass", bound_shrink=0.5),
           Policy("flexicache", 1024, group_score="mass", bound_shrink=0.5),
           Policy("quest", 2048, group_score="mass"), Policy("quest", 1024, group_score="mass"))
    return replace(select_16k(), name="select-16k-shrink", page_size=8, fidelity_extra=out)


def select_16k_unstable() -> EvalConfig:
    """:func:`select_16k_shrink`'s FlexiCache rows (8-token pages, mass, shrink 0.5, R = 16) with the least-stable
    37.5 % of heads re-ranked every step instead of 25 %: how much of the gap to the every-step twin do more
    unstable heads close?  Then the every-step twin at 1024 (the same-run anchor) and the 25 % row at a narrower
    shrink (0.375)."""
    out = (Policy("flexicache", 2048, 16, 0.375, group_score="mass", bound_shrink=0.5),
           Policy("flexicache", 1024, 16, 0.375, group_score="mass", bound_shrink=0.5),
           Policy("quest", 1024, group_score="mass", bound_shrink=0.5),
           Policy("flexicache", 2048, group_score="mass", bound_shrink=0.375))
    return replace(select_16k(), name="select-16k-unstable", page_size=8, fidelity_extra=out)


def select_cpu() -> EvalConfig:
    """``select-16k``'s question on the embedded SmolLM2 (3 query heads per KV head), CPU-sized like
    ``oracle-cpu``: 2 documents of 2,048 prompt tokens + 64 dense tokens, teacher-forced, budget 256: FlexiCache
    (measured profile) and Quest-like, each with the group maximum and with ``group_score="mass"``."""
    extra = tuple(Policy(f, 256, group_score=g) for f in ("flexicache", "quest") for g in ("max", "mass"))
    return replace(oracle_cpu(), name="select-cpu", fidelity_budgets=(), fidelity_families=(), fidelity_extra=extra)


def _shrink_pair(budget: int) -> tuple[Policy, ...]:
    """Quest-like and FlexiCache at ``budget`` with the group mass, each with and without ``bound_shrink=0.5``."""
    return tuple(Policy(f, budget, group_score="mass", bound_shrink=lam) for f in ("quest", "flexicache")
                 for lam in (1.0, 0.5))


def shrink_cpu() -> EvalConfig:
    """``bound_shrink=0.5`` in generation on the embedded SmolLM2, CPU-sized like ``select-cpu`` (2 documents of
    2,048 prompt tokens + 64 dense tokens, teacher-forced, budget 256): Quest-like and FlexiCache (measured
    profile), with the group mass, with and without the shrink."""
    extra = _shrink_pair(256)
    return replace(select_cpu(), name="shrink-cpu", fidelity_extra=extra)


def mass_tasks_cpu() -> EvalConfig:
    """``full``'s retrieval tasks (~800 tokens, SmolLM2) at 1/8 and 1/4, 4 samples: FlexiCache and Quest-like with
    the group maximum and with ``group_score="mass"`` — does the mass keep the needles?  CPU, ~15 min."""
    extra = tuple(Policy(f, b, group_score="mass") for b in (1 / 8, 1 / 4) for f in ("flexicache", "quest"))
    return replace(full(), name="mass-tasks-cpu", samples=4, reach_lengths=(), budgets=(1 / 8, 1 / 4),
                   families=("flexicache", "quest"), rerank_intervals=(), unstable_fractions=(), task_extra=extra,
                   fidelity_docs=0)


def later_question_cpu() -> EvalConfig:
    """``full``'s four needle tasks (~800 tokens, SmolLM2, 3 samples) at 1/8 and 1/4, with the context fed before
    the question (``question_after_context``): a context cached once and asked about afterwards.  Permanent eviction
    then chooses without the question; FlexiCache still ranks every page with it.  Every family (~30 min, CPU)."""
    return replace(full(), name="later-question-cpu", tasks=ALL_TASKS[:4], samples=3, reach_lengths=(),
                   budgets=(1 / 8, 1 / 4), rerank_intervals=(), unstable_fractions=(), task_extra=(), fidelity_docs=0,
                   question_after_context=True)


def question_in_prompt_cpu() -> EvalConfig:
    """``later-question-cpu``'s samples and policies with the question in the one prompt forward (the control)."""
    return replace(later_question_cpu(), name="question-in-prompt-cpu", question_after_context=False)


def _later_question(cfg: EvalConfig) -> EvalConfig:
    """A Qwen task grid with the question fed after the context: its families at its budgets (FlexiCache with the
    measured profile, Quest-like and the eviction baselines; the variants of ``task_extra`` are left to the
    question-in-prompt grid, which keeps a sample within ~20 s on an H200); no fidelity part (it has no question)."""
    return replace(cfg, name=f"{cfg.name}-later-question", question_after_context=True, task_extra=(),
                   fidelity_docs=0, fidelity_extra=())


def profiles_qwen_cpu() -> EvalConfig:
    """Does Qwen2.5-Coder-0.5B's measured profile beat a random one of the same size?  CPU-sized: 2 documents of
    4,096 prompt tokens + 32 dense tokens, teacher-forced, budget 256 (1/16): FlexiCache R16 with the measured and
    a random 25 % profile, each with the group maximum and with ``group_score="mass"`` (~15 min on 2 cores)."""
    extra = tuple(Policy("flexicache", 256, 16, 0.25, kind, group_score=g)
                  for g in ("max", "mass") for kind in ("measured", "random"))
    return EvalConfig(name="profiles-qwen-cpu", model="qwen2.5-coder-0.5b", tasks=(), reach_lengths=(),
                      fidelity_docs=2, fidelity_prompt=4096, fidelity_length=32, fidelity_budgets=(),
                      fidelity_families=(), fidelity_free_run=False, fidelity_extra=extra)


def profiles_qwen_cpu_budgets() -> EvalConfig:
    """``profiles-qwen-cpu`` at the larger budgets 512 (1/8) and 1024 (1/4), group maximum (the default): does the
    measured profile's lead over a random one hold as the budget grows?  (~12 min on 2 cores.)"""
    extra = tuple(Policy("flexicache", b, 16, 0.25, kind) for b in (512, 1024) for kind in ("measured", "random"))
    return replace(profiles_qwen_cpu(), name="profiles-qwen-cpu-budgets", fidelity_extra=extra)


def profiles_qwen_cpu_recommended() -> EvalConfig:
    """``profiles-qwen-cpu`` with the README's long-output setting for Qwen (8-token pages, group mass, shrink 0.5,
    37.5 % unstable): does the measured profile still beat a random one of the same size, at budgets 256 (1/16) and
    512 (1/8)?  (~15 min on 2 cores.)"""
    extra = tuple(Policy("flexicache", b, 16, 0.375, kind, group_score="mass", bound_shrink=0.5)
                  for b in (256, 512) for kind in ("measured", "random"))
    return replace(profiles_qwen_cpu(), name="profiles-qwen-cpu-recommended", page_size=8, fidelity_extra=extra)


def shrink_qwen_cpu() -> EvalConfig:
    """``bound_shrink=0.5`` in generation on Qwen2.5-Coder-0.5B (7 query heads per KV head), where the offline study
    gained most, CPU-sized: 3 documents of 4,096 prompt tokens + 48 dense tokens, teacher-forced, budget 256
    (1/16), 8-token pages, the group mass (the 16k grids' setting): Quest-like and FlexiCache (measured profile),
    with and without the shrink (~25 min on 2 cores)."""
    extra = _shrink_pair(256)
    return replace(profiles_qwen_cpu(), name="shrink-qwen-cpu", fidelity_docs=3, fidelity_length=48, page_size=8,
                   fidelity_extra=extra)


def shrink_qwen_cpu_512() -> EvalConfig:
    """:func:`shrink_qwen_cpu` at budget 512 (1/8 of the 4k prompts): does the shrink's gain hold at a larger budget?"""
    extra = _shrink_pair(512)
    return replace(shrink_qwen_cpu(), name="shrink-qwen-cpu-512", fidelity_extra=extra)


def qwen_32k_retention() -> EvalConfig:
    """Issue 14's retrieval target at 32k with a sample size that can show it: the question after the context
    (where eviction baselines lose what they dropped), budget 2048 (1/16), 8 samples a task (``qwen-32k-later-question``
    had 3: FlexiCache 75 %, one multikey sample lost), every family; ~5 min on an H200."""
    return replace(_later_question(qwen_32k()), name="qwen-32k-retention", samples=8, budgets=(2048,))


def qwen_32k_retention_tuned() -> EvalConfig:
    """:func:`qwen_32k_retention` with the settings the README recommends for long outputs on Qwen2.5-class models
    (8-token pages, group mass, ``bound_shrink=0.5``): does retrieval at 1/16 of 32k hold with them?  FlexiCache
    (measured profile) and its every-step twin; the eviction baselines do not depend on these settings."""
    extra = tuple(Policy(f, 2048, group_score="mass", bound_shrink=0.5) for f in ("flexicache", "quest"))
    return replace(qwen_32k_retention(), name="qwen-32k-retention-tuned", page_size=8, families=(), task_extra=extra)


def select_16k_unstable_random() -> EvalConfig:
    """:func:`select_16k_unstable`'s headline rows (37.5 % unstable, shrink 0.5, 8-token pages, mass) with a random
    profile of the same size, at 2048 and 1024: issue 14's "the measured profile beats a random one at every
    budget" for the recommended setting (the measured rows are not repeated: this eval is bitwise reproducible,
    run 13's 1.047 and 1.077 stand)."""
    out = tuple(Policy("flexicache", b, 16, 0.375, "random", group_score="mass", bound_shrink=0.5) for b in (2048, 1024))
    return replace(select_16k(), name="select-16k-unstable-random", page_size=8, fidelity_extra=out)


def _retention_rows(budget: int) -> tuple[Policy, ...]:
    """The long-generation settings of issue 14 at one budget, for retrieval: FlexiCache (measured profile) with
    the least-stable 37.5 % of heads re-ranked every step and ``bound_shrink=0.5``, its every-step twin with the
    shrink, and FlexiCache with 25 % unstable and no shrink (the paper's bound); all with the group mass."""
    return (Policy("flexicache", budget, 16, 0.375, group_score="mass", bound_shrink=0.5),
            Policy("quest", budget, group_score="mass", bound_shrink=0.5),
            Policy("flexicache", budget, group_score="mass"))


def qwen_retention_unstable(base: EvalConfig) -> EvalConfig:
    """Does retrieval at 1/16 of ``base``'s length (``qwen_16k()`` or ``qwen_32k()``) hold with the settings that
    met issue 14's long-generation targets (``select-16k-unstable``: 8-token pages, mass, 37.5 % unstable, shrink
    0.5)?  The question after the context, 16 samples a task (``qwen-32k-retention-tuned`` had 8: one multikey
    sample lost with 25 % unstable and the shrink, by the every-step twin too); ~5 min on an H200 at 32k."""
    budget = base.fidelity_prompt // 16
    return replace(_later_question(base), name=f"{base.name}-retention-unstable", samples=16, budgets=(budget,),
                   page_size=8, families=(), task_extra=_retention_rows(budget))


def qwen_16k_retention() -> EvalConfig:
    """Issue 14's retrieval target at 16k with 16 samples a task (``qwen-16k-later-question`` had 4): the question
    after the context, budget 1024 (1/16), every family with the paper's settings (16-token pages, group
    maximum, 25 % unstable, R16) beside Quest-like and the eviction baselines; ~4 min on an H200."""
    return replace(_later_question(qwen_16k()), name="qwen-16k-retention", samples=16, budgets=(1024,))


def qwen_16k_retention_oracle() -> EvalConfig:
    """niah_multikey at 1/16 of 16k, 16 samples, 8-token pages (``qwen-16k-retention-unstable``'s samples): the
    oracle (exact attention mass of the current query, same budget) and Quest's bound with the group mass through
    the same reference path.  Every 8-token row of ``qwen-16k-retention-unstable`` lost one sample dense answers:
    if the oracle keeps it, the bound's ranking loses it; if not, the budget does."""
    grid = qwen_retention_unstable(qwen_16k())
    (budget,) = grid.budgets
    return replace(grid, name="qwen-16k-retention-oracle", tasks=("niah_multikey",),
                   task_extra=(Policy("oracle", budget), Policy("quest-ref", budget, group_score="mass")))


def qwen_32k_retention_multikey() -> EvalConfig:
    """:func:`qwen_32k_retention`'s multikey task with 16 samples (8 before), FlexiCache with the paper's settings
    only: does its 100 % hold on twice the samples?  ~2 min on an H200."""
    return replace(qwen_32k_retention(), name="qwen-32k-retention-multikey", samples=16, tasks=("niah_multikey",),
                   families=("flexicache",))


def _split_rows(budget: int, fraction: float = 0.375) -> tuple[Policy, ...]:
    """FlexiCache with a rule per kind of head at one budget: the stable heads by the mass of a box shrunk by
    half (the long-generation setting), the unstable ones (the least-stable ``fraction``, re-ranked every step)
    by the paper's bound, the group maximum of the full box; then its every-step twin (R = 1: every head
    re-ranked every step, each by its own rule)."""
    rule = dict(group_score="mass", bound_shrink=0.5, unstable_scoring=("max", 1.0))
    return (Policy("flexicache", budget, 16, fraction, **rule), Policy("flexicache", budget, 1, fraction, **rule))


def _oracle_unstable_rows(budget: int) -> tuple[Policy, ...]:
    """The profile's least-stable 37.5 % ranked by the exact attention mass, the other heads by the long-output
    rule (mass of the half-shrunk box) and by the paper's bound, every head every step (the reference path)."""
    return (Policy("oracle-unstable", budget, 1, 0.375, group_score="mass", bound_shrink=0.5),
            Policy("oracle-unstable", budget, 1, 0.375))


def qwen_16k_retention_oracle_unstable() -> EvalConfig:
    """``qwen-16k-retention-oracle``'s multikey samples with only the unstable heads ranked exactly
    (:func:`_oracle_unstable_rows`): every min/max rule lost sample 12, the oracle kept it.  Kept here too: a
    better ranking of the heads whose pages all stay on the device would do; lost: the stable heads' ranking
    matters as well (~1 min on an H200)."""
    grid = qwen_16k_retention_oracle()
    (budget,) = grid.budgets
    return replace(grid, name="qwen-16k-retention-oracle-unstable", task_extra=_oracle_unstable_rows(budget))


def _exact_rows(budget: int, fraction: float = 0.375, profile: str = "measured",
                interval: int = 16) -> Policy:
    """The long-output setting (8-token pages; the stable heads by the mass of the half-shrunk box) with the
    unstable heads ranked by the exact attention mass (``unstable_group_score="exact"``)."""
    return Policy("flexicache", budget, interval, fraction, profile, group_score="mass", bound_shrink=0.5,
                  unstable_scoring=("exact", 1.0))


def select_16k_exact() -> EvalConfig:
    """Issue 14's long-generation targets for :func:`_exact_rows` (``oracle-unstable`` kept 16k's multikey sample
    12 on the reference path): 16k fidelity at 2048 and 1024, each beside its every-step twin (R = 1), then a random
    profile of the same size at both budgets (~3 min on an H200)."""
    rows = []
    for b in (2048, 1024):
        rows += [_exact_rows(b), _exact_rows(b, interval=1)]
    rows += [_exact_rows(b, profile="random") for b in (2048, 1024)]
    return replace(select_16k(), name="select-16k-exact", page_size=8, fidelity_extra=tuple(rows))


def qwen_retention_exact(base: EvalConfig) -> EvalConfig:
    """Retrieval at 1/16 of ``base``'s length (16 samples a task, the question after the context, 8-token pages)
    with the unstable heads ranked exactly (:func:`_exact_rows`), 37.5 % and 25 % unstable (~2 min at 16k, ~5 at
    32k on an H200)."""
    grid = qwen_retention_unstable(base)
    (budget,) = grid.budgets
    return replace(grid, name=f"{base.name}-retention-exact",
                   task_extra=tuple(_exact_rows(budget, f) for f in (0.375, 0.25)))


def split_qwen_cpu() -> EvalConfig:
    """``profiles-qwen-cpu-recommended``'s documents (2 x 4,096 prompt tokens + 32 dense tokens, teacher-forced,
    8-token pages) at budgets 256 (1/16) and 512 (1/8): the README's long-output setting (37.5 % unstable, mass,
    shrink 0.5 for every head) beside the same with the unstable heads ranked by the paper's bound, and that
    split with 25 % unstable (~15 min on 2 cores).  Does giving the needle-seeking heads the full bound cost
    long-generation fidelity?"""
    extra = []
    for b in (256, 512):
        extra += [Policy("flexicache", b, 16, 0.375, group_score="mass", bound_shrink=0.5), _split_rows(b)[0],
                  _split_rows(b, 0.25)[0]]
    return replace(profiles_qwen_cpu(), name="split-qwen-cpu", page_size=8, fidelity_extra=tuple(extra))


def exact_qwen_cpu() -> EvalConfig:
    """``split-qwen-cpu``'s documents (2 x 4,096 prompt tokens + 32 dense tokens, 8-token pages) with the unstable
    heads ranked by the exact attention mass (:func:`_exact_rows`) at 256 (1/16) and 512 (1/8), against the
    long-output setting's 1.364 / 0.987 there (~8 min on 2 cores)."""
    return replace(split_qwen_cpu(), name="exact-qwen-cpu", fidelity_extra=(_exact_rows(256), _exact_rows(512)))


def exact_qwen_cpu_32k() -> EvalConfig:
    """The 32k multikey sample the long-output setting lost on the H200 (run 14, index 4: 8718 for 6034), on the
    CPU, the question after the context, budget 2048 (1/16), 8-token pages: dense, the long-output setting, and
    the same with the unstable heads ranked exactly (:func:`_exact_rows`).  Does the exact ranking keep what the
    shrunk box lost?  (~25 min on 2 cores: three 32k prefills.)"""
    grid = qwen_retention_unstable(qwen_32k())
    (budget,) = grid.budgets
    return replace(grid, name="exact-qwen-cpu-32k", tasks=("niah_multikey",), samples=5, task_indices=(4,),
                   task_extra=(_retention_rows(budget)[0], _exact_rows(budget)))


def split_qwen_cpu_max_shrink() -> EvalConfig:
    """``split-qwen-cpu``'s documents with the unstable heads ranked by the group maximum of the half-shrunk box
    (stable heads as before: the mass of the half-shrunk box), 37.5 % unstable, at 256 and 512 (~7 min on 2
    cores): does a group maximum keep the split's retrieval at less cost to long generation?"""
    extra = tuple(Policy("flexicache", b, 16, 0.375, group_score="mass", bound_shrink=0.5,
                         unstable_scoring=("max", 0.5)) for b in (256, 512))
    return replace(split_qwen_cpu(), name="split-qwen-cpu-max-shrink", fidelity_extra=extra)


def select_16k_split() -> EvalConfig:
    """``select-16k-unstable``'s documents (8 x 16,384 prompt tokens + 256 dense tokens, teacher-forced, 8-token
    pages) with the unstable heads ranked by the paper's bound (:func:`_split_rows`) at 2048 and 1024, each beside
    its every-step twin, then the split with 25 % unstable (fewer heads on the full bound) at both budgets: issue
    14's long-generation targets for the split rule (~4.5 min on an H200)."""
    return replace(select_16k(), name="select-16k-split", page_size=8,
                   fidelity_extra=_split_rows(2048) + _split_rows(1024)
                   + tuple(_split_rows(b, 0.25)[0] for b in (2048, 1024)))


def qwen_retention_split(base: EvalConfig) -> EvalConfig:
    """:func:`qwen_retention_unstable`'s samples (16 a task, the question after the context, 1/16 of the length,
    8-token pages) for the split rule (:func:`_split_rows`) with 37.5 % and with 25 % unstable: does the paper's
    bound on the unstable heads keep the multikey needles the shrunk mass lost (16k sample 12, 32k sample 4)?  The
    retrieval heads that lost them (layers 9 and 11, KV head 1) are unstable at both fractions."""
    grid = qwen_retention_unstable(base)
    (budget,) = grid.budgets
    return replace(grid, name=f"{base.name}-retention-split",
                   task_extra=tuple(_split_rows(budget, f)[0] for f in (0.375, 0.25)))


def retention_shrink_qwen_cpu() -> EvalConfig:
    """:func:`qwen_retention_unstable`'s question at CPU size: niah_multikey (the task the shrink lost a sample of
    at 32k) at ~4k tokens, budget 256 (1/16), 8 samples, the question after the context (16 min on 2 cores)."""
    return replace(_later_question(_qwen_long(4096, (256,), 8)), name="retention-shrink-qwen-cpu",
                   tasks=("niah_multikey",), page_size=8, families=(), task_extra=_retention_rows(256))


def named_configs() -> dict:
    return {"tiny": tiny, "full": full, "gpu-short": gpu_short, "fidelity-3k": fidelity_3k,
            "profiles-3k": profiles_3k, "sinks-3k": sinks_3k, "recency-8k": recency_8k,
            "free-8k": free_8k, "pages8-tasks": pages8_tasks, "oracle-16k": oracle_16k,
            "oracle-16k-pages8": oracle_16k_pages8, "oracle-cpu": oracle_cpu,
            "oracle-qwen-cpu": oracle_qwen_cpu, "qwen-8k": qwen_8k, "qwen-16k": qwen_16k, "qwen-32k": qwen_32k,
            "select-16k": select_16k, "select-16k-pages8": select_16k_pages8, "select-16k-rest": select_16k_rest,
            "select-16k-seat": select_16k_seat, "select-16k-shrink": select_16k_shrink,
            "select-16k-unstable": select_16k_unstable,
            "select-cpu": select_cpu, "shrink-cpu": shrink_cpu, "shrink-qwen-cpu": shrink_qwen_cpu,
            "shrink-qwen-cpu-512": shrink_qwen_cpu_512,
            "profiles-qwen-cpu": profiles_qwen_cpu, "mass-tasks-cpu": mass_tasks_cpu,
            "profiles-qwen-cpu-budgets": profiles_qwen_cpu_budgets, "later-question-cpu": later_question_cpu,
            "question-in-prompt-cpu": question_in_prompt_cpu,
            "qwen-16k-later-question": lambda: _later_question(qwen_16k()),
            "qwen-32k-later-question": lambda: _later_question(qwen_32k()), "qwen-32k-retention": qwen_32k_retention,
            "qwen-32k-retention-tuned": qwen_32k_retention_tuned,
            "qwen-16k-retention-unstable": lambda: qwen_retention_unstable(qwen_16k()),
            "qwen-32k-retention-unstable": lambda: qwen_retention_unstable(qwen_32k()),
            "retention-shrink-qwen-cpu": retention_shrink_qwen_cpu,
            "qwen-16k-retention": qwen_16k_retention, "qwen-16k-retention-oracle": qwen_16k_retention_oracle,
            "qwen-32k-retention-multikey": qwen_32k_retention_multikey,
            "split-qwen-cpu": split_qwen_cpu, "split-qwen-cpu-max-shrink": split_qwen_cpu_max_shrink,
            "select-16k-split": select_16k_split,
            "qwen-16k-retention-oracle-unstable": qwen_16k_retention_oracle_unstable,
            "select-16k-exact": select_16k_exact, "exact-qwen-cpu": exact_qwen_cpu,
            "exact-qwen-cpu-32k": exact_qwen_cpu_32k,
            "qwen-16k-retention-exact": lambda: qwen_retention_exact(qwen_16k()),
            "qwen-32k-retention-exact": lambda: qwen_retention_exact(qwen_32k()),
            "qwen-16k-retention-split": lambda: qwen_retention_split(qwen_16k()),
            "qwen-32k-retention-split": lambda: qwen_retention_split(qwen_32k()),
            "profiles-qwen-cpu-recommended": profiles_qwen_cpu_recommended,
            "select-16k-unstable-random": select_16k_unstable_random}
