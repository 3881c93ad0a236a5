"""Temporal-stability metrics of paper §2.2-2.3, computed from recorded selections.

RCO_h(s,t) = max(0, (|S_s ∩ S_t|/K − K/N_t) / (1 − K/N_t))
TS_h(s)    = 1/(W−1) · Σ_{t=s+1}^{s+W−1} RCO_h(s,t)

Everything is pure: inputs are SelectionRecords / arrays, outputs are arrays.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import NamedTuple

import numpy as np

from .record import PAD, SelectionRecord

# Upper bound on the scratch memory of one vectorised block.  It caps both the
# per-step membership table and the gathered index block, so very long
# contexts (N in the tens of thousands of pages) stay within ~100 MB.
_BLOCK_BYTES = 32 << 20


# --------------------------------------------------------------------- RCO
def _rco_from_counts(inter, size_s, size_t, k: int, n_t):
    """Vectorised RCO from intersection counts; the single source of truth
    for both the scalar ``rco`` and the whole-record functions.

    Edge case K >= N_t (every candidate page is selected): chance overlap
    K/N_t reaches 1 so the correction's denominator is <= 0 and the formula is
    meaningless (it even exceeds 1 for K > N_t).  There is no choice to be
    stable or unstable about, so we fall back to the *uncorrected* overlap
    |S_s ∩ S_t| / max(|S_s|, |S_t|): 1.0 exactly when the sets are equal
    (two empty sets count as equal), otherwise the fraction of the larger
    selection shared.  With N fixed both sets are "all pages", giving 1.0 for
    every head, so short-context steps add the same value to every head and
    do not bias the head ranking; when new pages appear (N_s < N_t) the value
    is the fraction of step t's pages already selected at s — the quantity a
    stable head's cache would not have to fetch.  max() keeps it symmetric.
    """
    inter = np.asarray(inter, np.float64)
    n_t = np.asarray(n_t, np.float64)
    chance = k / n_t
    with np.errstate(divide="ignore", invalid="ignore"):
        corrected = np.maximum(0.0, (inter / k - chance) / (1.0 - chance))
    bigger = np.maximum(size_s, size_t)
    plain = np.where(bigger > 0, inter / np.maximum(bigger, 1), 1.0)
    return np.where(k < n_t, corrected, plain)


def _as_set(pages) -> set[int]:
    if hasattr(pages, "detach"):  # torch tensor
        pages = pages.detach().cpu().numpy()
    arr = np.asarray(list(pages) if isinstance(pages, (set, frozenset)) else pages).ravel()
    if arr.size and arr.min() < PAD:
        raise ValueError("page ids must be >= 0 (or -1 for padding)")
    return {int(p) for p in arr if p != PAD}


def rco(s_s, s_t, k: int, n_t: int) -> float:
    """Random-corrected overlap of two top-K page selections (−1 ignored).

    k is the selection budget K in pages, n_t the candidate count N_t at the
    later step t.  See ``_rco_from_counts`` for the K >= N_t convention.
    """
    if k < 1 or n_t < 1:
        raise ValueError("k and n_t must be >= 1")
    a, b = _as_set(s_s), _as_set(s_t)
    if len(a) > k or len(b) > k:
        raise ValueError(f"a selection has more than k={k} pages")
    return float(_rco_from_counts(len(a & b), len(a), len(b), k, n_t))


# -------------------------------------------------------- whole-record RCO
def window_starts(num_steps: int, w: int, stride: int = 1) -> np.ndarray:
    """Starts s of the full windows [s, s+W−1] inside D recorded steps.

    Only full windows are used so every TS averages exactly W−1 RCO values,
    as the 1/(W−1) of the formula prescribes.  stride=1 (default) evaluates
    TS_h(s) at every step like the paper's per-step definition; stride=W
    gives non-overlapping windows.
    """
    if w < 2:
        raise ValueError("window W must be >= 2 (TS needs at least one offset)")
    if stride < 1:
        raise ValueError("stride must be >= 1")
    return np.arange(0, max(num_steps - w + 1, 0), stride, dtype=np.int64)


def _layer_rco(pages: np.ndarray, npages: np.ndarray, k: int, starts: np.ndarray, w: int) -> np.ndarray:
    """RCO(s, s+Δ) for one layer: [len(starts), W−1, H].

    Membership-table gather: for a block of reference steps s we scatter S_s
    into a boolean table [block, H, N+1] and look up the K pages of each S_t,
    so one pair costs O(K) instead of a set intersection.  Padding is mapped
    to an extra column that is forced to False.
    """
    D, H, K = pages.shape
    out = np.empty((len(starts), w - 1, H), np.float64)
    if len(starts) == 0:
        return out
    pad_col = int(pages.max()) + 1 if pages.size else 0
    n_cols = max(pad_col, 0) + 1
    ids = np.where(pages >= 0, pages, pad_col).astype(np.int64)  # [D, H, K]
    sizes = (pages >= 0).sum(-1)  # [D, H]
    offsets = np.arange(1, w, dtype=np.int64)
    block = max(1, min(_BLOCK_BYTES // (H * n_cols), _BLOCK_BYTES // (8 * (w - 1) * H * K)))
    head_base = (np.arange(H, dtype=np.int64) * n_cols)[:, None]  # [H, 1]
    for b0 in range(0, len(starts), block):
        s = starts[b0 : b0 + block]
        c = len(s)
        row_base = np.arange(c, dtype=np.int64)[:, None, None] * (H * n_cols) + head_base  # [c, H, 1]
        table = np.zeros(c * H * n_cols, bool)
        table[row_base + ids[s]] = True
        table[row_base[..., 0] + pad_col] = False
        t = s[:, None] + offsets  # [c, W−1]
        hits = table[row_base[:, None] + ids[t]]  # [c, W−1, H, K]
        inter = hits.sum(-1)
        out[b0 : b0 + c] = _rco_from_counts(inter, sizes[s][:, None], sizes[t], k, npages[t][..., None])
    return out


def rco_matrix(record: SelectionRecord, w: int, stride: int = 1) -> np.ndarray:
    """RCO_h(s, s+Δ) for every window start s and Δ=1..W−1: [S, W−1, L, H]."""
    starts = window_starts(record.num_steps, w, stride)
    per_layer = [
        _layer_rco(record.layer_pages(l), record.layer_num_pages(l), record.k, starts, w)
        for l in range(record.num_layers)
    ]
    return np.stack(per_layer, axis=2)


def temporal_stability(record: SelectionRecord, w: int, stride: int = 1) -> np.ndarray:
    """TS_h(s) for every window start s: [num_windows, L, H] (float64).

    Computed layer by layer so the [S, W−1, L, H] intermediate never exists.
    """
    starts = window_starts(record.num_steps, w, stride)
    out = np.empty((len(starts), record.num_layers, record.num_kv_heads), np.float64)
    for l in range(record.num_layers):
        out[:, l] = _layer_rco(record.layer_pages(l), record.layer_num_pages(l), record.k, starts, w).mean(1)
    return out


def rco_by_offset(records: SelectionRecord | Sequence[SelectionRecord], w: int, stride: int = 1) -> np.ndarray:
    """Mean RCO per offset Δ=1..W−1 over all windows (of all samples): [W−1, L, H].

    Uses the same window starts as ``temporal_stability``, so the mean over Δ
    equals the mean TS over the same windows.  NaN where there is no window.
    """
    if isinstance(records, SelectionRecord):
        records = [records]
    if not records:
        raise ValueError("no records")
    L, H = records[0].num_layers, records[0].num_kv_heads
    total = np.zeros((w - 1, L, H), np.float64)
    n = 0
    for rec in records:
        if (rec.num_layers, rec.num_kv_heads) != (L, H):
            raise ValueError("records have different (layers, heads) shapes")
        starts = window_starts(rec.num_steps, w, stride)
        n += len(starts)
        for l in range(L):
            total[:, l] += _layer_rco(rec.layer_pages(l), rec.layer_num_pages(l), rec.k, starts, w).sum(0)
    return total / n if n else np.full_like(total, np.nan)


# ----------------------------------------------------------- classification
class Classification(NamedTuple):
    unstable: frozenset  # {(layer, head)}
    counts: np.ndarray  # [L, H] int: windows in which the head was in the bottom fraction
    mean_ts: np.ndarray  # [L, H] float: TS averaged over all windows of all samples


def num_unstable(num_heads: int, fraction: float) -> int:
    """round(fraction·num_heads), halves rounded up: Python's round() is
    banker's rounding, which would make the count depend on parity
    (22.5 -> 22 but 23.5 -> 24)."""
    return int(math.floor(fraction * num_heads + 0.5))


def classify_unstable(ts_windows_list: Iterable[np.ndarray], fraction: float = 0.25) -> Classification:
    """Paper §2.3: pick the heads most often in the bottom ``fraction`` of TS.

    Per window (every window of every sample, equally weighted) a head is in
    the bottom set when fewer than m = num_unstable(L·H, fraction) heads have a
    strictly lower TS.  Heads tied at the boundary are therefore *all*
    counted: cutting a tie by index would systematically blame low-numbered
    layers for windows in which all heads behave identically (e.g. K >= N_t).
    The m heads with the highest counts are unstable; ties go to the lower
    mean TS, then to the lower (layer, head).
    """
    if not 0.0 <= fraction <= 1.0:
        raise ValueError("fraction must be in [0, 1]")
    arrays = [np.asarray(a, np.float64) for a in ts_windows_list]
    if not arrays or any(a.ndim != 3 or a.shape[1:] != arrays[0].shape[1:] for a in arrays):
        raise ValueError("need >= 1 array, all shaped [num_windows, L, H] with the same L, H")
    L, H = arrays[0].shape[1:]
    ts = np.concatenate([a.reshape(a.shape[0], L * H) for a in arrays])
    if ts.shape[0] == 0:
        raise ValueError("no windows to classify (every sample shorter than W?)")
    if np.isnan(ts).any():
        raise ValueError("TS contains NaN")
    m = num_unstable(L * H, fraction)
    if m > 0:
        kth = np.partition(ts, m - 1, axis=1)[:, m - 1 : m]
        counts = (ts <= kth).sum(0)
    else:
        counts = np.zeros(L * H, np.int64)
    mean_ts = ts.mean(0)
    order = np.lexsort((np.arange(L * H), mean_ts, -counts))
    unstable = frozenset((int(i) // H, int(i) % H) for i in order[:m])
    return Classification(unstable, counts.reshape(L, H).astype(np.int64), mean_ts.reshape(L, H))


def cross_task_overlap(sets: Mapping[str, Iterable]) -> tuple[list[str], np.ndarray]:
    """Paper Table 1: M[i, j] = |A_i ∩ A_j| / |A| in the mapping's order.

    All sets must have the same non-zero size (the paper's normaliser |A| is
    only meaningful then).
    """
    names = list(sets)
    frozen = [frozenset(sets[n]) for n in names]
    sizes = {len(s) for s in frozen}
    if len(sizes) > 1:
        raise ValueError(f"unstable sets differ in size: { {n: len(s) for n, s in zip(names, frozen)} }")
    size = sizes.pop() if sizes else 0
    if names and size == 0:
        raise ValueError("unstable sets are empty")
    mat = np.array([[len(a & b) / size for b in frozen] for a in frozen], np.float64).reshape(len(names), len(names))
    return names, mat
