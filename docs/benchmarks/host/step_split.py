"""Where a compiled decode step's wall time goes on the host, without a profiler (CUDA; a probe, not a product path).

Run 31c (H200, 16 x 16k): the README call's step is 20.0 ms with 13.0 ms of device work, StaticCache's 19.2 with 16.0;
under the profiler the README call's host spends 8.1 ms from the token to its ``cudaGraphLaunch`` (StaticCache 3.2)
and the launch call 2.9 ms (1.1). The profiler inflates both. This probe stamps, per step, with ``perf_counter``
only: the step clock's stamp (after its synchronize, as generate's own stopping check waits), entering and leaving
the compiled forward ``generate`` calls, and entering and leaving every ``CUDAGraph.replay`` inside it. Segments:
``gen`` (stamp to the compiled call: generate's Python), ``pre`` (the call to its replay: Dynamo's guards, AOT and
cudagraph trees' wrappers, the input copy), ``launch`` (the replay call), ``post`` (the replay's return to the
call's), ``wait`` (the call's return to the next stamp: logits processing and waiting for the device).
Each row also reports the live threads during its steps.  ``--affinity gpu-node`` first restricts the process (and
so every thread it starts, the page-locking threads included) to the CPUs of the GPU's NUMA node, so first-touch
places the host tier's pages there: a probe of whether the node a pinned page lives on moves the step.  ``--numa
off`` takes back the library's own placement (``PinSettings.numa``: pages prefer the GPU's node), so first touch
decides, as before it.

    python docs/benchmarks/host/step_split.py --case 16x16384 --rows flexicache-unsized,static-sdpa_grouped
"""
import argparse
import json
import statistics
import threading
import time

import torch


class Stamps:
    def __init__(self):
        self.calls, self.replays = [], []
        self.threads = set()

    def wrap_call(self, f):
        def timed(*a, **k):
            t0 = time.perf_counter()
            out = f(*a, **k)
            self.calls.append((t0, time.perf_counter()))
            self.threads.update(t.name for t in threading.enumerate())
            return out
        return timed


def split(clock_stamps, calls, replays):
    """Per step (a compiled call between two stamps with one replay inside): the five segments, in ms."""
    rows = []
    for c_in, c_out in calls:
        before = [s for s in clock_stamps if s <= c_in]
        after = [s for s in clock_stamps if s >= c_out]
        inside = [r for r in replays if c_in <= r[0] and r[1] <= c_out]
        if not before or not after or len(inside) != 1:
            continue
        r_in, r_out = inside[0]
        rows.append(dict(gen=c_in - before[-1], pre=r_in - c_in, launch=r_out - r_in, post=c_out - r_out,
                         wait=after[0] - c_out, step=after[0] - before[-1]))
    return {k: round(1e3 * statistics.median(r[k] for r in rows), 3) for k in rows[0]} | {"steps": len(rows)}


def bind_to_gpu_node() -> tuple:
    import os

    from flexicache_hf.host_memory import device_numa_node

    node = device_numa_node(0)  # (before --numa off stands it in)
    if node is None:
        return node, "one NUMA node, or none known"
    spans = open(f"/sys/devices/system/node/node{node}/cpulist").read().strip().split(",")
    cpus = {c for span in spans for c in range(int(span.split("-")[0]), int(span.split("-")[-1]) + 1)}
    os.sched_setaffinity(0, cpus)
    return node, len(cpus)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", default="16x16384")
    ap.add_argument("--rows", default="flexicache-unsized,static-sdpa_grouped")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--json")
    ap.add_argument("--affinity", choices=("none", "gpu-node"), default="none")
    ap.add_argument("--numa", choices=("on", "off"), default="on")
    args = ap.parse_args()
    from flexicache_hf import host_memory

    print("GPU's node", host_memory.device_numa_node(0), "numa", args.numa, flush=True)
    if args.affinity == "gpu-node":
        print("bound to", bind_to_gpu_node(), flush=True)
    if args.numa == "off":
        host_memory.device_numa_node = lambda device: None

    from flexicache_hf.bench.generate.clock import StepClock
    from flexicache_hf.bench.generate.device import release
    from flexicache_hf.bench.generate.run import generate_once
    from flexicache_hf.bench.host_probe import load_case

    model, profile, ids, gen = load_case(args.case, args.new_tokens)

    stamps = Stamps()
    orig_get = model.get_compiled_call
    model.get_compiled_call = lambda cfg: stamps.wrap_call(orig_get(cfg))
    orig_replay = torch.cuda.CUDAGraph.replay

    def replay(self):
        t0 = time.perf_counter()
        orig_replay(self)
        stamps.replays.append((t0, time.perf_counter()))
    torch.cuda.CUDAGraph.replay = replay

    out = {}
    for row in args.rows.split(","):
        generate_once(model, ids, row, gen, 16, profile=profile, stop_after=16)  # warm-up (compile)
        for rep in range(2):
            stamps.calls.clear(), stamps.replays.clear(), stamps.threads.clear()
            clock = StepClock()
            res, _, _ = generate_once(model, ids, row, gen, args.new_tokens, profile=profile, clock=clock)
            seg = split(clock.stamps, stamps.calls, stamps.replays)
            seg.update(median_step_ms=round(res["median_step_ms"], 3), threads=sorted(stamps.threads))
            out[f"{row}#{rep}"] = seg
            print(row, rep, json.dumps(seg), flush=True)
        release(model, compiled=True)
    if args.json:
        json.dump(out, open(args.json, "w"), indent=1)


if __name__ == "__main__":
    main()
