"""The state of a tensor inside a chunk, and the only moves between states."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch


class TensorState(Enum):
    """The state of a tensor in its chunk; ``TRANSITIONS`` lists the legal moves."""

    FREE = 0  # nothing needed: the chunk may drop its gathered copy
    COMPUTE = 1  # in use by forward or backward: the gathered copy is needed
    HOLD = 2  # between uses: data valid (gathered or in this rank's shard)
    HOLD_AFTER_BWD = 3  # backward used it; its gradient is not complete yet
    READY_FOR_REDUCE = 4  # its gradient is complete and waits for the chunk's reduce

    # Members are singletons compared by identity: hash them by identity too,
    # in C. Enum's own __hash__ is a Python call, and the hooks look states up
    # in sets and counters thousands of times a step.
    __hash__ = object.__hash__


# [Note: tensor state table]
# Every legal move. Anything else is a bug in the caller and raises: where
# backward hooks can fire in either order, the caller resolves the order
# instead of this table being loosened (ColossalAI silently ignores such moves).
TRANSITIONS: dict[TensorState, frozenset[TensorState]] = {
    TensorState.FREE: frozenset({TensorState.HOLD, TensorState.COMPUTE}),
    TensorState.HOLD: frozenset({TensorState.FREE, TensorState.COMPUTE}),
    TensorState.COMPUTE: frozenset({TensorState.HOLD, TensorState.HOLD_AFTER_BWD}),
    TensorState.HOLD_AFTER_BWD: frozenset({TensorState.COMPUTE, TensorState.READY_FOR_REDUCE}),
    TensorState.READY_FOR_REDUCE: frozenset({TensorState.HOLD}),
}
"""Every legal move between tensor states; any other raises (see [Note: tensor state table])."""


@dataclass(slots=True)
class TensorInfo:
    """Where one tensor lives in its chunk, and its state."""

    offset: int
    """First element of the tensor in the chunk."""

    end: int
    """One past its last element."""

    shape: torch.Size
    """Its shape (the data is re-viewed from the chunk with it)."""

    state: TensorState = TensorState.HOLD
    """Its current state."""

    @property
    def numel(self) -> int:
        return self.end - self.offset


def path_between(old: TensorState, new: TensorState) -> list[TensorState]:
    """The shortest chain of legal moves from ``old`` to ``new`` (``new``
    last; empty when they are equal), from the table above.

    Raises:
        ValueError: ``new`` cannot be reached from ``old``.
    """
    paths: dict[TensorState, list[TensorState]] = {old: []}
    frontier = [old]
    while frontier and new not in paths:
        nxt = []
        for state in frontier:
            for move in sorted(TRANSITIONS[state], key=lambda s: s.value):
                if move not in paths:
                    paths[move] = [*paths[state], move]
                    nxt.append(move)
        frontier = nxt
    if new not in paths:
        raise ValueError(f"path_between: {new.name} cannot be reached from {old.name}")
    return paths[new]
