"""The kernel table: one row per kernel gives both backends their fields and the decode step its custom ops."""

import os
import pickle
import subprocess
import sys

import pytest
import torch

from flexicache_hf.kernels import KERNELS, REFERENCE_OPS, KernelOps, ops_for, ops_named, reference
from flexicache_hf.kernels.table import OPS

# The ops' schemas are what a compiled decode step is traced against: they change only on purpose.
SCHEMAS = {
    "append_token": "(Tensor(a0!) k_pool, Tensor(a1!) v_pool, Tensor(a2!) kmin, Tensor(a3!) kmax, Tensor key, "
                    "Tensor value, Tensor rows, Tensor page) -> ()",
    "page_scores": "(Tensor query, Tensor kmin, Tensor kmax, Tensor heads, Tensor num_pages, Tensor active, "
                   "str combine, float scale, float shrink) -> Tensor",
    "page_lse": "(Tensor query, Tensor k_pool, Tensor page_table, Tensor heads, Tensor num_pages, Tensor valid_lo, "
                "Tensor seq_len, float scale, Tensor? candidates=None) -> Tensor",
    "group_mass": "(Tensor scores, float scale, Tensor? num_pages, Tensor? active) -> Tensor",
    "select_pages": "(Tensor(a0!) scores, SymInt k, Tensor num_pages, Tensor active, Tensor(a4!) out, "
                    "Tensor? heads=None, float keep_margin=0., Tensor? keep=None) -> ()",
    "sparse_decode": "(Tensor query, Tensor k_pool, Tensor v_pool, Tensor page_table, Tensor pages, "
                     "Tensor valid_lo, Tensor seq_len, float scale) -> Tensor",
    "copy_kv_pages": "(Tensor(a0!) dst_k, Tensor(a1!) dst_v, Tensor dst_index, Tensor src_k, Tensor src_v, "
                     "Tensor src_index) -> ()",
    "load_pages_behind": "(Tensor dst_k, Tensor dst_v, Tensor dst_index, Tensor src_k, Tensor src_v, "
                         "Tensor src_index, Tensor(a6!) token, Tensor after) -> ()",
    "join_loads": "(Tensor(a0!) token) -> ()",
    "reseat_slots": "(Tensor(a0!) slot_page, Tensor wanted, Tensor slot_phys, Tensor(a3!) table_buffer, "
                    "Tensor slot_heads, SymInt num_heads, SymInt null_page, Tensor? when) -> (Tensor, Tensor)",
    "place_page": "(Tensor(a0!) slot_page, Tensor slot_phys, Tensor(a2!) table_buffer, Tensor slot_heads, "
                  "SymInt num_heads, Tensor page, Tensor(a6!) tail, Tensor? when) -> ()",
    "plan_step": "(Tensor(a0!) length, Tensor(a1!) step, Tensor(a2!) current, Tensor(a3!) pos, Tensor(a4!) page, "
                 "Tensor(a5!) offset, Tensor(a6!) num_pages, Tensor(a7!) new_page, Tensor(a8!) page_full, "
                 "Tensor(a9!) overflow, Tensor origin, int page_size, int capacity) -> ()",
    "begin_layer": "(Tensor(a0!) due, Tensor(a1!) anchor, Tensor(a2!) late, Tensor(a3!) since, Tensor current, "
                   "Tensor phase, Tensor rerank_all, Tensor page, int interval, bool overlap) -> ()",
}


def test_each_row_is_a_field_of_every_backend_and_its_op_keeps_its_schema():
    names = [k.name for k in KERNELS]
    assert names == ["minmax_update", "append_token", "page_scores", "page_lse", "group_mass", "select_pages",
                     "sparse_decode", "copy_pages", "copy_kv_pages", "load_pages_behind", "join_loads", "copy_rows",
                     "copy_block", "reseat_slots", "place_page", "plan_step", "begin_layer"]
    assert [f.name for f in KernelOps.__dataclass_fields__.values()] == ["name", *names]
    assert set(OPS) == set(SCHEMAS)
    for name, schema in SCHEMAS.items():
        op = getattr(torch.ops.flexicache, name).default
        assert str(op._schema) == f"flexicache::{name}{schema}"
        assert torch.Tag.pt2_compliant_tag in op.tags
        assert torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CUDA")  # the CUDA twin, found lazily
    for k in KERNELS:
        entry = getattr(REFERENCE_OPS, k.name)
        if k.name in SCHEMAS:  # direct eagerly, the op while torch.compile traces
            assert entry.eager is k.reference and entry.__doc__ == k.reference.__doc__
        else:  # prompt-side: the kernel itself
            assert entry is k.reference is getattr(reference, k.name)


