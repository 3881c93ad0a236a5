"""Page-locking throughput of host memory: torch's pinned allocator against the host tier's exact-size blocks (CUDA).

    python -m flexicache_hf.bench.pinning [--gb 8 30] [--threads 1 4 8 16] [--methods torch register keeper ...]
        [--chunk-mib 64] [--piece-mib 1024] [--blocks 64] [--pinners 2] [--hugepages system|on|off]
        [--copy-check] [--json FILE]

Each row page-locks ``--gb`` GB once, on fresh memory, and frees it before the next row (torch's cached blocks are
emptied).  Methods:

* ``torch``: ``torch.empty(n, pin_memory=True)``, what the host tier took before: ``cudaHostAlloc`` in one thread,
  the block rounded up to a power of two.
* ``torch-register``: the same with torch's ``pinned_use_cuda_host_register`` (pages touched by N threads, then one
  ``cudaHostRegister``); still rounded.
* ``lazy``: an exact mapping registered at once; ``cuMemHostRegister`` faults every page in (one thread).
* ``register``: the host tier's block (:class:`~flexicache_hf.host_memory.PinnedBlock`): populated by N threads
  (``MADV_POPULATE_WRITE``, ``--chunk-mib`` a task), then one ``cuMemHostRegister``.
* ``pieces``: populated by N threads, then registered in ``--piece-mib`` pieces by N threads at once (whether the
  driver registers in parallel).
* ``keeper``: the host tier's path in a forward: ``--blocks`` equal blocks (a model's K and V tiers) prefetched by a
  :class:`~flexicache_hf.block_keeper.BlockKeeper` (N populating threads, ``--pinners`` blocks at once) and acquired in
  order, as the layers take them; ``first_s`` is when the first block was ready.

Prints a table, then the rows and the machine as one JSON line (``JSON {...}``; ``--json`` writes it too).
``--copy-check`` adds the host-to-device and device-to-host GB/s of a 1 GiB copy from each row's memory (page-locked
memory copies at DMA speed; pageable memory would be several times slower).
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from ..block_keeper import BlockKeeper
from ..host_room import meminfo
from ..host_memory import PAGE, PinnedBlock, PinSettings, map_anonymous, populate, register, unmap, unregister
from . import emit_json
from .generate.device import empty_host_cache

METHODS = ("torch", "torch-register", "lazy", "register", "pieces", "keeper")
THREADED = {"torch-register", "register", "pieces", "keeper"}
GB = 10**9


def machine() -> dict:
    """What the numbers depend on: kernel, transparent huge pages, processors, memory, GPU and driver."""
    def read(path):
        """A small text file's content, or None."""
        try:
            return Path(path).read_text().strip()
        except OSError:
            return None

    mem = {k: v for k, v in meminfo().items() if k in ("MemTotal", "MemAvailable")}
    driver = None
    try:
        from cuda.bindings import driver as drv

        driver = drv.cuDriverGetVersion()[1]
    except Exception:  # noqa: BLE001 - informative only
        pass
    return {"kernel": platform.release(), "thp_enabled": read("/sys/kernel/mm/transparent_hugepage/enabled"),
            "thp_defrag": read("/sys/kernel/mm/transparent_hugepage/defrag"), "cpus": os.cpu_count(),
            "affinity": len(os.sched_getaffinity(0)), **{k.lower(): v for k, v in mem.items()},
            "gpu": torch.cuda.get_device_name(), "cuda_driver": driver, "torch": torch.__version__,
            "torch_cuda": torch.version.cuda}


def available_bytes() -> int:
    """MemAvailable (0 when unknown)."""
    return meminfo().get("MemAvailable", 0)


