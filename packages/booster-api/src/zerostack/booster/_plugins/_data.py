"""A DistributedSampler and DataLoader that remember where an epoch is, so a
resumed run skips the batches it already trained on.

[Note: sampler position] ``StatefulDistributedSampler.state_dict()`` holds the
epoch and how many of this rank's samples the DataLoader handed out in it;
``ResumableDataLoader`` counts them as it yields batches (not as the sampler
is read: with workers the loader reads indices ahead). After
``load_state_dict`` the next iteration starts at that position, once; the
epoch after starts from its beginning again.

``iter(DataLoader)`` draws one number from torch's global generator (the
workers' base seed). The uninterrupted run drew it when the epoch began, so
the state it saved mid-epoch comes after that draw; the resumed iteration
therefore draws under ``torch.random.fork_rng`` and leaves the restored RNG
as it was saved.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, DistributedSampler

_API = "StatefulDistributedSampler"


class StatefulDistributedSampler(DistributedSampler):
    """``torch.utils.data.DistributedSampler`` with a position: ``state_dict()``
    / ``load_state_dict()`` carry the epoch and the samples of this rank
    already consumed in it (counted by :class:`ResumableDataLoader`), and the
    first iteration after a load skips those. Arguments as DistributedSampler's.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.consumed = 0  # this rank's samples handed out in the current epoch
        self._start = 0  # samples to skip in the next iteration (after a load)

    def __iter__(self) -> Iterator[int]:
        indices = list(super().__iter__())
        start, self._start = self._start, 0
        self.consumed = start
        return iter(indices[start:])

    def set_epoch(self, epoch: int) -> None:
        """As DistributedSampler's; a new epoch starts at its first sample
        (unless it is the epoch a loaded state is in)."""
        if epoch != self.epoch:
            self._start = 0
            self.consumed = 0
        super().set_epoch(epoch)

    @property
    def resuming(self) -> bool:
        """True when the next iteration starts after a loaded position."""
        return self._start > 0

    def state_dict(self) -> dict[str, Any]:
        """``{"epoch", "consumed", "num_replicas", "seed", "shuffle",
        "dataset_len"}``: the position in samples of this rank, and what
        decides the order it points into (checked at the load)."""
        return {
            "epoch": self.epoch,
            "consumed": self.consumed,
            "num_replicas": self.num_replicas,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "dataset_len": len(self.dataset),  # type: ignore[arg-type]
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Go to the saved epoch and position. Saved at another world size, the
        position is scaled (the same number of samples over all ranks; the
        samples themselves differ, as the ranks split the data otherwise).

        Raises:
            ValueError: ``state`` is not a ``state_dict()``, or its seed,
                shuffle or dataset length differ from this sampler's (the
                position would skip samples not seen and repeat others).
        """
        if not isinstance(state, dict) or not {"epoch", "consumed"} <= set(state):
            raise ValueError(
                f"{_API}.load_state_dict: state must be a state_dict() of this sampler (got "
                f"{sorted(state) if isinstance(state, dict) else type(state).__name__}); pass "
                "what state_dict() returned"
            )
        now = {"seed": self.seed, "shuffle": self.shuffle, "dataset_len": len(self.dataset)}  # type: ignore[arg-type]
        other = {k: (state[k], v) for k, v in now.items() if k in state and state[k] != v}
        if other:  # the position would point into another order of the data
            raise ValueError(
                f"{_API}.load_state_dict: the saved position is in another order of the data "
                f"(got {other} as (saved, now)); build the dataloader with the saved seed, "
                "shuffle and dataset, or leave the dataloader out of the load to start the epoch afresh"
            )
        consumed = int(state["consumed"])
        saved_world = int(state.get("num_replicas", self.num_replicas))
        if saved_world != self.num_replicas:
            consumed = consumed * saved_world // self.num_replicas
        self.epoch = int(state["epoch"])
        self._start = min(consumed, self.num_samples)
        self.consumed = self._start


class ResumableDataLoader(DataLoader):
    """A DataLoader that tells its :class:`StatefulDistributedSampler` how many
    samples it has yielded; see [Note: sampler position]."""

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]  # a generator over it
        sampler = self.sampler
        if not isinstance(sampler, StatefulDistributedSampler):
            yield from super().__iter__()
            return
        if sampler.resuming:
            with torch.random.fork_rng(devices=[]):
                it = super().__iter__()
        else:
            it = super().__iter__()
        step = self.batch_size or 1
        for batch in it:
            # A short last batch only happens at the end: the count caps there.
            sampler.consumed = min(sampler.num_samples, sampler.consumed + step)
            yield batch

    def state_dict(self) -> dict[str, Any]:
        """The sampler's position (see [Note: sampler position]).

        Raises:
            TypeError: the sampler has no position.
        """
        return _stateful(self).state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at a saved position."""
        _stateful(self).load_state_dict(state)


def _stateful(loader: DataLoader) -> StatefulDistributedSampler:
    sampler: Any = getattr(loader, "sampler", None)
    if not callable(getattr(sampler, "state_dict", None)):
        raise TypeError(
            f"dataloader: its sampler has no state_dict (got {type(sampler).__name__}); build "
            "the dataloader with plugin.prepare_dataloader (a StatefulDistributedSampler)"
        )
    return sampler
