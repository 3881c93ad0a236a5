"""The keeper of page-locked host blocks: lends them to host tiers, keeps those given back, pins ahead.

:data:`BLOCKS`, the process's :class:`BlockKeeper` (like :data:`~flexicache_hf.recycling.KEEPER`, a process resource),
lends :class:`~flexicache_hf.host_memory.PinnedBlock` s as CPU tensors.  When the last view of a lent tensor dies (the
tier grew, selected rows or died, after synchronising its copy stream) the block comes back, still registered, and
the next tier asking for exactly its size takes it: a later cache of the same shape page-locks nothing (as torch's
caching allocator did for the tier before).  :meth:`BlockKeeper.prefetch` pins a forward's blocks in the background
ahead of the layers that take them: the first layer's update names every layer's blocks, and the populating threads
and the registrations overlap the layers computing meanwhile.  Kept blocks never make the process's page-locked
memory exceed the most its tiers held, or were about to hold, at once (the oldest go first when a new block would);
``release_storage()`` frees them all.
"""

from __future__ import annotations

import collections
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

import torch

from .host_memory import HostMemoryError, PinnedBlock, PinSettings, format_bytes, populate_pool


@dataclass(eq=False)
class _Pending:
    """A block being pinned in the background for :meth:`BlockKeeper.prefetch`; ``claimed`` once an acquire waits
    for it (its bytes then count as lent)."""

    key: tuple[int, int, int | None]  # (bytes, align, device)
    claimed: bool = False
    block: object = None
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)

    def result(self):
        """The pinned block, once pinned (raises the pinning's error)."""
        self.done.wait()
        if self.error is not None:
            if isinstance(self.error, HostMemoryError):
                raise self.error
            raise HostMemoryError(f"page-locking host memory failed: {self.error}") from self.error
        return self.block