def copy_speed(host: torch.Tensor) -> dict:
    """GB/s of copying the first GiB of ``host`` (uint8) to the device and back (asynchronous copies, timed on the
    device)."""
    n = min(host.numel(), 1 << 30)
    src, dev = host[:n], torch.empty(n, dtype=torch.uint8, device="cuda")
    out = {}
    for name, (dst, s) in {"h2d_GBps": (dev, src), "d2h_GBps": (src, dev)}.items():
        dst.copy_(s, non_blocking=True)  # warm
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(s, non_blocking=True)
        end.record()
        end.synchronize()
        out[name] = round(n / (start.elapsed_time(end) / 1e3) / GB, 1)
    return out


def set_torch_register(threads: int | None) -> None:
    """Turn torch's ``pinned_use_cuda_host_register`` on with ``threads`` (a power of two), or off (``None``)."""
    setting = ("pinned_use_cuda_host_register:False" if threads is None else
               f"pinned_use_cuda_host_register:True,pinned_num_register_threads:{threads}")
    torch.cuda.memory._set_allocator_settings(setting)


def run_torch(n: int, threads: int | None, check: bool) -> dict:
    """``torch.empty(n, pin_memory=True)`` (torch's own register path with ``threads``), timed, then freed."""
    if threads is not None:
        set_torch_register(threads)
    try:
        t0 = time.perf_counter()
        t = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        row = {"s": time.perf_counter() - t0, "held_bytes": 1 << (n - 1).bit_length()}
        if check:
            row.update(copy_speed(t))
        del t
    finally:
        if threads is not None:
            set_torch_register(None)
        empty_host_cache()
    return row


def run_block(n: int, settings: PinSettings, check: bool) -> dict:
    """One :class:`PinnedBlock` (``settings.threads == 0``: registration faults the pages), timed, then freed."""
    pool = ThreadPoolExecutor(settings.threads) if settings.threads > 1 else None
    try:
        t0 = time.perf_counter()
        block = PinnedBlock(n, PAGE, torch.cuda.current_device(), settings, pool)
        row = {"s": time.perf_counter() - t0, "populate_s": block.populate_s, "register_s": block.register_s,
               "registrations": len(block.spans)}
        if check:
            row.update(copy_speed(block.lend(lambda b: None)))
        t1 = time.perf_counter()
        block.free()
        row["free_s"] = time.perf_counter() - t1
    finally:
        if pool is not None:
            pool.shutdown()
    return row


def run_pieces(n: int, threads: int, settings: PinSettings, piece: int) -> dict:
    """Populated by ``threads``, then registered in ``piece``-byte pieces from ``threads`` threads at once."""
    device = torch.cuda.current_device()
    pool = ThreadPoolExecutor(max(1, threads))
    t0 = time.perf_counter()
    addr = map_anonymous(n, settings.hugepages)
    spans = []
    try:
        populate(addr, n, settings.chunk_bytes, pool if threads > 1 else None)
        t1 = time.perf_counter()
        cuts = [(addr + off, min(piece, n - off)) for off in range(0, n, piece)]
        futures = [pool.submit(register, a, m, device) for a, m in cuts]
        for f in futures:  # every piece settles before any error is raised (the registered ones are undone)
            if f.exception() is None:
                spans += f.result()
        for f in futures:
            f.result()
        t2 = time.perf_counter()
    finally:
        unregister(spans, device)
        unmap(addr, n)
        pool.shutdown()
    return {"s": t2 - t0, "populate_s": t1 - t0, "register_s": t2 - t1, "registrations": len(spans)}


