"""``model.generate`` end to end, FlexiCache against the dense caches a transformers user has (CUDA).

    python -m flexicache_hf.bench.generate [--model llama8b|smollm2] [--cases 1x16384,16x16384,16x30720]
        [--rows dynamic,static,offloaded,flexicache,flexicache-graph] [--static-variants sdpa,eager]
        [--new-tokens 256] [--budget 1024] [--profile-steps 32] [--out DIR]
    python -m flexicache_hf.bench.generate --largest-batch 30720 [--rows ...] [--probe-tokens 16]

One ``generate`` call per (case, row), greedy, exactly ``--new-tokens`` tokens.  A logits processor
synchronises and stamps every step, so the first stamp is the **time to first token** (the prefill) and the
differences are the **decode steps** (first, median, p99, max).  Also recorded: output tokens/s over the
whole call, peak GPU memory (``max_memory_allocated``, weights included), pinned host bytes and pinned
allocations made during the call (``torch.cuda.host_memory_stats``), FlexiCache's pages promoted from host,
and ``dynamo_graphs_added`` (``torch._dynamo.utils.counters["stats"]["unique_graphs"]`` after the call minus
before: 0 on a call that compiled nothing).

Rows:

* ``dynamic``: ``DynamicCache`` + SDPA, eager (transformers' default).
* ``static``, ``static-<impl>``: a ``StaticCache(config, max_cache_len=prompt + new)`` (what
  ``cache_implementation="static"`` makes), so ``generate`` compiles the decode step itself
  (``torch.compile`` "reduce-overhead", CUDA graphs): the fastest dense path transformers has.  One row per
  ``--static-variants`` entry, the attention implementation: ``sdpa`` gives the row ``static``, any other
  (``eager``, ``flex_attention``, ``sdpa_grouped``, ...) ``static-<impl>``.  ``sdpa_grouped``
  (:mod:`flexicache_hf.bench.grouped_sdpa`) is SDPA that reads each KV head once (no ``repeat_kv`` under a
  mask) and prefills without a quadratic mask: the strongest StaticCache configuration we found.  An
  unsupported variant or an out-of-memory records ``{"error": ...}`` and the run goes on.
  ``--static-prefill-chunk N`` prefills these rows' prompts in eager chunks of N tokens (``prefill_in_chunks``,
  timed as part of the first token) before ``generate`` takes the filled cache: a prompt whose one-shot prefill
  does not fit beside a static buffer (16 × 30k on the H200) then fits.  ``--prefill-chunk N`` does the same for
  the flexicache rows (each chunk after the first attends exactly over the cached prefix, as a follow-up turn
  does): a batch whose one-shot prefill activations do not fit (``--largest-batch``) then may.
* ``offloaded``: ``cache_implementation="offloaded"`` (``DynamicCache`` with layer-wise CPU offload);
  fewer steps (``--offloaded-tokens``) since each costs ~1 s at long contexts.
* ``flexicache``: ``FlexiCache(profile, token_budget=..., max_cache_len=prompt + new)``, **eager**
  (``generate(..., disable_compile=True)``), run twice with a fresh cache each time (``flexicache`` and
  ``flexicache-again``: the second shows the pinned-memory pool reused and no warm-up left).
* ``flexicache-graph``: the same cache config with ``generate``'s auto-compile (FlexiCache with a
  ``max_cache_len`` is compileable, like StaticCache), also twice: ``flexicache-graph-again`` is a second
  fresh cache after compilation (its ``dynamo_graphs_added`` should be 0: no recompile).  Each new cache takes
  the storage of the one dropped before it (``storage_taken``; see ``recycling.py``), so its first step
  replays the graphs the warm-up recorded.  Both flexicache rows
  then run once more on that last cache after ``cache.reset()`` (``-reset``): a sized cache keeps its buffers at
  their addresses, so a compiled step replays its recorded CUDA graphs (the first step shows it).

Every row first warms up: a compiling row (``static*``, ``flexicache-graph``) with a call at the very shapes
it is measured at, stopped after 4 steps (compiled and captured); the eager rows once per process on a 1×1024
prompt (kernel builds, allocator).  Then the measured call(s).  Between compiled rows the bench calls
``torch._dynamo.reset()`` (drops the compiled code and the CUDA-graph trees with their memory pools) and forgets
``generate``'s compiled call, so no stale graph holds memory and no row runs into the recompile limit; also
after any failed row, with ``gc.collect()`` and ``torch.cuda.empty_cache()``.  When the case changes, the cached
pinned host blocks of the previous shape are released (``torch._C._host_emptyCache``); so are those of the
``offloaded`` row (its KV went to pinned memory) and of a failed row, so they do not add to the next row's.

``--profile-steps N`` (0: off): for the ``static*`` and ``flexicache-graph`` rows, after the measured call, one
more ``generate`` of N + 8 tokens on a fresh cache of the same size, under ``torch.profiler`` (CPU + CUDA).  The
step clock then also drops a marker (``record_function``) at every stamp, in the profiler's own clock.  Over the
window from the 4th stamp to the last (N + 4 decode steps, after the prefill and the first steps), the union of
the CUDA kernel / memcpy / memset intervals (clipped to the window) divided by the window is
``gpu_busy_fraction``; kernels whose start lies in the window per step is ``kernels_per_step``; also
``gpu_busy_ms_per_step``, ``window_ms_per_step``, ``graph_launches_per_step``, and ``top_kernels`` (the 80
device operations with the most time per step: where the kernels of a step come from).  The clock synchronises every step
(as in the measured call), so the fraction explains the measured step: ``busy × step`` is GPU time, the rest is
host time per step (generate's Python, the launch of a graph or of eager kernels).  The profiler's own overhead
slows the host side somewhat.  A trace without step markers or device events records ``profile_error``.

``--largest-batch PROMPT_LEN``: per row, the largest batch that runs ``--probe-tokens`` new tokens at that
prompt length: batches 16, 32, 64, ... until one fails (out of memory or any error), then bisection between the
last success and the first failure down to a step of 8 (at most ``--max-probes`` probes per row).  Probes of the
compiling rows run eagerly (``disable_compile=True``; same caches, same prefill, which is what runs out of
memory), since each compile costs ~30 s; ``--probe-compiled`` probes them compiled.  Eager probes of
``flexicache-graph`` are ``flexicache``'s very calls, so that row reuses ``flexicache``'s search.  Caches are
sized for ``--new-tokens`` in the probes too.  Recorded as case ``largest@PROMPT_LEN``: ``{"largest_batch": b,
"tried": {batch: "ok" | error}}`` (batch 0: not even batch 1 ran), then one full measured row (warm-up +
``--new-tokens``) at that batch as case ``{b}x{PROMPT_LEN}`` (if that fails, once more at the next smaller batch
that passed its probe).  Host memory: FlexiCache gets
``host_memory_limit = --host-limit-gb`` (default 70 % of the machine's RAM) and an offloaded row whose
KV would exceed it is refused before it runs, so a probe fails cleanly instead of the OS killing the process.

``--followup`` adds a multi-turn case: a prefix of the first case's length, then a follow-up turn of
``--followup-tokens`` new prompt tokens on the same cache, timing the follow-up's first token (eager rows; the
median of ``--followup-repeats`` turns, each on a fresh cache).
Models: ``llama8b`` is Llama-3.1-8B's shape with random bf16 weights (speed only) and the shipped
Llama-3.1-8B-Instruct profile; ``smollm2`` is the embedded SmolLM2-135M-Instruct (real weights; ``--gguf`` or
``FLEXICACHE_GGUF``) with its measured profile, on real text.  A prompt longer than the model's context less the
new tokens is shortened to fit (SmolLM2 has 8192 positions: case ``1x8192`` runs 7936 prompt + 256 new tokens);
every result records ``prompt_tokens`` and ``batch``.

Writes ``generate-<tag>.json`` (everything, after every row) and ``generate-<tag>.png`` (median decode step per
case and row, p99 as a marker above each bar; time to first token) to ``--out`` and prints a table last: per case
and row TTFT, median and p99 step, decode tokens/s, peak GPU GB, pinned GB, the median step against
``dynamic``'s (``med/dyn``) and against the best (lowest median) ``static*`` row of the same case
(``med/static``, that row named below the table).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time
from pathlib import Path

import torch

from ..hf_compat import generate_cache_kwarg

DEFAULT_OUT = Path(__file__).resolve().parents[2] / "docs" / "benchmarks"
ROWS = ("dynamic", "static", "offloaded", "flexicache", "flexicache-graph")
WARMUP_STEPS = 4
MARK = "flexicache_bench.step"  # the profiler marker the step clock drops at every stamp
PROFILE_SKIP = 3  # the profile window starts at the 4th stamp
TOP_KERNELS = 80  # device operations listed per profiled row (names cut to 80 characters)


class StepClock:
    """Logits processor: synchronise and stamp every generated token; stop after ``stop_after`` if given.

    With ``mark`` it also drops a zero-length ``record_function`` marker at each stamp (for ``--profile-steps``).
    """

    def __init__(self, stop_after: int | None = None, mark: bool = False):
        self.stamps: list[float] = []
        self.stop_after = stop_after
        self.mark = mark
        self.t0 = time.perf_counter()

    def __call__(self, input_ids, scores):
        torch.cuda.synchronize()
        self.stamps.append(time.perf_counter())
        if self.mark:
            with torch.profiler.record_function(MARK):
                pass
        return scores

    def stop(self, input_ids, scores, **kwargs):  # a StoppingCriteria (warm-up calls only)
        done = self.stop_after is not None and len(self.stamps) >= self.stop_after
        return torch.full((input_ids.shape[0],), done, dtype=torch.bool, device=input_ids.device)


# ---- pure helpers (tests/test_bench_generate.py) ---------------------------------------------------------------
def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def summarise(clock: StepClock) -> dict:
    s = clock.stamps
    steps = [1e3 * (b - a) for a, b in zip(s, s[1:])]
    out = {"ttft_s": s[0] - clock.t0, "tokens": len(s), "total_s": s[-1] - clock.t0,
           "tokens_per_s": len(s) / (s[-1] - clock.t0)}
    if steps:
        out.update(first_step_ms=steps[0], median_step_ms=statistics.median(steps), p99_step_ms=_pct(steps, 0.99),
                   max_step_ms=max(steps), decode_tokens_per_s=len(steps) / (s[-1] - s[0]))
    return out


def expand_rows(rows: list[str], static_variants: list[str]) -> list[str]:
    """``static`` becomes one row per attention variant (``sdpa`` -> ``static``, else ``static-<impl>``)."""
    out: list[str] = []
    for row in rows:
        names = [static_row(v) for v in static_variants] if row == "static" else [row]
        out.extend(n for n in names if n not in out)
    return out


def static_row(impl: str) -> str:
    return "static" if impl == "sdpa" else f"static-{impl}"


def check_rows(rows: list[str]) -> list[str]:
    """The names among ``rows`` that are no row (``static-<impl>`` is one for any impl)."""
    return sorted(r for r in set(rows) if r not in ROWS and not (r.startswith("static-") and len(r) > 7))


def attn_impl(row: str) -> str:
    if row.startswith("flexicache"):
        return "flexicache"
    if row.startswith("static-"):
        return row[len("static-"):]
    return "sdpa"


def is_compiled(row: str) -> bool:
    """Rows whose decode step ``generate`` compiles."""
    return row == "flexicache-graph" or row == "static" or row.startswith("static-")


def is_profiled(row: str) -> bool:
    return is_compiled(row)


def probe_key(row: str, compiled_probes: bool) -> str:
    """Rows whose probes are the same calls share one search: an eager probe of ``flexicache-graph`` is
    exactly ``flexicache``'s."""
    return "flexicache" if row == "flexicache-graph" and not compiled_probes else row


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


