"""Whether a forward's host tiers may grow: under ``host_memory_limit``, and within what the machine has free.

Both are checked once per forward, at layer 0's update, before any layer grows, commits or pins (the plans of
:func:`flexicache_hf.cache.plan_host` and :mod:`flexicache_hf.reserve`): a refused forward raises
:class:`~flexicache_hf.HostMemoryError` and the cache is as it was.

``host_memory_limit`` is the user's cap on one cache's host tier (``None``: none).  The machine's room is checked
whatever the cap: populating and page-locking more memory than the machine has does not fail, the kernel's
out-of-memory killer ends the process (a README call of 56 rows at 30k on a 125 GB host was killed so).  The room is
``MemAvailable`` (``/proc/meminfo``), bounded by the process's cgroup v2 ``memory.max`` where one is set, less a margin
kept free for everything else (:func:`margin_bytes`).  Before refusing, memory FlexiCache keeps for later caches
(page-locked blocks no tier holds) and unreachable caches are given back, and the room is read again.  Where the
machine's memory cannot be read (not Linux), only the cap applies.
"""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Callable

from .block_keeper import BLOCKS
from .host_memory import HostMemoryError, format_bytes

MARGIN_FRACTION = 0.05  # of the machine's memory, kept free beside the host tier
MARGIN_FLOOR = 1 << 30


def check_host_limit(need: int, limit: int | None) -> None:
    """Refuse (HostMemoryError) host tiers that would hold ``need`` bytes over ``limit`` (host_memory_limit)."""
    if limit is not None and need > limit:
        raise HostMemoryError(
            f"the host tier would need {format_bytes(need)}, over host_memory_limit={format_bytes(limit)}; "
            "raise the limit, shorten the prompt, or use FlexiCacheConfig(offload=False) to keep every page on the "
            "device")


def check_host_growth(need: int, limit: int | None, new: int,
                      room: Callable[[], tuple[int, int] | None] | None = None) -> None:
    """Refuse (HostMemoryError, nothing changed) host tiers that would hold ``need`` bytes over ``limit``, or whose
    ``new`` bytes (allocated or committed by this forward) would not fit in the machine's room.  ``room``: returns
    ``(available, total)`` bytes, or None when unknown (default :func:`machine_room`)."""
    check_host_limit(need, limit)
    if new <= 0:
        return
    room = room or machine_room
    free = _spare(room())
    if free is None or new <= free:
        return
    BLOCKS.release()  # blocks kept for later tiers, then caches no one can reach (a dropped cache in a cycle)
    gc.collect()
    now = room()
    free = _spare(now)
    if free is not None and new > free:
        available, total = now
        raise HostMemoryError(
            f"the host tier would grow by {format_bytes(new)}, but this machine has {format_bytes(available)} of "
            f"memory available and {format_bytes(margin_bytes(total))} of it is kept free; shorten the prompt or the "
            "batch, or use FlexiCacheConfig(offload=False) to keep every page on the device")


def _spare(room: tuple[int, int] | None) -> int | None:
    if room is None:
        return None
    available, total = room
    return available - margin_bytes(total)


def margin_bytes(total: int) -> int:
    """Memory kept free beside the host tier on a machine of ``total`` bytes."""
    return max(MARGIN_FLOOR, int(total * MARGIN_FRACTION))


def machine_room() -> tuple[int, int] | None:
    """``(available, total)`` bytes of memory this process may still take: ``MemAvailable`` and ``MemTotal``, each
    bounded by the cgroup v2 ``memory.max`` (less its ``memory.current``, plus its reclaimable file pages) where one is
    set; None where ``/proc/meminfo`` cannot be read."""
    info = meminfo()
    if "MemAvailable" not in info or "MemTotal" not in info:
        return None
    available, total = info["MemAvailable"], info["MemTotal"]
    group = _cgroup_room()
    if group is not None:
        available, total = min(available, group[0]), min(total, group[1])
    return available, total


def meminfo() -> dict[str, int]:
    """``/proc/meminfo``'s fields in bytes (``{}`` where it cannot be read)."""
    try:
        text = Path("/proc/meminfo").read_text()
    except OSError:
        return {}
    out = {}
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        fields = rest.split()
        if fields and fields[0].isdigit():
            out[name] = int(fields[0]) * 1024
    return out


def _cgroup_room() -> tuple[int, int] | None:
    """``(available, limit)`` under this process's cgroup v2 ``memory.max``; None when unlimited or unknown."""
    try:
        line = next(x for x in Path("/proc/self/cgroup").read_text().splitlines() if x.startswith("0::"))
        folder = Path("/sys/fs/cgroup") / line[3:].lstrip("/")
        limit = (folder / "memory.max").read_text().strip()
        if limit == "max":
            return None
        current = int((folder / "memory.current").read_text())
        stat = dict(x.split() for x in (folder / "memory.stat").read_text().splitlines())
    except (OSError, StopIteration, ValueError):
        return None
    reclaimable = int(stat.get("inactive_file", 0))
    return max(0, int(limit) - current + reclaimable), int(limit)
