"""The scaffolding of the per-package bad-input tables
(``tests/test_bad_inputs.py``): a case type, one torch thread, exact state
comparison and the check every case gets (see docs/reliability.md)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch


@dataclass(frozen=True)
class BadInput:
    """One entry point called the wrong way.

    Args:
        id: the case's name (unique in its table).
        call: ``call(env)`` makes the bad call.
        error: the exception type it must raise.
        match: a regex the message must match (it names the argument and the value).
        fixed: the case failed before the table existed (counted in the docs).
        options: per-table extras (e.g. the dtype of the model to build).
    """

    id: str
    call: Callable[[Any], object]
    error: type[BaseException]
    match: str
    fixed: bool = False
    options: dict[str, Any] = field(default_factory=dict)


@contextlib.contextmanager
def one_torch_thread() -> Iterator[None]:
    """Run on one intra-op thread: the tables use tiny tensors, and on a
    loaded machine a thread-pool barrier per op costs more than the op (a
    step took 0.8 s with 2 threads, 0.05 s with 1)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def same_state(a: Any, b: Any) -> bool:
    """Exact equality of nested tensors, dicts, lists and plain values."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return (
            isinstance(b, dict) and a.keys() == b.keys() and all(same_state(a[k], b[k]) for k in a)
        )
    if isinstance(a, list | tuple):
        return (
            isinstance(b, list | tuple)
            and len(a) == len(b)
            and all(same_state(x, y) for x, y in zip(a, b, strict=True))
        )
    return a == b


def check_bad_input(
    case: BadInput,
    env: Any,
    snapshot: Callable[[Any], Any],
    still_works: Callable[[Any], None] | None = None,
    cleanup: Callable[[Any], None] | None = None,
) -> None:
    """The three checks of a case: ``case.call(env)`` raises ``case.error``
    with a message matching ``case.match``; ``snapshot(env)`` is the same
    before and after (after ``cleanup(env)``, which undoes what the case
    itself did before its bad call, as a user would); then
    ``still_works(env)`` (a correct call) succeeds."""
    before = snapshot(env)
    with pytest.raises(case.error, match=case.match):
        case.call(env)
    if cleanup is not None:
        cleanup(env)
    if not same_state(before, snapshot(env)):
        raise AssertionError(f"{case.id}: the failed call changed the state")
    if still_works is not None:
        still_works(env)


def check_unique_ids(cases: Sequence[BadInput] | Sequence[Any]) -> None:
    """Every case of a table has its own id."""
    ids = [c.id for c in cases]
    duplicates = sorted({i for i in ids if ids.count(i) > 1})
    if duplicates:
        raise AssertionError(f"case ids used more than once: {duplicates}")
