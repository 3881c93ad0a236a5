"""Profiling tasks: long-context, long-generation prompts from the project corpus (paper §2.2).

The paper profiles on several LongBench / L-Eval tasks and compares the unstable-head sets they give
(Table 1).  Cross-task overlap only means something if the tasks really differ, so each task here draws
from a different part of the corpus *and* asks for a different kind of answer.  The corpus has three
sources (Python docs, GNU standards, licenses); the Python docs are split into the reference library
chapters and the tutorials/HOWTOs, which read and are answered quite differently.

Sample choice is a pure function of the corpus and the arguments (no RNG), so a profile is reproducible.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

import torch

from ..data import Document, build_prompt, documents_by_source

PYTHON_DOCS = "Python 3.11 documentation (Debian python3-doc)"
GNU_STANDARDS = "GNU coding standards (Debian gnu-standards)"
LICENSES = "Debian common-licenses"

# A top-level texinfo chapter: "7 The Release Process" underlined with '*'.
_CHAPTER = re.compile(r"^(\d+|Appendix [A-Z]) [^\n]+\n\*+\n", re.M)
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
    stride, so that library chapters are not all asyncio/argparse (alphabetical order)."""
    if len(pool) <= n:
        return list(pool)
    return [pool[((2 * i + 1) * len(pool)) // (2 * n)] for i in range(n)]


def _titles(*prefixes: str) -> Callable[[list[Document]], list[Document]]:
    """Documents whose title starts with one of ``prefixes``, grouped in the order of the prefixes."""
    def pick(docs: list[Document]) -> list[Document]:
        return [d for p in prefixes for d in docs if d.title.startswith(p)]
    return pick


def _longest_first(docs: list[Document]) -> list[Document]:
    # Longest first: short permissive licences (BSD: 1.5k chars) would give tiny contexts.
    return sorted(docs, key=lambda d: (-len(d.text), d.id))


def _gnu_excerpts(docs: list[Document]) -> list[Document]:
    """One excerpt per chapter: that chapter and the ones after it, up to the appendices.

    The two GNU documents are far longer than a prompt, so each sample starts at another chapter.  The
    appended GFDL is left out (it belongs to the licence task).  Chapters are ranked by length, and the
    two documents alternate so consecutive samples come from different documents.
    """
    per_doc = []
    for d in docs:
        marks = list(_CHAPTER.finditer(d.text))
        appendix = next((m.start() for m in marks if m.group(1).startswith("Appendix")), len(d.text))
        chapters = []
        for i, m in enumerate(marks):
            if m.group(1).startswith("Appendix"):
                continue
            end = marks[i + 1].start() if i + 1 < len(marks) else len(d.text)
            heading = m.group(0).splitlines()[0]
            excerpt = Document(f"{d.id}#{m.group(1)}", d.source, d.license, f"{d.title} {heading}",
                               d.text[m.start():appendix])
            chapters.append((-(end - m.start()), i, excerpt))
        per_doc.append([c[2] for c in sorted(chapters, key=lambda c: c[:2])])
    out = []
    for rank in range(max((len(c) for c in per_doc), default=0)):
        out.extend(c[rank] for c in per_doc if rank < len(c))
    return out


def default_tasks() -> list[ProfilingTask]:
    """The four default tasks, one per corpus part, each with its own kind of answer."""
    return [
        ProfilingTask(
            name="library-summary",
            source=PYTHON_DOCS,
            instruction=("Summarise this chapter of the Python standard library documentation: what the module "
                         "is for, its main classes and functions with their parameters, and a short example "
                         "of typical use."),
            description="summarise a Python standard-library reference chapter (library/*)",
            candidates=_titles("library/"),
            spread=True,
        ),
        ProfilingTask(
            name="license-obligations",
            source=LICENSES,
            instruction=("Explain, clause by clause, the obligations this license places on someone who "
                         "modifies the software and redistributes it, and what happens if they break them."),
            description="explain the obligations of a Debian common license (longest first)",
            candidates=_longest_first,
        ),
        ProfilingTask(
            name="gnu-compare",
            source=GNU_STANDARDS,
            instruction=("Compare the sections of this excerpt of the GNU standards: for each section state its "
                         "main rules, then point out where sections overlap, depend on each other or pull in "
                         "different directions."),
            description="compare the sections of a GNU coding/maintainer standards chapter",
            candidates=_gnu_excerpts,
        ),
        ProfilingTask(
            name="tutorial-qa",
            source=PYTHON_DOCS,
            instruction=("Answer these questions about the tutorial above. 1. What problem does it teach you to "
                         "solve? 2. What are the steps, in order, with the code for each? 3. Which mistakes "
                         "or pitfalls does it warn about? 4. What should a reader study next?"),
            description="answer questions about a Python HOWTO or tutorial (howto/*, tutorial/*)",
            candidates=_titles("tutorial/", "howto/"),
            spread=True,
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
