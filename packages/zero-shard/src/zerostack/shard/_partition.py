"""Process-group helpers and the partition/padding math every ZeRO stage uses."""

from __future__ import annotations

import torch
import torch.distributed as dist

# torch 2.13 deprecates reduce_scatter_tensor for reduce_scatter_single; the
# device machine's torch 2.11 may only have the old name.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def rank_and_world(group: dist.ProcessGroup | None = None) -> tuple[int, int]:
    """(rank, world size) in ``group``; (0, 1) without torch.distributed."""
    if not dist.is_available() or not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def shard_numel(numel: int, world: int) -> int:
    """Elements of each rank's equal piece of a ``numel``-element tensor
    (padded: a tensor smaller than the group still gives every rank one)."""
    return max(1, -(-numel // world))


def shard_bounds(numel: int, world: int, rank: int) -> tuple[int, int]:
    """The [start, end) of the real (unpadded) elements in ``rank``'s piece,
    relative to the flat tensor; empty when the piece is all padding."""
    size = shard_numel(numel, world)
    start = min(numel, rank * size)
    return start, min(numel, start + size)


def padded_flat(t: torch.Tensor, world: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``t`` flattened and zero-padded to ``world * shard_numel`` elements."""
    numel = t.numel()
    out = torch.zeros(world * shard_numel(numel, world), dtype=dtype or t.dtype, device=t.device)
    out[:numel].copy_(t.reshape(-1))
    return out


def all_gather_into(out: torch.Tensor, shard: torch.Tensor, group, async_op: bool = False):
    if not dist.is_initialized():
        out.copy_(shard)
        return None
    return dist.all_gather_into_tensor(out, shard, group=group, async_op=async_op)


def reduce_scatter_sum(out: torch.Tensor, full: torch.Tensor, group, async_op: bool = False):
    if not dist.is_initialized():
        out.copy_(full)
        return None
    return _reduce_scatter(out, full, op=dist.ReduceOp.SUM, group=group, async_op=async_op)


def all_reduce_sum(t: torch.Tensor, group, async_op: bool = False):
    if not dist.is_initialized():
        return None
    return dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group, async_op=async_op)
