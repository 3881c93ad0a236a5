"""The arguments of a cache's row operations (beam reorder, batch selection, batch expansion), checked and made
plain before any layer changes: every layer then takes the same index, which each layer's tensors accept.

transformers' ``Cache`` hands the argument to each layer in turn, so an argument one layer's storage refused after
an earlier layer had taken it would leave the layers with different rows.  Here it is checked once against the
batch held: an index is a 1-D integer tensor (or sequence) of rows in ``[-B, B)``, negative ones counted from the
end as torch indexing does, given to the layers as non-negative int64; an expansion is a positive int.
"""

from __future__ import annotations

import torch


def checked_rows(method: str, arg, layers: list):
    """``arg`` of row operation ``method`` for a cache of ``layers``, as every layer takes it; raises
    (``TypeError``, ``ValueError``, ``IndexError``) on one it cannot apply, before anything changes.  Reads the
    index on the host (a device index: one sync, as the layers' copies of the host tier read it anyway).  An empty
    cache holds no rows: ``arg`` as given (its layers change nothing)."""
    batch = next((layer.storage.batch for layer in layers if layer.is_initialized), None)
    if batch is None:
        return arg
    if method == "batch_repeat_interleave":
        if isinstance(arg, bool) or not isinstance(arg, int) or arg < 1:
            raise ValueError(f"batch_repeat_interleave takes a positive int number of repeats, got {arg!r}")
        return arg
    index = arg if isinstance(arg, torch.Tensor) else torch.as_tensor(arg)
    if index.dtype == torch.bool or index.dtype.is_floating_point or index.dtype.is_complex:
        raise TypeError(f"{method} takes integer row indices, got a {index.dtype} tensor")
    if index.ndim != 1 or index.numel() == 0:
        raise ValueError(f"{method} takes a non-empty 1-D tensor of row indices, got shape {tuple(index.shape)}")
    rows = index.detach().to("cpu", torch.long)
    lo, hi = int(rows.min()), int(rows.max())
    if lo < -batch or hi >= batch:
        raise IndexError(f"{method}: row index {lo if lo < -batch else hi} is out of range for a cache of "
                         f"{batch} rows")
    if lo < 0:
        index = torch.where(index < 0, index + batch, index)
    return index.long()
