"""The kernel table: every kernel registered once, with its reference, its CUDA twin and its custom op.

A row (:class:`Kernel`) names

* the kernel's plain PyTorch reference (:mod:`.reference`: the CPU path, the test oracle, and the signature and
  contract every backend keeps);
* its CUDA twin: the attribute of the same name in a module of this package (a Triton kernel, or a cuda-python
  copy), imported on first use on CUDA only, so the CPU path never needs Triton or cuda-python;
* for a kernel of the decode step, the schema of its ``torch.library`` custom op ``flexicache::<name>`` (the
  arguments it mutates marked ``(aN!)``) and its fake (the op's outputs from its inputs' shapes).

Why the ops: Dynamo cannot trace into a Triton launcher's host code (block-size choices, cached SM counts), a
cuda-python launch or the reference's data-dependent shapes, and must not: the decode step it captures in a CUDA
graph has to replay the launches exactly.  Each decode-step kernel is therefore one opaque op with its fake and
its mutated arguments declared; the op runs the CUDA twin on CUDA tensors and the reference on others (which
lets CPU tests compile a decode step too).  The host tier reaches the ops as a CUDA tensor aliasing its pinned
memory (:meth:`~flexicache_hf.tiers.HostTier.device_pages`): cudagraph trees only replay buffers that live on
the device, and the alias is one, at a fixed address.  The prompt-side kernels (MinMax over a chunk, row copies)
and the one-pool page copy (benchmarks; the cache copies K and V together) are never traced and have no op.

A backend is a :class:`KernelOps`, one field per row: eagerly a field calls its backend's kernel directly (an
op's dispatch costs more than some of these kernels); while torch.compile traces, a decode-step kernel's field
calls the op.  :func:`ops_for` is the one place that picks a backend.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import inspect
import os
import threading
from typing import Any, Callable

import torch
from torch.library import custom_op

from ..cuda_context import cuda_core
from . import reference, reference_schedule

REFERENCE, TRITON = "reference", "triton"  # the backends' names (KernelOps.name: pickles carry it)


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One row of the table (see the module docstring)."""

    name: str
    reference: Callable[..., Any]
    cuda: str  # the module of its CUDA twin (attribute ``name``)
    schema: str | None = None  # its op's arguments (the reference's names) and returns; None: eager only, no op
    fake: Callable[..., Any] | None = None  # its op's outputs from the inputs' shapes (None: the op returns nothing)
    prepare: Callable[[dict], None] | None = None  # a traced call's bound arguments made to fit the schema
    result: str | None = None  # the argument a traced call returns (where the reference returns it, the op nothing)


def _scores_like(query, kmin, kmax, heads, *_):
    return query.new_empty((query.shape[0], heads.shape[0], kmin.shape[2]), dtype=torch.float32)


def _lse_like(query, k_pool, page_table, heads, *_):
    group = query.shape[1] // page_table.shape[1]
    return query.new_empty((query.shape[0], heads.shape[0], group, page_table.shape[2]), dtype=torch.float32)


def _mass_like(scores, *_):
    return scores.new_empty((scores.shape[0], scores.shape[1], scores.shape[3]), dtype=torch.float32)


def _attention_like(query, *_):
    return torch.empty_like(query)


def _promoted_like(slot_page, wanted, *_):
    return wanted.new_empty(wanted.shape), wanted.new_empty(wanted.shape)  # contiguous, as the kernels return them


def _default_scale(args: dict) -> None:
    """The op takes a float: ``scale=None`` becomes the reference's default, ``D ** -0.5``."""
    if args["scale"] is None:
        args["scale"] = args["query"].shape[-1] ** -0.5


