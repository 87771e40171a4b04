"""The partition/padding math every ZeRO stage uses."""

from __future__ import annotations

import torch


def _check(api: str, **values: int) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{api}: {name} must be an int (got {value!r})")
        if value < (1 if name == "world" else 0):
            raise ValueError(
                f"{api}: {name} must be >= {1 if name == 'world' else 0} (got {value})"
            )


def shard_numel(numel: int, world: int) -> int:
    """Elements of each rank's equal piece of a ``numel``-element tensor
    (padded: a tensor smaller than the group still gives every rank one)."""
    _check("shard_numel", numel=numel, world=world)
    return max(1, -(-numel // world))


def shard_bounds(numel: int, world: int, rank: int) -> tuple[int, int]:
    """The [start, end) of the real (unpadded) elements in ``rank``'s piece,
    relative to the flat tensor; empty when the piece is all padding."""
    _check("shard_bounds", numel=numel, world=world, rank=rank)
    if rank >= world:
        raise ValueError(f"shard_bounds: rank must be < world ({world}) (got {rank})")
    size = shard_numel(numel, world)
    start = min(numel, rank * size)
    return start, min(numel, start + size)


def padded_flat(t: torch.Tensor, world: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``t`` flattened and zero-padded to ``world * shard_numel`` elements."""
    numel = t.numel()
    out = torch.zeros(world * shard_numel(numel, world), dtype=dtype or t.dtype, device=t.device)
    out[:numel].copy_(t.reshape(-1))
    return out
