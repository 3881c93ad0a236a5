"""Which of a layer's global KV heads this process holds: all of them, or its tensor-parallel block.

Under transformers' tensor parallelism (``from_pretrained(..., tp_plan="auto")`` under ``torchrun``) the Llama-style
plans shard ``k_proj`` / ``v_proj`` column-wise (``Shard(0)`` of the weight), so with ``H`` KV heads and a
tensor-parallel group of ``n`` ranks, rank ``r`` computes, and hands its cache, the contiguous block of global KV heads
``[r * H / n, (r + 1) * H / n)``; the model config keeps the global ``num_key_value_heads``.  A head profile names
global heads, so each rank's layer maps the profile's unstable heads into its block and keeps the rest of the profile
out of it.  Nothing crosses ranks: every rank's cache serves its own heads, as transformers' own caches do.

Transformers builds the mesh ``(pp, dp_replicate, fsdp, tp)`` with ``tp`` innermost, so a rank's place in its
tensor-parallel group is its global rank modulo the group's size.  The size is the model config's
``distributed_config.tp_size`` when the cache has seen the config (``FlexiCache(..., model_config=model.config)``),
else the ``torch.distributed`` world size (tensor parallelism alone, the ``tp_plan="auto"`` default).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import torch

from .head_profile import ModelIdentity, ProfileError


@dataclass(frozen=True)
class TensorParallel:
    """This process's tensor-parallel group: its size and this process's rank in it (1, 0: none)."""

    size: int = 1
    rank: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank {self.rank} is outside a group of {self.size}")

    @classmethod
    def of_process(cls, tp_size: int | None = None) -> TensorParallel:
        """The group of the running process: ``tp_size`` ranks (default: the whole ``torch.distributed`` world), this
        process's rank within it from its global rank (none when ``torch.distributed`` is not initialised)."""
        dist = torch.distributed
        if not (dist.is_available() and dist.is_initialized()):
            return cls()
        world, rank = dist.get_world_size(), dist.get_rank()
        size = tp_size or world
        if world % size:
            raise ValueError(f"a tensor-parallel size of {size} does not divide the {world} processes")
        return cls(size, rank % size)


def tp_size_of(model_config: Any) -> int | None:
    """The tensor-parallel size transformers recorded on a model's config (``None`` when it has none)."""
    config = getattr(model_config, "config", model_config)  # a model too
    size = getattr(getattr(config, "distributed_config", None), "tp_size", None)
    return size if isinstance(size, int) and not isinstance(size, bool) and size > 0 else None


@dataclass(frozen=True)
class HeadShard:
    """The global KV heads ``[start, start + count)`` (of ``num_heads``) that one layer holds in this process."""

    num_heads: int
    start: int
    count: int

    def __post_init__(self) -> None:
        if not (0 <= self.start and 0 < self.count and self.start + self.count <= self.num_heads):
            raise ValueError(f"heads [{self.start}, {self.start + self.count}) are not a block of {self.num_heads}")

    @property
    def heads(self) -> range:
        """The global heads held, in local order."""
        return range(self.start, self.start + self.count)

    def to_local(self, heads: Iterable[int]) -> tuple[int, ...]:
        """The local indices of those of the global ``heads`` this shard holds, sorted; the others are dropped."""
        return tuple(sorted(h - self.start for h in set(heads) if self.start <= h < self.start + self.count))


def kv_head_shard(ident: ModelIdentity, layer: int, heads: int, head_dim: int,
                  tp: TensorParallel = TensorParallel()) -> HeadShard:
    """Which of ``ident``'s (a profile's) KV heads a layer given ``heads`` KV heads of ``head_dim`` holds.

    Every head when ``heads`` is the profile's count; under tensor parallelism of ``tp.size`` ranks with
    ``heads * tp.size`` heads in the profile, rank ``tp.rank``'s block; otherwise a :class:`ProfileError`.
    """
    total = ident.num_kv_heads
    if head_dim == ident.head_dim and heads == total:
        return HeadShard(total, 0, total)
    if head_dim == ident.head_dim and tp.size > 1 and heads * tp.size == total:
        return HeadShard(total, tp.rank * heads, heads)
    what = (f"layer {layer} has {heads} KV heads of dim {head_dim}, but the profile was made for {total} KV heads of "
            f"dim {ident.head_dim} ({ident.name or ident.model_type})")
    if head_dim != ident.head_dim or tp.size == 1:
        raise ProfileError(f"{what}; profile this model with `python -m flexicache_hf.profile`")
    share = f"{total // tp.size}" if total % tp.size == 0 else f"{total}/{tp.size} (not a whole number)"
    raise ProfileError(
        f"{what}, and under tensor parallelism over {tp.size} ranks each rank holds {share} of them: use a profile "
        "of this model, or, if the tensor-parallel group is smaller than the world (data or pipeline parallelism "
        "too), make the cache with model_config=model.config so that it knows the tp_size"
    )
