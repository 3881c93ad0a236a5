"""Profiling tasks: long-context, long-generation prompts from the text corpus (paper §2.2).

The paper profiles on several LongBench / L-Eval tasks and compares the unstable-head sets they give
(Table 1).  Cross-task overlap only means something if the tasks really differ, so each task draws from a
different part of the corpus *and* asks for a different kind of answer.  The built-in corpus
(:mod:`flexicache_hf.corpus`) has three sources: CPython's language reference, installed packages'
license texts and library docstrings.  The language reference feeds two tasks, a summary and a
question-and-answer one, on disjoint sections (alternate ranks by length, so both get long ones).

Sample choice is a pure function of the corpus and the arguments (no RNG), so a profile is reproducible.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..corpus import DOCSTRINGS, LICENSES, REFERENCE
from ..data import Document, build_prompt, documents_by_source

# Characters per token is ~4 for English prose with SmolLM2/Llama tokenisers; only used to skip
# documents that obviously cannot fill a prompt, so a rough figure is enough.
_CHARS_PER_TOKEN = 4


@dataclass(frozen=True)
class Sample:
    """One profiling prompt: which task and document it came from, and its tokens ``[1, T]``."""

    task: str
    doc_id: str
    title: str
    input_ids: torch.LongTensor


@dataclass(frozen=True)
class ProfilingTask:
    """A profiling task: a corpus slice, a way to pick documents from it, and an instruction."""

    name: str
    source: str  # corpus source the documents come from
    instruction: str  # appended after the document as the user's request
    description: str
    candidates: Callable[[list[Document]], list[Document]]  # every usable document, in preference order
    # True: take documents evenly spaced over the candidates (topic variety); False: the first n (the
    # candidates are already ranked, e.g. longest first).
    spread: bool = False

    def documents(self, n: int, *, min_chars: int = 0, corpus=None) -> list[Document]:
        """The first ``n`` candidates with at least ``min_chars`` characters (fewer if the corpus runs out)."""
        if n < 1:
            raise ValueError(f"n must be >= 1, found {n}")
        docs = documents_by_source(corpus).get(self.source)
        if not docs:
            raise ValueError(f"task {self.name!r}: the corpus has no documents from {self.source!r}")
        pool = [d for d in self.candidates(docs) if len(d.text) >= min_chars]
        return _spread(pool, n) if self.spread else pool[:n]

    def samples(self, tokenizer, n: int, max_prompt_tokens: int, *, corpus=None) -> list[Sample]:
        """``n`` chat prompts of at most ``max_prompt_tokens`` tokens from ``n`` different documents.

        Documents shorter than ~max_prompt_tokens are skipped when enough longer ones exist, so that the
        context length (and with it N, the number of candidate pages) is similar across tasks.
        """
        docs = self.documents(n, min_chars=max_prompt_tokens * _CHARS_PER_TOKEN, corpus=corpus)
        if len(docs) < n:  # not enough long documents: fall back to the longest short ones
            docs = self.documents(n, corpus=corpus)
        if len(docs) < n:
            raise ValueError(f"task {self.name!r} has only {len(docs)} documents, {n} asked for")
        return [
            Sample(self.name, d.id, d.title, build_prompt(tokenizer, d, self.instruction, max_prompt_tokens))
            for d in docs
        ]


def _spread(pool: list[Document], n: int) -> list[Document]:
    """``n`` documents evenly spaced over ``pool`` (all of it when shorter), each from the middle of its
    stride, so that modules in name order are not all transformers.a* (or all of one library)."""
    if len(pool) <= n:
        return list(pool)
    return [pool[((2 * i + 1) * len(pool)) // (2 * n)] for i in range(n)]


def _longest_first(docs: list[Document]) -> list[Document]:
    # Longest first: short permissive licences (MIT: ~1k chars) would give tiny contexts.
    return sorted(docs, key=lambda d: (-len(d.text), d.id))


def _ranks(parity: int) -> Callable[[list[Document]], list[Document]]:
    """Every other document by length (even or odd rank), so two tasks on one source never share one."""
    def pick(docs: list[Document]) -> list[Document]:
        return _longest_first(docs)[parity::2]
    return pick


def default_tasks() -> list[ProfilingTask]:
    """The four default tasks over the corpus's three sources, each with its own kind of answer."""
    return [
        ProfilingTask(
            name="reference-summary",
            source=REFERENCE,
            instruction=("Summarise this section of the Python language reference: which constructs or objects "
                         "it defines, the rules that govern them, and a short example of each main rule."),
            description="summarise a section of the Python language reference (even ranks by length)",
            candidates=_ranks(0),
        ),
        ProfilingTask(
            name="license-obligations",
            source=LICENSES,
            instruction=("Explain, clause by clause, the obligations this license places on someone who "
                         "modifies the software and redistributes it, and what happens if they break them."),
            description="explain the obligations of an installed package's license text (longest first)",
            candidates=_longest_first,
        ),
        ProfilingTask(
            name="api-explain",
            source=DOCSTRINGS,
            instruction=("Explain the API documented above to a new user: what the module is for, its main "
                         "classes and functions with their parameters and return values, and how they fit "
                         "together in a typical use."),
            description="explain a transformers or torch module's API from its docstrings (spread over modules)",
            candidates=list,
            spread=True,
        ),
        ProfilingTask(
            name="reference-qa",
            source=REFERENCE,
            instruction=("Answer these questions about the reference section above. 1. Which constructs or "
                         "operations does it define? 2. What are the exact rules, step by step, including the "
                         "order of evaluation? 3. Which cases raise an error or behave surprisingly? 4. Which "
                         "related sections should a reader study next?"),
            description="answer questions about a section of the Python language reference (odd ranks by length)",
            candidates=_ranks(1),
        ),
    ]


def get_tasks(names=None) -> list[ProfilingTask]:
    """Default tasks by name (all of them for ``None``), in the order asked for."""
    tasks = {t.name: t for t in default_tasks()}
    if names is None:
        return list(tasks.values())
    unknown = [n for n in names if n not in tasks]
    if unknown:
        raise ValueError(f"unknown task(s) {unknown}; available: {list(tasks)}")
    if len(set(names)) != len(names):
        raise ValueError(f"a task is listed twice: {list(names)}")
    return [tasks[n] for n in names]
