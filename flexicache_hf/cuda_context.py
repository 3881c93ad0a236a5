"""The CUDA context a cuda-python call runs in: torch's primary context of a device, made current once per thread
(the driver API acts on the calling thread's current context; torch does not make its context current for it)."""

from __future__ import annotations

import threading

_tls = threading.local()  # the devices whose primary context was made current in each thread


def make_current(index: int) -> None:
    """Make device ``index``'s primary context (torch's) current in this thread, once per thread and device."""
    done = getattr(_tls, "devices", None)
    if done is None:
        done = _tls.devices = set()
    if index not in done:
        from cuda.core import Device

        Device(index).set_current()
        done.add(index)
