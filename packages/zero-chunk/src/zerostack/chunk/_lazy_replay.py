"""Replay of a LazyInitContext record: the real values of chosen tensors.
See [Note: lazy init record].

Only what the chosen tensors need runs, in recorded order: an op runs when a
tensor it makes or writes is needed later. A value overwritten whole before
it is read (``torch.empty`` then ``normal_``, or a layer's own init that the
model's init redraws) is never computed, but a random op whose result is
dead still runs, on a scratch tensor, so that every later draw sees the RNG
where eager construction had it. Each storage is freed after its last use,
so the live tensors at any point are those the remaining ops still read:
replaying a model module after module holds about one module at a time.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Callable, Iterator

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from zerostack.chunk._lazy_record import Op, Recording, Ref

_RUN, _SCRATCH = 1, 2  # run the op; run a dead random op for its RNG draws only


class Replay:
    """Computes ``targets`` (storage ids) from ``rec``.

    Args:
        rec: the record.
        targets: the storages whose final values are wanted.
        all_random: run every random op and RNG change, so that the
            generators end where eager construction left them.

    Raises:
        ValueError: a target depends on a meta tensor made outside the block.
    """

    def __init__(self, rec: Recording, targets: set[int], *, all_random: bool = False) -> None:
        self.rec = rec
        self.ops = list(rec.ops)
        self.targets = frozenset(targets)
        self.live: dict[int, torch.Tensor] = {}
        self._gens = [g for g, _ in rec.generators.values()]
        self._states = [state for _, state in rec.generators.values()]
        self._saved: list[torch.Tensor] = []
        self._plan(all_random)

    def _plan(self, all_random: bool) -> None:
        """Walk the record backwards, keeping the ops whose results are needed,
        and the draws and RNG state changes that a kept draw depends on."""
        needed = set(self.targets)
        self.mode = [0] * len(self.ops)
        self.keep: dict[int, tuple[tuple[int, int], ...]] = {}  # op -> (leaf, sid) to keep
        # Per generator: does a kept draw (or, with all_random, the end) come
        # later, with no state set in between? Then an earlier draw must run.
        later_draw: dict[int, bool] = defaultdict(lambda: all_random)
        slots_needed: set[int] = set()  # saved states that a kept state change restores
        for k in range(len(self.ops) - 1, -1, -1):
            op = self.ops[k]
            g = id(op.gen)
            if op.rng is not None:
                kind, value = op.rng
                if kind == "get":
                    if value in slots_needed:
                        self.mode[k] = _RUN
                        later_draw[g] = True
                    continue
                if later_draw[g]:  # a state a later draw starts from
                    self.mode[k] = _RUN
                    if kind == "slot":
                        slots_needed.add(value)
                later_draw[g] = False
                continue
            made = [sid for _, sid in op.creates]
            if any(s in needed for s in made) or any(s in needed for s, _ in op.writes):
                self.mode[k] = _RUN
                self.keep[k] = tuple((j, s) for j, s in op.creates if s in needed)
                needed.difference_update(made)
                needed.difference_update(s for s, whole in op.writes if whole)
                needed |= op.reads
                if op.random:
                    later_draw[g] = True
            elif op.random and later_draw[g]:
                self.mode[k] = _SCRATCH
                needed |= op.reads
        if needed:
            storage = self.rec.storages[min(needed)]
            if storage.device is None:
                raise ValueError(
                    "LazyInitContext: a value depends on a meta tensor made outside the "
                    f"`with LazyInitContext()` block (got shape {list(storage.base.size)}, "
                    f"{storage.base.dtype}); create it inside the block, or on a real device"
                )
            raise AssertionError(f"LazyInitContext: no recorded op makes storages {sorted(needed)}")

    def run(self, on_final: Callable[[int], None] | None = None) -> None:
        """Replay; call ``on_final(sid)`` as each target's value is final (the
        caller's RNG state is in place during the call). Targets stay live
        until ``drop``."""
        last: dict[int, int] = {}
        for k, mode in enumerate(self.mode):
            if mode:
                op = self.ops[k]
                for i, x in enumerate(op.flat):
                    if type(x) is Ref and not (mode == _SCRATCH and i in op.whole):
                        last[x.sid] = k
                for _, s in self.keep.get(k, ()):
                    last[s] = k
        frees: dict[int, list[int]] = defaultdict(list)
        for s, k in last.items():
            frees[k].append(s)
        slots: dict[int, torch.Tensor] = {}
        self._swap_in()
        try:
            with torch.no_grad(), self.rec.pause():
                for k, mode in enumerate(self.mode):
                    if not mode:
                        continue
                    op = self.ops[k]
                    if op.rng is not None:
                        self._rng(op, slots)
                    else:
                        self._run(op, mode, k)
                    for s in frees.get(k, ()):
                        if s not in self.targets:
                            self.live.pop(s, None)
                        elif on_final is not None:
                            self._swap_out()
                            try:
                                on_final(s)
                            finally:
                                self._swap_in()
        finally:
            self._swap_out()

    def view(self, ref: Ref) -> torch.Tensor:
        """The live value of ``ref``: its storage's tensor, or a view of it."""
        base = self.live.get(ref.sid)
        if base is None:
            raise AssertionError(f"LazyInitContext: storage {ref.sid} is not live in the replay")
        if (ref.dtype, ref.size, ref.stride, ref.offset) == (
            base.dtype, tuple(base.shape), tuple(base.stride()), base.storage_offset()
        ):  # fmt: skip
            return base
        return torch.empty(0, dtype=ref.dtype, device=base.device).set_(
            base.untyped_storage(), ref.offset, ref.size, ref.stride
        )

    def drop(self, sid: int) -> None:
        self.live.pop(sid, None)

    @contextlib.contextmanager
    def generators_at_end(self) -> Iterator[None]:
        """The generators as the replay left them, for the block's duration."""
        self._swap_in()
        try:
            yield
        finally:
            self._swap_out()

    # -- internals ------------------------------------------------------------

    def _run(self, op: Op, mode: int, k: int) -> None:
        vals = list(op.flat)
        for i, x in enumerate(op.flat):
            if type(x) is Ref:
                if i in op.whole and mode == _SCRATCH:
                    storage = self.rec.storages[x.sid]
                    vals[i] = torch.empty_strided(
                        x.size, x.stride, dtype=x.dtype, device=storage.device
                    )
                    continue
                if i in op.whole and x.sid not in self.live:
                    self.live[x.sid] = self._alloc(
                        x.sid
                    )  # overwritten whole: never computed before
                vals[i] = self.view(x)
            elif i in op.scratch:
                vals[i] = torch.empty_like(x)  # a real tensor from outside: left alone
        args, kwargs = tree_unflatten(vals, op.spec)
        out = op.func(*args, **kwargs)
        keep = self.keep.get(k)
        if keep:
            out_flat = tree_flatten(out)[0]
            for j, s in keep:
                self.live[s] = self._fit(out_flat[j], s)

    def _alloc(self, sid: int) -> torch.Tensor:
        storage = self.rec.storages[sid]
        b = storage.base
        raw = torch.UntypedStorage(storage.nbytes, device=storage.device)
        return torch.empty(0, dtype=b.dtype, device=storage.device).set_(
            raw, b.offset, b.size, b.stride
        )

    def _fit(self, out: torch.Tensor, sid: int) -> torch.Tensor:
        """``out`` laid out as the meta kernel laid out the recorded tensor
        (later views address the storage by those strides and offsets)."""
        storage = self.rec.storages[sid]
        b = storage.base
        if (
            out.device == storage.device
            and (out.dtype, tuple(out.shape), tuple(out.stride()), out.storage_offset())
            == (b.dtype, b.size, b.stride, b.offset)
            and out.untyped_storage().nbytes() == storage.nbytes
        ):
            return out
        fitted = self._alloc(sid)
        fitted.copy_(out)
        return fitted

    def _rng(self, op: Op, slots: dict[int, torch.Tensor]) -> None:
        kind, value = op.rng
        gen = op.gen
        if kind == "get":
            slots[value] = gen.get_state()
        elif kind == "slot":
            gen.set_state(slots[value])
        else:
            gen.set_state(value)

    def _swap_in(self) -> None:
        self._saved = [g.get_state() for g in self._gens]
        for g, state in zip(self._gens, self._states, strict=True):
            g.set_state(state)

    def _swap_out(self) -> None:
        self._states = [g.get_state() for g in self._gens]
        for g, state in zip(self._gens, self._saved, strict=True):
            g.set_state(state)
