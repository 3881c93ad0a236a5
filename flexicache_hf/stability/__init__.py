"""Offline head-stability profiling (paper §2): store selections, score, classify, plot.

The plotting functions are re-exported lazily (module ``__getattr__``) so
that using the metrics never pulls in matplotlib.
"""

from .metrics import (
    Classification,
    classify_unstable,
    cross_task_overlap,
    num_unstable,
    rco,
    rco_by_offset,
    rco_matrix,
    temporal_stability,
    window_starts,
)
from .record import PAD, SelectionRecord

__all__ = [
    "PAD",
    "Classification",
    "SelectionRecord",
    "classify_unstable",
    "cross_task_overlap",
    "num_unstable",
    "rco",
    "rco_by_offset",
    "rco_matrix",
    "temporal_stability",
    "window_starts",
    "plot_overlap_heatmap",
    "plot_rco_vs_offset",
    "plot_ts_distribution",
]

_FIGURE_FUNCTIONS = frozenset({"plot_overlap_heatmap", "plot_rco_vs_offset", "plot_ts_distribution"})


def __getattr__(name: str):
    if name in _FIGURE_FUNCTIONS:
        from . import figures

        return getattr(figures, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
