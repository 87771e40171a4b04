"""ZeroOptimizer(cpu_offload=True, gpu_update_fraction=f)'s device lane: a
share of the offloaded buckets updated by the compute device's Adam, their
masters and Adam states streamed from their pinned host homes and back.

[Note: Adam where the bandwidth is] With ``cpu_offload`` every update used
to run in CPU Adam, bound by host memory bandwidth, while PCIe and the GPU's
Adam sat idle (see [Note: offloaded step pipeline], and [Note: step-time
floor] for the split that finishes first). With ``gpu_update_fraction`` f,
buckets holding about f of this rank's elements, spread through write-back
order (``lane_members``), are the device lane; the rest step in CPU Adam as
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

Which buckets: about one in 1/f, spread through write-back order (the
order the next forward needs them), so that the forward follows both lanes
as they go ([Note: the lane's units spread through the forward's order]);
CPU Adam's calls close at each device-lane bucket. A device-lane update
only queues copies and a kernel, on a worker of its own (zerostack.shard's
[Note: the device lane's own worker]), beside CPU Adam's: PCIe, the GPU and
the CPU work at the same time from the start of the update phase.

Hosts read or write the homes only after ``settle()`` (the last copy back is
done): ``wait_updates()`` (and so the state-dict methods), a parameter
written in place (``_adopt_writes``), a load. The next step's copies to the
device are ordered after this step's copies back on the device itself.
The mechanism (homes, staging slots, streams, the window loop, the check
of the optimizer) is ``LaneStaging`` in ``_lane.py``, shared with
GeminiOptimizer's ``gpu_update_fraction``, whose unit is a CPU-held chunk
instead of a bucket (zerostack.gemini's [Note: Gemini's device lane]).
Exact: the same kernel math on the same values, bit for bit on CUDA too
(zerostack-fused-adam's CUDA kernel does CPU Adam's operations). A failed update
writes nothing when it fails in its first window (the kernels' argument
checks, an injected fault): the kernels step the staging copies, the
parameters and homes are written after them and the step counts at the
end, so its retry gives the uninterrupted run's values. A bucket of
several windows that fails in a later one keeps the windows it stepped:
the step's ``LaneProgress`` (given again to the retry) says how far it
got, and the retry goes on from there, so no window is stepped twice and
the run again equals the uninterrupted one. ``zero_grad()`` dropping such
an update leaves those windows stepped (as CPU Adam's NVMe pieces, see
[Note: a failed CPU update]).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from zerostack.chunk import phase
from zerostack.shard import _partition as part
from zerostack.shard._lane import (
    LANE_HYPER,
    LaneHomes,
    LaneProgress,
    LaneStaging,
    Launch,
)

if TYPE_CHECKING:
    from zerostack.shard._bucket import _Bucket, _Shard

__all__ = ["DeviceLane", "LaneHomes"]


def lane_writable(param: torch.Tensor) -> bool:
    """Whether the device lane can write ``param``: it writes parameters in
    place as flat pieces, so they must be contiguous. ``gpu_update_fraction``
    "auto" gives 0.0 (saying why) for a model with one that is not; a
    number raises (``_contiguous_params``)."""
    return param.is_contiguous()


def _contiguous_params(bucket: _Bucket) -> None:
    for s in bucket.shards:
        if not lane_writable(s.param):
            raise NotImplementedError(
                f"ZeroOptimizer: gpu_update_fraction writes parameters in place as flat pieces, "
                f"and {s.name} is not contiguous (got stride {s.param.stride()}); make the "
                "model's parameters contiguous or pass gpu_update_fraction=0.0"
            )


class DeviceLane:
    """ZeroOptimizer's device lane: its buckets' homes and update, over the
    shared ``LaneStaging`` (see [Note: Adam where the bandwidth is]).

    Args:
        buckets: the device-lane buckets; their masters are rebound to views
            of their new homes.
        optimizer: the inner optimizer (fused-adam's), whose groups give the
            hyperparameters and whose ``state`` holds the step counts.
        device: the compute device.
        world, rank: this rank's place (for its pieces of the parameters).
        pin: pin the homes (with CUDA).
        window: elements of a staging slot (rounded up to a multiple of
            1024, at most the largest bucket's): ZeroOptimizer gives
            ``min(reduce_bucket_size, LANE_WINDOW) / world``.
    """

    def __init__(
        self, buckets: list[_Bucket], optimizer: torch.optim.Optimizer, device: torch.device,
        world: int, rank: int, pin: bool, window: int,
    ) -> None:  # fmt: skip
        self.optimizer, self.device, self.world, self.rank = optimizer, device, world, rank
        # Staging slots hold a window of a bucket: a bucket larger (one
        # parameter above reduce_bucket_size) crosses in several.
        self.staging = LaneStaging(device, window, max(b.piece_total for b in buckets))
        self._elements = sum(b.piece_total for b in buckets)
        self._buckets = len(buckets)
        self.updates = 0  # buckets updated by the device's Adam
        groups = optimizer.param_groups
        self._group_of = {id(m): gi for gi, g in enumerate(groups) for m in g["params"]}
        self._offset = {
            s.index: off for b in buckets for s, off in zip(b.shards, b.offsets, strict=True)
        }
        for bucket in buckets:  # every one checked before any master is rebound
            _contiguous_params(bucket)
        for bucket in buckets:
            bucket.lane = self._homes(bucket, pin, device.type == "cuda")

    @staticmethod
    def _homes(bucket: _Bucket, pin: bool, cuda: bool) -> LaneHomes:
        homes = LaneHomes.new(bucket.piece_total, bucket.shards[0].master.dtype, pin, cuda)
        with torch.no_grad():
            for s, off in zip(bucket.shards, bucket.offsets, strict=True):
                view = homes.master[off : off + s.piece]
                view.copy_(s.master)
                s.master.data = view  # the same tensor object: groups and state keys hold
        return homes

    def describe(self) -> str:
        """The lane's share, for the layout's log line."""
        return (
            f"{len(self._offset)} params in {self._buckets} buckets spread through "
            f"write-back order step in the device's Adam, {self._elements} elements of this "
            f"rank's pieces, staging {2 * self.staging.window} elements on the device"
        )

    def staging_bytes(self) -> int:
        """Bytes of the staging slots on the device (allocated at the first update)."""
        return self.staging.staging_bytes()

    def start(self) -> None:
        """See ``LaneStaging.start``."""
        self.staging.start()

    def settle(self) -> None:
        """Wait until the homes hold every update queued so far (a host wait)."""
        self.staging.settle()

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
        versions: list[int], progress: LaneProgress,
    ) -> None:  # fmt: skip
        """Step ``pairs`` (each used shard of ``bucket`` and its reduced
        gradient on the device) in the device's Adam, one staging window
        after the other; on the worker when overlapping. ``versions``: the
        owner's parameter versions, kept current for the parameters written
        here (see [Note: parameters written in place]). ``progress``: this
        step's, the same object in a retry, which goes on from the first
        window not stepped."""
        if bucket.lane is None:  # a lane bucket has homes from construction on
            raise AssertionError(f"rank {self.rank}: DeviceLane.update of a bucket without homes")
        with phase("zerostack::device_update"), self.staging.lock:
            created = self._states(pairs, bucket)
            # A parameter written since the last write-back keeps the user's
            # value (the write-back adopts it into its master).
            mine = [s for s, _ in pairs if s.param._version == versions[s.index]]
            dtype = bucket.shards[0].param.dtype
            try:
                self.staging.run(
                    bucket.lane, bucket.piece_total, self._launches(pairs), div_scale, dtype,
                    lambda out, window: self._write_params(mine, out, window), progress,
                )  # fmt: skip
            except BaseException:
                if progress.done == 0:  # nothing stepped: as if it never began
                    for s in created:
                        self.optimizer.state.pop(s.master, None)
                else:  # the windows stepped wrote these; the retry writes the rest
                    for s in mine:
                        versions[s.index] = s.param._version
                raise
            for s, _ in pairs:
                self.optimizer.state[s.master]["step"] += 1
            for s in mine:
                versions[s.index] = s.param._version
            self.updates += 1

    def _launches(self, pairs: list) -> list[Launch]:
        """The kernel calls: shards by parameter group and step count (each
        call takes one of each)."""
        calls: dict[tuple[int, float], list] = {}
        for s, grad in pairs:
            step = float(self.optimizer.state[s.master]["step"]) + 1
            key = (self._group_of[id(s.master)], step)
            calls.setdefault(key, []).append((self._offset[s.index], s.piece, grad))
        groups = self.optimizer.param_groups
        return [
            ({k: groups[gi][k] for k in LANE_HYPER}, step, items)
            for (gi, step), items in calls.items()
        ]

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
