"""What passes between a FlexiCache and the attention function: the :class:`PagedKV` handle, the per-forward
:class:`ForwardGuard`, and the errors a cache raises about its own state or the model it serves."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import torch


class UnsupportedModelError(ValueError):
    """The model's attention layout cannot be served by FlexiCache (e.g. sliding-window layers)."""


class CacheStateError(RuntimeError):
    """The cache cannot serve this call: an earlier forward stopped part-way, or layers were driven out of order."""


class ConcurrentUseError(CacheStateError):
    """A thread used a FlexiCache while another thread's forward through it was under way."""


class ForwardGuard:
    """One forward's progress through the cache: ``update(0), attend(0), update(1), ..., attend(L-1)``.

    A forward that raised (or was interrupted) part-way leaves some layers holding its tokens and others not;
    reusing such a cache would be silently wrong.  The guard knows: a forward is *open* from the moment layer 0's
    update starts changing storage until the last layer's attention returns, and validation errors raised before
    that leave it closed (the cache unchanged).  :meth:`FlexiCache.ensure_usable` acts on an open forward.
    """

    def __init__(self, num_layers: int):
        self.num_layers = num_layers
        self._lock = threading.Lock()  # opening a forward: the check of another thread's and the opening are one
        self.clear()

    def clear(self) -> None:
        self.next = (0, "update")
        self.open = False
        self.began_empty = True  # the open forward started on an empty cache (nothing of value to lose)
        self.failure: str | None = None  # the first error FlexiCache saw in the open forward
        self.owner: threading.Thread | None = None  # the thread running the open forward

    def __getstate__(self) -> dict:  # a lock and a thread belong to this process (a copy is made between forwards)
        state = dict(self.__dict__)
        del state["_lock"]
        state["owner"] = None
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def in_use_elsewhere(self) -> bool:
        """Whether another thread is running a forward through the cache now: the open forward's thread is alive,
        is not this one, and no error of that forward reached FlexiCache (a forward that raised is over)."""
        owner = self.owner
        return (self.open and owner is not None and owner is not threading.current_thread() and owner.is_alive()
                and self.failure is None)

    def check_thread(self) -> None:
        """Refuse a thread while another one's forward through the cache is under way (changing nothing)."""
        if self.in_use_elsewhere():
            raise ConcurrentUseError(
                f"this FlexiCache is in use by another thread ({self.owner.name}), whose forward through it is under "
                f"way (at layer {self.next[0]} of {self.num_layers}): a FlexiCache holds one sequence of tokens and "
                "serves one forward at a time. Give each thread its own FlexiCache, or hand a cache to another "
                "thread only between calls"
            )

    def begin(self, layer: int, phase: str, empty: bool = False) -> None:
        if (layer, phase) == (0, "update"):
            with self._lock:  # no other thread can open the forward between the check and the opening
                self.check_thread()
                self._expect(layer, phase)
                self.open, self.began_empty, self.failure = True, empty, None
                self.owner = threading.current_thread()
            return
        self.check_thread()
        self._expect(layer, phase)

    def _expect(self, layer: int, phase: str) -> None:
        if (layer, phase) != self.next:
            raise CacheStateError(
                f"FlexiCache layer {layer}'s {phase} came when layer {self.next[0]}'s {self.next[1]} was due: a "
                "FlexiCache serves one forward at a time, through every layer in order"
            )

    def end(self, layer: int, phase: str) -> None:
        if phase == "update":
            self.next = (layer, "attend")
        elif layer + 1 < self.num_layers:
            self.next = (layer + 1, "update")
        else:
            self.clear()

    def stopped_error(self) -> CacheStateError:
        """The error that refuses a cache whose open forward stopped part-way on a cache that held tokens."""
        layer, phase = self.next
        where = "attention" if phase == "attend" else "storage"
        return CacheStateError(
            f"this FlexiCache cannot be used: a forward stopped part-way, at layer {layer} of {self.num_layers} "
            f"({where}; {self.failure or 'the error was raised outside FlexiCache'}), so some layers hold its tokens "
            "and others do not. Call cache.reset() to empty it, or use a new FlexiCache"
        )

    def note(self, error: BaseException) -> None:
        """Remember the first error of the open forward, to name it when the cache is next used (only the errors of
        the thread running it: another thread's refusal is not this forward's failure)."""
        if self.open and self.failure is None and self.owner in (None, threading.current_thread()):
            text = f"{type(error).__name__}: {error}"
            self.failure = text if len(text) <= 300 else text[:297] + "..."


@dataclass(frozen=True, eq=False)
class PagedKV:
    """What ``FlexiCache.update`` hands to the attention function in place of key/value tensors.

    ``keys``/``values`` are this forward's new states ``[B, H, T, D]`` of layer ``layer_idx`` at positions
    ``start .. start+T-1``; everything older lives in that layer's pages.  The attention function gives the handle
    back to ``cache.attend``.  Any torch operation on a handle (i.e. a non-FlexiCache attention function receiving
    it) fails with an explanation instead of computing garbage.
    """

    cache: Any  # the FlexiCache that made it
    layer_idx: int
    keys: torch.Tensor
    values: torch.Tensor
    start: int
    # A prompt chunk's offloaded heads, gathered once ``[B, len(slot_heads), T, D]``: the host copy reads them and
    # so does the prompt's top-K seat, so the copy stream never holds the whole chunk (all heads) alive.
    offloaded: tuple[torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        error = TypeError(WRONG_ATTENTION)
        for arg in (*args, *(kwargs or {}).values()):
            if isinstance(arg, PagedKV):
                arg.cache.refused(arg, error)  # nothing of the attention ran: the forward is undone where it can be
                break
        raise error

    def __getattr__(self, name):  # only reached for attributes a handle lacks (e.g. `.shape`)
        if name.startswith("__") or name == "cache":  # protocol probes (copy, pickle) and unset fields
            raise AttributeError(name)
        error = TypeError(f"{WRONG_ATTENTION} (an attention function asked the handle for `{name}`)")
        self.cache.refused(self, error)
        raise error


WRONG_ATTENTION = (
    "FlexiCache stores paged KV that only the 'flexicache' attention can read: load the model with "
    "attn_implementation='flexicache' (after `import flexicache_hf`) or pass a DynamicCache instead"
)
