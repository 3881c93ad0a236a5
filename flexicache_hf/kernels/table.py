"""The kernel table: every kernel registered once, with its reference and its CUDA twin.

A row (:class:`Kernel`) names

* the kernel's plain PyTorch reference (:mod:`.reference`: the CPU path, the test oracle, and the signature and
  contract every backend keeps);
* its CUDA twin: the attribute of the same name in a module of this package (a Triton kernel, or a cuda-python
  copy), imported on first use on CUDA only, so the CPU path never needs Triton or cuda-python.

A backend is a :class:`KernelOps`, one field per row, each the backend's kernel itself; :func:`ops_for` is the one
place that picks a backend.  No kernel is traced by torch.compile: a compiled decode step runs a layer's kernels
inside one opaque op (:mod:`flexicache_hf.graph_step`), eagerly, while its CUDA graph is captured.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import os
import threading
from typing import Any, Callable

import torch

from ..cuda_context import cuda_core
from . import reference, reference_schedule

REFERENCE, TRITON = "reference", "triton"  # the backends' names (KernelOps.name: pickles carry it)


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One row of the table (see the module docstring)."""

    name: str
    reference: Callable[..., Any]
    cuda: str  # the module of its CUDA twin (attribute ``name``)


KERNELS = (
    Kernel("minmax_update", reference.minmax_update, "minmax"),  # a prompt chunk's keys
    Kernel("append_token", reference.append_token, "append"),
    Kernel("page_scores", reference.page_scores, "scores"),
    Kernel("page_lse", reference.page_lse, "page_lse"),
    # The "mass" combine of a group's per-query-head scores (page_scores' bounds, page_lse's exact log-sum-exps):
    # one launch where the reference is ~8 ops over [B, h, G, P], and nothing read on inactive rows.
    Kernel("group_mass", reference.group_mass, "mass"),
    # A Triton radix select rather than torch.topk + sort + padding (the reference): the earlier in-register select
    # beat it at every benchmark shape on the H200, 7-24 us vs 38-94 us for 8-512 rows of 625-1875 pages
    # (docs/benchmarks/decode.md, rerank.json).  The select walks only each row's live pages, rows of any width.
    Kernel("select_pages", reference.select_pages, "select"),
    Kernel("sparse_decode", reference.sparse_decode, "sparse_decode"),
    # Tier copies: the NVRTC kernel of .uva_copy (pinned host memory in place through UVA), which falls back to
    # torch indexing where cuda-python is missing or a tensor has no device address (pageable host memory).
    Kernel("copy_pages", reference.copy_pages, "uva_copy"),
    Kernel("copy_kv_pages", reference.copy_kv_pages, "uva_copy"),  # both pools of a layer in one launch
    # The same copies behind the compute (FlexiCacheConfig.overlap_loads): on the device's load stream, joined at
    # the end of the forward.
    Kernel("load_pages_behind", reference.load_pages_behind, "behind"),
    Kernel("join_loads", reference.join_loads, "behind"),
    Kernel("copy_rows", reference.copy_rows, "row_copy"),  # a prompt's offload: a few cuMemcpy2DAsync per span
    Kernel("copy_block", reference.copy_block, "row_copy"),  # whole pages staged: a few cuMemcpyAsync per block
    Kernel("reseat_slots", reference.reseat_slots, "slots"),
    Kernel("place_page", reference.place_page, "slots"),
    # The decode schedule's scalars (reference_schedule.py): the step's plan, once per step, and each layer's
    # re-rank flag and anchor.
    Kernel("plan_step", reference_schedule.plan_step, "schedule"),
    Kernel("begin_layer", reference_schedule.begin_layer, "schedule"),
)
TABLE = {k.name: k for k in KERNELS}


@functools.cache
def cuda_twin(name: str) -> Callable[..., Any]:
    """Kernel ``name``'s CUDA implementation (the first call imports its module: Triton, cuda-python)."""
    return getattr(importlib.import_module(f".{TABLE[name].cuda}", __package__), name)


def _by_name(ops):
    return ops_named, (ops.name,)  # a copied or unpickled cache uses this process's kernels


KernelOps = dataclasses.make_dataclass(
    "KernelOps", [("name", str)] + [(k.name, Callable[..., Any]) for k in KERNELS], frozen=True,
    namespace={"__module__": __name__, "__reduce__": _by_name,
               "__doc__": "A backend: the kernels of :data:`KERNELS` by name, with the reference's signatures."})


def _backend(name: str, implementation: Callable[[Kernel], Callable[..., Any]]) -> KernelOps:
    return KernelOps(name, **{k.name: implementation(k) for k in KERNELS})


REFERENCE_OPS = _backend(REFERENCE, lambda k: k.reference)
_backends = {REFERENCE: REFERENCE_OPS}
_building = threading.Lock()  # held while the Triton backend is made or warmed (a first use waits on it)
_ahead_lock = threading.Lock()  # guards _ahead (never held while building: asking for a build never waits)
_ahead: dict[str, threading.Thread] = {}  # Triton's setup being made ahead of its first use, by stage (build_ahead)
_warmed: set[str] = set()  # the stages of the per-process setup made: "load", "driver" (with the copy kernel)


def ops_named(name: str) -> KernelOps:
    """The backend called ``name``: ``"reference"``, or ``"triton"`` (Triton / cuda-python, built on first use)."""
    ops = _backends.get(name)
    if ops is None or (name == TRITON and len(_warmed) < len(_ahead)):  # made, or a stage of it still being made
        if name != TRITON:
            raise ValueError(f"no kernel backend named {name!r}")
        ops = _make_triton(())  # waits for a stage being made ahead (Triton's driver is not made twice at once)
    return ops


