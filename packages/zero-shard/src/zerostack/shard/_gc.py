"""When Python's cycle collector runs during training.

[Note: collector schedule] A training step creates and drops many Python
objects (autograd nodes, hook arguments, small lists). Their count triggers
the cycle collector at points no one chose, and a generation-2 collection
walks every live object of the process: with a large model that is tens of
milliseconds, landing on a random step (measured on an H200: 0.207-0.288 s
per step with the collector on, 0.205-0.215 s with it off). As the large
trainers do (torchtitan, Megatron), the optimizer wrappers take the
collector off automatic at their first step (after one full collection) and
run a generation-1 collection every ``every_n_steps`` steps, with a full one
every ``_FULL_EVERY`` of those, so garbage still cannot pile up. Automatic
collection comes back when the last wrapper using the schedule is closed or
freed. ``every_n_steps=0`` leaves the collector alone (the opt-out).
"""

from __future__ import annotations

import gc
import logging
import weakref

from torch.profiler import record_function

logger = logging.getLogger(__name__)
_FULL_EVERY = 20  # scheduled collections per full (generation-2) collection
_users: weakref.WeakSet = weakref.WeakSet()  # schedules that have started
_state = {"disabled_by_us": False, "logged": False}


class CollectorSchedule:
    """The cycle collector's schedule for one optimizer wrapper.

    Args:
        api: the wrapper's name, for messages.
        every_n_steps: steps between scheduled collections; 0 leaves the
            collector alone. Default 50.

    Raises:
        ValueError: a negative ``every_n_steps``.
    """

    def __init__(self, api: str, every_n_steps: int = 50) -> None:
        if (
            isinstance(every_n_steps, bool)
            or not isinstance(every_n_steps, int)
            or every_n_steps < 0
        ):
            raise ValueError(
                f"{api}: gc_every_n_steps must be an int >= 0 (got {every_n_steps!r}); "
                "0 leaves Python's garbage collector alone"
            )
        self.api = api
        self.every_n_steps = every_n_steps
        self.steps = 0
        self.collections = 0

    def tick(self) -> None:
        """After each optimizer step."""
        if self.every_n_steps == 0:
            return
        if self.steps == 0:
            self._start()
        self.steps += 1
        if self.steps % self.every_n_steps == 0:
            self.collections += 1
            full = self.collections % _FULL_EVERY == 0
            with record_function("zerostack::gc"):
                gc.collect(2 if full else 1)

    def _start(self) -> None:
        _users.add(self)
        if gc.isenabled():
            gc.collect()
            gc.disable()
            _state["disabled_by_us"] = True
        if not _state["logged"]:
            _state["logged"] = True
            logger.info(
                "%s: automatic garbage collection is off during training; a generation-1 "
                "collection runs every %d steps (gc_every_n_steps=0 turns this off)",
                self.api, self.every_n_steps,
            )  # fmt: skip

    def close(self) -> None:
        """Stop using the schedule; the last user turns automatic collection back on."""
        _users.discard(self)
        if not _users and _state["disabled_by_us"]:
            _state["disabled_by_us"] = False
            gc.enable()
