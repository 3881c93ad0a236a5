"""The run configurations of the accuracy harness (``--config NAME``) and the policy grid each one expands to.

**Canonical grids** live here, in code: the ones a user starts from.

* ``tiny``: the CPU smoke test of the whole pipeline (the tests run it).
* ``full``: SmolLM2's retrieval tasks and 8k fidelity at budgets 1/16..1/4, every family: the README's accuracy
  figures for SmolLM2.
* ``fidelity-3k``: long generation on SmolLM2 at CPU size, FlexiCache against Quest-like and StreamingLLM.
* ``recency-8k`` and ``pages8-tasks``: what SmolLM2's recommended settings rest on (a sink page and recent pages
  for long outputs, 8-token pages for retrieval).
* ``qwen-16k`` and ``qwen-32k``: the harness on Qwen2.5-Coder-0.5B at 16k and 32k, every family.
* ``select-16k-exact``, ``qwen-16k-retention-exact`` and ``qwen-32k-retention-exact``: what the recommended
  setting for Qwen2.5-class models rests on (8-token pages, group mass, shrink 0.5, 37.5 % unstable heads ranked
  by the exact attention mass), for long outputs and for retrieval.
* ``stagger-16k``: Qwen 16k fidelity with each layer's re-ranks on its own steps (``stagger_reranks``) against the
  same settings unstaggered.
* ``candidates-16k``: Qwen 16k fidelity with the unstable heads' exact mass over every page against over a few
  times the budget of pages picked by the min/max bound (``exact_candidates``).
* ``sinks-16k``: Qwen 16k fidelity with the profile's setting plus a sink page, plus recent pages, or with half the
  heads unstable.

**Archived grids**: every other grid answered one question along the way; what matters of it now is its results,
so it is a JSON file beside them,
``docs/benchmarks/accuracy/<results folder>/grid.json`` (``archived-grids/<name>.json`` there for a grid that has
no results), written by :func:`grid_to_json` and read by :func:`read_grid`; ``--config`` takes its name or the
path of any such file.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields, replace
from functools import partial
from pathlib import Path
from typing import Callable

from .policies import Policy

ALL_TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery", "variable_tracking",
             "frequent_words")
ARCHIVE = Path(__file__).resolve().parents[2] / "docs" / "benchmarks" / "accuracy"
GRID_FILE = "grid.json"  # an archived grid's file in its results folder
UNRUN_FOLDER = "archived-grids"  # under ARCHIVE: archived grids without results, as <name>.json


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


# ---- grids as JSON ----------------------------------------------------------------------------------------------
POLICY_FIELDS = ("fidelity_extra", "task_extra")


# Policy fields added after grids were archived, with the value every archived grid ran (a Policy's default keeps it)
LATER_POLICY_FIELDS = {"stagger_reranks": False, "exact_candidates": 0, "keep_margin": 0.0, "overlap_loads": False}


def _plain(value):
    """``value`` as JSON data: a Policy becomes the dict of its every field (a field added after grids were archived
    only where it differs from what those grids ran: ``LATER_POLICY_FIELDS``), a tuple a list."""
    if isinstance(value, Policy):
        return {f.name: _plain(getattr(value, f.name)) for f in fields(Policy)
                if f.name not in LATER_POLICY_FIELDS or getattr(value, f.name) != LATER_POLICY_FIELDS[f.name]}
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    return value


def _tuples(value):
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


def grid_to_json(cfg: EvalConfig, about: str = "") -> str:
    """``cfg`` with every field (defaults too, so a later default cannot change it), one policy a line; ``about``
    says what the grid measures.  :func:`grid_from_json` gives ``cfg`` back, field types included."""
    lines = []
    for f in fields(EvalConfig):
        value = _plain(getattr(cfg, f.name))
        if f.name in POLICY_FIELDS and value:
            text = "[\n" + ",\n".join("   " + json.dumps(p) for p in value) + "\n  ]"
        else:
            text = json.dumps(value)
        lines.append(f"  {json.dumps(f.name)}: {text}")
    return "{\n" + f' "about": {json.dumps(about)},\n "config": {{\n' + ",\n".join(lines) + "\n }\n}\n"


def grid_from_json(text: str) -> EvalConfig:
    config = json.loads(text)["config"]
    kw = {}
    for key, value in config.items():
        if key in POLICY_FIELDS:
            value = tuple(Policy(**{k: _tuples(v) for k, v in p.items()}) for p in value)
        elif key != "extra":
            value = _tuples(value)
        kw[key] = value
    return EvalConfig(**kw)


def read_grid(path: str | Path) -> EvalConfig:
    return grid_from_json(Path(path).read_text())


def archived_grids(root: Path = ARCHIVE) -> dict[str, Path]:
    """Every archived grid by name: ``<results folder>/grid.json`` and ``archived-grids/<name>.json`` under
    ``root`` (none when the package runs without its checkout's ``docs``)."""
    out: dict[str, Path] = {}
    for path in sorted(root.glob(f"*/{GRID_FILE}")) + sorted((root / UNRUN_FOLDER).glob("*.json")):
        name = json.loads(path.read_text())["config"]["name"]
        if name in out:
            raise ValueError(f"grid {name!r} is archived twice: {out[name]} and {path}")
        out[name] = path
    return out


# ---- canonical grids ----------------------------------------------------------------------------------------------
CANONICAL: dict[str, Callable[[], EvalConfig]] = {}


def canonical(fn: Callable[[], EvalConfig]) -> Callable[[], EvalConfig]:
    """Registers a canonical grid under its function's name with dashes (``qwen_16k`` -> ``qwen-16k``); the first
    line of its docstring is its description in ``--help``."""
    CANONICAL[fn.__name__.replace("_", "-")] = fn
    return fn


def describe(name: str) -> str:
    return (CANONICAL[name].__doc__ or "").strip().splitlines()[0]


@canonical
def tiny() -> EvalConfig:
    """CPU smoke test on SmolLM2 (~17 min on 2 cores): every task and family once.

    One budget, one sample per task and no sweeps: a test of the whole pipeline on the real model, not a measurement.
    """
    return EvalConfig(name="tiny", task_length=384, samples=1, budgets=(1 / 4,), sweep_budget=1 / 4,
                      rerank_intervals=(16,), unstable_fractions=(0.25,), reach_lengths=(256, 512), reach_samples=2,
                      fidelity_prompt=512, fidelity_length=24, fidelity_budgets=(64,))


@canonical
def full() -> EvalConfig:
    """SmolLM2: retrieval at 1/16..1/4 with the R x unstable sweep and 8k fidelity; every family.

    Tasks: budgets 1/16..1/4 of ~800-token prompts (where dense SmolLM2-135M still scores on most tasks), 8
    samples, the R x unstable-fraction sweep, and the paper's selection with a sink page and two recent pages as
    an extra row.  Fidelity: 4 documents (spread over the corpus sources) of 7,680 prompt tokens + 512 dense tokens
    (the model's whole 8k context) at budgets 1024/2048/512/256 (in that order, so a time limit drops the smallest
    budgets first), teacher-forced.  Too long for one 10-minute GPU command: run it as ``--part tasks`` and
    ``--part fidelity``.
    """
    extra = tuple(Policy("flexicache", b, 16, 0.25, "measured", 1, 2) for b in (1 / 8, 1 / 4))
    return EvalConfig(name="full", samples=8, reach_lengths=(400, 800, 1200, 2000, 3500), reach_samples=8,
                      task_extra=extra, fidelity_docs=4, fidelity_prompt=7680, fidelity_length=512,
                      fidelity_budgets=(1024, 2048, 512, 256), fidelity_free_run=False)


@canonical
def fidelity_3k() -> EvalConfig:
    """SmolLM2 long generation, CPU-sized: 3k-token documents, budgets 256/512/1024.

    Two documents of 3,072 prompt tokens + 128 dense tokens; FlexiCache against Quest-like (same selection, no
    tiers) and StreamingLLM (permanent eviction).
    """
    return EvalConfig(name="fidelity-3k", tasks=(), reach_lengths=(), fidelity_doc_indices=(0, 22),
                      fidelity_prompt=3072, fidelity_length=128, fidelity_budgets=(256, 512, 1024),
                      fidelity_families=("flexicache", "quest", "streaming"))


@canonical
def recency_8k() -> EvalConfig:
    """SmolLM2 8k fidelity with sink and recent pages (its long-output setting).

    ``full``'s fidelity documents, FlexiCache keeping a sink page and a window of recent pages in every re-rank:
    does recency close the gap to StreamingLLM on prose continuation?
    """
    variants = tuple(Policy("flexicache", b, 16, 0.25, "measured", 1, r)
                     for b, r in ((1024, 4), (1024, 16), (512, 4), (512, 8), (256, 4), (2048, 16)))
    return replace(full(), name="recency-8k", tasks=(), reach_lengths=(), fidelity_budgets=(),
                   fidelity_families=(), fidelity_extra=variants)


@canonical
def pages8_tasks() -> EvalConfig:
    """SmolLM2 retrieval with 8-token pages at 1/8 and 1/4 (its retrieval setting).

    ``full``'s tasks, FlexiCache (R16 u25) and Quest-like.  Does a finer page grain lift the min/max selection at
    6-12 pages' worth of budget?
    """
    return replace(full(), name="pages8-tasks", page_size=8, reach_lengths=(), budgets=(1 / 8, 1 / 4),
                   families=("flexicache", "quest"), rerank_intervals=(), unstable_fractions=(), task_extra=(),
                   fidelity_docs=0)


def _qwen_long(length: int, budgets: tuple[int, ...], samples: int) -> EvalConfig:
    """The harness on Qwen2.5-Coder-0.5B at one context ``length`` (GPU-sized; ``--part tasks`` / ``--part
    fidelity`` as separate commands).

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


@canonical
def qwen_16k() -> EvalConfig:
    """Qwen2.5-Coder-0.5B at 16k, budgets 1024 and 2048: every family, tasks and fidelity.

    :func:`_qwen_long` at 16k: budgets 1024 (1/16) and 2048 (1/8), 4 samples a task.
    """
    return _qwen_long(16384, (1024, 2048), 4)


@canonical
def qwen_32k() -> EvalConfig:
    """Qwen2.5-Coder-0.5B at 32k, budgets 2048 and 4096: every family, tasks only.

    :func:`_qwen_long` at 32k (the model's whole context): budgets 2048 (1/16) and 4096 (1/8), 3 samples a task.
    Tasks only: the built-in corpus has no document long enough for a 32k-token fidelity prompt.
    """
    return _qwen_long(32768, (2048, 4096), 3)


def _exact_unstable(budget: int, fraction: float = 0.375, profile: str = "measured", interval: int = 16,
                    stagger: bool = False, candidates: int = 0, sink: int = 0, recent: int = 0,
                    keep: float = 0.0, overlap: bool = False) -> Policy:
    """The long-output setting (the stable heads by the mass of the half-shrunk box) with the least-stable
    ``fraction`` of heads ranked by the exact attention mass (``unstable_group_score="exact"``; over their
    ``candidates`` x budget pages of the largest bound, 0: every page); ``sink`` / ``recent`` pages kept."""
    return Policy("flexicache", budget, interval, fraction, profile, sink_pages=sink, recent_pages=recent,
                  group_score="mass", bound_shrink=0.5, unstable_scoring=("exact", 1.0), stagger_reranks=stagger,
                  exact_candidates=candidates, keep_margin=keep, overlap_loads=overlap)


@canonical
def select_16k_exact() -> EvalConfig:
    """Qwen 16k fidelity, the unstable heads ranked exactly (its long-output setting).

    8 documents of 16,384 prompt tokens + 256 dense tokens, teacher-forced, 8-token pages; budgets 2048 and 1024,
    each beside its every-step twin (R = 1), then a random profile of the same size at both (~3 min on an H200).
    """
    rows = []
    for b in (2048, 1024):
        rows += [_exact_unstable(b), _exact_unstable(b, interval=1)]
    rows += [_exact_unstable(b, profile="random") for b in (2048, 1024)]
    return _qwen_16k_fidelity("select-16k-exact", rows, page_size=8)


def _qwen_16k_fidelity(name: str, rows: list[Policy], page_size: int) -> EvalConfig:
    """Qwen 16k teacher-forced fidelity only: 8 documents of 16,384 prompt tokens + 256 dense tokens, ``rows``."""
    return EvalConfig(name=name, model="qwen2.5-coder-0.5b", tasks=(), reach_lengths=(), fidelity_docs=8,
                      fidelity_prompt=16384, fidelity_length=256, fidelity_budgets=(), fidelity_families=(),
                      fidelity_free_run=False, page_size=page_size, fidelity_extra=tuple(rows))


@canonical
def stagger_16k() -> EvalConfig:
    """Qwen 16k fidelity, each layer re-ranking on its own steps (staggered) and all on the same.

    Staggered against unstaggered: the paper's scoring (min/max bound, 25 % unstable) and the accurate one (ranked by mass, 37.5 %
    unstable by the exact mass), both on 8-token pages, at budgets 2048 and 1024, 8 documents (~5 min on an H200).
    Stagger moves each layer's re-rank steps (layer ``l`` at ``l mod R``), keeping R: a stable head's selection is
    as old at most, on average as old, as unstaggered."""
    rows = []
    for b in (2048, 1024):
        for stagger in (False, True):
            rows += [Policy("flexicache", b, 16, 0.25, stagger_reranks=stagger), _exact_unstable(b, stagger=stagger)]
    return _qwen_16k_fidelity("stagger-16k", rows, page_size=8)


@canonical
def candidates_16k() -> EvalConfig:
    """Qwen 16k fidelity, the unstable heads' exact mass over every page or over candidate pages.

    Every page against their 1, 2 or 4 x budget pages of the largest min/max bound (``exact_candidates``), the
    profile's settings otherwise (37.5 % unstable, staggered), at budgets 2048 and 1024, 8 documents (~5 min on an
    H200)."""
    rows = [_exact_unstable(b, stagger=True, candidates=c) for b in (2048, 1024) for c in (0, 1, 2, 4)]
    return _qwen_16k_fidelity("candidates-16k", rows, page_size=8)


@canonical
def sinks_16k() -> EvalConfig:
    """Qwen 16k fidelity: the profile's setting, + a sink page, + recent pages, 50 % unstable.

    The profile's setting (37.5 % unstable by the exact mass, staggered, 8-token pages) as shipped, with the first
    page kept (``sink_pages=1``), with it and the 4 newest pages (``recent_pages=4``: the last 32 prompt tokens,
    which a stable head's selection made before the prompt ended may miss), and with half the heads unstable, at
    budgets 2048 and 1024 (kept pages count inside the budget), 8 documents (~5 min on an H200)."""
    rows = []
    for b in (2048, 1024):
        rows += [_exact_unstable(b, stagger=True), _exact_unstable(b, stagger=True, sink=1),
                 _exact_unstable(b, stagger=True, sink=1, recent=4), _exact_unstable(b, 0.5, stagger=True)]
    return _qwen_16k_fidelity("sinks-16k", rows, page_size=8)



@canonical
def interval_16k() -> EvalConfig:
    """Qwen 16k fidelity: the profile's setting, its stable heads re-ranked every 8 or 4 steps.

    The profile's setting (37.5 % unstable by the exact mass, staggered, 8-token pages) with ``rerank_interval`` 8
    and 4 at budgets 2048 and 1024, 8 documents (~2 min on an H100): how much of the gap to dense is a stable head's
    selection growing old between re-ranks (``select-16k-exact``: 1.039 at R 16 against 1.022 every step)."""
    rows = [_exact_unstable(b, stagger=True, interval=r) for b in (2048, 1024) for r in (8, 4)]
    return _qwen_16k_fidelity("interval-16k", rows, page_size=8)


@canonical
def keep_16k() -> EvalConfig:
    """Qwen 16k fidelity: stable heads keep selected pages within a margin (``keep_margin``).

    The profile's setting (37.5 % unstable by the exact mass, staggered, 8-token pages) re-ranked every 8 steps with
    ``keep_margin`` 0.5 and 1, and every 16 steps with 1, at budgets 2048 and 1024, 8 documents (~3 min on an H100):
    whether a margin that cuts a stable head's promotions (``bench.promotion``) keeps R 8's accuracy
    (``interval-16k``)."""
    rows = [_exact_unstable(b, stagger=True, interval=r, keep=k) for b in (2048, 1024)
            for r, k in ((8, 0.5), (8, 1.0), (16, 1.0))]
    return _qwen_16k_fidelity("keep-16k", rows, page_size=8)

@canonical
def overlap_16k() -> EvalConfig:
    """Qwen 16k fidelity: its defaults with and without ``overlap_loads`` (late re-ranks).

    R 8, ``keep_margin=1``, staggered, 37.5 % unstable by the exact mass, 8-token pages, with and without
    ``overlap_loads`` (a stable head due to re-rank attends its previous selection at that step, its promoted pages
    loading behind the later layers), at budgets 2048 and 1024, 8 documents (~3 min on an H100): whether a step-late
    selection keeps the defaults' accuracy, before its speed could make it a default."""
    rows = [_exact_unstable(b, stagger=True, interval=8, keep=1.0, overlap=o) for b in (2048, 1024)
            for o in (False, True)]
    return _qwen_16k_fidelity("overlap-16k", rows, page_size=8)


def _retention_exact(base: EvalConfig, name: str = "exact", **policy) -> EvalConfig:
    """Retrieval at 1/16 of ``base``'s length with the question after the context, 16 samples a task, 8-token
    pages: the exact ranking of the unstable heads with 37.5 % and 25 % of heads unstable (``policy``: more
    :func:`_exact_unstable` arguments); no fidelity part."""
    budget = base.fidelity_prompt // 16
    return replace(base, name=f"{base.name}-retention-{name}", question_after_context=True, fidelity_docs=0,
                   fidelity_extra=(), samples=16, budgets=(budget,), page_size=8, families=(),
                   task_extra=tuple(_exact_unstable(budget, f, **policy) for f in (0.375, 0.25)))


@canonical
def qwen_16k_retention_exact() -> EvalConfig:
    """Qwen retrieval at 1/16 of 16k, question after the context, ranked exactly (its setting).

    niah_single / niah_multikey, 16 samples a task, 8-token pages, 37.5 % and 25 % unstable (~2 min on an H200).
    """
    return _retention_exact(qwen_16k())


@canonical
def qwen_32k_retention_exact() -> EvalConfig:
    """Qwen retrieval at 1/16 of 32k, question after the context, ranked exactly (its setting).

    niah_single / niah_multikey, 16 samples a task, 8-token pages, 37.5 % and 25 % unstable (~5 min on an H200).
    """
    return _retention_exact(qwen_32k())



@canonical
def qwen_16k_retention_keep() -> EvalConfig:
    """Qwen retrieval at 1/16 of 16k, question after the context, the defaults since run 27.

    ``qwen-16k-retention-exact`` with the stable heads re-ranked every 8 steps, staggered, ``keep_margin=1``
    (~2 min on an H200)."""
    return _retention_exact(qwen_16k(), "keep", interval=8, stagger=True, keep=1.0)


@canonical
def qwen_32k_retention_keep() -> EvalConfig:
    """Qwen retrieval at 1/16 of 32k, question after the context, the defaults since run 27.

    ``qwen-32k-retention-exact`` with the stable heads re-ranked every 8 steps, staggered, ``keep_margin=1``
    (~5 min on an H200)."""
    return _retention_exact(qwen_32k(), "keep", interval=8, stagger=True, keep=1.0)

# ---- by name -------------------------------------------------------------------------------------------------------
def named_configs() -> dict[str, Callable[[], EvalConfig]]:
    """Every grid by name, canonical first: a function that makes (or reads) it."""
    return {**CANONICAL, **{name: partial(read_grid, path) for name, path in archived_grids().items()}}


def load_grid(spec: str) -> EvalConfig:
    """The grid ``spec`` names: a canonical grid, an archived one, or a grid JSON file's path."""
    if spec in CANONICAL:
        return CANONICAL[spec]()
    archived = archived_grids()
    if spec in archived:
        return read_grid(archived[spec])
    if Path(spec).is_file():
        return read_grid(spec)
    raise ValueError(f"no grid {spec!r}: not a canonical grid ({', '.join(CANONICAL)}), an archived one "
                     f"(under {ARCHIVE}) or a grid JSON file")


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
