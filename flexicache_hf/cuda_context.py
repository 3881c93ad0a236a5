"""The CUDA context a cuda-python call runs in: torch's primary context of a device, made current once per thread
(the driver API acts on the calling thread's current context; torch does not make its context current for it).

Also the one place ``cuda.core`` is imported (:func:`cuda_core`).  cuda-core 1.2's package ``__init__`` copies its
versioned submodule's globals into its own (``__name__`` and ``__spec__`` included), so Python's per-module import
lock stops making a second thread wait for the first one's import: a thread importing it while another (the host
tier's background commits) is still inside its ``__init__`` gets ``ImportError: cannot import name 'Device' from
'cuda.core.cu13'``.  Every import of it goes through one lock here."""

from __future__ import annotations

import threading

_tls = threading.local()  # the devices whose primary context was made current in each thread
_import_lock = threading.Lock()
_core = []  # the module once imported whole (every page copy asks for it: no lock after the first import)


def cuda_core():
    """The ``cuda.core`` module, imported under this module's lock (raises ``ImportError`` without cuda-python)."""
    if not _core:
        with _import_lock:
            if not _core:
                import cuda.core

                _core.append(cuda.core)
    return _core[0]


def make_current(index: int) -> None:
    """Make device ``index``'s primary context (torch's) current in this thread, once per thread and device."""
    done = getattr(_tls, "devices", None)
    if done is None:
        done = _tls.devices = set()
    if index not in done:
        cuda_core().Device(index).set_current()
        done.add(index)