def test_backends_are_picked_by_device_and_pickled_by_name():
    assert ops_for(torch.device("cpu")) is REFERENCE_OPS and ops_named("reference") is REFERENCE_OPS
    assert ops_for(torch.device("cuda"), prefer="reference") is REFERENCE_OPS
    assert pickle.loads(pickle.dumps(REFERENCE_OPS)) is REFERENCE_OPS
    with pytest.raises(ValueError, match="no kernel backend named 'cuda'"):
        ops_named("cuda")


def test_the_cpu_path_imports_no_cuda_twin():
    code = ("import sys, flexicache_hf, flexicache_hf.kernels as k; k.ops_for('cpu'); "
            "print(sorted(m for m in sys.modules if m.startswith('flexicache_hf.kernels.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert eval(out) == ["flexicache_hf.kernels.reference", "flexicache_hf.kernels.reference_copies",
                         "flexicache_hf.kernels.reference_schedule", "flexicache_hf.kernels.table"]


def in_fresh_python(code: str, **env: str | None) -> None:
    """Run ``code`` in a fresh interpreter (the kernel table is per process) with ``env`` changed (``None``: unset;
    warnings off: a fork beside a thread warns) and check that it ends by printing ``ok``."""
    changed = {k: v for k, v in {**os.environ, **env}.items() if v is not None}
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, env=changed,
                         timeout=240)
    assert out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def test_the_cuda_backend_is_built_ahead_once_and_a_forked_child_can_build_it():
    """``build_ahead``: the CUDA twins' backend (and Triton's cache key) made on one daemon thread per process, which
    a later use finds made; a second call starts nothing; a child forked while a build held the lock builds on its
    own.  A cache made where CUDA is absent (CI) starts no build.  In a fresh interpreter: the table is per process."""
    code = """
import os, sys, threading, torch
from flexicache_hf import FlexiCache
from flexicache_hf.kernels import table
FlexiCache("SmolLM2-135M-Instruct")  # no CUDA here: nothing built ahead
assert not torch.cuda.is_available() and table.TRITON not in table._backends and not table._ahead
t = table.build_ahead()
assert t is not None and t.daemon and table.build_ahead() is None  # one build per process
t.join(60)
assert table.TRITON in table._backends and table.ops_named(table.TRITON) is table._backends[table.TRITON]
from triton.runtime.cache import triton_key
assert triton_key.cache_info().hits + triton_key.cache_info().currsize >= 1  # made on the thread
assert table.build_ahead() is None
table._building.acquire()  # a build holding the lock when the process forks
pid = os.fork()
if pid == 0:
    ok = table._building.acquire(timeout=5) and not table._ahead
    os._exit(0 if ok else 1)
_, status = os.waitpid(pid, 0)
table._building.release()
assert os.waitstatus_to_exitcode(status) == 0
print("ok")
"""
    in_fresh_python(code, CUDA_VISIBLE_DEVICES="")


def test_importing_on_a_cuda_host_loads_the_kernels_ahead_and_a_cache_adds_only_the_driver():
    """On a machine with an NVIDIA driver (faked here: torch's CUDA build and the driver's control device), importing
    the package loads the kernels' modules, Triton's key and cuda.core on a daemon thread without initialising CUDA;
    a cache's ``build_ahead`` then starts only the driver's stage, which a first use waits for, and nothing twice
    (run 33j: made beside a first prefill, the loading cost it 0.6 s)."""
    code = """
import os, torch
torch.version.cuda = "13.0"
exists = os.path.exists
os.path.exists = lambda p: p == "/dev/nvidiactl" or exists(p)
import flexicache_hf
from flexicache_hf.kernels import table
os.path.exists = exists
load = table._ahead["load"]
assert load.daemon and table.build_ahead(driver=False) is None  # being made: nothing started twice
load.join(120)
assert table._warmed == {"load"} and table.TRITON in table._backends and not torch.cuda.is_initialized()
import sys
assert {'cuda.core', 'flexicache_hf.kernels.minmax', 'flexicache_hf.kernels.uva_copy'} <= set(sys.modules)
from triton.runtime.cache import triton_key
assert triton_key.cache_info().currsize == 1
driver = table.build_ahead()
assert driver is not None and driver.name == "flexicache-build-driver" and table.build_ahead() is None
assert table.ops_named(table.TRITON) is table._backends[table.TRITON]  # a first use waits for the driver's stage
assert table._warmed == {"load", "driver"} and table.build_ahead() is None
print("ok")
"""
    in_fresh_python(code, CUDA_VISIBLE_DEVICES=None)


