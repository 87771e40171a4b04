"""The collectives of the whole project: chunks (ZeRO-3) and zero-shard
(ZeRO-1/2) both issue theirs through here.

[Note: one collectives module] It lives in zero-chunk, the lowest package
that both users may import (zero-shard depends on zero-chunk for it), so
torch-version differences (renamed collectives, deprecations) are handled
once. Every function works without an initialised process group (a single
process: the result is this rank's own data).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

# torch 2.13 deprecates all_gather_into_tensor / reduce_scatter_tensor for
# the *_single names; the device machine's torch 2.11 may only have the old ones.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def rank_and_world(group: dist.ProcessGroup | None = None) -> tuple[int, int]:
    """(rank, world size) in ``group``; (0, 1) when torch.distributed is not initialised."""
    if not dist.is_available() or not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def all_gather_into(out: torch.Tensor, shard: torch.Tensor, group=None, async_op: bool = False):
    """Gather every rank's ``shard`` into ``out`` (in rank order)."""
    if not dist.is_initialized():
        out.copy_(shard)
        return None
    return _all_gather(out, shard, group=group, async_op=async_op)


def reduce_scatter_sum(out: torch.Tensor, full: torch.Tensor, group=None, async_op: bool = False):
    """Sum ``full`` over ranks and keep this rank's slice in ``out``."""
    if not dist.is_initialized():
        out.copy_(full)
        return None
    return _reduce_scatter(out, full, op=dist.ReduceOp.SUM, group=group, async_op=async_op)


def all_reduce_sum(t: torch.Tensor, group=None, async_op: bool = False):
    """Sum ``t`` over ranks, in place."""
    if not dist.is_initialized():
        return None
    return dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group, async_op=async_op)


def all_reduce_max(t: torch.Tensor, group=None) -> None:
    """Element-wise maximum of ``t`` over ranks, in place."""
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
