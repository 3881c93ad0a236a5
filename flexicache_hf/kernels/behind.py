"""CUDA twins of :func:`~flexicache_hf.kernels.reference.load_pages_behind` and :func:`~.reference.join_loads`:
page loads that run behind the compute.

A device's load stream (:mod:`~flexicache_hf.load_stream`) takes the page copies a decode step issues after a layer's
attention (``FlexiCacheConfig.overlap_loads``): the stream first waits for the compute stream (so the copies follow
what was queued before them: the attention that read the slots, the reseat that chose them), then the copies run there
while the later layers compute, and :func:`join_loads` makes the compute stream wait for them (the last layer of the
forward). Inside a captured decode step the same calls fork the load stream off the capture and join it back, so the
graph holds the copies as a parallel branch.

The index lists are cloned on the compute stream before the fork: the clones come from the caching allocator and
are recorded on the load stream, so no later allocation can take their memory before the copies have read them.
"""

from __future__ import annotations

import torch

from ..load_stream import join_load_stream, load_stream


def load_pages_behind(dst_k: torch.Tensor, dst_v: torch.Tensor, dst_index: torch.Tensor, src_k: torch.Tensor,
                      src_v: torch.Tensor, src_index: torch.Tensor) -> None:
    """Same contract as :func:`reference.load_pages_behind`: the copies queued on the load stream."""
    from .uva_copy import copy_kv_pages

    device = dst_k.device
    compute, side = torch.cuda.current_stream(device), load_stream(device)
    di, si = dst_index.clone(), src_index.clone()
    side.wait_stream(compute)
    with torch.cuda.stream(side):
        copy_kv_pages(dst_k, dst_v, di, src_k, src_v, si)
    di.record_stream(side)
    si.record_stream(side)


def join_loads(device: torch.device) -> None:
    """Same contract as :func:`reference.join_loads`: the compute stream waits for the load stream."""
    join_load_stream(device)
