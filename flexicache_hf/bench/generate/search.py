"""``--largest-batch``: per row, the largest batch that runs at one prompt length (a doubling, then a bisection),
then one measured row at that batch."""

from __future__ import annotations

import time

import torch

from .device import empty_host_cache, error_record, release
from .report import batch_throughput
from .rows import is_compiled, probe_key
from .run import generate_once, run_row


def search_largest(try_batch, *, start: int = 16, step: int = 8, max_probes: int = 8) -> tuple[int, dict]:
    """The largest batch ``b`` (a multiple of ``step``) with ``try_batch(b)`` true, at most ``max_probes`` calls.

    Doubles from ``start`` until a batch fails, then bisects between the last success and the first failure
    until they are ``step`` apart.  If ``start`` itself fails the bisection runs from 0, and when every multiple
    of ``step`` fails batch 1 is tried last.  Returns (largest batch that passed, 0 if none; {batch: passed}).
    A search cut short by ``max_probes`` returns the largest success so far.
    """
    if start < 1 or step < 1 or max_probes < 1:
        raise ValueError("start, step and max_probes must be positive")
    tried: dict[int, bool] = {}

    def probe(b: int) -> bool:
        tried[b] = bool(try_batch(b))
        return tried[b]

    lo, hi, b = 0, None, start
    while len(tried) < max_probes:
        if not probe(b):
            hi = b
            break
        lo, b = b, 2 * b
    if hi is None:  # out of probes while still doubling
        return lo, tried
    while hi - lo > step and len(tried) < max_probes:
        mid = lo + max(1, (hi - lo) // 2 // step) * step
        if mid >= hi:
            break
        if probe(mid):
            lo = mid
        else:
            hi = mid
    if lo == 0 and 1 not in tried and len(tried) < max_probes and probe(1):
        lo = 1
    return lo, tried


def run_largest(model, make_prompt, length, rows, args, profile, warmed, record) -> None:
    """``--largest-batch``: per row, the batch search (``search_largest``) then one measured row at its result."""
    base = {}
    last_batch = [None]

    def prompt(b):  # distinct rows made once (real text is slow to make), then repeated
        if "ids" not in base:
            base["ids"] = make_prompt(min(b, 16), length)
        rows_ = base["ids"]
        return rows_[torch.arange(b, device=rows_.device) % rows_.shape[0]]

    def new_batch(b):  # pinned blocks of another batch are never reused: give them back first
        if last_batch[0] != b:
            empty_host_cache()
        last_batch[0] = b

    memo: dict[str, tuple[int, dict]] = {}  # probe_key -> (largest, tried): equal probes run once
    for row in rows:
        tried: dict[int, str] = {}

        def try_batch(b):
            new_batch(b)
            ids, err = prompt(b), None
            try:
                new = min(args.probe_tokens, args.offloaded_tokens) if row == "offloaded" else args.probe_tokens
                generate_once(model, ids, row, args, new, profile=profile,
                              cache_len=ids.shape[1] + args.new_tokens, eager=not args.probe_compiled)
            except Exception as e:  # noqa: BLE001
                err = error_record(e)["error"]
            tried[b] = "ok" if err is None else err
            print(f"probe {row} {b}x{length}: {tried[b]}", flush=True)
            ids = None
            release(model, compiled=args.probe_compiled and is_compiled(row) or err is not None)
            return err is None

        t, key = time.perf_counter(), probe_key(row, args.probe_compiled)
        if key in memo:
            best, tried = memo[key]
        else:
            best, _ = search_largest(try_batch, start=args.probe_start, step=args.probe_step,
                                     max_probes=args.max_probes)
            memo[key] = best, tried
        record(f"largest@{length}", row, {"largest_batch": best, "tried": {str(b): v for b, v in tried.items()},
                                          "probe_tokens": args.probe_tokens, "search_s": time.perf_counter() - t,
                                          "probes_compiled": bool(args.probe_compiled),
                                          "probes_of": key})
        candidates = sorted((b for b, v in tried.items() if v == "ok"), reverse=True)[:2]
        for b in candidates:  # the largest that passed; the next one down if its measured call fails
            new_batch(b)
            results = run_row(model, prompt(b), row, args, profile, warmed, again=False)
            measured = not any("error" in res for _, res in results)
            for name, res in results:  # the throughput table's rows: each row at its own largest batch
                record(f"{b}x{length}", name, {**res, **batch_throughput(res), "largest_batch_row": measured})
            if measured:
                break
