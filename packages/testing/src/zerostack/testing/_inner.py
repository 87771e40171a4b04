"""Watch the steps a wrapper takes of its inner optimizer."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch


@contextlib.contextmanager
def inner_steps(
    optimizer: torch.optim.Optimizer, before: Callable[[torch.optim.Optimizer], None] | None = None
) -> Iterator[list[None]]:
    """Count (and run ``before`` ahead of) each ``step`` of ``optimizer``,
    the inner optimizer a wrapper steps, while the block runs.

    Wrappers step their inner optimizer through its class, without torch's
    hook wrapper (zero-shard's ``step_with_div_scale(..., hooks=False)``),
    so a step hook on it would not see those steps: this replaces the
    class's ``step`` for the block, for both ways of calling it, and acts on
    ``optimizer``'s calls only (other instances of the class step as before).

    Yields:
        A list that gains one entry per step of ``optimizer``.
    """
    cls = type(optimizer)
    original = cls.__dict__["step"]  # torch's wrapper, set on the class at construction
    unwrapped = original.__wrapped__
    calls: list[None] = []

    def counted(self: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        if self is optimizer:
            calls.append(None)
            if before is not None:
                before(self)
        return unwrapped(self, *args, **kwargs)

    wrapper = torch.optim.Optimizer.profile_hook_step(counted)
    wrapper.hooked = True  # type: ignore[attr-defined]
    cls.step = wrapper  # type: ignore[method-assign]
    try:
        yield calls
    finally:
        cls.step = original  # type: ignore[method-assign]
