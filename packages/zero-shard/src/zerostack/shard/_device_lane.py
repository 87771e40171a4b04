"""ZeroOptimizer(cpu_offload=True, gpu_update_fraction=f)'s device lane: a
share of the offloaded buckets updated by the compute device's Adam, their
masters and Adam states streamed from their pinned host homes and back.

[Note: Adam where the bandwidth is] With ``cpu_offload`` every update used
to run in CPU Adam, bound by host memory bandwidth, while PCIe and the GPU's
Adam sat idle (see [Note: offloaded step pipeline], and [Note: step-time
floor] for the split that finishes first). With ``gpu_update_fraction`` f,
the first buckets in write-back order holding about f of this rank's
elements (``lane_prefix``) are the device lane; the rest step in CPU Adam as
before. A device-lane bucket:

- keeps its masters and both Adam moments on the host between steps, in
  three pinned flat buffers (``LaneHomes``): the masters are views of the
  first (rebound once, so they stay the tensors the inner optimizer and
  its state dict know), and the inner optimizer's ``exp_avg`` /
  ``exp_avg_sq`` become views of the others at the bucket's first update
  here (states loaded since are copied in first). Nothing of it stays on
  the device after the step but the staging below;
- keeps its reduced gradient on the device (backward copies nothing to the
  host for it; its squared norm is taken there as for the other buckets, so
  the global norm, clipping and the fp16 overflow check cover both lanes);
- at ``step()``, under the same key as a CPU-lane bucket (its position in
  write-back order) in the same ``CpuUpdatePipeline``, so the order, waits,
  failure rule ([Note: a failed CPU update]) and drop-a-batch rule ([Note:
  dropping a batch]) are the CPU lane's: its three buffers go host to
  device into one of two staging slots (pinned, non_blocking, on the lane's
  ``up`` stream), zerostack-fused-adam's ``adam_update`` steps them there
  (the CUDA multi-tensor kernel; on a CPU compute device the CPU kernel,
  which is what makes a CPU run bitwise equal to f = 0), its new fp16/bf16
  piece goes straight into the parameters, and on the ``down`` stream the
  three buffers go back. A slot holds ``reduce_bucket_size / N`` elements
  (a bucket of one larger parameter, an embedding say, crosses in several
  windows) and is taken again only after its copies back (an event the
  ``up`` stream waits for), so at most two windows are in flight, each
  direction of PCIe busy at once, and the device holds two windows of
  staging (``staging_bytes``: 14 B per element with bf16 parameters; two
  more for each other pairing of master and parameter dtypes in the lane,
  a model with fp32 and bf16 parameters say).
  The write-back then has nothing to copy at world size 1, and at N > 1
  all-gathers this rank's pieces from the parameters.

Which buckets: the first in write-back order, which the next forward needs
first. The one worker runs the updates in key order, and a device-lane
update only queues copies and a kernel, so with these buckets first it
queues all of them at once and goes on to CPU Adam: PCIe, the GPU and the
CPU work at the same time from the start of the update phase (had they come
last, the worker would queue them only after every CPU update). And the
forward's first modules wait only for the device lane, whose first bucket
is ready one copy and one kernel after ``step()``, while CPU Adam gets the
time of their forward as a head start on the buckets after them.

Hosts read or write the homes only after ``settle()`` (the last copy back is
done): ``wait_updates()`` (and so the state-dict methods), a parameter
written in place (``_adopt_writes``), a load. The next step's copies to the
device are ordered after this step's copies back on the device itself.
Exact: the same kernel math on the same values; on CUDA the kernel differs
from CPU Adam by rounding (fp32, a few ulp per step). A failed update
writes nothing when it fails in its first window (the kernels' argument
checks, an injected fault): the kernels step the staging copies, the
parameters and homes are written after them and the step counts at the
end, so its retry gives the uninterrupted run's values. A bucket of
several windows that fails after its first leaves those updated, as CPU
Adam's NVMe pieces do (see [Note: a failed CPU update]).
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from zerostack.chunk import phase
from zerostack.shard import _partition as part

if TYPE_CHECKING:
    from zerostack.shard._bucket import _Bucket, _Shard

_HYPER = ("lr", "betas", "eps", "weight_decay", "adamw_mode", "bias_correction")
_SLOTS = 2  # staging slots: one window copied in while the one before is copied back
_ALIGN = 1024  # a window's elements: slot boundaries keep the kernels' vector alignment


@dataclass(slots=True)
class LaneHomes:
    """A device-lane bucket's pinned host homes (flat, ``piece_total``
    elements) and its events (CUDA only). See [Note: Adam where the
    bandwidth is]."""

    master: torch.Tensor  # the masters' dtype; each master is a view of it
    exp_avg: torch.Tensor  # fp32; the inner optimizer's states are views of these
    exp_avg_sq: torch.Tensor
    updated: Any = None  # on ``up``: the parameters hold the update
    stored: Any = None  # on ``down``: the homes hold it

    def flat(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Master, exp_avg, exp_avg_sq: what crosses PCIe each way."""
        return self.master, self.exp_avg, self.exp_avg_sq