class BlockKeeper:
    """Lends page-locked blocks and keeps those given back for the next tier of their size (thread-safe).

    Bytes are *lent* (viewed by a tier, or claimed while being pinned for one), *kept* (registered, free) or
    *pending* (being pinned in the background, unclaimed).  Lent + kept + pending never exceeds ``peak``, the most
    lent (or planned by a prefetch) at once: a new block first frees the oldest kept blocks it would push past that.

    Args:
        settings: how blocks are pinned.
        pin: ``pin(nbytes, align, device)`` makes a block (default: a :class:`PinnedBlock`, populated on
            the process's populating threads);
            a block has ``nbytes``, ``key``, ``lend(on_return)`` and ``free()``.
    """

    def __init__(self, settings: PinSettings | None = None, pin: Callable | None = None):
        self.settings = settings or PinSettings()
        self._pin_fn = pin or self._pin_block
        self._lock = threading.RLock()  # re-entrant: a tensor dying inside the keeper gives its block back here
        self._kept: list = []  # free blocks, oldest first
        self._pending: list[_Pending] = []
        self._lent = self._peak = 0
        self._pools: dict[str, ThreadPoolExecutor] = {}
        self._counts = collections.Counter()

    # ---- lending ----------------------------------------------------------------------------------------------
    def acquire(self, nbytes: int, align: int = 1, device: torch.device | int | None = None) -> torch.Tensor:
        """A ``uint8`` CPU tensor of ``nbytes`` page-locked bytes: a kept block of that size, else the one being
        pinned for it, else one pinned now (its bytes first make room under the bound).  Raises HostMemoryError."""
        if nbytes == 0:  # (no rows or no heads: nothing to page-lock)
            return torch.empty(0, dtype=torch.uint8)
        index = _device_index(device)
        key = (nbytes, align, index)
        victims, job = [], None
        with self._lock:
            block, source = self._take_kept(key), "reused"
            if block is None:
                job = next((j for j in self._pending if j.key == key and not j.claimed), None)
                if job is not None:
                    job.claimed, source = True, "prefetched"
                else:
                    victims, source = self._trim(nbytes, nbytes, collections.Counter()), "pinned_now"
            self._lent += nbytes
            self._peak = max(self._peak, self._lent)
        self._free(victims)
        t0 = time.perf_counter_ns()
        try:
            if job is not None:
                block = job.result()
            elif block is None:
                block = self._pin(*key)
        except BaseException:
            with self._lock:
                self._lent -= nbytes
                if job is not None and job in self._pending:
                    job.claimed = False  # interrupted while waiting: the block goes to the kept ones when pinned
                elif job is not None and job.block is not None:
                    self._kept.append(job.block)
            raise
        with self._lock:
            self._counts.update({source: 1, "wait_ns": time.perf_counter_ns() - t0})
        return block.lend(self._give_back)

    def prefetch(self, sizes: list[tuple[int, int]], device: torch.device | int | None = None) -> int:
        """Start pinning, in the background and in this order, the blocks ``sizes`` (``(nbytes, align)`` each: what a
        forward's layers will acquire) that neither a kept block nor one already pending covers; kept blocks the
        plan does not use make room first.  Returns the bytes it started pinning."""
        index = _device_index(device)
        keys = [(n, align, index) for n, align in sizes]
        with self._lock:
            want = collections.Counter(keys)
            have = collections.Counter(b.key for b in self._kept)
            have.update(j.key for j in self._pending if not j.claimed)
            missing = want - have
            adding = sum(key[0] * c for key, c in missing.items())
            planned = sum(key[0] for key in keys)
            victims = self._trim(adding, planned, want & have)
            self._peak = max(self._peak, self._lent + planned)
            jobs = []
            for key in keys:
                if missing[key] > 0:
                    missing[key] -= 1
                    jobs.append(_Pending(key))
            self._pending.extend(jobs)
        self._free(victims)
        for job in jobs:
            self._executor("pin", self.settings.pinners).submit(self._run, job)
        return adding

    def _run(self, job: _Pending) -> None:
        """A background pin: the block goes to whoever claimed it, else to the kept blocks."""
        try:
            block, error = self._pin(*job.key), None
        except BaseException as e:  # noqa: BLE001 - handed to the claimer (an unclaimed failure is retried there)
            block, error = None, e
        with self._lock:
            self._pending.remove(job)
            if job.claimed:
                job.block, job.error = block, error
            elif block is not None:
                self._kept.append(block)
        job.done.set()

    def _give_back(self, block) -> None:
        """Every view of a lent block is gone: keep it for the next tier of its size."""
        with self._lock:
            self._lent -= block.nbytes
            self._kept.append(block)

    # ---- bookkeeping (integers) ---------------------------------------------------------------------------------
    def _take_kept(self, key):
        """The newest kept block of ``key``, removed from the kept ones (None if there is none)."""
        for i in range(len(self._kept) - 1, -1, -1):
            if self._kept[i].key == key:
                return self._kept.pop(i)
        return None

    def _trim(self, adding: int, planned: int, protect: collections.Counter) -> list:
        """Kept blocks to free (oldest first, none of ``protect``'s keys and counts) so that ``adding`` new bytes keep
        lent + kept + pending within the bound once ``planned`` more bytes are lent; removed from the kept ones."""
        bound = max(self._peak, self._lent + planned)
        total = self._lent + self.kept_bytes() + adding
        spare, victims, keep = collections.Counter(protect), [], []
        for block in self._kept:
            if total > bound and spare[block.key] <= 0:
                victims.append(block)
                total -= block.nbytes
            else:
                spare[block.key] -= 1
                keep.append(block)
        self._kept = keep
        return victims

    def kept_bytes(self) -> int:
        """Page-locked bytes no tier holds: kept blocks and unclaimed background pins."""
        with self._lock:
            return sum(b.nbytes for b in self._kept) + sum(j.key[0] for j in self._pending if not j.claimed)

    def stats(self) -> dict:
        """Byte counts (lent, kept, pending, peak) and counters since the process started (blocks pinned and their
        bytes and seconds; acquires served by a kept block, a background pin, or pinned on the spot; seconds
        acquires waited; bytes freed)."""
        with self._lock:
            pending = sum(j.key[0] for j in self._pending if not j.claimed)
            out = {"lent_bytes": self._lent, "kept_bytes": self.kept_bytes() - pending, "pending_bytes": pending,
                   "peak_bytes": self._peak}
            c = self._counts
            out.update(pins=c["pins"], pinned_bytes=c["pinned_bytes"], pin_s=c["pin_ns"] / 1e9, reused=c["reused"],
                       prefetched=c["prefetched"], pinned_now=c["pinned_now"], wait_s=c["wait_ns"] / 1e9,
                       freed_bytes=c["freed_bytes"])
            return out

    # ---- pinning and freeing ------------------------------------------------------------------------------------
    def _pin(self, nbytes: int, align: int, device: int | None):
        """A new block (counted); any failure is a HostMemoryError."""
        t0 = time.perf_counter_ns()
        try:
            block = self._pin_fn(nbytes, align, device)
        except HostMemoryError:
            raise
        except Exception as e:  # noqa: BLE001 - the driver's or the OS's: one error type for the tier
            raise HostMemoryError(f"page-locking {format_bytes(nbytes)} of host memory failed: {e}") from e
        with self._lock:
            self._counts.update(pins=1, pinned_bytes=nbytes, pin_ns=time.perf_counter_ns() - t0)
        return block

    def _pin_block(self, nbytes: int, align: int, device: int | None) -> PinnedBlock:
        """The default ``pin``: a :class:`PinnedBlock` populated on the process's populating threads (the pool host
        ranges grow on too: :func:`~flexicache_hf.host_memory.populate_pool`)."""
        s = self.settings
        pool = populate_pool(s.threads) if s.threads > 1 else None
        return PinnedBlock(nbytes, align, device, s, pool)

    def _executor(self, name: str, workers: int) -> ThreadPoolExecutor:
        """This keeper's thread pool ``name`` ("pin": the background pins), made on first use with ``workers``
        threads."""
        with self._lock:
            pool = self._pools.get(name)
            if pool is None:
                pool = self._pools[name] = ThreadPoolExecutor(workers, thread_name_prefix=f"flexicache-{name}")
            return pool

    def _free(self, blocks: list) -> None:
        """Unregister and unmap ``blocks`` (kept ones, taken out of the keeper already), counting the bytes."""
        for block in blocks:
            block.free()
        if blocks:
            with self._lock:
                self._counts["freed_bytes"] += sum(b.nbytes for b in blocks)

    def release(self) -> int:
        """Free every kept block and every unclaimed background pin (waiting for those under way), after the devices
        finished their queued work; returns the bytes freed.  The bound starts again from what is lent."""
        with self._lock:
            victims, self._kept = self._kept, []
            jobs = [j for j in self._pending if not j.claimed]
            for job in jobs:
                job.claimed = True  # ours now: freed below instead of kept
            self._peak = self._lent
        for job in jobs:
            try:
                victims.append(job.result())
            except HostMemoryError:
                pass
        _quiesce({getattr(b, "device", None) for b in victims})
        self._free(victims)
        return sum(b.nbytes for b in victims)


    def close(self) -> int:
        """:meth:`release`, then stop this keeper's threads (a keeper of its own, e.g. a benchmark's)."""
        freed = self.release()
        with self._lock:
            pools, self._pools = list(self._pools.values()), {}
        for pool in pools:
            pool.shutdown()
        return freed


def _device_index(device: torch.device | int | None) -> int | None:
    """The CUDA device index a block registers under (None: no registration)."""
    if device is None or isinstance(device, int):
        return device
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return device.index if device.index is not None else torch.cuda.current_device()


def _quiesce(devices: set) -> None:
    """Wait for ``devices``' queued work (nothing still reads memory about to be unregistered)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for index in sorted(d for d in devices if d is not None):
            torch.cuda.synchronize(index)


BLOCKS = BlockKeeper()  # one per process, like recycling.KEEPER: page-locked memory is a process resource