def _make_triton(stages: tuple[str, ...]) -> KernelOps:
    """The Triton backend, made once under the build lock (a first use meanwhile waits here, not on a second build
    of the same things), with the ``stages`` of Triton's per-process setup not yet made (:data:`_STAGES`; what
    fails there is left to Triton's own first use)."""
    with _building:
        ops = _backends.get(TRITON) or _backend(TRITON, lambda k: cuda_twin(k.name))
        for stage in stages:
            if stage not in _warmed:
                try:
                    _STAGES[stage]()
                except Exception:  # noqa: BLE001 - e.g. no device: Triton's own first use reports it
                    pass
                _warmed.add(stage)
        _backends[TRITON] = ops
        return ops


def build_ahead(name: str = TRITON, *, driver: bool = True) -> threading.Thread | None:
    """Build backend ``name`` on a daemon thread, once per process, ahead of its first use: Triton and cuda-python
    imported, the kernels' modules loaded and Triton's process-wide cache key made (a hash of its ~500 MB library,
    which its first compile or cache lookup computes); with ``driver`` also Triton's driver, the one step that
    initialises CUDA in the process, and the tier-copy kernel for the current device.  So a first cache's prefill
    does not make them, nor wait for them.

    The package starts the CUDA-free part when it is imported on a machine with an NVIDIA driver
    (:func:`cuda_host`), while the user loads a model; a cache made on CUDA starts the rest.  Returns the thread,
    or ``None`` when that much is made or being made (or ``name`` is not a backend built on first use).  What fails
    here is left to the first use, which builds the backend again and raises (a first use meanwhile waits for this
    build)."""
    stages = ("load", "driver") if driver else ("load",)
    with _ahead_lock:
        if name != TRITON or all(s in _warmed or s in _ahead for s in stages):
            return None
        todo = tuple(s for s in stages if s not in _ahead)
        thread = threading.Thread(target=_build_quietly, args=(todo,), daemon=True, name=f"flexicache-build-{todo[-1]}")
        _ahead.update(dict.fromkeys(todo, thread))
    thread.start()
    return thread


def _build_quietly(stages: tuple[str, ...]) -> None:
    try:
        _make_triton(stages)
    except Exception:  # noqa: BLE001 - the first use reports it
        pass


def _load() -> None:
    """What needs no device: Triton's cache key (a hash of its library, kept by ``functools.cache``) and
    ``cuda.core`` imported for the tier copies (with the kernels' modules, 0.6 s of a first cache's prefill on an
    H100 host when made beside it, run 33j)."""
    try:
        from triton.runtime.cache import triton_key
    except ImportError:  # older Triton
        from triton.compiler.compiler import triton_key
    triton_key()
    try:  # Triton 3.6 imports its gluon package at a kernel's first launch (0.15 s of a first prefill, run 39)
        importlib.import_module("triton.experimental.gluon")
    except ImportError:
        pass
    try:
        cuda_core()
    except ImportError:  # no cuda-python: the copies fall back to torch indexing
        pass


def _triton_driver() -> None:
    """Triton's driver: a utilities module compiled from C on a cold disk cache (1.5 s of the H200's first prefill
    in run 25); asking whether it is active initialises CUDA."""
    from triton.runtime.driver import driver
    driver.active  # noqa: B018 - made on first access


def _copy_kernel() -> None:
    """The tier-copy kernel for the current device: NVRTC-built by a machine's first process, loaded from
    ``cuda.core``'s program cache by later ones; else made at a first cache's first offload, inside its prefill."""
    from .uva_copy import prepare_copies

    prepare_copies(torch.cuda.current_device())


def _cuda_setup() -> None:
    """The stage that needs the device: Triton's driver, then the tier-copy kernel (each failure left to its use)."""
    for step in (_triton_driver, _copy_kernel):
        try:
            step()
        except Exception:  # noqa: BLE001 - e.g. no device, no NVRTC: the first use reports it
            pass


_STAGES = {"load": _load, "driver": _cuda_setup}


def cuda_host() -> bool:
    """Whether this machine has an NVIDIA driver and this process may use a GPU, asked without initialising CUDA
    (so children forked later can still use it): torch built with CUDA, the driver's control device present,
    ``CUDA_VISIBLE_DEVICES`` not empty, Triton installed."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return (torch.version.cuda is not None and os.path.exists("/dev/nvidiactl") and visible not in ("", "-1")
            and importlib.util.find_spec("triton") is not None)


def _before_fork() -> None:
    """A fork waits (30 s at most) for the builds in flight on other threads: a child then never inherits the
    module locks of an import half done (the package starts one on import, on a machine with a GPU)."""
    for thread in list(_ahead.values()):
        if thread.is_alive() and thread is not threading.current_thread():
            thread.join(timeout=30)


def _after_fork_in_child() -> None:
    """A forked child has none of its parent's other threads: a build one of them held the lock for never ends."""
    global _building, _ahead_lock
    _building, _ahead_lock = threading.Lock(), threading.Lock()
    _ahead.clear()


os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)


def ops_for(device: torch.device, *, prefer: str | None = None) -> KernelOps:
    """Kernels for tensors on ``device``: Triton / cuda-python on CUDA, the PyTorch reference elsewhere.

    ``prefer="reference"`` forces the reference (used by tests and to compare backends).
    """
    if prefer == REFERENCE or torch.device(device).type != "cuda":
        return REFERENCE_OPS
    return ops_named(TRITON)
