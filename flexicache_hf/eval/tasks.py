"""RULER-style synthetic tasks built offline from the project corpus, deterministic by seed.

Each task makes :class:`TaskSample` s of a target prompt length: a context (real prose from the corpus as
haystack, with needles or assignments inserted between paragraphs; or synthetic coded text), a question,
an answer prefix that the model continues (RULER puts it in the assistant turn, which matters for small
models), the gold answers, and the scorer.  All scorers are "fraction of gold answers found as whole
tokens in the output" (RULER's string_match_all), which is the single-needle exact match as a special case.

Samples depend only on (task, seed, index, length, tokenizer, corpus): every policy sees identical prompts.
"""

from __future__ import annotations

import functools
import random
import re
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..corpus import REFERENCE
from ..data import documents_by_source, token_ids
from .scorers import match_all

# Prose of the language reference (~360k characters, ~90k tokens): far more than an 8k-token haystack,
# so a haystack is consecutive paragraphs of one kind of text.
HAYSTACK_SOURCE = REFERENCE


@dataclass(frozen=True)
class TaskSample:
    task: str
    index: int
    context: str
    question: str
    answer_prefix: str
    answers: tuple[str, ...]
    max_new_tokens: int
    scorer: Callable[[str, tuple[str, ...]], float] = field(default=match_all, compare=False, repr=False)

    def score(self, output: str) -> float:
        return self.scorer(output, self.answers)


# ---- tokenisation ----------------------------------------------------------------------------------
def encode_text(tokenizer, text: str) -> list[int]:
    return token_ids(tokenizer.encode(text, add_special_tokens=False))


def _turn_text(tokenizer, context: str, question: str) -> str:
    """The prompt's text before the answer prefix: one user turn (context, then question), through the chat
    template when the tokenizer has one (instruct models), plain text otherwise."""
    user = f"{context}\n\n{question}" if context else question
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template([{"role": "user", "content": user}], add_generation_prompt=True,
                                             tokenize=False)
    return f"{user}\n"


def render(tokenizer, context: str, question: str, answer_prefix: str) -> torch.LongTensor:
    """Prompt ``[1, T]``: one user turn (context, then question) and the answer prefix the model continues."""
    ids = encode_text(tokenizer, _turn_text(tokenizer, context, question)) + encode_text(tokenizer, answer_prefix)
    return torch.tensor([ids], dtype=torch.long)


def render_split(tokenizer, context: str, question: str, answer_prefix: str) -> tuple[torch.LongTensor, ...]:
    """:func:`render`'s prompt as two chunks ``([1, T1], [1, T2])``: everything through the context, then the
    question with the answer prefix.  Fed one after the other, the cache holds the context before the question
    exists: a query-aware eviction baseline compresses it without knowing what will be asked (the setting of a
    context cached once and asked about later), while FlexiCache keeps every page and ranks them with the
    question's queries.  Together the chunks are exactly ``render``'s tokens: the cut falls after the last token
    that ends inside the context (a token spanning the boundary, such as ``".\n\n"``, goes with the question)."""
    if not context:
        raise ValueError("a prompt without a context has nothing to store before the question")
    text = _turn_text(tokenizer, context, question)
    cut = text.rfind(f"\n\n{question}")
    whole = encode_text(tokenizer, text)
    k = _tokens_within(tokenizer, text, cut, whole)
    tail = whole[k:] + encode_text(tokenizer, answer_prefix)
    return torch.tensor([whole[:k]], dtype=torch.long), torch.tensor([tail], dtype=torch.long)


def _tokens_within(tokenizer, text: str, cut: int, whole: list[int]) -> int:
    """How many leading tokens of ``whole`` (the tokens of ``text``) end at or before character ``cut``."""
    try:  # fast tokenizers say where each token ends
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        offsets = enc["offset_mapping"]
    except (TypeError, KeyError, NotImplementedError, ValueError):
        offsets = None
    if offsets is not None and len(offsets) == len(whole):
        return next((i for i, (_, end) in enumerate(offsets) if end > cut), len(whole))
    head = encode_text(tokenizer, text[:cut])  # others: the context's own tokens, where they start the prompt's
    return next((i for i, (a, b) in enumerate(zip(whole, head)) if a != b), min(len(whole), len(head)))


