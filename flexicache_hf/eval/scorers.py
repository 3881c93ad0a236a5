"""Scorers: answer matching for the synthetic tasks, sequence similarity for long-generation fidelity."""

from __future__ import annotations

import re
from typing import Sequence


def contains(output: str, answer: str) -> bool:
    """``answer`` occurs in ``output`` as a whole token (case-insensitive): "1234" is not found in "12345"."""
    return re.search(rf"(?<![\w]){re.escape(answer)}(?![\w])", output, re.IGNORECASE) is not None


def match_all(output: str, answers: Sequence[str]) -> float:
    """Fraction of ``answers`` found in ``output`` (RULER's string_match_all); 1.0 for a single hit."""
    if not answers:
        raise ValueError("a sample needs at least one answer")
    return sum(contains(output, a) for a in answers) / len(answers)


def lcs_length(a: Sequence, b: Sequence) -> int:
    """Length of the longest common subsequence (O(len(a)·len(b)) time, O(len(b)) memory)."""
    if not a or not b:
        return 0
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b, 1):
            cur.append(prev[j - 1] + 1 if x == y else max(prev[j], cur[j - 1]))
        prev = cur
    return prev[-1]


def rouge_l(candidate: Sequence, reference: Sequence) -> float:
    """ROUGE-L F1 over tokens (ids or words): 2·LCS / (|candidate| + |reference|)."""
    if not candidate and not reference:
        return 1.0
    return 2 * lcs_length(candidate, reference) / (len(candidate) + len(reference))


def agreement_length(candidate: Sequence, reference: Sequence) -> int:
    """Tokens from the start on which ``candidate`` equals ``reference``."""
    n = 0
    for x, y in zip(candidate, reference):
        if x != y:
            break
        n += 1
    return n
