"""Figures for the head-stability study (paper Fig. 1, TS histogram, Table 1).

Figures are built on ``matplotlib.figure.Figure`` with an explicit Agg canvas
instead of pyplot: no global backend switch, no rcParams mutation, no figure
registry to leak memory when called in a loop.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure


def _new_figure(width: float, height: float) -> Figure:
    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _save(fig: Figure, path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    return path


def plot_rco_vs_offset(rco_by_offset: np.ndarray, layer: int, path) -> Path:
    """Fig. 1: mean RCO vs offset Δ, one line per KV head of ``layer``.

    rco_by_offset: [W−1, L, H] as returned by metrics.rco_by_offset.
    """
    data = np.asarray(rco_by_offset)
    if data.ndim != 3 or not 0 <= layer < data.shape[1]:
        raise ValueError(f"expected [W-1, L, H] with layer < L, got {data.shape} and layer {layer}")
    offsets = np.arange(1, data.shape[0] + 1)
    fig = _new_figure(6.0, 4.0)
    ax = fig.add_subplot()
    for h in range(data.shape[2]):
        ax.plot(offsets, data[:, layer, h], marker=".", label=f"KV head {h}")
    ax.set(xlabel="offset Δ (decode steps)", ylabel="mean RCO", ylim=(0.0, 1.02),
           title=f"Layer {layer}: top-K overlap vs offset")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small", ncols=2)
    return _save(fig, path)


def plot_ts_distribution(mean_ts: np.ndarray, unstable: Iterable[tuple[int, int]], path) -> Path:
    """Histogram of per-head mean TS, unstable heads stacked in a second colour."""
    ts = np.asarray(mean_ts, np.float64)
    if ts.ndim != 2:
        raise ValueError(f"mean_ts must be [L, H], got {ts.shape}")
    mask = np.zeros(ts.shape, bool)
    for layer, head in unstable:
        mask[layer, head] = True
    bins = np.linspace(0.0, 1.0, 41)
    fig = _new_figure(6.0, 4.0)
    ax = fig.add_subplot()
    ax.hist([ts[~mask], ts[mask]], bins=bins, stacked=True, color=["tab:blue", "tab:red"],
            label=[f"stable ({(~mask).sum()})", f"unstable ({mask.sum()})"])
    # A rug makes single heads visible even when a bin holds many of them.
    ax.plot(ts[mask], np.zeros(mask.sum()), "|", color="tab:red", markersize=12)
    ax.set(xlabel="mean temporal stability TS", ylabel="number of KV heads",
           title="Per-head temporal stability")
    ax.legend()
    return _save(fig, path)


def plot_overlap_heatmap(names: Sequence[str], matrix: np.ndarray, path) -> Path:
    """Table 1 style heat map of cross-task unstable-set overlap, annotated."""
    mat = np.asarray(matrix, np.float64)
    n = len(names)
    if mat.shape != (n, n):
        raise ValueError(f"matrix must be [{n}, {n}], got {mat.shape}")
    side = 1.0 + 0.7 * max(n, 2)
    fig = _new_figure(side + 1.5, side)
    ax = fig.add_subplot()
    im = ax.imshow(mat, vmin=0.0, vmax=1.0, cmap="viridis")
    ax.set_xticks(range(n), labels=list(names), rotation=45, ha="right")
    ax.set_yticks(range(n), labels=list(names))
    for i in range(n):
        for j in range(n):
            # Dark text on the bright end of viridis, light text elsewhere.
            ax.text(j, i, f"{mat[i, j]:.2f}", ha="center", va="center",
                    color="black" if mat[i, j] > 0.6 else "white", fontsize="small")
    ax.set_title("Cross-task overlap of unstable heads")
    fig.colorbar(im, ax=ax)
    return _save(fig, path)