KERNELS = (
    Kernel("minmax_update", reference.minmax_update, "minmax"),  # a prompt chunk's keys
    Kernel("append_token", reference.append_token, "append",
           "(Tensor(a0!) k_pool, Tensor(a1!) v_pool, Tensor(a2!) kmin, Tensor(a3!) kmax, Tensor key, Tensor value, "
           "Tensor rows, Tensor page) -> ()"),
    Kernel("page_scores", reference.page_scores, "scores",
           "(Tensor query, Tensor kmin, Tensor kmax, Tensor heads, Tensor num_pages, Tensor active, str combine, "
           "float scale, float shrink) -> Tensor", _scores_like, prepare=_default_scale),
    Kernel("page_lse", reference.page_lse, "page_lse",
           "(Tensor query, Tensor k_pool, Tensor page_table, Tensor heads, Tensor num_pages, Tensor valid_lo, "
           "Tensor seq_len, float scale, Tensor? candidates=None) -> Tensor", _lse_like),
    # The "mass" combine of a group's per-query-head scores (page_scores' bounds, page_lse's exact log-sum-exps):
    # one launch where the reference is ~8 ops over [B, h, G, P], and nothing read on inactive rows.
    Kernel("group_mass", reference.group_mass, "mass",
           "(Tensor scores, float scale, Tensor? num_pages, Tensor? active) -> Tensor", _mass_like),
    # A Triton radix select rather than torch.topk + sort + padding (the reference): the earlier in-register select
    # beat it at every benchmark shape on the H200, 7-24 us vs 38-94 us for 8-512 rows of 625-1875 pages
    # (docs/benchmarks/decode.md, rerank.json).  The select walks only each row's live pages, rows of any width.
    Kernel("select_pages", reference.select_pages, "select",
           "(Tensor(a0!) scores, SymInt k, Tensor num_pages, Tensor active, Tensor(a4!) out, Tensor? heads=None, "
           "float keep_margin=0.0, Tensor? keep=None) -> ()", result="out"),
    Kernel("sparse_decode", reference.sparse_decode, "sparse_decode",
           "(Tensor query, Tensor k_pool, Tensor v_pool, Tensor page_table, Tensor pages, Tensor valid_lo, "
           "Tensor seq_len, float scale) -> Tensor", _attention_like),
    # Tier copies: the NVRTC kernel of .uva_copy (pinned host memory in place through UVA), which falls back to
    # torch indexing where cuda-python is missing or a tensor has no device address (pageable host memory).
    Kernel("copy_pages", reference.copy_pages, "uva_copy"),
    Kernel("copy_kv_pages", reference.copy_kv_pages, "uva_copy",  # both pools of a layer in one launch
           "(Tensor(a0!) dst_k, Tensor(a1!) dst_v, Tensor dst_index, Tensor src_k, Tensor src_v, "
           "Tensor src_index) -> ()"),
    # The same copies behind the compute (FlexiCacheConfig.overlap_loads): on the device's load stream, joined at
    # the end of the forward; ``token`` (the schedule's) orders the loads and their join in a traced step.  The pools
    # it writes are not declared mutated: declared, a compiled step may hand the op a copy of a pool and copy it back
    # right after the op returns, while the load stream still writes the copy (inductor's code did so).  Nothing
    # later in the step reads the layer's pools (the next step reads them after the join); the op takes the layer's
    # attention output (``after``, not read) so that it follows the attention that read the slots it overwrites.
    # Its index lists alone do not order it: inductor may run the reseat that makes them before the attention (on a
    # copy of the page table), and then did run the load before it too (NOTES, 2026-12-05).
    Kernel("load_pages_behind", reference.load_pages_behind, "behind",
           "(Tensor dst_k, Tensor dst_v, Tensor dst_index, Tensor src_k, Tensor src_v, Tensor src_index, "
           "Tensor(a6!) token, Tensor after) -> ()"),
    Kernel("join_loads", reference.join_loads, "behind", "(Tensor(a0!) token) -> ()"),
    Kernel("copy_rows", reference.copy_rows, "row_copy"),  # a prompt's offload: a few cuMemcpy2DAsync per span
    Kernel("copy_block", reference.copy_block, "row_copy"),  # whole pages staged: a few cuMemcpyAsync per block
    Kernel("reseat_slots", reference.reseat_slots, "slots",
           "(Tensor(a0!) slot_page, Tensor wanted, Tensor slot_phys, Tensor(a3!) table_buffer, Tensor slot_heads, "
           "SymInt num_heads, SymInt null_page, Tensor? when) -> (Tensor, Tensor)", _promoted_like),
    Kernel("place_page", reference.place_page, "slots",
           "(Tensor(a0!) slot_page, Tensor slot_phys, Tensor(a2!) table_buffer, Tensor slot_heads, "
           "SymInt num_heads, Tensor page, Tensor(a6!) tail, Tensor? when) -> ()"),
    # The decode schedule's scalars (reference_schedule.py says why these are ops): the step's plan, once per step,
    # and each layer's re-rank flag and anchor.
    Kernel("plan_step", reference_schedule.plan_step, "schedule",
           "(Tensor(a0!) length, Tensor(a1!) step, Tensor(a2!) current, Tensor(a3!) pos, Tensor(a4!) page, "
           "Tensor(a5!) offset, Tensor(a6!) num_pages, Tensor(a7!) new_page, Tensor(a8!) page_full, "
           "Tensor(a9!) overflow, Tensor origin, int page_size, int capacity) -> ()"),
    Kernel("begin_layer", reference_schedule.begin_layer, "schedule",
           "(Tensor(a0!) due, Tensor(a1!) anchor, Tensor(a2!) late, Tensor(a3!) since, Tensor current, "
           "Tensor phase, Tensor rerank_all, Tensor page, int interval, bool overlap) -> ()"),
)
TABLE = {k.name: k for k in KERNELS}


