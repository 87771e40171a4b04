"""Every rank starts from rank 0's parameters and buffers, as torch DDP makes it.

[Note: rank 0's initial values] torch's DistributedDataParallel broadcasts
rank 0's parameters and buffers when it wraps a model, and DeepSpeed's engine
broadcasts the model at initialize, so a script that seeds each rank
differently before building its model (a per-rank augmentation seed) still
trains one model. ZeroOptimizer takes each rank's piece of a parameter from
that rank's own values, and GeminiDDP puts each rank's shard into the chunks:
without this, differently built ranks would train a stitch of their shards
that no rank initialised, with buffers that stay per rank. So both call
``sync_from_rank0`` when they wrap: one small all-reduce of three fp64
figures a tensor finds whether the ranks differ (the common case, ranks that
agree, costs nothing more), and only then is every tensor broadcast from rank
0 and a warning logged.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.nn.parameter import is_lazy

from zerostack.chunk import rank_and_world

logger = logging.getLogger(__name__)
# Elements turned into fp64 at a time: a tensor's figures cost at most 32 MB
# more on its device, not a fp64 copy of a whole embedding.
_SLICE = 2**22


def _figures(t: torch.Tensor) -> torch.Tensor:
    """Sum, sum of squares and sum over the even positions of ``t``, in fp64:
    equal on ranks that hold the same values (the same kernels on the same
    data), and unequal for different values, a permutation included."""
    flat = t.detach()
    if flat.is_complex():
        flat = torch.view_as_real(flat)
    flat = flat.reshape(-1)
    out = torch.zeros(3, dtype=torch.float64, device=flat.device)
    for start in range(0, flat.numel(), _SLICE):  # _SLICE is even: [::2] keeps even positions
        piece = flat[start : start + _SLICE].to(torch.float64)
        out[0] += piece.sum()
        out[1] += piece.dot(piece)
        out[2] += piece[::2].sum()
    return out


def _comm_device(group: dist.ProcessGroup | None) -> torch.device:
    """Where the group's collectives take tensors (NCCL: the current GPU)."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _broadcast_(
    t: torch.Tensor, src: int, group: dist.ProcessGroup | None, on: torch.device
) -> None:
    """Overwrite ``t`` with rank ``src``'s values, as bytes (any dtype)."""
    own = t.detach()
    if own.device == on and own.is_contiguous():
        dist.broadcast(own.reshape(-1).view(torch.uint8), src=src, group=group)
        return
    buf = own.reshape(-1).to(on, copy=True)
    dist.broadcast(buf.view(torch.uint8), src=src, group=group)
    own.copy_(buf.view(own.shape))


def sync_from_rank0(
    tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    group: dist.ProcessGroup | None = None,
    api: str = "sync_from_rank0",
) -> int:
    """Make every rank of ``group`` hold the group's rank 0's values of
    ``tensors`` when the ranks differ, as torch DDP does when it wraps a
    model. See [Note: rank 0's initial values].

    A collective: every rank of ``group`` calls it with the same tensors
    (names, shapes and dtypes) in the same order. Meta tensors (a model under
    LazyInitContext), uninitialized ones (``nn.LazyLinear``) and tensors met
    before are skipped. When the ranks agree, the only traffic is one
    all-reduce of 6 fp64 numbers a tensor; when any tensor differs, every
    tensor is broadcast from the group's rank 0 (on the current GPU for NCCL,
    the CPU otherwise, copied back in place) and the group's rank 0 logs a
    warning naming how many differed. A tensor holding a NaN counts as
    differing (it is broadcast, as DDP broadcasts every tensor).

    Args:
        tensors: (name, tensor) pairs, e.g. a module's named_parameters()
            and named_buffers(); the names go into the warning.
        group: the data-parallel group. Default None (the default group).
        api: who wraps the model, named in the warning. Default "sync_from_rank0".

    Returns:
        How many tensors differed between the ranks (0: nothing was broadcast).
    """
    rank, world = rank_and_world(group)
    if world == 1:
        return 0
    named: list[tuple[str, torch.Tensor]] = []
    seen: set[int] = set()
    for name, t in tensors:
        if not (t.is_meta or is_lazy(t)) and id(t) not in seen:
            seen.add(id(t))
            named.append((name, t))
    if not named:
        return 0
    on = _comm_device(group)
    mine = torch.stack([_figures(t).to(on) for _, t in named])
    both = torch.cat([mine, -mine])  # one MAX gives every figure's maximum and minimum
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    differ = (both[: len(named)] != -both[len(named) :]).any(dim=1).tolist()
    num_differ = sum(differ)
    if not num_differ:
        return 0
    src = dist.get_global_rank(group, 0) if group is not None else 0
    with torch.no_grad():
        for _, t in named:
            if t.numel():
                _broadcast_(t, src, group, on)
    if rank == 0:
        names = [n for (n, _), d in zip(named, differ, strict=True) if d]
        logger.warning(
            "%s: %d of %d parameters and buffers differ between the %d ranks (e.g. %s); every "
            "rank now holds rank 0's values, broadcast as torch DDP and DeepSpeed's engine do "
            "when they wrap a model; seed every rank alike before building the model to skip "
            "this broadcast",
            api, num_differ, len(named), world, ", ".join(names[:3]) + (", ..." if len(names) > 3 else ""),
        )  # fmt: skip
    return num_differ