def run_keeper(n: int, settings: PinSettings, blocks: int) -> dict:
    """``blocks`` equal blocks prefetched by a fresh keeper and acquired in order (a forward's layers)."""
    size = max(PAGE, n // blocks // PAGE * PAGE)
    keeper = BlockKeeper(settings)
    device = torch.cuda.current_device()
    t0 = time.perf_counter()
    keeper.prefetch([(size, PAGE)] * blocks, device)
    held = [keeper.acquire(size, PAGE, device)]
    first = time.perf_counter() - t0
    held += [keeper.acquire(size, PAGE, device) for _ in range(blocks - 1)]
    row = {"s": time.perf_counter() - t0, "first_s": first, "blocks": blocks, "block_bytes": size}
    stats = keeper.stats()
    row.update(pin_s=stats["pin_s"], wait_s=stats["wait_s"], prefetched=stats["prefetched"])
    del held
    keeper.close()
    return row


def measure(method: str, n: int, threads: int, a) -> dict:
    """One row (errors are recorded, not raised)."""
    hp = {"system": None, "on": True, "off": False}[a.hugepages]
    settings = PinSettings(threads=threads, chunk_bytes=a.chunk_mib << 20, pinners=a.pinners, hugepages=hp)
    try:
        if method in ("torch", "torch-register"):
            row = run_torch(n, threads if method == "torch-register" else None, a.copy_check)
        elif method == "lazy":
            row = run_block(n, PinSettings(threads=0, hugepages=hp), a.copy_check)
        elif method == "register":
            row = run_block(n, settings, a.copy_check)
        elif method == "pieces":
            row = run_pieces(n, threads, settings, a.piece_mib << 20)
        else:
            row = run_keeper(n, settings, a.blocks)
        row["GBps"] = round(n / row["s"] / GB, 2)
    except Exception as e:  # noqa: BLE001 - a row that fails is reported, the others still run
        row = {"error": f"{type(e).__name__}: {e}"}
    return {"method": method, "gb": n / GB, "threads": threads if method in THREADED else 1, **row}


def table(rows: list[dict]) -> str:
    """The rows as a fixed-width table."""
    head = f"{'method':<15}{'GB':>6}{'thr':>5}{'s':>9}{'GB/s':>9}{'populate':>10}{'register':>10}  note"
    lines = [head, "-" * len(head)]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['method']:<15}{r['gb']:>6.1f}{r['threads']:>5}  {r['error']}")
            continue
        note = " ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()
                        if k not in ("method", "gb", "threads", "s", "GBps", "populate_s", "register_s"))
        pop, reg = r.get("populate_s"), r.get("register_s")
        lines.append(f"{r['method']:<15}{r['gb']:>6.1f}{r['threads']:>5}{r['s']:>9.2f}{r['GBps']:>9.2f}"
                     f"{'' if pop is None else f'{pop:.2f}':>10}{'' if reg is None else f'{reg:.2f}':>10}  {note}")
    return "\n".join(lines)


def main(argv=None) -> dict:
    """Run the rows asked for; print the table and one JSON line."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gb", type=float, nargs="+", default=[8, 30], help="bytes to page-lock per row, in GB")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 4, 8, 16],
                    help="populating threads (torch-register: a power of two)")
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    ap.add_argument("--chunk-mib", type=int, default=64, help="MiB one populating task covers")
    ap.add_argument("--piece-mib", type=int, default=1024, help="MiB one registration covers (pieces)")
    ap.add_argument("--blocks", type=int, default=64, help="blocks the keeper row splits the bytes into")
    ap.add_argument("--pinners", type=int, default=2, help="blocks the keeper pins at once")
    ap.add_argument("--hugepages", choices=("system", "on", "off"), default="on",
                    help="transparent huge pages: advised (on, the library's default), against (off), or the system's")
    ap.add_argument("--copy-check", action="store_true", help="H2D / D2H GB/s of each row's memory")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench.pinning needs a CUDA device")
    torch.zeros(1, device="cuda")  # the context first: no row pays for it
    rows = []
    for gb in a.gb:
        n = int(gb * GB) // PAGE * PAGE
        for method in a.methods:
            for threads in (a.threads if method in THREADED else [1]):
                if available_bytes() and n > available_bytes() * 0.9:
                    rows.append({"method": method, "gb": n / GB, "threads": threads, "error": "not enough free memory"})
                    continue
                rows.append(measure(method, n, threads, a))
                print(table(rows[-1:]).splitlines()[-1], flush=True)
    out = {"machine": machine(), "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(a).items()},
           "rows": rows}
    print()
    print(table(rows))
    return emit_json(out, a.json)


if __name__ == "__main__":
    main()
