"""What surrounds a row on the device and the host: error records, host-memory limits, pinned-memory and compile
counters, and freeing what a row left before the next one."""

from __future__ import annotations

import gc
import os

import torch

from ...host_room import meminfo


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
    total = meminfo().get("MemTotal")
    if total:
        return 0.7 * total / 1e9
    try:
        return 0.7 * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    except (ValueError, OSError, AttributeError):
        return 0.0


class HostLimitError(RuntimeError):
    """A row's host memory would exceed ``--host-limit-gb`` (refused before running)."""


def pinned_stats() -> dict:
    """Page-locked host memory in use, page-locks so far, bytes ever page-locked and seconds forwards waited for
    page-locking: FlexiCache's host tiers (``block_keeper.BLOCKS``) and torch's pinned allocator (the offloaded row's
    KV, generate's flags) together."""
    from ...block_keeper import BLOCKS

    st = torch.cuda.host_memory_stats() if hasattr(torch.cuda, "host_memory_stats") else {}
    ours = BLOCKS.stats()
    return {"pinned_bytes": st.get("allocated_bytes.current", 0) + ours["lent_bytes"],
            "pinned_allocs": st.get("num_host_alloc", 0) + ours["pins"],
            "pinned_locked": st.get("allocated_bytes.allocated", 0) + ours["pinned_bytes"],
            "pin_wait_s": ours["wait_s"]}


def empty_host_cache() -> None:
    """Release cached (unused) pinned host blocks, torch's and the host tiers' kept ones: those of another shape are
    never reused."""
    from ...block_keeper import BLOCKS

    BLOCKS.release()
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


def compile_phases() -> dict[str, float]:
    """Seconds torch.compile has spent so far in each of its timed phases (``torch._dynamo.utils``'s
    ``compilation_time_metrics``: Dynamo's bytecode tracing, AOT autograd, Inductor's lowering and code generation,
    waiting for its kernel builds, ...), summed per phase; ``{}`` without them."""
    try:
        from torch._dynamo.utils import compilation_time_metrics
    except Exception:  # noqa: BLE001
        return {}
    return {name: float(sum(times)) for name, times in list(compilation_time_metrics.items())}


def phases_since(before: dict[str, float], top: int = 12) -> dict[str, float]:
    """The ``top`` phases by seconds spent since ``before`` (a :func:`compile_phases` snapshot), rounded to ms."""
    now = compile_phases()
    spent = {name: now[name] - before.get(name, 0.0) for name in now}
    best = sorted(((s, n) for n, s in spent.items() if s > 0.0005), reverse=True)[:top]
    return {name: round(s, 3) for s, name in best}


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
    from ... import release_storage

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


class TritonCompiles:
    """``with TritonCompiles() as tc``: the Triton kernels this process compiled inside the block (per kernel name in
    ``tc.kernels``: ``[compiles, seconds]``) and the ones it loaded from Triton's cache (``tc.hits``), through
    ``triton.knobs.compilation.listener`` (the listener before the block is called too, and put back after it).
    What a first cache's time to first token spends building kernels.  Kernels torch.compile builds in its worker
    processes are not seen; with a Triton without the listener every count stays ``None``."""

    def __init__(self):
        self.hits = self.kernels = None
        self._knobs = self._previous = None

    def __enter__(self) -> "TritonCompiles":
        try:
            from triton import knobs
        except ImportError:
            return self
        if not hasattr(getattr(knobs, "compilation", None), "listener"):
            return self
        self._knobs, self._previous = knobs, knobs.compilation.listener
        self.hits, self.kernels = 0, {}
        knobs.compilation.listener = self._listen
        return self

    def _listen(self, *, src, metadata, metadata_group, times, cache_hit) -> None:
        if cache_hit:
            self.hits += 1
        else:
            entry = self.kernels.setdefault(str(getattr(src, "name", "?")), [0, 0.0])
            entry[0] += 1
            entry[1] += times.total / 1e6  # CompileTimes are in microseconds
        if self._previous is not None:
            self._previous(src=src, metadata=metadata, metadata_group=metadata_group, times=times,
                           cache_hit=cache_hit)

    def __exit__(self, *exc) -> None:
        if self._knobs is not None:
            self._knobs.compilation.listener = self._previous

    def record(self) -> dict:
        if self.kernels is None:  # no listener: nothing known
            return {"triton_compiles": None, "triton_cache_hits": None, "triton_compile_s": None,
                    "triton_kernels": None}
        builds = self.kernels.values()
        return {"triton_compiles": sum(n for n, _ in builds), "triton_cache_hits": self.hits,
                "triton_compile_s": sum(s for _, s in builds),
                "triton_kernels": {name: [n, round(s, 3)] for name, (n, s) in self.kernels.items()}}
