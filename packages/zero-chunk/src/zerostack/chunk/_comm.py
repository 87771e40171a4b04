"""The collectives of the whole project: chunks (ZeRO-3) and zero-shard
(ZeRO-1/2) both issue theirs through here.

[Note: one collectives module] It lives in zero-chunk, the lowest package
that both users may import (zero-shard depends on zero-chunk for it), so
torch-version differences (renamed collectives, deprecations) are handled
once. Every function works without an initialised process group (a single
process: the result is this rank's own data).

[Note: collective debug mode] Ranks that disagree on the next collective (a
module skipped on one rank, a data-dependent branch) hang: each waits in a
collective the others never join. With ``ZEROSTACK_DEBUG_COLLECTIVES=1`` (or
``debug_collectives(True)``, or the wrappers' ``debug_collectives=True``)
every collective here is preceded by an all-gather of a fingerprint (which
collective, how many elements, which dtype, and a hash of the caller's label,
such as "forward of module h.0.attn"). Every rank sees every fingerprint, so
on a difference every rank raises the same CollectiveMismatchError, naming
what each rank was about to do. It costs a blocking all-gather of 4 integers
per collective (and a device sync with NCCL): a debugging aid, off by default.
"""

from __future__ import annotations

import os
import zlib

import torch
import torch.distributed as dist

# torch 2.13 deprecates all_gather_into_tensor / reduce_scatter_tensor for
# the *_single names; the device machine's torch 2.11 may only have the old ones.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


_debug = os.environ.get("ZEROSTACK_DEBUG_COLLECTIVES", "0") not in ("", "0")
_label = "no label"


class CollectiveMismatchError(RuntimeError):
    """Ranks were about to issue different collectives (see [Note: collective
    debug mode]); raised on every rank of the group."""


def debug_collectives(enabled: bool | None = None) -> bool:
    """Whether every collective first checks that all ranks issue the same
    one (see [Note: collective debug mode]); ``enabled`` switches it for
    this process. Returns the setting in force."""
    global _debug
    if enabled is not None:
        if not isinstance(enabled, bool):
            raise TypeError(f"debug_collectives: enabled must be a bool or None (got {enabled!r})")
        _debug = enabled
    return _debug


def set_collective_label(label: str) -> str:
    """Name what the next collectives are for ("forward of module h.0.attn"),
    for the debug mode's check and its error; returns the previous label."""
    global _label
    if not isinstance(label, str):
        raise TypeError(f"set_collective_label: label must be a str (got {label!r})")
    previous, _label = _label, label
    return previous


def _describe(op: str, t: torch.Tensor) -> str:
    return f"{op} of {t.numel()} x {t.dtype} ({_label})"


def _check(op: str, t: torch.Tensor, group) -> None:
    """The debug mode's fingerprint exchange before a collective."""
    world = dist.get_world_size(group)
    if world == 1:
        return
    fields = (op, str(t.dtype), _label)
    mine = torch.tensor(
        [t.numel(), *(zlib.crc32(f.encode()) for f in fields)], dtype=torch.int64, device=t.device
    )
    every = torch.empty(world * mine.numel(), dtype=torch.int64, device=t.device)
    _all_gather(every, mine, group=group)
    rows = every.view(world, -1).tolist()
    if all(row == rows[0] for row in rows):
        return
    described: list[str | None] = [None] * world
    dist.all_gather_object(described, _describe(op, t), group=group)
    by_text: dict[str, list[int]] = {}
    for rank, text in enumerate(described):
        by_text.setdefault(str(text), []).append(rank)
    lines = "; ".join(
        f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}: {text}"
        for text, r in by_text.items()
    )
    raise CollectiveMismatchError(
        f"ranks disagree on the next collective: {lines}. Every rank must run forward and "
        "backward through the same modules with parameters, and put the same outputs into "
        "its loss (a data-dependent branch or a module skipped on some ranks hangs the group)"
    )


def rank_and_world(group: dist.ProcessGroup | None = None) -> tuple[int, int]:
    """(rank, world size) in ``group``; (0, 1) when torch.distributed is not initialised."""
    if not dist.is_available() or not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _alone(group) -> bool:
    """No other rank takes part: no process group, or one of one rank.

    [Note: a collective over one rank] On one rank an all-gather or a
    reduce-scatter (a sum over one rank) is a copy and an all-reduce leaves
    its tensor as it is, so they are done here on the current stream,
    without the process group. Through NCCL they took 34 ms of the host's
    time in three steps of a 24-chunk LLaMA under Gemini on one GPU (213
    calls, torch.distributed's functions under cProfile), and the main job
    under torchrun on one GPU ran 1.25-1.31x faster without them (docs/benchmarks.md, "Offloaded steps, 2026-12-04 tenth session").
    They return None, as without a process group: there is nothing to wait
    for."""
    return not dist.is_initialized() or dist.get_world_size(group) == 1


def all_gather_into(out: torch.Tensor, shard: torch.Tensor, group=None, async_op: bool = False):
    """Gather every rank's ``shard`` into ``out`` (in rank order)."""
    if _alone(group):  # See [Note: a collective over one rank]
        out.copy_(shard)
        return None
    if _debug:
        _check("all_gather", shard, group)
    return _all_gather(out, shard, group=group, async_op=async_op)


def reduce_scatter_sum(out: torch.Tensor, full: torch.Tensor, group=None, async_op: bool = False):
    """Sum ``full`` over ranks and keep this rank's slice in ``out``."""
    if _alone(group):
        out.copy_(full)
        return None
    if _debug:
        _check("reduce_scatter", full, group)
    return _reduce_scatter(out, full, op=dist.ReduceOp.SUM, group=group, async_op=async_op)


def all_reduce_sum(t: torch.Tensor, group=None, async_op: bool = False):
    """Sum ``t`` over ranks, in place."""
    if _alone(group):
        return None
    if _debug:
        _check("all_reduce(sum)", t, group)
    return dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group, async_op=async_op)


def all_reduce_max(t: torch.Tensor, group=None) -> None:
    """Element-wise maximum of ``t`` over ranks, in place."""
    if not _alone(group):
        if _debug:
            _check("all_reduce(max)", t, group)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
