"""Does a CUDA graph holding the tier-copy kernel (NVRTC, loaded by cuda.core) start later than one without it?

Run 31c (H200): the README call's graph (1,455 kernels) reached the device 2.84 ms after its ``cudaGraphLaunch``
began (the launch call itself: 2.90 ms), StaticCache's (710 kernels) after 0.08 ms (its call: 1.10 ms). This probe
captures graphs of N tiny kernels of one kind each and times, over replays of an idle GPU: the host's ``replay()``
call, and the call plus the device's run (``replay(); synchronize()``).  A graph whose device run starts early ends
near max(call, device run); one that waits for the whole launch, near their sum.  Kinds: Triton kernels (also
with 30 arguments), aten kernels, graphs of half as many nodes, the tier-copy kernel (its lists all "no page";
device or pinned host source), and a one-line NVRTC kernel launched as ``cuda.core`` launches the copy kernel (a
library kernel) or as a plain module function (``cuModuleLoadData``), which splits the loading path from the node
count.

    python docs/benchmarks/kernels/scripts/graph_launch.py [--nodes 1455] [--json FILE]
"""
import argparse
import json
import statistics
import time

import numpy as np
import torch
import triton
import triton.language as tl

from flexicache_hf.kernels.uva_copy import copy_pages


@triton.jit
def _bump(x_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    tl.store(x_ptr + i, tl.load(x_ptr + i, mask=m) + 1, mask=m)


@triton.jit
def _bump_wide(x_ptr, a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15, a16, a17, a18, a19,
               a20, a21, a22, a23, n, s0, s1, s2, s3, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    tl.store(x_ptr + i, tl.load(x_ptr + i, mask=m) + 1, mask=m)


def triton_node(x):
    _bump[(1,)](x, x.numel(), BLOCK=1024)


def triton_wide_node(x):
    """The same work with 30 arguments (24 pointers), as FlexiCache's attention kernels take: a node's parameter
    block, not its work, differs."""
    _bump_wide[(1,)](x, *([x] * 24), x.numel(), 3, 5, 7, 11, BLOCK=1024)


def aten_node(x):
    x.add_(1)


def make_copy_node(nodes_dev):
    pool = torch.zeros(64, 8, 128, dtype=torch.bfloat16, device="cuda")
    host = torch.zeros(64, 8, 128, dtype=torch.bfloat16).pin_memory()
    skip = torch.full((512,), -1, dtype=torch.long, device="cuda")
    src = torch.zeros(512, dtype=torch.long, device="cuda")

    def node(x):
        copy_pages(pool, skip, host if nodes_dev == "host" else pool, src)
    return node


_BUMP = r"""extern "C" __global__ void flexicache_probe_bump(float* x) { x[threadIdx.x] += 1.0f; }"""


def nvrtc_nodes():
    """The same one-line NVRTC kernel launched two ways: as ``cuda.core`` launches it (its ``Kernel``, from the
    library ``ObjectCode`` loads: what the tier-copy kernel does), and as a plain module function
    (``cuModuleLoadData`` + ``cuModuleGetFunction`` + ``cuLaunchKernel``)."""
    import ctypes

    from cuda.bindings import driver

    from flexicache_hf.cuda_context import cuda_core, make_current

    core = cuda_core()
    dev = core.Device(torch.cuda.current_device())
    dev.set_current()
    cc = dev.compute_capability
    obj = core.Program(_BUMP, code_type="c++", options=core.ProgramOptions(arch=f"sm_{cc.major}{cc.minor}")
                       ).compile("cubin")
    kern = obj.get_kernel("flexicache_probe_bump")
    err, module = driver.cuModuleLoadData(obj.code)
    assert err == driver.CUresult.CUDA_SUCCESS, err
    err, func = driver.cuModuleGetFunction(module, b"flexicache_probe_bump")
    assert err == driver.CUresult.CUDA_SUCCESS, err
    from flexicache_hf.kernels.uva_copy import _COPIER  # its cuda.core view of a torch stream, as copies take it

    def library_node(x):
        make_current(x.device.index)
        stream = _COPIER._stream(x.device.index, torch.cuda.current_stream().cuda_stream)
        core.launch(stream, core.LaunchConfig(grid=1, block=32), kern, np.uint64(x.data_ptr()))

    def module_node(x):
        make_current(x.device.index)
        stream = driver.CUstream(torch.cuda.current_stream().cuda_stream)
        (e,) = driver.cuLaunchKernel(func, 1, 1, 1, 32, 1, 1, 0, stream, ((x.data_ptr(),), (ctypes.c_void_p,)), 0)
        assert e == driver.CUresult.CUDA_SUCCESS, e
    return library_node, module_node


def probe(kinds, n, reps=40):
    """``kinds``: list of (node function, share of the n nodes)."""
    x = torch.zeros(1024, device="cuda")
    plan = []
    for fn, share in kinds:
        plan += [fn] * int(round(share * n))
    # interleave evenly
    order = sorted(range(len(plan)), key=lambda i: (i * 7919) % len(plan))
    plan = [plan[i] for i in order]
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        for fn, _ in kinds:  # every kind once outside the capture (builds, first-use setup)
            fn(x)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for fn in plan:
            fn(x)
    for _ in range(5):
        g.replay()
    torch.cuda.synchronize()
    call, total, dev = [], [], []
    for _ in range(reps):
        torch.cuda.synchronize()
        time.sleep(0.002)
        t0 = time.perf_counter()
        g.replay()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        call.append((t1 - t0) * 1e3)
        total.append((t2 - t0) * 1e3)
    # device run alone: two replays back to back, the second's time is the device's (the launch overlaps the first)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(reps // 4):
        g.replay()
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        dev.append(a.elapsed_time(b))
    med = statistics.median
    return {"nodes": len(plan), "call_ms": med(call), "call_plus_run_ms": med(total), "device_ms": med(dev),
            "start_delay_ms": med(total) - med(dev)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, default=1455)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    n, half = args.nodes, args.nodes // 2
    copy_dev, copy_host = make_copy_node("dev"), make_copy_node("host")
    rows = {  # (kinds, nodes): StaticCache's graph had 710 kernels in run 31c, the README call's 1,455
        "triton": ([(triton_node, 1.0)], n),
        "triton_half": ([(triton_node, 1.0)], half),
        "aten": ([(aten_node, 1.0)], n),
        "triton_wide": ([(triton_wide_node, 1.0)], n),
        "triton+copy_dev": ([(triton_node, 1 - 64 / n), (copy_dev, 64 / n)], n),
        "triton+copy_host": ([(triton_node, 1 - 64 / n), (copy_host, 64 / n)], n),
        "triton_half+copy_host": ([(triton_node, 1 - 64 / half), (copy_host, 64 / half)], half),
    }
    try:
        library_node, module_node = nvrtc_nodes()
        rows["triton+nvrtc_library"] = ([(triton_node, 1 - 64 / n), (library_node, 64 / n)], n)
        rows["triton+nvrtc_module"] = ([(triton_node, 1 - 64 / n), (module_node, 64 / n)], n)
    except Exception as e:  # noqa: BLE001 - the other rows still answer
        print("nvrtc rows skipped:", type(e).__name__, e)
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
    for name, (kinds, nodes) in rows.items():
        try:
            out[name] = probe(kinds, nodes)
        except Exception as e:  # noqa: BLE001 - one failing kind does not lose the others
            out[name] = {"error": f"{type(e).__name__}: {e}"}
        print(name, {k: round(v, 3) if isinstance(v, float) else v for k, v in out[name].items()}, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