def lane_prefix(order: list[_Bucket], fraction: float) -> int:
    """How many buckets, from the first in write-back order, hold the share
    of elements nearest ``fraction`` (ties to fewer)."""
    total = sum(b.piece_total for b in order)
    best, best_gap, held = 0, fraction, 0
    for k, bucket in enumerate(order, start=1):
        held += bucket.piece_total
        gap = abs(held / total - fraction)
        if gap < best_gap:
            best, best_gap = k, gap
    return best


def _contiguous_params(bucket: _Bucket) -> None:
    for s in bucket.shards:
        if not s.param.is_contiguous():
            raise NotImplementedError(
                f"ZeroOptimizer: gpu_update_fraction writes parameters in place as flat pieces, "
                f"and {s.name} is not contiguous (got stride {s.param.stride()}); make the "
                "model's parameters contiguous or pass gpu_update_fraction=0.0"
            )


class DeviceLane:
    """The device lane's buffers, streams and update (see [Note: Adam where
    the bandwidth is]).

    Args:
        buckets: the device-lane buckets; their masters are rebound to views
            of their new homes.
        optimizer: the inner optimizer (fused-adam's), whose groups give the
            hyperparameters and whose ``state`` holds the step counts.
        device: the compute device.
        world, rank: this rank's place (for its pieces of the parameters).
        pin: pin the homes (with CUDA).
        window: elements of a staging slot (rounded up to a multiple of
            1024, at most the largest bucket's): ``reduce_bucket_size / world``
            bounds the buckets but those of one larger parameter.
    """

    def __init__(
        self, buckets: list[_Bucket], optimizer: torch.optim.Optimizer, device: torch.device,
        world: int, rank: int, pin: bool, window: int,
    ) -> None:  # fmt: skip
        self.optimizer, self.device, self.world, self.rank = optimizer, device, world, rank
        cuda = device.type == "cuda"
        self.up = torch.cuda.Stream(device) if cuda else None
        self.down = torch.cuda.Stream(device) if cuda else None
        # Staging per dtypes (master, moments, parameter), allocated at first
        # use: buckets of another dtype than the first's step in their own.
        self._slots: dict[tuple[torch.dtype, ...], list[tuple[torch.Tensor, ...]]] = {}
        self._free: dict[tuple[torch.dtype, ...], list[Any]] = {}
        self._next: dict[tuple[torch.dtype, ...], int] = {}
        # Staging slots hold a window of a bucket: a bucket larger (one
        # parameter above reduce_bucket_size) crosses in several.
        largest = max(b.piece_total for b in buckets)
        self._window = min(largest, -(-window // _ALIGN) * _ALIGN)
        self._elements = sum(b.piece_total for b in buckets)
        self._lock = threading.Lock()  # the worker and a retry on the main thread share the slots
        self._last: Any = None  # the last ``stored`` event recorded
        self.updates = 0  # buckets updated by the device's Adam
        groups = optimizer.param_groups
        self._group_of = {id(m): gi for gi, g in enumerate(groups) for m in g["params"]}
        self._offset = {
            s.index: off for b in buckets for s, off in zip(b.shards, b.offsets, strict=True)
        }
        for bucket in buckets:
            _contiguous_params(bucket)
            bucket.lane = self._homes(bucket, pin, cuda)

    @staticmethod
    def _homes(bucket: _Bucket, pin: bool, cuda: bool) -> LaneHomes:
        total, dtype = bucket.piece_total, bucket.shards[0].master.dtype
        homes = LaneHomes(
            master=torch.empty(total, dtype=dtype, pin_memory=pin),
            exp_avg=torch.zeros(total, dtype=torch.float32, pin_memory=pin),
            exp_avg_sq=torch.zeros(total, dtype=torch.float32, pin_memory=pin),
            updated=torch.cuda.Event() if cuda else None,
            stored=torch.cuda.Event(blocking=True) if cuda else None,  # a host waits: no spinning
        )
        with torch.no_grad():
            for s, off in zip(bucket.shards, bucket.offsets, strict=True):
                view = homes.master[off : off + s.piece]
                view.copy_(s.master)
                s.master.data = view  # the same tensor object: groups and state keys hold
        return homes

    def describe(self) -> str:
        """The lane's share, for the layout's log line."""
        return (
            f"{len(self._offset)} params in the first buckets (write-back order) step in the "
            f"device's Adam, {self._elements} elements of this rank's pieces"
        )

    def staging_bytes(self) -> int:
        """Bytes of the staging slots on the device (allocated at the first update)."""
        slots = (slot for ring in self._slots.values() for slot in ring)
        return sum(t.numel() * t.element_size() for slot in slots for t in slot)

    def start(self) -> None:
        """At ``step()``, before the updates are queued: the lane's copies and
        kernels come after the work queued so far (the last backward and its
        reductions) and after the last step's copies back."""
        if self.up is not None:
            self.up.wait_stream(torch.cuda.current_stream(self.device))
            self.up.wait_stream(self.down)

    def settle(self) -> None:
        """Wait until the homes hold every update queued so far (a host wait)."""
        if self._last is not None:
            self._last.synchronize()

    def _slot(self, bucket: _Bucket, numel: int) -> tuple[list[torch.Tensor], Any]:
        """The next staging slot of ``bucket``'s dtypes: its four buffers, cut
        to ``numel``, and the event its last copies back recorded."""
        dtypes = (
            bucket.lane.master.dtype,
            torch.float32,
            torch.float32,
            bucket.shards[0].param.dtype,
        )
        if dtypes not in self._slots:
            ring = [
                tuple(torch.empty(self._window, dtype=d, device=self.device) for d in dtypes)
                for _ in range(_SLOTS)
            ]
            if self.up is not None:  # freed with the lane: reused only after its copies
                for t in (t for slot in ring for t in slot):
                    t.record_stream(self.up)
                    t.record_stream(self.down)
            self._slots[dtypes] = ring
            self._free[dtypes] = [torch.cuda.Event() if self.up is not None else None for _ in ring]
            self._next[dtypes] = 0
        i = self._next[dtypes]
        self._next[dtypes] = (i + 1) % _SLOTS
        return [t[:numel] for t in self._slots[dtypes][i]], self._free[dtypes][i]

    def _states(self, pairs: list[tuple[_Shard, torch.Tensor]], bucket: _Bucket) -> list:
        """Each updated shard's state, homed: a new one (zeros) or one that is
        not a view of the homes yet (loaded) is put there first. Returns the
        shards whose state was created (dropped again if the update fails)."""
        homes, created = bucket.lane, []
        for s, _ in pairs:
            state = self.optimizer.state[s.master]
            off = self._offset[s.index]
            for key in ("exp_avg", "exp_avg_sq"):
                home = getattr(homes, key)[off : off + s.piece]
                old = state.get(key)
                if old is not None and old.data_ptr() == home.data_ptr():
                    continue
                self.settle()  # the homes are written below: no copy back may be in flight
                home.copy_(old.reshape(-1) if old is not None else torch.zeros(()))
                state[key] = home
            if "step" not in state:
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                created.append(s)
        return created

    @torch.no_grad()
    def update(
        self, bucket: _Bucket, pairs: list[tuple[_Shard, torch.Tensor]], div_scale: float,
        versions: list[int],
    ) -> None:  # fmt: skip
        """Step ``pairs`` (each used shard of ``bucket`` and its reduced
        gradient on the device) in the device's Adam, one staging window
        after the other; on the worker when overlapping. ``versions``: the
        owner's parameter versions, kept current for the parameters written
        here (see [Note: parameters written in place])."""
        with phase("zerostack::device_update"), self._lock:
            created = self._states(pairs, bucket)
            # A parameter written since the last write-back keeps the user's
            # value (the write-back adopts it into its master).
            mine = [s for s, _ in pairs if s.param._version == versions[s.index]]
            launches = self._launches(pairs)
            try:
                for w0 in range(0, bucket.piece_total, self._window):
                    window = (w0, min(bucket.piece_total, w0 + self._window))
                    self._step_window(bucket, launches, window, div_scale, mine)
            except BaseException:
                for s in created:
                    self.optimizer.state.pop(s.master, None)
                raise
            for s, _ in pairs:
                self.optimizer.state[s.master]["step"] += 1
            for s in mine:
                versions[s.index] = s.param._version
            self.updates += 1

    def _launches(self, pairs: list) -> dict[tuple[int, float], list]:
        """The kernel calls: shards by parameter group and step count (each
        call takes one of each), as (shard, offset, gradient)."""
        calls: dict[tuple[int, float], list] = {}
        for s, grad in pairs:
            step = float(self.optimizer.state[s.master]["step"]) + 1
            key = (self._group_of[id(s.master)], step)
            calls.setdefault(key, []).append((s, self._offset[s.index], grad))
        return calls

    def _step_window(
        self, bucket: _Bucket, launches: dict, window: tuple[int, int], div_scale: float,
        mine: list[_Shard],
    ) -> None:  # fmt: skip
        """Elements ``window`` of ``bucket``: homes to a staging slot, the
        kernels, this rank's new pieces into the parameters, slot back home."""
        from zerostack.fused_adam import adam_update  # checked at construction

        w0, w1 = window
        homes = bucket.lane
        (master, m, v, out), free = self._slot(bucket, w1 - w0)
        up = self.up
        with torch.cuda.stream(up) if up is not None else contextlib.nullcontext():
            if up is not None:
                up.wait_event(free)  # the slot's last copies back are done
            for stage, home in zip((master, m, v), homes.flat(), strict=True):
                stage.copy_(home[w0:w1], non_blocking=True)
            for (gi, step), items in launches.items():
                cut = [(max(off, w0), min(off + s.piece, w1), off, g) for s, off, g in items]
                cut = [
                    (lo - w0, hi - w0, g[lo - off : hi - off]) for lo, hi, off, g in cut if lo < hi
                ]
                if not cut:
                    continue
                ps, ms, vs, outs = ([t[a:b] for a, b, _ in cut] for t in (master, m, v, out))
                group = self.optimizer.param_groups[gi]
                adam_update(ps, [g for _, _, g in cut], ms, vs, step=step, div_scale=div_scale,
                            outs=outs, **{k: group[k] for k in _HYPER})  # fmt: skip
                if up is not None:
                    for _, _, g in cut:  # read on this stream; the step may drop them before
                        g.record_stream(up)
            self._write_params(mine, out, window)
            if up is not None:
                homes.updated.record(up)
        self._store(homes, (master, m, v), window, free)

    def _write_params(self, mine: list[_Shard], out: torch.Tensor, window: tuple[int, int]) -> None:
        """This rank's pieces of the updated parameters that lie in
        ``window``, from the kernel's copy-out into the parameters."""
        w0, w1 = window
        for s in mine:
            start, end = part.shard_bounds(s.param.numel(), self.world, self.rank)
            off = self._offset[s.index]
            lo, hi = max(off, w0), min(off + end - start, w1)  # the padding stays out
            if lo < hi:
                flat = s.param.view(-1)
                flat[start + lo - off : start + hi - off].copy_(out[lo - w0 : hi - w0])

    def _store(
        self, homes: LaneHomes, staged: tuple[torch.Tensor, ...], window: tuple[int, int],
        free: Any,
    ) -> None:  # fmt: skip
        """The stepped masters and moments of ``window`` back into their
        homes: on ``down``, after the kernel; then the slot may be taken again."""
        w0, w1 = window
        down = self.down
        with torch.cuda.stream(down) if down is not None else contextlib.nullcontext():
            if down is not None:
                down.wait_event(homes.updated)
            for home, stage in zip(homes.flat(), staged, strict=True):
                home[w0:w1].copy_(stage, non_blocking=True)
            if down is not None:
                homes.stored.record(down)
                free.record(down)
                self._last = homes.stored
