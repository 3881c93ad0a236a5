"""The step clock: a logits processor that stamps every generated token, and the summary of one call's stamps."""

from __future__ import annotations

import statistics
import time

import torch

from .sampler import ThreadSampler

MARK = "flexicache_bench.step"  # the profiler marker the step clock drops at every stamp


class StepClock:
    """Logits processor: synchronise and stamp every generated token; stop after ``stop_after`` if given.

    With ``mark`` it also drops a zero-length ``record_function`` marker at each stamp (for ``--profile-steps``).
    With ``profile_prefill`` it holds a :class:`ThreadSampler` the caller starts (:meth:`start`) just before
    ``generate``; the first stamp stops it: the calling thread's Python stacks during the prefill
    (``--prefill-profile``).
    """

    def __init__(self, stop_after: int | None = None, mark: bool = False, profile_prefill: bool = False):
        self.stamps: list[float] = []
        self.lengths: list[int] = []  # the sequence length each stamp scored (assisted decoding: several per forward)
        self.stop_after = stop_after
        self.mark = mark
        self.profiler = ThreadSampler() if profile_prefill else None
        self.t0 = time.perf_counter()

    def start(self) -> None:
        """The call starts now (and, with ``profile_prefill``, its profile)."""
        self.t0 = time.perf_counter()
        if self.profiler is not None:
            self.profiler.enable()

    def __call__(self, input_ids, scores):
        torch.cuda.synchronize()
        if self.profiler is not None and not self.stamps:
            self.profiler.disable()
        self.stamps.append(time.perf_counter())
        self.lengths.append(input_ids.shape[1])
        if self.mark:
            with torch.profiler.record_function(MARK):
                pass
        return scores

    def stop(self, input_ids, scores, **kwargs):  # a StoppingCriteria (warm-up calls only)
        done = self.stop_after is not None and len(self.stamps) >= self.stop_after
        return torch.full((input_ids.shape[0],), done, dtype=torch.bool, device=input_ids.device)


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def summarise(clock: StepClock) -> dict:
    """The first stamp is the time to first token (the prefill), the differences the decode steps."""
    s = clock.stamps
    steps = [1e3 * (b - a) for a, b in zip(s, s[1:])]
    out = {"ttft_s": s[0] - clock.t0, "tokens": len(s), "total_s": s[-1] - clock.t0,
           "tokens_per_s": len(s) / (s[-1] - clock.t0)}
    if steps:
        out.update(first_step_ms=steps[0], median_step_ms=statistics.median(steps), p99_step_ms=_pct(steps, 0.99),
                   max_step_ms=max(steps), decode_tokens_per_s=len(steps) / (s[-1] - s[0]))
    return out


def summarise_assisted(clock: StepClock, new_tokens: int, end: float) -> dict:
    """A prompt-lookup / assisted call: a forward verifies several drafted positions and the logits processor
    stamps each of them, so step times mean nothing; what counts is ``new_tokens`` over the call's wall time
    (``end``), and how many forwards produced them (a forward's stamps start at a length no longer than the last)."""
    forwards = 1 + sum(b <= a for a, b in zip(clock.lengths, clock.lengths[1:])) if clock.lengths else 0
    total = end - clock.t0
    return {"ttft_s": clock.stamps[0] - clock.t0 if clock.stamps else None, "tokens": new_tokens, "total_s": total,
            "tokens_per_s": new_tokens / total, "forwards": forwards,
            "tokens_per_forward": new_tokens / forwards if forwards else None}
