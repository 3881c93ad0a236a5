"""Compact store of one sample's per-step top-K page selections (paper §2.2).

The paper's profiling data is a [D, L, H, K] tensor of page indices.  We keep
exactly that (split per layer, int32), never a dense per-page boolean mask,
because masks would cost O(D·L·H·N) and N (pages) grows with the context
while K stays fixed.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

PAD = -1  # page index used when fewer than K pages exist at a step
_FORMAT_VERSION = 1


class SelectionRecord:
    """Per-layer int32 arrays [D, H, K] of selected page ids plus N_t per step.

    ``append`` is called once per (decode step, layer).  Steps must be
    contiguous per layer (step0, step0+1, ...): the metrics interpret the row
    distance as the decode-step offset Δ, so a silently skipped step would
    corrupt every RCO value that spans it.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, k: int, chunk_steps: int = 256):
        if min(num_layers, num_kv_heads, k, chunk_steps) < 1:
            raise ValueError("num_layers, num_kv_heads, k and chunk_steps must be >= 1")
        self._L, self._H, self._K = int(num_layers), int(num_kv_heads), int(k)
        # Fixed-size growth keeps over-allocation bounded by one chunk (memory
        # stays O(D·L·H·K)); with D <= a few thousand the copies are negligible.
        self._chunk = int(chunk_steps)
        self._pages = [np.empty((0, self._H, self._K), np.int32) for _ in range(self._L)]
        self._npages = [np.empty((0,), np.int32) for _ in range(self._L)]
        self._count = [0] * self._L
        self._step0: int | None = None

    # ------------------------------------------------------------------ shape
    @property
    def num_layers(self) -> int:
        return self._L

    @property
    def num_kv_heads(self) -> int:
        return self._H

    @property
    def k(self) -> int:
        return self._K

    @property
    def first_step(self) -> int | None:
        return self._step0

    @property
    def num_steps(self) -> int:
        """Steps recorded for *every* layer (a step being appended layer by
        layer is not complete until its last layer arrives)."""
        return min(self._count)

    def __len__(self) -> int:
        return self.num_steps

    @property
    def nbytes(self) -> int:
        """Bytes held by the backing arrays (allocated capacity, not just D)."""
        return sum(a.nbytes for a in self._pages) + sum(a.nbytes for a in self._npages)

    # ------------------------------------------------------------------ write
    def append(self, step: int, layer: int, pages, num_pages: int) -> None:
        """Record layer ``layer``'s selection at decode step ``step``.

        pages: [num_kv_heads, k'] ints with k' <= k (torch or numpy); -1 pads.
        Narrower inputs are right-padded with -1 so that a recorder may pass
        ``topk(min(k, N_t))`` directly.  num_pages is N_t, the candidate count.
        """
        if not 0 <= layer < self._L:
            raise IndexError(f"layer {layer} out of range [0, {self._L})")
        if self._step0 is None:
            self._step0 = int(step)
        expected = self._step0 + self._count[layer]
        if step != expected:
            raise ValueError(f"layer {layer}: expected step {expected}, got {step} (steps must be contiguous)")
        num_pages = int(num_pages)
        if num_pages < 1:
            raise ValueError("num_pages must be >= 1")
        row = self._validate(pages, num_pages)

        n = self._count[layer]
        if n == self._pages[layer].shape[0]:
            self._grow(layer)
        self._pages[layer][n] = row
        self._npages[layer][n] = num_pages
        self._count[layer] = n + 1

    def _validate(self, pages, num_pages: int) -> np.ndarray:
        if hasattr(pages, "detach"):  # torch tensor; duck-typed to avoid importing torch here
            pages = pages.detach().cpu().numpy()
        arr = np.asarray(pages)
        if arr.ndim != 2 or arr.shape[0] != self._H or arr.shape[1] > self._K:
            raise ValueError(f"pages must have shape [{self._H}, <= {self._K}], got {arr.shape}")
        if arr.size and not np.issubdtype(arr.dtype, np.integer):
            raise TypeError(f"pages must be integer, got {arr.dtype}")
        if arr.size and (arr.min() < PAD or arr.max() >= num_pages):
            raise ValueError(f"page ids must be -1 or in [0, {num_pages})")
        row = np.full((self._H, self._K), PAD, np.int32)
        row[:, : arr.shape[1]] = arr
        # Duplicates would make |S| != number of entries and break the set
        # semantics the metrics rely on, so reject them at the source.
        srt = np.sort(row, axis=1)
        if np.any((srt[:, 1:] == srt[:, :-1]) & (srt[:, 1:] != PAD)):
            raise ValueError("duplicate page id within a head's selection")
        return row

    def _grow(self, layer: int) -> None:
        old_p, old_n = self._pages[layer], self._npages[layer]
        cap = old_p.shape[0] + self._chunk
        new_p = np.empty((cap, self._H, self._K), np.int32)
        new_n = np.empty((cap,), np.int32)
        new_p[: old_p.shape[0]] = old_p
        new_n[: old_n.shape[0]] = old_n
        self._pages[layer], self._npages[layer] = new_p, new_n

    # ------------------------------------------------------------------- read
    def layer_pages(self, layer: int) -> np.ndarray:
        """Read-only view [num_steps, H, K] int32 of a layer's selections."""
        v = self._pages[layer][: self.num_steps]
        v.flags.writeable = False
        return v

    def layer_num_pages(self, layer: int) -> np.ndarray:
        """Read-only view [num_steps] int32 of N_t for a layer."""
        v = self._npages[layer][: self.num_steps]
        v.flags.writeable = False
        return v

    # --------------------------------------------------------------- persist
    def save(self, path) -> Path:
        """Write a compressed ``.npz``; returns the path actually written
        (numpy appends ``.npz`` when missing).  Partially appended steps are
        kept so a load continues exactly where recording stopped."""
        path = Path(path)
        if path.suffix != ".npz":
            path = path.with_name(path.name + ".npz")
        arrays = {
            "meta": np.array(
                [_FORMAT_VERSION, self._L, self._H, self._K, self._chunk,
                 -1 if self._step0 is None else self._step0],
                np.int64,
            ),
        }
        for layer in range(self._L):
            n = self._count[layer]
            arrays[f"pages_{layer}"] = self._pages[layer][:n]
            arrays[f"num_pages_{layer}"] = self._npages[layer][:n]
        np.savez_compressed(path, **arrays)
        return path

    @classmethod
    def load(cls, path) -> "SelectionRecord":
        with np.load(Path(path), allow_pickle=False) as z:
            version, L, H, K, chunk, step0 = (int(x) for x in z["meta"])
            if version != _FORMAT_VERSION:
                raise ValueError(f"unsupported SelectionRecord format {version}")
            rec = cls(L, H, K, chunk_steps=chunk)
            rec._step0 = None if step0 < 0 else step0
            for layer in range(L):
                p = np.ascontiguousarray(z[f"pages_{layer}"], dtype=np.int32)
                n = np.ascontiguousarray(z[f"num_pages_{layer}"], dtype=np.int32)
                if p.shape[1:] != (H, K) or n.shape != p.shape[:1]:
                    raise ValueError(f"corrupt record: layer {layer} has shape {p.shape}")
                rec._pages[layer], rec._npages[layer] = p, n
                rec._count[layer] = p.shape[0]
        return rec
