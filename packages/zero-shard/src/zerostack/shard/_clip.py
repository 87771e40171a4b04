"""Gradient norm, overflow and usage over shards: one all-reduce, one host read."""

from __future__ import annotations

import math

import torch

from zerostack.chunk import all_reduce_sum, set_collective_label


def grad_stats(
    shards: list[torch.Tensor], extra: torch.Tensor, group, norm_sq: torch.Tensor | None = None
) -> list[float]:
    """Sum over ranks of [squared L2 norm of ``shards``, *extra], read once.

    Per-shard norms stay on the device; they, and ``extra`` (e.g. per-parameter
    "had a gradient" flags), travel in one all-reduce, and the result reaches
    the host in one read. An inf or nan anywhere makes the norm non-finite on
    every rank, which is how overflow is detected. ``norm_sq``, when given, is
    this rank's squared norm already summed on the device (``shards`` unused).
    """
    device = extra.device
    if norm_sq is not None:
        norm_sq = norm_sq.float().to(device)
    elif shards:
        # Shards may sit on several devices (some offloaded to the host):
        # each norm comes to ``device`` before they are summed.
        norms = torch._foreach_norm(shards)
        norm_sq = torch.stack([n.float().to(device) for n in norms]).pow(2).sum()
    else:
        norm_sq = torch.zeros((), dtype=torch.float32, device=device)
    packed = torch.cat([norm_sq.view(1), extra.float()])
    set_collective_label("the step's gradient norm and overflow check")
    all_reduce_sum(packed, group)
    return packed.tolist()


def clip_coefficient(total_norm: float, max_norm: float) -> float:
    """The factor that brings ``total_norm`` down to ``max_norm`` (1 when
    clipping is off or not needed)."""
    if max_norm <= 0 or not math.isfinite(total_norm):
        return 1.0
    return min(1.0, max_norm / (total_norm + 1e-6))