@functools.cache
def cuda_twin(name: str) -> Callable[..., Any]:
    """Kernel ``name``'s CUDA implementation (the first call imports its module: Triton, cuda-python)."""
    return getattr(importlib.import_module(f".{TABLE[name].cuda}", __package__), name)


def _positional(implementation: Callable[[], Callable[..., Any]], n: int, keywords: tuple[str, ...],
                returns: bool) -> Callable[..., Any]:
    """``implementation()`` called the way an op calls its kernel: every argument positional, in schema order (the
    reference's first ``n`` parameters are positional, the rest ``keywords``)."""

    def run(*args):
        out = implementation()(*args[:n], **dict(zip(keywords, args[n:])))
        return out if returns else None

    return run


def _no_output(*_):
    return None


class _Op:
    """A decode-step kernel's custom op, and how a :class:`KernelOps` call reaches it while torch.compile traces."""

    def __init__(self, kernel: Kernel):
        qualname = f"flexicache::{kernel.name}"
        schema = torch._C.parse_schema(qualname + kernel.schema)
        params = list(inspect.signature(kernel.reference).parameters.values())
        self.names = tuple(a.name for a in schema.arguments)
        if self.names != tuple(p.name for p in params):
            raise TypeError(f"{qualname}: the schema's arguments {self.names} are not its reference's parameters")
        self.params = tuple((p.name, p.default) for p in params)
        self.floats = tuple(a.name for a in schema.arguments if str(a.type) == "float")
        self.prepare, self.result = kernel.prepare, kernel.result
        n = sum(p.kind is not p.KEYWORD_ONLY for p in params)
        call = functools.partial(_positional, n=n, keywords=self.names[n:], returns=bool(schema.returns))
        mutated = tuple(a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write)
        # The reference on every device; CUDA tensors (the dispatcher's pick when any argument is one) take the twin.
        self.op = custom_op(qualname, call(lambda: kernel.reference), mutates_args=mutated, schema=kernel.schema)
        self.op.register_kernel("cuda")(call(lambda: cuda_twin(kernel.name)))
        self.op.register_fake(kernel.fake or _no_output)

    def trace(self, args: tuple, kwargs: dict):
        """A call with the reference's signature, as traced: its arguments bound as the reference binds them
        (defaults included) and fitted to the schema, through the op."""
        bound = dict(zip(self.names, args))
        for name, default in self.params[len(args):]:
            bound[name] = kwargs.get(name, default)
        if self.prepare is not None:
            self.prepare(bound)
        for name in self.floats:
            bound[name] = float(bound[name])
        out = self.op(*bound.values())  # in schema order: the reference's
        return out if self.result is None else bound[self.result]


OPS = {k.name: _Op(k) for k in KERNELS if k.schema is not None}


def _entry(kernel: Kernel, impl: Callable[..., Any]) -> Callable[..., Any]:
    """``impl`` (a kernel with the reference's signature) as a backend's field: called directly, or, for a kernel
    with an op, the op while torch.compile traces (``.eager`` is ``impl``)."""
    if kernel.schema is None:
        return impl
    name = kernel.name

    def call(*args, **kwargs):
        if torch.compiler.is_compiling():
            return OPS[name].trace(args, kwargs)
        return impl(*args, **kwargs)

    call.__name__, call.__qualname__, call.__doc__ = name, name, impl.__doc__
    call.__signature__, call.eager = inspect.signature(impl), impl
    return call


def _by_name(ops):
    return ops_named, (ops.name,)  # a copied or unpickled cache uses this process's kernels


KernelOps = dataclasses.make_dataclass(
    "KernelOps", [("name", str)] + [(k.name, Callable[..., Any]) for k in KERNELS], frozen=True,
    namespace={"__module__": __name__, "__reduce__": _by_name,
               "__doc__": "A backend: the kernels of :data:`KERNELS` by name, with the reference's signatures."})


def _backend(name: str, implementation: Callable[[Kernel], Callable[..., Any]]) -> KernelOps:
    return KernelOps(name, **{k.name: _entry(k, implementation(k)) for k in KERNELS})


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
