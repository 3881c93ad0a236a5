"""The step clock: a logits processor that stamps every generated token, and the summary of one call's stamps."""

from __future__ import annotations

import collections
import statistics
import sys
import threading
import time

import torch

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


class ThreadSampler:
    """The Python stack of one thread, sampled every ``interval`` seconds from a thread of its own: each sample's
    wall time since the previous one goes to every function on the stack (inclusive), to the innermost (own) and to
    the line the innermost was at (``lines``: which call of a function the thread sat in).

    ``cProfile`` cannot say this in Python 3.12+: built on ``sys.monitoring``, it records every thread's calls
    into one profile, so the page-locking threads' work beside a prefill showed up under whatever the prefill's
    thread was calling (run 34).  A sampler sees only the thread that called :meth:`enable`, waits included (a
    wait releases the GIL, so the sampler runs then; pure Python is seen at the interpreter's switch interval)."""

    def __init__(self, interval: float = 0.001, depth: int = 160):
        self.interval, self.depth = interval, depth
        self.inclusive: collections.Counter = collections.Counter()  # where -> seconds
        self.own: collections.Counter = collections.Counter()
        self.hits: collections.Counter = collections.Counter()  # where -> samples with it on the stack
        self.lines: collections.Counter = collections.Counter()  # innermost file:line(function) -> seconds
        self.line_hits: collections.Counter = collections.Counter()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def enable(self) -> None:
        """Sample the calling thread from now on."""
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, args=(threading.get_ident(),), daemon=True,
                                        name="flexicache-sampler")
        self._thread.start()

    def disable(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None

    def _run(self, target: int) -> None:
        last = time.perf_counter()
        while not self._stop.wait(self.interval):
            frame = sys._current_frames().get(target)
            now = time.perf_counter()
            dt, last = now - last, now
            stack, line = [], None
            if frame is not None:
                line = f"{frame.f_code.co_filename}:{frame.f_lineno}({frame.f_code.co_name})"
            while frame is not None and len(stack) < self.depth:
                code = frame.f_code
                stack.append(f"{code.co_filename}:{code.co_firstlineno}({code.co_name})")
                frame = frame.f_back
            if not stack:
                continue
            self.own[stack[0]] += dt
            self.lines[line] += dt
            self.line_hits[line] += 1
            for where in set(stack):
                self.inclusive[where] += dt
                self.hits[where] += 1


def top_functions(sampler: ThreadSampler, n: int = 25) -> list[list]:
    """The ``n`` functions of a sample with the most inclusive time: ``[inclusive s, own s, samples, where]``."""
    rows = sorted(sampler.inclusive.items(), key=lambda kv: -kv[1])[:n]
    return [[round(t, 3), round(sampler.own.get(where, 0.0), 3), sampler.hits[where], where] for where, t in rows]


def top_lines(sampler: ThreadSampler, n: int = 25) -> list[list]:
    """The ``n`` lines the sampled thread sat at longest (innermost frame): ``[s, samples, file:line(function)]``."""
    return [[round(t, 3), sampler.line_hits[where], where]
            for where, t in sorted(sampler.lines.items(), key=lambda kv: -kv[1])[:n]]


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
