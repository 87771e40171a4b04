"""GeminiOptimizer(gpu_update_fraction=f)'s device lane: a share of the
CPU-held optimizer chunks updated by the compute device's Adam, over
zerostack.shard's ``LaneStaging`` (the mechanism ZeroOptimizer's
``cpu_offload`` lane uses: see zerostack.shard's [Note: Adam where the
bandwidth is]).

[Note: Gemini's device lane] The chunks whose masters and Adam states live
on the host (``GeminiDDP.offloaded_masters``: static ``offload_optim_frac``
or what auto placement left on the CPU) used to step in CPU Adam only. With
``gpu_update_fraction`` f, those of them holding about f of their
elements, spread through compute order (``chunk_lane``), are the device
lane; the others step in CPU Adam as before. A device-lane chunk:

- keeps its master and both Adam moments on the host between steps: the
  master chunk's shard is the master home (pinned once on CUDA, in place:
  the same tensor object, so the optimizer's state key and the chunk hold),
  and the inner optimizer's ``exp_avg`` / ``exp_avg_sq`` become two pinned
  flat homes (created as zeros, or a loaded state copied in, at ``step()``
  on the main thread before any slice is saved, and again in the update for
  a retry after a failed first update);
- keeps its reduced gradient on the device where its parameter shard lives
  there: backward stages nothing to the host for it (see [Note:
  CPU-step buffers]); its norm is taken there as for every chunk, so
  clipping and the fp16 overflow check cover both lanes;
- at ``step()``, is submitted to the one CpuUpdatePipeline under its chunk
  index like a CPU-lane chunk, so the order, the waits, the failure rule and
  the drop-a-batch rule are the CPU lane's. Its update copies master and
  moments into a staging slot on the device (``up`` stream), steps them in
  zerostack-fused-adam's ``adam_update`` (the CUDA kernel; on a CPU compute
  device the CPU kernel, which makes a CPU run equal f = 0 bitwise), writes
  the new fp16/bf16 values into the chunk's shard on the device (over the
  reduced gradient, window by window after the kernel read it) and copies
  the three back on the ``down`` stream. The write-back (the chunk's next
  use) makes the compute stream wait for the ``updated`` event and copies
  nothing;
- or, where its parameter shard lives in pinned host memory (static
  ``offload_param_frac``), finds its reduced gradient there (landed in
  backward: the device has no room to keep the lane's gradients, 2 B a
  parameter) and copies it up with the window, into a fifth staging buffer;
  the new values go down into that shard on ``down`` beside the homes, and
  the write-back makes the host wait for the ``stored`` event, since the
  next gather copies from that shard. So the split runs where every chunk
  lives on the host (the 2B and 8B rows of ``benchmarks/scale.py``), at 2 B
  more each way a parameter (the floor counts them: ``host_value_fraction``
  in [Note: step-time floor]).

A staging slot holds one chunk shard, so every chunk crosses in one window
and an update that fails (an argument check, an injected fault) has written
nothing: its retry gives the uninterrupted run's values. The device holds two
slots (``staging_bytes``: 2 x shard x 14 B with bf16 parameters, 16 B once
a gradient came from the host); auto placement plans with them subtracted
from the capacity, for the largest shard the lane takes of those left on
the host (the lane takes none larger than the median shard: not an
embedding's nor an untied head's, larger than a layer's), and its
steady-state evictions count them as held (``AutoPlacement.reserved_bytes``;
when they did not, gathered chunks took the staging's bytes over the plan:
LLaMA 1.1B under a 12 GiB cap ran out of memory in most runs). Under auto placement a
chunk whose shard was evicted to the host that step has its gradient on
the host, and the reserve has no room for its copy up: that step it runs in
CPU Adam, on the same homes, after their last copy back (as does a chunk
whose host gradient is pageable, whose copy would make the host wait).

Which chunks: about one in 1/f, spread through compute order (chunk order
under static placement, which records none), the order the next forward
needs them in, so that the forward follows both lanes as they go
(zerostack.shard's [Note: the lane's units spread through the forward's
order]). A device-lane update only queues copies and a kernel, on a worker
of its own beside CPU Adam's (zerostack.shard's [Note: the device lane's
own worker]): PCIe, the GPU and the CPU all work from the start of the
update phase.

Not implemented (``NotImplementedError`` at construction): optimizers other
than fused-adam's HybridAdam / CPUAdam (the lane runs fused-adam's Adam
kernels on the states those keep; torch's Adam or SGD would step other
math, or other states, than the CPU lane), and Adam states on disk
(``nvme_offload_fraction`` > 0: those states would cross disk, host and
PCIe, and HybridAdam's NVMe pipeline, which reads them ahead chunk by chunk,
owns where they are; the homes here are host memory).

Hosts read or write the homes only after ``settle()``: ``wait_updates()``
(and so every state-dict method and load), the step's saved slices of
parameters no rank gave a gradient, and a CPU-Adam update of a lane chunk.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from zerostack.chunk import Chunk, phase, pinned_empty
from zerostack.shard import LANE_HYPER, LaneHomes, LaneStaging, lane_members

logger = logging.getLogger(__name__)
_OUT_BYTES = {torch.float16: 2, torch.bfloat16: 2, torch.float32: 4}


def staging_bytes(shard_numel: int, dtype: torch.dtype, host_grads: bool = False) -> int:
    """Device bytes of the lane's two staging slots for chunk shards of
    ``shard_numel`` elements with ``dtype`` parameters: fp32 master and
    moments, and the new values (and, with ``host_grads``, the copy of a
    gradient from the host)."""
    values = _OUT_BYTES.get(dtype, 4)
    return 2 * shard_numel * (3 * 4 + values + (values if host_grads else 0))


def chunk_lane(sizes: list[int], fraction: float) -> list[int]:
    """The positions in ``sizes`` (CPU-held master shards' elements, in
    compute order) of the lane's chunks: ``lane_members`` over those no
    larger than the median shard, so that an embedding's or an untied head's
    chunk, larger than a layer's, does not set the staging (a slot holds a
    whole shard)."""
    return lane_members(sizes, fraction, sorted(sizes)[len(sizes) // 2]) if sizes else []


def lane_staging_bytes(fraction: float, dtype: torch.dtype, host_masters: list[Chunk]) -> int:
    """The staging of the lane ``GeminiLane.choose`` would take over
    ``host_masters`` (CPU-held master chunks in compute order, none
    pageable): for the largest shard of its members (``chunk_lane``)."""
    sizes = [m.shard_size for m in host_masters]
    members = chunk_lane(sizes, fraction)
    return staging_bytes(max(sizes[k] for k in members), dtype) if members else 0


class GeminiLane:
    """The device lane of a GeminiOptimizer (see [Note: Gemini's device lane]).

    Args:
        pairs: the optimizer's (param chunk, master chunk) pairs.
        masters: the master shards, by pair index (the inner optimizer's params).
        members: pair indices of the lane's chunks.
        optimizer: the inner optimizer (fused-adam's), whose ``state`` holds
            the steps and moments.
        device: the compute device.
        host_grads: take chunks whose gradient is in pinned host memory
            (static placement on CUDA; auto placement's reserve has no room
            for the copy of such a gradient: see [Note: Gemini's device lane]).
    """

    def __init__(
        self, pairs: list[tuple[Chunk, Chunk]], masters: list[torch.Tensor], members: list[int],
        optimizer: torch.optim.Optimizer, device: torch.device, host_grads: bool = False,
    ) -> None:  # fmt: skip
        self.pairs, self.masters, self.optimizer, self.device = pairs, masters, optimizer, device
        self.host_grads = host_grads
        cuda = device.type == "cuda"
        largest = max(masters[i].numel() for i in members)
        self.staging = LaneStaging(device, largest, largest)  # a slot holds a whole shard
        self.homes: dict[int, LaneHomes] = {}
        with torch.no_grad():
            for i in members:
                master = masters[i]
                if cuda and not master.is_pinned():  # the same tensor object, pinned
                    master.data = (
                        pinned_empty(master.numel(), master.dtype)
                        .copy_(master.detach().reshape(-1))
                        .view_as(master)
                    )
                self.homes[i] = LaneHomes.new(master.numel(), master.dtype, cuda, cuda, master)
        self.updates = 0  # chunks updated by the device's Adam

    @classmethod
    def choose(
        cls, pairs: list[tuple[Chunk, Chunk]], masters: list[torch.Tensor], order: list[int],
        fraction: float, optimizer: torch.optim.Optimizer, device: torch.device,
        host_grads: bool = False,
    ) -> GeminiLane | None:  # fmt: skip
        """The lane over those of ``order`` (CPU-held pair indices in
        compute order) holding about ``fraction`` of their elements, spread
        through it (``chunk_lane``); None when that is no chunk. Logs the
        decision."""
        members = [order[k] for k in chunk_lane([masters[i].numel() for i in order], fraction)]
        if not members:
            logger.info(
                "GeminiOptimizer: gpu_update_fraction %.2f moves none of the %d CPU-held optimizer "
                "chunks to the device's Adam", fraction, len(order),
            )  # fmt: skip
            return None
        lane = cls(pairs, masters, members, optimizer, device, host_grads)
        shard = lane.staging.window
        hosted = sum(pairs[i][0].shard_device.type == "cpu" for i in members) if host_grads else 0
        logger.info(
            "GeminiOptimizer: gpu_update_fraction %.2f: %d of %d CPU-held optimizer chunks "
            "(spread through compute order, %d of %d elements; %d with their parameter shard on "
            "the host) step in the Adam of %s, streamed from their host homes; staging %.1f MB "
            "there",
            fraction, len(members), len(order), sum(masters[i].numel() for i in members),
            sum(masters[i].numel() for i in order), hosted, device,
            staging_bytes(shard, pairs[order[0]][0].dtype, host_grads and hosted > 0) / 2**20,
        )  # fmt: skip
        return lane

    def __contains__(self, i: object) -> bool:
        return i in self.homes

    def takes(self, i: int, grad: torch.Tensor) -> bool:
        """Pair ``i`` steps in the device's Adam now: in the lane, its
        gradient on the compute device (by type: a device given as "cuda"
        has no index, its tensors' devices do), or with ``host_grads`` in
        pinned host memory."""
        if i not in self.homes:
            return False
        return grad.device.type == self.device.type or (self.host_grads and grad.is_pinned())

    def home_states(self, i: int) -> bool:
        """Pair ``i``'s moments are (views of) its homes: created as zeros
        (step 0) or copied in (loaded). True when the state was created."""
        homes, state = self.homes[i], self.optimizer.state[self.masters[i]]
        for key in ("exp_avg", "exp_avg_sq"):
            home, old = getattr(homes, key), state.get(key)
            if old is not None and old.data_ptr() == home.data_ptr():
                continue
            self.staging.settle()  # the homes are written below: no copy back may be in flight
            with torch.no_grad():
                home.copy_(old.reshape(-1) if old is not None else torch.zeros(()))
            if "step" not in state:  # HybridAdam's order of keys
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state[key] = home
        return float(state["step"]) == 0

    def settle(self) -> None:
        """Wait until the homes hold every update queued so far."""
        self.staging.settle()

    def events(self, i: int) -> LaneHomes:
        """Pair ``i``'s homes, whose ``updated`` event (``stored`` for new
        values in host memory) its write-back waits for."""
        return self.homes[i]

    @torch.no_grad()
    def update(
        self, i: int, grad: torch.Tensor, div_scale: float, saved: list | None,
        hyper: dict[str, Any],
    ) -> None:  # fmt: skip
        """Step pair ``i`` (its reduced gradient ``grad`` on the device, or
        landed in pinned host memory) in
        the device's Adam with the step's hyperparameters; on the worker
        when overlapping. ``saved``: slices of parameters no rank gave a
        gradient, put back after (see GeminiOptimizer._save_slices)."""
        chunk, master = self.pairs[i][0], self.masters[i]
        with phase("zerostack::device_update"), self.staging.lock:
            created = self.home_states(i)
            state = self.optimizer.state[master]
            # Where the write-back finds the new values: the shard (a
            # gathered copy is released there), or the kept-gathered share.
            target = chunk.shard if chunk.shard is not None else chunk.local_share()
            # A shard in host memory (its gradient landed there) gets them on
            # ``down``, beside the homes; the write-back waits for that.
            on_host = target.device.type == "cpu" and self.device.type != "cpu"
            launch = ({k: hyper[k] for k in LANE_HYPER}, float(state["step"]) + 1,
                      [(0, master.numel(), grad)])  # fmt: skip

            def write(out: torch.Tensor, window: tuple[int, int]) -> None:
                target[window[0] : window[1]].copy_(out)
                _unstepped(target, master, saved, non_blocking=True)

            try:
                self.staging.run(
                    self.homes[i], master.numel(), [launch], div_scale, target.dtype,
                    None if on_host else write, out_home=target if on_host else None,
                )  # fmt: skip
            except BaseException:
                if created:
                    self.optimizer.state.pop(master, None)
                raise
            state["step"] += 1
            if saved:
                self.staging.settle()  # the homes hold the step: put those slices back
                restore_unstepped(saved, self.optimizer.state)
                if on_host:
                    _unstepped(target, master, saved)
            self.updates += 1


def _unstepped(
    target: torch.Tensor, master: torch.Tensor, saved: list | None, non_blocking: bool = False
) -> None:
    """The saved values of parameters no rank gave a gradient over their
    slices of the new values ``target`` (see GeminiOptimizer._save_slices)."""
    for t, sl, value in saved or ():
        if t is master and value is not None:
            target[sl].copy_(value, non_blocking=non_blocking)


def restore_unstepped(saved: list | None, state: Any) -> None:
    """Put back what ``GeminiOptimizer._save_slices`` saved of parameters no
    rank gave a gradient: their slices of the master and of the optimizer's
    state. An entry without a value is a slice of a master whose state this
    step created: its slices of every state tensor become zeros, the state
    torch's optimizers start a parameter from at its first gradient (a
    momentum buffer of the chunk kept ``weight_decay * p`` there, and the
    parameter's first update later took 0.9 of it)."""
    for t, sl, value in saved or ():
        if value is not None:
            t[sl].copy_(value)
            continue
        for v in state.get(t, {}).values():  # element-wise ones: their zeros are a start
            if torch.is_tensor(v) and v.is_floating_point() and v.numel() == t.numel():
                v[sl].zero_()