def union_length(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by the union of ``(start, end)`` intervals."""
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(iv for iv in intervals if iv[1] > iv[0]):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total


def gpu_busy(device_events: list[tuple[float, float, str]], marks: list[float], *, skip: int = PROFILE_SKIP,
             graph_launches: list[float] = ()) -> dict:
    """GPU busy fraction between ``marks[skip]`` and ``marks[-1]`` (one mark per generated token).

    ``device_events``: ``(start, end, kind)`` with kind ``kernel`` / ``memcpy`` / ``memset`` (any time unit;
    results in ms assume ns).  ``graph_launches``: start times of ``cudaGraphLaunch`` calls (host side).
    """
    marks = sorted(marks)
    if len(marks) < skip + 2:
        raise ValueError(f"{len(marks)} step markers in the trace, need at least {skip + 2}")
    w0, w1 = marks[skip], marks[-1]
    steps = len(marks) - 1 - skip
    clipped = [(max(s, w0), min(e, w1)) for s, e, *_ in device_events if e > w0 and s < w1]
    if not clipped:
        raise ValueError("no CUDA kernel / memcpy events inside the decode window "
                         "(CUPTI did not record device activity?)")
    busy = union_length(clipped)
    count = {k: sum(1 for s, _, kind, *_ in device_events if kind == k and w0 <= s < w1)
             for k in ("kernel", "memcpy", "memset")}
    return {"gpu_busy_fraction": busy / (w1 - w0), "kernels_per_step": count["kernel"] / steps,
            "memcpy_per_step": count["memcpy"] / steps, "memset_per_step": count["memset"] / steps,
            "gpu_busy_ms_per_step": busy / steps / 1e6, "window_ms_per_step": (w1 - w0) / steps / 1e6,
            "graph_launches_per_step": sum(1 for t in graph_launches if w0 <= t < w1) / steps,
            "profile_window_steps": steps}


def top_kernels(device_events: list[tuple], marks: list[float], *, skip: int = PROFILE_SKIP, n: int = 15) -> list[dict]:
    """The ``n`` device operations that take the most time per decode step in the window of :func:`gpu_busy`:
    ``{"name", "ms_per_step", "count_per_step"}`` from ``(start, end, kind, name)`` events (ns), names cut to 80
    characters (Inductor's fused kernels carry long names)."""
    marks = sorted(marks)
    if len(marks) < skip + 2:
        return []
    w0, w1 = marks[skip], marks[-1]
    steps = len(marks) - 1 - skip
    total: dict[str, list[float]] = {}
    for s, e, _, name in device_events:
        if w0 <= s < w1:
            t = total.setdefault(name[:80], [0.0, 0])
            t[0] += e - s
            t[1] += 1
    ranked = sorted(total.items(), key=lambda kv: -kv[1][0])[:n]
    return [{"name": k, "ms_per_step": v[0] / steps / 1e6, "count_per_step": v[1] / steps} for k, v in ranked]


def device_kind(name: str, activity: str | None) -> str | None:
    """``kernel`` / ``memcpy`` / ``memset`` for a device-side profiler event, ``None`` for anything else
    (GPU user annotations: record_function ranges projected on the GPU timeline, which are no work)."""
    if activity:
        return {"kernel": "kernel", "gpu_memcpy": "memcpy", "gpu_memset": "memset"}.get(activity)
    if name.startswith("Memcpy"):
        return "memcpy"
    if name.startswith("Memset"):
        return "memset"
    return "kernel"


def split_events(events, *, names: bool = False) -> tuple[list[tuple], list[float], list[float]]:
    """(device events, step marks, graph launch times) in ns, from kineto events (``prof.profiler.kineto_results
    .events()``) or, failing that, ``FunctionEvent``s (``prof.events()``, times in us).  A device event is
    ``(start, end, kind)``, with ``names`` ``(start, end, kind, name)``."""
    dev, marks, launches = [], [], []
    for e in events:
        if hasattr(e, "start_ns"):
            name, start, end = e.name(), float(e.start_ns()), float(e.end_ns())
            on_device = str(e.device_type()).rsplit(".", 1)[-1] == "CUDA"
            activity = e.activity_type() if hasattr(e, "activity_type") else None
            annotation = e.is_user_annotation() if hasattr(e, "is_user_annotation") else False
        else:
            name, start, end = e.name, 1e3 * e.time_range.start, 1e3 * e.time_range.end
            on_device = str(e.device_type).rsplit(".", 1)[-1] == "CUDA"
            activity = getattr(e, "activity_type", None)
            annotation = bool(getattr(e, "is_user_annotation", False))
        if name == MARK and not on_device:
            marks.append(start)
        elif on_device and not annotation and name != MARK:
            kind = device_kind(name, activity)
            if kind is not None:
                dev.append((start, end, kind, name) if names else (start, end, kind))
        elif not on_device and name in ("cudaGraphLaunch", "cudaGraphLaunch_v10000", "cuGraphLaunch"):
            launches.append(start)
    return dev, marks, launches


def add_ratios(results: list[dict]) -> None:
    """Per case: each row's median step against ``dynamic``'s and against the best (lowest) ``static*`` row's."""
    for case in dict.fromkeys(r["case"] for r in results):
        rows = [r for r in results if r["case"] == case and r.get("median_step_ms")]
        dyn = next((r["median_step_ms"] for r in rows if r["row"] == "dynamic"), None)
        statics = [r for r in rows if is_compiled(r["row"]) and r["row"].startswith("static")]
        best = min(statics, key=lambda r: r["median_step_ms"]) if statics else None
        for r in rows:
            r["median_vs_dynamic"] = r["median_step_ms"] / dyn if dyn else None
            r["median_vs_best_static"] = r["median_step_ms"] / best["median_step_ms"] if best else None
            r["best_static_row"] = best["row"] if best else None


def format_table(results: list[dict]) -> str:
    """The table printed last (``add_ratios`` first for the two ratio columns)."""
    def num(v, fmt, scale=1.0):
        if not isinstance(v, (int, float)):
            return "-".rjust(int("".join(ch for ch in fmt.split(".")[0] if ch.isdigit()) or 0))
        return format(v / scale if scale != 1.0 else v, fmt)

    head = (f"{'case':<12} {'row':<24} {'TTFT s':>7} {'med ms':>8} {'p99 ms':>8} {'dec tok/s':>9} {'peak GB':>8} "
            f"{'pin GB':>7} {'med/dyn':>8} {'med/static':>10} {'busy':>5} {'graphs+':>7}")
    lines = [head]
    best: dict[str, str] = {}
    searches = []
    for r in results:
        if "largest_batch" in r:
            searches.append(r)
            continue
        if "error" in r:
            lines.append(f"{r['case']:<12} {r['row']:<24} error: {r['error'][:100]}")
            continue
        if r.get("best_static_row"):
            best[r["case"]] = r["best_static_row"]
        busy = r.get("gpu_busy_fraction")  # absent unless profiled
        lines.append(
            f"{r['case']:<12} {r['row']:<24} {num(r.get('ttft_s'), '7.2f')} {num(r.get('median_step_ms'), '8.2f')} "
            f"{num(r.get('p99_step_ms'), '8.2f')} {num(r.get('decode_tokens_per_s'), '9.1f')} "
            f"{num(r.get('peak_gpu_bytes'), '8.1f', 1e9)} {num(r.get('pinned_bytes'), '7.1f', 1e9)} "
            f"{num(r.get('median_vs_dynamic'), '8.2f')} {num(r.get('median_vs_best_static'), '10.2f')} "
            f"{num(busy, '5.0%')} {num(r.get('dynamo_graphs_added'), '7d')}")
    if best:
        lines.append("med/dyn: median step / dynamic's; med/static: median step / the best static row's ("
                     + ", ".join(f"{c}: {b}" for c, b in best.items()) + "); busy: GPU busy fraction of the "
                     "profiled decode steps; graphs+: dynamo graphs compiled during the measured call")
    for r in searches:
        tried = ", ".join(f"{b}: {'ok' if v == 'ok' else 'fail'}"
                          for b, v in sorted(r["tried"].items(), key=lambda kv: int(kv[0])))
        lines.append(f"{r['case']:<12} {r['row']:<24} largest batch {r['largest_batch']} (tried {tried})")
    return "\n".join(lines)


def error_record(e: BaseException) -> dict:
    if isinstance(e, torch.OutOfMemoryError):
        kind = "out of memory"
    else:
        kind = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
    return {"error": kind, "detail": (str(e).splitlines() or [""])[0][:500]}


def kv_bytes(config, batch: int, tokens: int, elt: int = 2) -> int:
    """Dense K + V bytes of ``batch`` rows of ``tokens`` tokens (all layers, bf16)."""
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * heads * head_dim * elt * batch * tokens


def default_host_limit_gb() -> float:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return 0.7 * int(line.split()[1]) * 1024 / 1e9
    except OSError:
        pass
    try:
        return 0.7 * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    except (ValueError, OSError, AttributeError):
        return 0.0


class HostLimitError(RuntimeError):
    """A row's host memory would exceed ``--host-limit-gb`` (refused before running)."""


# ---- the GPU side -----------------------------------------------------------------------------------------
def pinned_stats() -> dict:
    st = torch.cuda.host_memory_stats() if hasattr(torch.cuda, "host_memory_stats") else {}
    return {"pinned_bytes": st.get("allocated_bytes.current", 0), "pinned_allocs": st.get("num_host_alloc", 0),
            "pinned_locked": st.get("allocated_bytes.allocated", 0)}  # bytes ever page-locked


def empty_host_cache() -> None:
    """Release cached (unused) pinned host blocks: those of another shape are never reused."""
    fn = (getattr(getattr(torch, "accelerator", None), "empty_host_cache", None)
          or getattr(torch._C, "_host_emptyCache", None))
    if fn is not None:
        try:
            fn()
        except RuntimeError:
            pass


def dynamo_counts() -> tuple[int, dict]:
    """(unique dynamo graphs so far, inductor cudagraph counters)."""
    try:
        from torch._dynamo.utils import counters
    except Exception:  # noqa: BLE001  (no dynamo: nothing compiled)
        return 0, {}
    return int(counters["stats"]["unique_graphs"]), {k: v for k, v in counters["inductor"].items() if "cudagraph" in k}


def cudagraph_recordings() -> int | None:
    """CUDA graphs cudagraph trees recorded so far on the current device (None when unknown)."""
    try:
        from torch._inductor.cudagraph_trees import get_manager

        manager = get_manager(torch.cuda.current_device(), create_if_none_exists=False)
        return 0 if manager is None else int(repr(manager.graph_counter)[len("count("):-1])
    except Exception:  # noqa: BLE001  (a private counter: report nothing rather than fail the row)
        return None


def release(model, *, compiled: bool) -> None:
    """Free what a row left: its objects, the storage FlexiCache keeps from its last cache, cached blocks and,
    after a compiled row, the compiled code and graphs."""
    from ..recycling import release_storage

    gc.collect()
    release_storage()
    if compiled:
        from torch import _dynamo

        _dynamo.reset()  # also resets the CUDA-graph trees (their memory pools)
        for attr in ("_compiled_call", "_last_compile_config", "_cache", "_previous_max_cache_length"):
            model.__dict__.pop(attr, None)
        gc.collect()
    try:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    except RuntimeError as e:  # a sticky CUDA error: the rows after this one will record it
        print(f"release: {e}", flush=True)


def new_cache(row: str, model, profile, args, max_cache_len: int):
    """The cache object a row passes to ``generate`` (``None``: generate makes it from cache_implementation)."""
    from transformers import DynamicCache, StaticCache

    from ..cache import FlexiCache

    if row.startswith("flexicache"):
        limit = int(args.host_limit_gb * 1e9) if args.host_limit_gb > 0 else None
        return FlexiCache(profile, token_budget=args.budget, rerank_interval=args.rerank_interval,
                          stagger_reranks=args.stagger_reranks, group_score=args.group_score,
                          page_size=args.page_size, bound_shrink=args.bound_shrink,
                          unstable_group_score=args.unstable_group_score,
                          max_cache_len=max_cache_len, model_config=model.config, host_memory_limit=limit)
    if is_compiled(row):  # static*
        try:
            return StaticCache(config=model.config, max_cache_len=max_cache_len)
        except TypeError:  # another signature: let generate make it (cache_implementation="static")
            return None
    return DynamicCache() if row == "dynamic" else None


def generate_once(model, ids, row: str, args, new: int, *, profile=None, stop_after=None, cache=None,
                  cache_len: int | None = None, eager: bool = False, clock: StepClock | None = None):
    """One timed generate call of ``new`` tokens; returns (summary dict, cache used, output ids).

    ``cache_len``: the cache's size (default prompt + ``new``); ``eager``: no compile even for a compiled row.
    """
    from transformers import StoppingCriteriaList

    clock = clock or StepClock(stop_after)
    kw = dict(max_new_tokens=new, min_new_tokens=new if stop_after is None else None, do_sample=False,
              attention_mask=torch.ones_like(ids), logits_processor=[clock],
              stopping_criteria=StoppingCriteriaList([clock.stop]), pad_token_id=0)
    if eager or not is_compiled(row):
        kw["disable_compile"] = True
    chunk = (args.static_prefill_chunk if row.startswith("static")
             else args.prefill_chunk if row.startswith("flexicache") else 0)
    if row == "offloaded" and args.host_limit_gb > 0:
        need = kv_bytes(model.config, ids.shape[0], ids.shape[1] + new)
        if need > args.host_limit_gb * 1e9:
            raise HostLimitError(f"the offloaded KV needs {need / 1e9:.1f} GB of host memory, over --host-limit-gb "
                                 f"{args.host_limit_gb:.1f}")
    model.set_attn_implementation(attn_impl(row))
    passed_in = cache is not None  # (the -reset row's: it runs on its own storage)
    cache = cache if cache is not None else new_cache(row, model, profile, args, cache_len or ids.shape[1] + new)
    if chunk and cache is None:
        raise RuntimeError("--static-prefill-chunk needs a StaticCache made here (this transformers' StaticCache "
                           "signature is unknown)")
    if chunk and int(cache.get_seq_length()):
        chunk = 0  # a later turn on a filled cache (the follow-up case): generate takes it whole
    if cache is not None:
        kw[generate_cache_kwarg()] = cache
    else:
        kw["cache_implementation"] = "static" if is_compiled(row) else row
    before = pinned_stats()
    graphs0, cg0 = dynamo_counts()
    rec0 = cudagraph_recordings()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.synchronize()
    clock.t0 = time.perf_counter()
    if chunk:  # the time to first token includes the chunks
        prefill_in_chunks(model, ids, cache, chunk)
    out = model.generate(ids, **kw)
    torch.cuda.synchronize()
    res = summarise(clock)
    after = pinned_stats()
    graphs1, cg1 = dynamo_counts()
    rec1 = cudagraph_recordings()
    res.update(peak_gpu_bytes=torch.cuda.max_memory_allocated(), pinned_bytes=after["pinned_bytes"],
               pinned_allocs_during=after["pinned_allocs"] - before["pinned_allocs"],
               pinned_bytes_added=after["pinned_locked"] - before["pinned_locked"],
               dynamo_graphs_added=graphs1 - graphs0, batch=ids.shape[0], prompt_tokens=ids.shape[1],
               compiled=is_compiled(row) and not eager, prefill_chunk_size=chunk or None)
    if rec0 is not None and rec1 is not None and rec1 >= rec0:
        res["cudagraphs_recorded"] = rec1 - rec0  # 0: every compiled step replayed graphs recorded earlier
    cg = {k: v - cg0.get(k, 0) for k, v in cg1.items() if v - cg0.get(k, 0)}
    if cg:
        res["cudagraph_counters_added"] = cg
    if row.startswith("flexicache"):
        # storage_taken: a new cache took a dropped one's storage at its first forward (recycling.py)
        res.update(storage_taken=not passed_in and cache.storage_reused, promoted_pages=cache.stats.promoted_pages(),
                   host_tier_bytes=cache.host_bytes(),
                   device_kv_bytes=cache.device_bytes(), dense_kv_bytes=cache.dense_bytes(),
                   cache_is_compileable=bool(cache.is_compileable))
    return res, cache, out


def prefill_in_chunks(model, ids: torch.Tensor, cache, chunk: int) -> None:
    """``--static-prefill-chunk`` / ``--prefill-chunk``: fill an empty ``cache`` with every prompt token but the
    last, ``chunk`` tokens per eager forward; ``generate`` then prefills the last token itself and decodes as
    usual (compiled, for a static cache).

    Not ``generate(prefill_chunk_size=...)``: for a compileable cache ``generate`` compiles the chunks too, and on
    the H200 image (torch 2.11, transformers 5.17) that compiled chunked prefill of a ``StaticCache`` failed at
    16 × 30k, once with "accessing tensor output of CUDAGraphs that has been overwritten by a subsequent run" and
    once with a segmentation fault (``docs/benchmarks/generate.md``, run 10).  Prompts are unpadded here."""
    end = ids.shape[1] - 1
    with torch.no_grad():
        for start in range(0, end, chunk):
            stop = min(start + chunk, end)
            model(input_ids=ids[:, start:stop], attention_mask=torch.ones_like(ids[:, :stop]),
                  past_key_values=cache, use_cache=True, logits_to_keep=1)


def profile_decode(model, ids, row, args, profile) -> dict:
    """``--profile-steps``: one more generate of N + 8 tokens under torch.profiler; GPU busy fraction and
    kernels per step over the decode window (see the module docstring).  Errors come back as ``profile_error``."""
    from torch.profiler import ProfilerActivity

    new = args.profile_steps + 8
    clock = StepClock(mark=True)
    try:
        with torch.profiler.profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            res, _, _ = generate_once(model, ids, row, args, new, profile=profile, clock=clock,
                                      cache_len=ids.shape[1] + max(new, args.new_tokens))
        t = time.perf_counter()
        kineto = getattr(getattr(prof, "profiler", None), "kineto_results", None)
        events = kineto.events() if kineto is not None else prof.events()
        dev, marks, launches = split_events(events, names=True)
        out = gpu_busy(dev, marks, graph_launches=launches)
        out["top_kernels"] = top_kernels(dev, marks, n=TOP_KERNELS)
        out.update(profile_tokens=new, profile_median_step_ms=res.get("median_step_ms"),
                   profile_graphs_added=res["dynamo_graphs_added"], profile_parse_s=time.perf_counter() - t)
        return out
    except Exception as e:  # noqa: BLE001  (a profile that fails keeps the row's measurement)
        return {"profile_error": error_record(e)["error"]}


def run_row(model, ids, row, args, profile, warmed: set, *, again: bool = True) -> list[tuple[str, dict]]:
    """Warm-up, then the measured call(s) of one row (``again``: the flexicache rows' second fresh cache).

    The compiling rows warm up at the very shapes they are measured at (a compiled step is specialised to the
    cache's shape), stopped after a few steps; the eager rows once per process on a short prompt (kernel
    builds, allocator), so no row's measured call pays a one-time cost.  Any error (out of memory, an
    unsupported attention) ends the row with ``{"error": ...}``; memory is freed before the next row.
    """
    results: list[tuple[str, dict]] = []
    compiled = is_compiled(row)
    new = args.offloaded_tokens if row == "offloaded" else args.new_tokens
    names = (row, f"{row}-again") if again and row.startswith("flexicache") else (row,)
    current, err = row, None
    try:
        warm = {}
        if compiled:
            t = time.perf_counter()
            res, _, _ = generate_once(model, ids, row, args, new, profile=profile, stop_after=WARMUP_STEPS)
            warm = {"warmup_s": time.perf_counter() - t, "warmup_graphs_added": res["dynamo_graphs_added"],
                    "compile_skipped": res["dynamo_graphs_added"] == 0}  # generate declined to compile
        elif row not in warmed:
            generate_once(model, ids[:1, :1024], row, args, 8, profile=profile)
            warmed.add(row)
        for name in names:
            current = name
            cache = None  # the previous fresh cache dies first: its pinned blocks are what the next one reuses
            gc.collect()
            res, cache, _ = generate_once(model, ids, row, args, new, profile=profile)
            if name == row:
                res.update(warm)
            results.append((name, res))
        if again and row.startswith("flexicache"):  # the last cache once more after reset(): buffers kept
            current = f"{row}-reset"
            cache.reset()
            res, _, _ = generate_once(model, ids, row, args, new, profile=profile, cache=cache)
            results.append((current, res))
        cache = None
        if args.profile_steps > 0 and is_profiled(row):
            current = row
            gc.collect()
            results[0][1].update(profile_decode(model, ids, row, args, profile))
    except Exception as e:  # noqa: BLE001  (recorded; the run goes on)
        err = error_record(e)
    if err is not None:
        results.append((current, err))
    release(model, compiled=compiled or err is not None)
    if row == "offloaded" or err is not None:  # offloaded KV sits in pinned blocks no FlexiCache reuses
        empty_host_cache()
    return results


def run_followup(model, ids, args, profile, make_prompt) -> list[tuple[str, dict]]:
    """Multi-turn: a prefix turn, then a ``--followup-tokens`` new prompt on the same cache (its TTFT); eager.

    One warm-up pass, then ``--followup-repeats`` measured ones (each on a fresh cache and prefix turn): a
    follow-up's first token takes ~0.1 s at 1 × 16k, where one call varies by tens of percent, so ``ttft_s`` is
    the median of the repeats (every one in ``ttft_runs_s``)."""
    out = []
    extra = make_prompt(ids.shape[0], args.followup_tokens)
    for row in ("dynamic", "flexicache"):
        err = None
        try:
            runs = []
            for attempt in range(1 + max(1, args.followup_repeats)):  # the first pass warms up
                total = ids.shape[1] + 8 + args.followup_tokens + args.new_tokens
                cache = new_cache(row, model, profile, args, total)
                _, cache, first = generate_once(model, ids, row, args, 8, profile=profile, cache=cache)
                turn = torch.cat([first, extra], dim=1)
                res, _, _ = generate_once(model, turn, row, args, args.new_tokens, profile=profile, cache=cache,
                                          stop_after=4)
                if attempt:
                    runs.append(res["ttft_s"])
                cache = None
            out.append((f"{row}-followup", {**res, "ttft_s": statistics.median(runs), "ttft_runs_s": runs,
                                            "prefix_tokens": ids.shape[1] + 8,
                                            "followup_tokens": args.followup_tokens}))
        except Exception as e:  # noqa: BLE001
            err = error_record(e)
        if err is not None:
            out.append((f"{row}-followup", err))
        cache = first = turn = None
        release(model, compiled=False)
    return out


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
        for b in candidates:
            new_batch(b)
            results = run_row(model, prompt(b), row, args, profile, warmed, again=False)
            for name, res in results:
                record(f"{b}x{length}", name, res)
            if not any("error" in res for _, res in results):
                break


def load(args):
    """(model, profile, make_prompt) for ``--model``."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    # attn_implementation="flexicache" is registered by the package's __init__, imported before this module
    from ..head_profile import resolve_profile

    if args.model == "llama8b":
        cfg = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                          num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
                          rope_theta=500000.0)
        torch.manual_seed(0)
        with torch.device("cuda"):
            model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="flexicache")
        profile = resolve_profile("Llama-3.1-8B-Instruct")

        def prompt(batch, length):
            return torch.randint(100, 120000, (batch, length), device="cuda")
    else:
        from ..data import long_prompt
        from ..models import load_default_model

        model, tok = load_default_model(gguf_path=args.gguf, dtype=torch.bfloat16, device="cuda")
        profile = resolve_profile("SmolLM2-135M-Instruct")

        def prompt(batch, length):
            return torch.cat([long_prompt(tok, length, doc_index=i) for i in range(batch)]).cuda()
    model.generation_config.pad_token_id = 0
    if args.unstable_fraction is not None:
        profile = profile.least_stable(args.unstable_fraction)
    return model.eval(), profile, prompt


def fit_prompt(length: int, new_tokens: int, max_positions: int | None) -> int:
    """The prompt length that leaves room for ``new_tokens`` in the model's context."""
    if max_positions and length + new_tokens > max_positions:
        return max(1, max_positions - new_tokens)
    return length


def figure(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timed = [r for r in results if r.get("median_step_ms")]
    cases = list(dict.fromkeys(r["case"] for r in timed))
    rows = list(dict.fromkeys(r["row"] for r in timed))
    if not cases:
        return
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    width = 0.8 / max(len(rows), 1)
    for ax, key, label in ((axes[0], "median_step_ms", "decode step (ms): bar median, marker p99"),
                           (axes[1], "ttft_s", "time to first token (s)")):
        for j, row in enumerate(rows):
            xs, vals, p99 = [], [], []
            for i, c in enumerate(cases):
                r = next((r for r in timed if r["case"] == c and r["row"] == row), None)
                if r is not None and r.get(key):
                    xs.append(i + j * width)
                    vals.append(r[key])
                    p99.append(r.get("p99_step_ms"))
            bars = ax.bar(xs, vals, width, label=row)
            if key == "median_step_ms":
                pts = [(x, p) for x, p in zip(xs, p99) if p]
                if pts:
                    ax.plot([x for x, _ in pts], [p for _, p in pts], linestyle="none", marker="_", markersize=9,
                            markeredgewidth=2, color=bars.patches[0].get_facecolor() if bars.patches else "k")
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(cases))], cases)
        ax.set_yscale("log")
        ax.set_ylabel(label)
    axes[0].legend(fontsize=7, ncol=2)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CUDA"
    fig.suptitle(f"model.generate end to end ({device}); missing bars: error / out of memory")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=("llama8b", "smollm2"), default="llama8b")
    ap.add_argument("--gguf", default=None)
    ap.add_argument("--cases", default="1x16384,16x16384,16x30720", help="BATCHxPROMPT, comma separated")
    ap.add_argument("--rows", default=",".join(ROWS), help=f"comma separated, of {ROWS} (or static-<impl>)")
    ap.add_argument("--static-variants", default="sdpa",
                    help="attention implementations of the static row, comma separated (sdpa,eager,flex_attention)")
    ap.add_argument("--static-prefill-chunk", type=int, default=0, metavar="TOKENS",
                    help="static rows prefill in eager chunks of this many tokens before generate (0: at once)")
    ap.add_argument("--prefill-chunk", type=int, default=0, metavar="TOKENS",
                    help="flexicache rows prefill in eager chunks of this many tokens before generate (0: at once)")
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--offloaded-tokens", type=int, default=16)
    ap.add_argument("--budget", type=int, default=1024)
    ap.add_argument("--rerank-interval", type=int, default=16)
    ap.add_argument("--stagger-reranks", action="store_true",
                    help="FlexiCacheConfig(stagger_reranks=True): layers re-rank their stable heads on different steps")
    ap.add_argument("--group-score", choices=("max", "mass"), default="max", help="FlexiCacheConfig.group_score")
    ap.add_argument("--page-size", type=int, default=16, help="FlexiCacheConfig.page_size")
    ap.add_argument("--bound-shrink", type=float, default=1.0, help="FlexiCacheConfig.bound_shrink")
    ap.add_argument("--unstable-group-score", choices=("max", "mass", "exact"), default=None,
                    help="FlexiCacheConfig.unstable_group_score (exact: the unstable heads by the exact mass)")
    ap.add_argument("--unstable-fraction", type=float, default=None,
                    help="re-cut the model's shipped profile to its least-stable fraction of heads")
    ap.add_argument("--profile-steps", type=int, default=0,
                    help="profile N+8 more tokens of the compiled rows (GPU busy fraction, kernels per step)")
    ap.add_argument("--largest-batch", type=int, default=None, metavar="PROMPT_LEN",
                    help="search each row's largest batch at this prompt length instead of --cases")
    ap.add_argument("--probe-tokens", type=int, default=16)
    ap.add_argument("--probe-start", type=int, default=16)
    ap.add_argument("--probe-step", type=int, default=8)
    ap.add_argument("--max-probes", type=int, default=8)
    ap.add_argument("--probe-compiled", action="store_true", help="probe the compiled rows compiled (~30 s each)")
    ap.add_argument("--host-limit-gb", type=float, default=None,
                    help="FlexiCache host_memory_limit and offloaded rows' cap (default 70%% of RAM; 0: none)")
    ap.add_argument("--followup", action="store_true", help="add the multi-turn follow-up case")
    ap.add_argument("--followup-tokens", type=int, default=512)
    ap.add_argument("--followup-repeats", type=int, default=5, help="measured follow-up turns per row (median)")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--tag", default=None, help="file name suffix (default: the model)")
    args = ap.parse_args(argv)
    rows = expand_rows([r for r in args.rows.split(",") if r], [v for v in args.static_variants.split(",") if v])
    bad = check_rows(rows)
    if bad:
        raise SystemExit(f"unknown rows {bad}; choose from {ROWS} (or static-<impl>)")
    if not torch.cuda.is_available():
        raise SystemExit("bench.generate needs a CUDA device")
    if args.host_limit_gb is None:
        args.host_limit_gb = default_host_limit_gb()
    from .grouped_sdpa import register
    register()  # the static-sdpa_grouped row's attention
    model, profile, make_prompt = load(args)
    max_pos = getattr(model.config, "max_position_embeddings", None)
    results, warmed = [], set()
    args.out.mkdir(parents=True, exist_ok=True)
    tag = args.tag or (args.model if args.largest_batch is None else f"{args.model}-largest{args.largest_batch}")
    weights = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "transformers": __import__("transformers").__version__, "rows": rows,
            "weights_bytes": weights,  # the model's own GPU bytes: every row's peak includes them
            "args": {k: str(v) for k, v in vars(args).items()}}
    json_path = args.out / f"generate-{tag}.json"

    def save():
        add_ratios(results)
        json_path.write_text(json.dumps({"meta": meta, "results": results}, indent=1))

    def record(case, name, res):  # saved after every row: a run cut short keeps what it measured
        if res.get("peak_gpu_bytes") is not None:  # what the cache and activations took beyond the weights
            res = {**res, "peak_above_weights_bytes": res["peak_gpu_bytes"] - weights}
        results.append({"case": case, "row": name, **res})
        print(json.dumps(results[-1]), flush=True)
        save()

    if args.largest_batch is not None:
        length = fit_prompt(args.largest_batch, args.new_tokens, max_pos)
        run_largest(model, make_prompt, length, rows, args, profile, warmed, record)
    else:
        for i, case in enumerate(c for c in args.cases.split(",") if c):
            batch, length = (int(x) for x in case.split("x"))
            fitted = fit_prompt(length, args.new_tokens, max_pos)
            if fitted != length:
                print(f"case {case}: prompt shortened to {fitted} tokens ({max_pos} positions, {args.new_tokens} new)",
                      flush=True)
            empty_host_cache()
            ids = make_prompt(batch, fitted)
            for row in rows:
                for name, res in run_row(model, ids, row, args, profile, warmed):
                    record(case, name, res)
            if args.followup and i == 0:
                for name, res in run_followup(model, ids, args, profile, make_prompt):
                    record(case, name, res)
            del ids
    save()
    figure(results, args.out / f"generate-{tag}.png")
    print()
    print(format_table(results))
    return results


if __name__ == "__main__":
    main()
