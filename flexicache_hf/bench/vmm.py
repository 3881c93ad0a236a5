"""How long growing in place takes (flexicache_hf/vmm.py): seconds per GB of ``grow_to``, device and host.

    python -m flexicache_hf.bench.vmm [--gb 4] [--device 0] [--chunk-mib 2 64] [--threads 8] [--json FILE]

Each row grows a fresh range to ``--gb`` GB, either one chunk per call (``step``: the decode path, mapping one chunk
ahead before a step; ``us_per_call`` is what one such call costs the host) or in one call (``once``: a prompt), then
releases it (``release_s``).  Kinds:

* ``device``: a :class:`~flexicache_hf.vmm.DeviceRange` (``cuMemCreate`` + ``cuMemMap`` + ``cuMemSetAccess`` per
  growth); ``mem_delta_gb`` is what ``torch.cuda.mem_get_info`` lost, against ``committed_gb``.
* ``host``: a pinned :class:`~flexicache_hf.vmm.HostRange` (populated on ``--threads`` threads, then
  ``cuMemHostRegister`` per growth).
* ``host-pageable``: the same without page-locking (the CPU path; also runs without CUDA).

Prints one JSON object (``--json`` writes it too).  No CUDA: the ``host-pageable`` rows only.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from ..host_memory import PinSettings
from ..vmm import DeviceRange, HostRange, vmm_supported

GB = 10**9
MIB = 1 << 20


def grow(make, total: int, chunk: int, once: bool) -> dict:
    """Grow a range from ``make(chunk)`` to ``total`` bytes (one call, or one chunk per call), then release it."""
    cuda = torch.cuda.is_available()
    free0 = torch.cuda.mem_get_info()[0] if cuda else 0
    r = make(chunk)
    t0 = time.perf_counter()
    calls = 0
    while r.committed_bytes < total:
        r.grow_to(total if once else r.committed_bytes + 1)
        calls += 1
    t1 = time.perf_counter()
    committed = r.committed_bytes
    delta = (free0 - torch.cuda.mem_get_info()[0]) if cuda else 0
    r.release()
    t2 = time.perf_counter()
    row = dict(chunk_mib=round(r.chunk_bytes / MIB, 3), mode="once" if once else "step", calls=calls,
               committed_gb=round(committed / GB, 3), grow_s=round(t1 - t0, 4),
               s_per_gb=round((t1 - t0) / (committed / GB), 4), us_per_call=round((t1 - t0) / calls * 1e6, 1),
               release_s=round(t2 - t1, 4))
    if isinstance(r, DeviceRange):
        row["mem_delta_gb"] = round(delta / GB, 3)
    return row


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gb", type=float, default=4.0, help="bytes each range grows to, in GB")
    p.add_argument("--device", type=int, default=0)
    p.add_argument("--chunk-mib", type=float, nargs="+", default=[2, 64], help="chunk sizes of the step rows")
    p.add_argument("--threads", type=int, default=PinSettings().threads, help="populating threads (host rows)")
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args(argv)
    total = int(a.gb * GB)
    settings = PinSettings(threads=a.threads)
    kinds = {"host-pageable": lambda c: HostRange(total, None, c, settings=settings)}
    if vmm_supported(a.device):
        torch.cuda.init()
        kinds = {"device": lambda c: DeviceRange(total, a.device, c),
                 "host": lambda c: HostRange(total, a.device, c, settings=settings), **kinds}
    rows = []
    for kind, make in kinds.items():
        for chunk in [int(c * MIB) for c in a.chunk_mib]:
            rows.append(dict(kind=kind, **grow(make, total, chunk, once=False)))
        rows.append(dict(kind=kind, **grow(make, total, int(64 * MIB), once=True)))
    out = dict(gb=a.gb, threads=a.threads, vmm=vmm_supported(a.device),
               gpu=torch.cuda.get_device_name(a.device) if torch.cuda.is_available() else None, rows=rows)
    text = json.dumps(out)
    print(text)
    if a.json:
        a.json.write_text(text + "\n")
    return out


if __name__ == "__main__":
    main()
