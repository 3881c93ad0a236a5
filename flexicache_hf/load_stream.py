"""The load stream of a device: where page loads run behind the compute (``FlexiCacheConfig.overlap_loads``).

One stream per device and process, made on first use (lowest priority, as the tier copies'), like torch's own
streams: the loads of every cache on a device queue there (:mod:`~flexicache_hf.kernels.behind` launches them), and
the compute stream waits for it where a forward ends (the last layer's ``join_loads``) or, eagerly, before the
schedule's next use.  Imports nothing but torch, so the CPU path may use it (it then does nothing).
"""

from __future__ import annotations

import threading

import torch

_streams: dict[int, torch.cuda.Stream] = {}
_lock = threading.Lock()


def _index(device: torch.device) -> int:
    device = torch.device(device)
    return device.index if device.index is not None else torch.cuda.current_device()


def load_stream(device: torch.device) -> torch.cuda.Stream:
    """The load stream of ``device`` (a CUDA device), made on first use."""
    index = _index(device)
    stream = _streams.get(index)
    if stream is None:
        with _lock:
            stream = _streams.setdefault(index, torch.cuda.Stream(device=index, priority=0))
    return stream


def join_load_stream(device: torch.device) -> None:
    """The compute stream of ``device`` waits for every load queued on its load stream (no host synchronisation;
    nothing to wait for off CUDA, or before the first load)."""
    if torch.device(device).type == "cuda" and _index(device) in _streams:
        torch.cuda.current_stream(device).wait_stream(_streams[_index(device)])


def synchronize_stream(stream: torch.cuda.Stream) -> None:
    """Wait on the host for the work queued on ``stream``; an idle one (``query()``) costs no wait (a freed cache's
    layers each synchronise their copy stream)."""
    if not stream.query():
        stream.synchronize()


def synchronize_load_streams() -> None:
    """Wait on the host for every load queued on any device's load stream (before page-locked memory they read is
    let go)."""
    for stream in list(_streams.values()):
        synchronize_stream(stream)
