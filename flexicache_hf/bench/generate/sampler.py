"""A stack sampler of one thread (``bench.generate --prefill-profile``): where that thread's wall time goes, by
function and by line, whatever other threads do meanwhile."""

from __future__ import annotations

import collections
import sys
import threading
import time


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