# ---- haystacks -------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=4)
def _paragraphs(corpus=None, source: str = HAYSTACK_SOURCE) -> tuple[str, ...]:
    docs = documents_by_source(corpus).get(source)
    if not docs:  # a corpus of your own without it: any source will do, the task only needs prose
        docs = next(iter(documents_by_source(corpus).values()))
    paras = []
    for d in docs:
        for p in re.split(r"\n\s*\n", d.text):
            p = " ".join(p.split())
            if len(p) <= 40:  # headings, rules, menu lines
                continue
            # Long paragraphs are split at sentences so needles can land anywhere and lengths fit well.
            paras.extend(re.split(r"(?<=[.!?])\s+(?=[A-Z])", p) if len(p) > 600 else [p])
    return tuple(paras)


def haystack(tokenizer, n_tokens: int, rng: random.Random, corpus=None) -> list[str]:
    """Consecutive corpus paragraphs from a random start, about ``n_tokens`` tokens in all."""
    paras = _paragraphs(corpus)
    at = rng.randrange(len(paras))
    out, count = [], 0
    while count < n_tokens:
        p = paras[at % len(paras)]
        out.append(p)
        count += len(encode_text(tokenizer, p)) + 1
        at += 1
    return out


def _insert(paras: list[str], items: list[str], rng: random.Random) -> str:
    """Put each item between paragraphs at random depths (order of items kept, as in RULER)."""
    slots = sorted(rng.randrange(len(paras) + 1) for _ in items)
    out = list(paras)
    for k, (slot, item) in enumerate(zip(slots, items)):
        out.insert(slot + k, item)
    return "\n".join(out)


def _words(rng: random.Random, n: int, corpus=None) -> list[str]:
    """``n`` distinct two-word keys like "quoting-directory" (unlikely to occur in the haystack)."""
    vocab = sorted({w.lower() for w in re.findall(r"\b[A-Za-z]{5,10}\b", " ".join(_paragraphs(corpus)[:400]))})
    keys: list[str] = []  # a list, not a set: a set's order follows the process's string-hash seed
    while len(keys) < n:
        key = f"{rng.choice(vocab)}-{rng.choice(vocab)}"
        if key not in keys:
            keys.append(key)
    return keys


def _numbers(rng: random.Random, n: int) -> list[str]:
    return [str(x) for x in rng.sample(range(1000, 10000), n)]  # 4-digit codes


def _fit(tokenizer, n_tokens: int, build: Callable[[int], TaskSample]) -> TaskSample:
    """Build once with a guessed filler size, then once more with the filler corrected by the overshoot."""
    s = build(n_tokens)
    over = len(render(tokenizer, s.context, s.question, s.answer_prefix)[0]) - n_tokens
    return build(max(16, n_tokens - over)) if over else s


# ---- tasks -----------------------------------------------------------------------------------------
_NEEDLE = "One of the special magic numbers for {key} is: {value}."


def _niah(name: str, n_keys: int, n_values: int, n_queries: int, max_new: int):
    def make(tokenizer, n_tokens: int, seed: int, index: int, corpus=None) -> TaskSample:
        def build(filler: int) -> TaskSample:
            rng = random.Random(f"{name}/{seed}/{index}")
            keys = _words(rng, n_keys, corpus)
            values = {k: _numbers(rng, n_values) for k in keys}
            needles = [_NEEDLE.format(key=k, value=v) for k in keys for v in values[k]]
            rng.shuffle(needles)
            asked = keys[:n_queries]
            paras = haystack(tokenizer, filler, rng, corpus)
            context = _insert(paras, needles, rng)
            answers = tuple(v for k in asked for v in values[k])
            what = " and ".join(asked)
            if n_values > 1:
                q = (f"What are all the special magic numbers for {what} mentioned in the provided text?")
                prefix = f"The special magic numbers for {what} mentioned in the provided text are"
            elif n_queries > 1:
                q = f"What are the special magic numbers for {what} mentioned in the provided text?"
                prefix = f"The special magic numbers for {what} mentioned in the provided text are"
            else:
                q = f"What is the special magic number for {what} mentioned in the provided text?"
                prefix = f"The special magic number for {what} mentioned in the provided text is"
            return TaskSample(name, index, context, q, prefix, answers, max_new)
        return _fit(tokenizer, n_tokens, build)
    return make