def test_the_device_stage_prepares_the_copy_kernel_even_when_tritons_driver_fails(monkeypatch):
    """The stage a CUDA cache starts ahead (``build_ahead``'s "driver") also builds or loads the tier-copy kernel for
    the current device, so a first cache's first offload does not; a failing step (no device here, for Triton's
    driver) is left to its first use and does not stop the other."""
    from flexicache_hf.kernels import table, uva_copy

    asked = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(uva_copy, "prepare_copies", lambda index: asked.append(index) or True)
    monkeypatch.setattr(table, "_triton_driver", lambda: 1 / 0)
    table._STAGES["driver"]()
    assert asked == [3]
    monkeypatch.setattr(uva_copy, "prepare_copies", lambda index: 1 / 0)
    table._STAGES["driver"]()  # raises nothing: the copy's first use reports it


def test_a_fork_waits_for_a_build_in_flight():
    """A process forked while a build runs on its thread (the package starts one on import on a GPU machine) forks
    only once the build is done: the child inherits no half-done import."""
    code = """
import os, time
from flexicache_hf.kernels import table
table._STAGES["load"] = lambda: time.sleep(1.0)
t = table.build_ahead(driver=False)
time.sleep(0.1)
assert t.is_alive()
pid = os.fork()
if pid == 0:
    os._exit(0 if "load" in table._warmed and not table._ahead else 1)
_, status = os.waitpid(pid, 0)
assert os.waitstatus_to_exitcode(status) == 0 and not t.is_alive()
print("ok")
"""
    in_fresh_python(code, CUDA_VISIBLE_DEVICES="")  # a GPU machine's import would start the build itself


def test_traced_calls_bind_like_the_reference():
    """Keyword arguments, defaults (``scale=None``: D ** -0.5) and a returned ``out`` reach the ops as the reference
    takes them: a compiled function of the fields equals their eager calls."""
    g = torch.Generator().manual_seed(0)
    B, H, G, P, D, k = 2, 3, 2, 9, 8, 4
    q = torch.randn(B, H * G, D, generator=g)
    lo = torch.randn(B, H, P, D, generator=g)
    kmin, kmax = lo, lo + torch.rand(B, H, P, D, generator=g)
    heads, n = torch.tensor([2, 0]), torch.tensor([P - 2])
    active = torch.tensor([True, False])

    def step(ops, out):
        scores = ops.page_scores(q, kmin, kmax, heads, n, active, "mass")  # scale and shrink: the defaults
        picked = ops.select_pages(scores, k, num_pages=n, active=active, out=out)
        return scores, picked

    traced = []

    def backend(gm, example_inputs):  # aot_eager, noting the graph's calls
        traced.extend(str(node.target) for node in gm.graph.nodes if node.op == "call_function")
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

    want = step(REFERENCE_OPS, torch.full((B, 2, k), -7))
    torch._dynamo.reset()
    got = torch.compile(step, backend=backend, fullgraph=True)(REFERENCE_OPS, torch.full((B, 2, k), -7))
    assert traced == ["flexicache.page_scores.default", "flexicache.select_pages.default"]
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert bool((got[1][:, 1] == -7).all())  # the inactive head's row of `out` is left as it was


def test_group_mass_traces_as_its_op_with_or_without_count_and_rows():
    """The exact ranking's combine (``KernelOps.group_mass``) reaches its op while traced, the optional page count
    and active rows as ``Tensor?``; the reference masks pages past the count and inactive rows to -inf."""
    g = torch.Generator().manual_seed(1)
    s = torch.randn(2, 3, 4, 10, generator=g)
    s[0, 0, :, 2] = float("-inf")
    n, active = torch.tensor([7]), torch.tensor([True, False, True])

    def step(ops):
        return ops.group_mass(s, 0.5), ops.group_mass(s, 0.5, n, active)

    traced = []

    def backend(gm, example_inputs):
        traced.extend(str(node.target) for node in gm.graph.nodes if node.op == "call_function")
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

    want = step(REFERENCE_OPS)
    torch._dynamo.reset()
    got = torch.compile(step, backend=backend, fullgraph=True)(REFERENCE_OPS)
    assert traced == ["flexicache.group_mass.default"] * 2
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    full, part = want
    assert bool(torch.isneginf(part[..., 7:]).all()) and bool(torch.isneginf(part[:, 1]).all())
    assert torch.isneginf(full[0, 0, 2]) and torch.allclose(full.clamp_min(0).sum(-1), torch.tensor(4.0))
    short = reference.group_mass(s[..., :7], 0.5)
    torch.testing.assert_close(part[:, [0, 2], :7], short[:, [0, 2]], rtol=1e-6, atol=0)  # as a slice would
