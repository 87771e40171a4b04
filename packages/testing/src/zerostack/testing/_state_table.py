"""A test of a state machine's table of allowed moves, as STYLE.md asks of
every one: each pair of states, allowed or refused."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from enum import Enum
from typing import Any

import pytest


def check_state_table(owner: Any, moves: Mapping[Enum, Collection[Enum]]) -> int:
    """Walk every ``(old, new)`` pair of the states that key ``moves``:
    ``owner`` put in ``old`` (its ``_state``) goes to ``new`` through
    ``owner._transition(new)`` when ``moves[old]`` holds it (then
    ``owner.training_state`` is ``new``), and raises RuntimeError matching
    ``illegal transition OLD -> NEW`` otherwise. No state may move to
    itself. Returns the number of allowed moves.
    """
    states = list(moves)
    allowed = 0
    for old in states:
        if old in moves[old]:
            raise AssertionError(f"check_state_table: {old.name} may move to itself")
        for new in states:
            owner._state = old
            if new in moves[old]:
                owner._transition(new)
                if owner.training_state is not new:
                    raise AssertionError(f"{old.name} -> {new.name} left {owner.training_state}")
                allowed += 1
            else:
                with pytest.raises(
                    RuntimeError, match=rf"illegal transition {old.name} -> {new.name}"
                ):
                    owner._transition(new)
    return allowed
