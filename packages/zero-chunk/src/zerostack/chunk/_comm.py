"""The collectives chunks use, with one place for torch-version differences."""

from __future__ import annotations

import torch
import torch.distributed as dist

# torch 2.13 deprecates reduce_scatter_tensor for reduce_scatter_single; the
# device machine's torch 2.11 may only have the old name.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def group_rank_and_size(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """(rank, world size) in ``group``; (0, 1) when torch.distributed is not initialised."""
    if not dist.is_available() or not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def all_gather(out: torch.Tensor, shard: torch.Tensor, group, async_op: bool):
    """Gather every rank's ``shard`` into ``out`` (in rank order)."""
    if not dist.is_initialized():
        out.copy_(shard)
        return None
    return dist.all_gather_into_tensor(out, shard, group=group, async_op=async_op)


def reduce_scatter_sum(out: torch.Tensor, full: torch.Tensor, group, async_op: bool):
    """Sum ``full`` over ranks and keep this rank's slice in ``out``."""
    if not dist.is_initialized():
        out.copy_(full)
        return None
    return _reduce_scatter(out, full, op=dist.ReduceOp.SUM, group=group, async_op=async_op)


def all_reduce_sum(t: torch.Tensor, group, async_op: bool):
    if not dist.is_initialized():
        return None
    return dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group, async_op=async_op)
