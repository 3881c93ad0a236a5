"""The kernel table: one row per kernel gives both backends their fields."""

import os
import pickle
import subprocess
import sys

import pytest
import torch

from flexicache_hf.kernels import KERNELS, REFERENCE_OPS, KernelOps, ops_for, ops_named, reference
def test_each_row_is_a_field_of_every_backend():
    names = [k.name for k in KERNELS]
    assert names == ["minmax_update", "append_token", "page_scores", "page_lse", "group_mass", "select_pages",
                     "sparse_decode", "copy_pages", "copy_kv_pages", "load_pages_behind", "join_loads", "copy_rows",
                     "copy_block", "reseat_slots", "place_page", "plan_step", "begin_layer"]
    assert [f.name for f in KernelOps.__dataclass_fields__.values()] == ["name", *names]
    for k in KERNELS:  # the reference backend's fields are the references themselves: no wrapper on the eager path
        assert getattr(REFERENCE_OPS, k.name) is k.reference


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


def test_group_mass_masks_pages_past_the_count_and_inactive_rows():
    """The exact ranking's combine (``KernelOps.group_mass``) with or without the optional page count and active
    rows: the reference masks pages past the count and inactive rows to -inf, and leaves the rest as without them."""
    g = torch.Generator().manual_seed(1)
    s = torch.randn(2, 3, 4, 10, generator=g)
    s[0, 0, :, 2] = float("-inf")
    n, active = torch.tensor([7]), torch.tensor([True, False, True])
    full, part = REFERENCE_OPS.group_mass(s, 0.5), REFERENCE_OPS.group_mass(s, 0.5, n, active)
    assert bool(torch.isneginf(part[..., 7:]).all()) and bool(torch.isneginf(part[:, 1]).all())
    assert torch.isneginf(full[0, 0, 2]) and torch.allclose(full.clamp_min(0).sum(-1), torch.tensor(4.0))
    short = reference.group_mass(s[..., :7], 0.5)
    torch.testing.assert_close(part[:, [0, 2], :7], short[:, [0, 2]], rtol=1e-6, atol=0)  # as a slice would