def _variable_tracking(tokenizer, n_tokens: int, seed: int, index: int, corpus=None, hops: int = 4) -> TaskSample:
    def build(filler: int) -> TaskSample:
        rng = random.Random(f"vt/{seed}/{index}")
        names: list[str] = []
        while len(names) < hops + 1:
            n = "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5))
            if n not in names:
                names.append(n)
        value = _numbers(rng, 1)[0]
        chain = [f"VAR {names[0]} = {value}."] + [f"VAR {names[i + 1]} = VAR {names[i]}." for i in range(hops)]
        context = _insert(haystack(tokenizer, filler, rng, corpus), chain, rng)
        q = f"Find all variables that are assigned the value {value} in the text above."
        prefix = (f"According to the chain of variable assignments in the text above, {hops + 1} variables are "
                  f"assigned the value {value}, they are:")
        return TaskSample("variable_tracking", index, context, q, prefix, tuple(names), 8 * (hops + 1))
    return _fit(tokenizer, n_tokens, build)


def _frequent_words(tokenizer, n_tokens: int, seed: int, index: int, corpus=None, top: int = 3) -> TaskSample:
    """RULER's frequent-words extraction: coded words with Zipf frequencies; name the ``top`` most common."""
    rng = random.Random(f"fwe/{seed}/{index}")
    vocab = sorted({"".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(4, 6)))
                    for _ in range(400)})
    rng.shuffle(vocab)
    weights = [1 / (r + 1) ** 1.5 for r in range(len(vocab))]
    per_word = len(encode_text(tokenizer, " ".join(vocab[:50]))) / 50
    words = rng.choices(vocab, weights, k=max(8, int(n_tokens / per_word)))
    counts: dict[str, int] = {}
    for w in words:
        counts[w] = counts.get(w, 0) + 1
    ranked = sorted(counts, key=lambda w: (-counts[w], w))
    # A tie at the cut would make the gold answer arbitrary: add copies until the top counts are strict.
    for i in reversed(range(top)):
        while counts[ranked[i]] <= counts[ranked[i + 1]]:
            words.insert(rng.randrange(len(words) + 1), ranked[i])
            counts[ranked[i]] += 1
    context = " ".join(words)
    q = (f"Read the coded text above and track the frequency of each coded word. What are the {top} most "
         "frequently appeared coded words?")
    prefix = f"According to the coded text above, the {top} most frequently appeared words are:"
    return TaskSample("frequent_words", index, context, q, prefix, tuple(ranked[:top]), 6 * top)


def task_makers() -> dict[str, Callable]:
    """Task name -> ``make(tokenizer, n_tokens, seed, index, corpus=None) -> TaskSample``."""
    return {
        "niah_single": _niah("niah_single", 1, 1, 1, 10),
        "niah_multikey": _niah("niah_multikey", 4, 1, 1, 10),
        "niah_multivalue": _niah("niah_multivalue", 1, 4, 1, 30),
        "niah_multiquery": _niah("niah_multiquery", 4, 1, 2, 20),
        "variable_tracking": _variable_tracking,
        "frequent_words": _frequent_words,
    }


def make_samples(tokenizer, task: str, n_tokens: int, count: int, seed: int, corpus=None) -> list[TaskSample]:
    makers = task_makers()
    if task not in makers:
        raise ValueError(f"unknown task {task!r}; choose from {sorted(makers)}")
    return [makers[task](tokenizer, n_tokens, seed, i, corpus) for i in range(count)]
