"""check_state_table: passes a machine that follows its table, fails one that does not."""

from __future__ import annotations

from enum import Enum

import pytest

from zerostack.testing import check_state_table


class _S(Enum):
    A = 0
    B = 1
    C = 2


_TABLE = {_S.A: frozenset({_S.B}), _S.B: frozenset({_S.A, _S.C}), _S.C: frozenset({_S.A})}


class _Machine:
    def __init__(self, table, strict: bool = True) -> None:
        self._state, self.table, self.strict = _S.A, table, strict

    @property
    def training_state(self) -> _S:
        return self._state

    def _transition(self, new: _S) -> None:
        if self.strict and new not in self.table[self._state]:
            raise RuntimeError(f"illegal transition {self._state.name} -> {new.name}")
        self._state = new


def test_a_machine_that_follows_its_table_passes():
    assert check_state_table(_Machine(_TABLE), _TABLE) == 4


def test_a_machine_that_allows_a_move_outside_its_table_fails():
    with pytest.raises(pytest.fail.Exception, match=r"DID NOT RAISE"):
        check_state_table(_Machine(_TABLE, strict=False), _TABLE)


def test_a_table_that_moves_a_state_to_itself_fails():
    table = dict(_TABLE)
    table[_S.C] = frozenset({_S.A, _S.C})
    with pytest.raises(AssertionError, match=r"C may move to itself"):
        check_state_table(_Machine(table), table)
