"""The device lane's mechanism, shared by ZeroOptimizer(cpu_offload) and
GeminiOptimizer (CPU-held chunks): pinned host homes of masters and Adam
states, two staging slots on the compute device, the ``up`` and ``down``
streams and the window loop that copies a home in, steps it in
zerostack-fused-adam's ``adam_update`` and copies it back. What each owner
keeps itself: which of its units (buckets, chunks) are in the lane, how the
inner optimizer's states become views of the homes, and where the new
fp16/bf16 values go (``write`` on the device, or ``out_home`` in host
memory). See [Note: Adam where the bandwidth is] in
zerostack.shard's ``_device_lane.py``.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from zerostack.shard._bucket import host_buffer

LANE_HYPER = ("lr", "betas", "eps", "weight_decay", "adamw_mode", "bias_correction")
_SLOTS = 2  # staging slots: one window copied in while the one before is copied back
_ALIGN = 1024  # a window's elements: slot boundaries keep the kernels' vector alignment

# One kernel call of a unit's update: adam_update's keywords (LANE_HYPER), the
# step count after it, and (offset in the unit's homes, elements, gradient)
# per tensor. A gradient on the device is read there; one in pinned host
# memory (Gemini's host-held shards) is copied up with the homes' window.
Launch = tuple[dict[str, Any], float, list[tuple[int, int, torch.Tensor]]]


@dataclass(slots=True)
class LaneHomes:
    """A device-lane unit's pinned host homes (flat) and its events (CUDA
    only). See [Note: Adam where the bandwidth is]."""

    master: torch.Tensor  # the masters' dtype; each master is (a view of) it
    exp_avg: torch.Tensor  # fp32; the inner optimizer's states are (views of) these
    exp_avg_sq: torch.Tensor
    updated: Any = None  # on ``up``: the owner's parameters on the device hold the update
    stored: Any = None  # on ``down``: the homes (and a run's ``out_home``) hold it
    host_values: bool = False  # the last run's new values went to an ``out_home``

    @classmethod
    def new(
        cls, total: int, dtype: torch.dtype, pin: bool, cuda: bool,
        master: torch.Tensor | None = None,
    ) -> LaneHomes:  # fmt: skip
        """Homes of ``total`` elements (zeros; ``master`` kept as the master
        home when given)."""

        return cls(
            master=host_buffer(total, dtype, pin) if master is None else master,
            exp_avg=host_buffer(total, torch.float32, pin, zero=True),
            exp_avg_sq=host_buffer(total, torch.float32, pin, zero=True),
            updated=torch.cuda.Event() if cuda else None,
            stored=torch.cuda.Event(blocking=True) if cuda else None,  # a host waits: no spinning
        )

    def flat(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Master, exp_avg, exp_avg_sq: what crosses PCIe each way."""
        return self.master, self.exp_avg, self.exp_avg_sq


def lane_members(sizes: Sequence[int], fraction: float, largest: int | None = None) -> list[int]:
    """Which units (positions in ``sizes``, their elements in the order the
    next forward needs them) the device lane takes: about ``fraction`` of
    the elements, spread through that order; none larger than ``largest``
    elements when given. See [Note: the lane's units spread through the
    forward's order].

    Walking the units in order, a unit joins the lane where that leaves the
    lane's running share of the elements so far nearer ``fraction`` (ties
    stay in CPU Adam), so every prefix of the order holds about ``fraction``
    in the lane; 0 takes none and 1 takes every unit that fits ``largest``.
    Then, where one unit joining or leaving brings the whole lane's share
    strictly nearer ``fraction`` (few units of unequal sizes), the one that
    brings it nearest does."""
    member = [False] * len(sizes)
    fits = [largest is None or size <= largest for size in sizes]
    seen = held = 0
    for k, size in enumerate(sizes):
        seen += size
        target = fraction * seen
        if fits[k] and abs(held + size - target) < abs(held - target):
            member[k], held = True, held + size
    gap = held - fraction * seen
    best, best_gap = None, abs(gap)
    for k, size in enumerate(sizes):
        flipped = abs(gap - size if member[k] else gap + size)
        if fits[k] and flipped < best_gap:
            best, best_gap = k, flipped
    if best is not None:
        member[best] = not member[best]
    return [k for k, m in enumerate(member) if m]


# [Note: the lane's units spread through the forward's order] Both lanes
# finish their units in the order the next forward needs them, and that
# forward waits for each unit's update. The lane used to take the first
# units (a prefix of that order): then the forward of CPU Adam's units could
# start only after the whole lane, long after CPU Adam had finished the
# first of them. On the 8.06B GPT of benchmarks/scale.py, every chunk on the
# host, the split (0.27) took 3.39 s a step against 3.03 s for CPU Adam
# alone, all of it in a forward of 2.06 s against 1.59-1.78 s
# (docs/benchmarks.md, twenty-fifth session). Spread, each prefix of the
# order holds about the lane's share of units, so with the two lanes
# balanced the k-th unit of the forward is ready after about k/N of the
# update phase, whichever lane steps it, and the forward follows both.
# Measured on one H100 host against the first units, in the same calls
# (docs/benchmarks.md, twenty-sixth session): the 4.24B GPT under a 24 GiB
# cap 1.124-1.160 s a step against 1.184-1.199 s; ZeRO-2 ``cpu_offload``
# 0.484-0.499 s against 0.500-0.508 s; the 8.06B split 3.20 s against
# 3.40 s (its forward 1.86 s against 2.06 s).
# Below a share of one half a large unit seldom joins: one of s elements
# joins only while the lane is behind its share by more than
# (1/2 - fraction) * s elements. Gemini's lane, whose staging holds a whole
# chunk shard, takes no chunk larger than the median (an embedding's or an
# untied head's, ``largest``), so its staging stays a typical chunk's; the
# ZeRO lane's staging holds a window, which a large bucket crosses in
# several.


def check_lane_optimizer(
    api: str, optimizer: torch.optim.Optimizer, device: torch.device, torch_adam: bool
) -> None:
    """What a device lane needs: Adam/AdamW in fused-adam's kernels (torch's
    Adam/AdamW too with ``torch_adam``, which ZeroOptimizer steps in
    fused-adam's), its states in host memory, and on CUDA the CUDA kernel.

    Raises:
        NotImplementedError: another optimizer, or Adam states on disk.
        RuntimeError: a CUDA device without fused-adam's CUDA kernel.
    """
    kind = type(optimizer)
    fused = kind.__module__.startswith("zerostack.fused_adam") and kind.__name__ != "FusedAdam"
    if not fused and not (torch_adam and kind in (torch.optim.Adam, torch.optim.AdamW)):
        wanted = "torch.optim.AdamW or Adam" if torch_adam else "zerostack.fused_adam's HybridAdam"
        raise NotImplementedError(
            f"{api}: gpu_update_fraction steps Adam/AdamW in fused-adam's kernels (got "
            f"{kind.__name__}); use {wanted}, or pass gpu_update_fraction=0.0"
        )
    from zerostack.fused_adam import cuda_kernel_available  # importable: checked above

    on_disk = getattr(optimizer, "nvme_offload_fraction", 0.0)
    if on_disk > 0:
        raise NotImplementedError(
            f"{api}: gpu_update_fraction with Adam states on disk is not implemented (got "
            f"nvme_offload_fraction={on_disk}); pass one of them as 0"
        )
    if device.type == "cuda" and not cuda_kernel_available():
        raise RuntimeError(
            f"{api}: gpu_update_fraction on {device} needs zerostack-fused-adam's CUDA kernel, "
            "which this install lacks (it is built where nvcc is found): reinstall with "
            "`ZEROSTACK_BUILD_CUDA=1 pip install --force-reinstall zerostack-fused-adam`"
        )


def lane_refusal(
    api: str, optimizer: torch.optim.Optimizer, device: torch.device, torch_adam: bool
) -> str | None:
    """Why ``check_lane_optimizer`` refuses a device lane (the first clause
    of its error), or None where it takes one."""
    try:
        check_lane_optimizer(api, optimizer, device, torch_adam)
    except (NotImplementedError, RuntimeError, ImportError) as refused:
        return str(refused).removeprefix(f"{api}: ").split(";")[0]
    return None


@dataclass
class LaneProgress:
    """How far one unit's update of one step got: elements stepped, window by
    window. A retry after a failure in a later window goes on from here, so
    no window is stepped twice (see [Note: Adam where the bandwidth is])."""

    done: int = 0


class LaneStaging:
    """The device lane's streams, staging slots and window loop (see [Note:
    Adam where the bandwidth is]).

    Args:
        device: the compute device.
        window: elements of a staging slot (rounded up to a multiple of
            1024, at most ``largest``).
        largest: elements of the largest unit the lane updates.
    """

    def __init__(self, device: torch.device, window: int, largest: int) -> None:
        self.device = device
        cuda = device.type == "cuda"
        self.up = torch.cuda.Stream(device) if cuda else None
        self.down = torch.cuda.Stream(device) if cuda else None
        # Staging per dtypes (master, moments, new values), allocated at first
        # use: a unit of other dtypes than the first's (an fp32 layer beside
        # bf16 ones, no fp32 masters) steps in slots of its own. A slot's
        # buffer for gradients copied from the host (by slot dtypes and the
        # gradient's dtype) is allocated at its first use too.
        self._slots: dict[tuple[torch.dtype, ...], list[tuple[torch.Tensor, ...]]] = {}
        self._grad_slots: dict[tuple[torch.dtype, ...], list[torch.Tensor]] = {}
        self._free: dict[tuple[torch.dtype, ...], list[Any]] = {}
        self._next: dict[tuple[torch.dtype, ...], int] = {}
        self.window = min(largest, -(-window // _ALIGN) * _ALIGN)
        # The worker and a retry on the main thread share the slots: an
        # owner holds this across a unit's update.
        self.lock = threading.Lock()
        self._last: Any = None  # the last ``stored`` event recorded

    def staging_bytes(self) -> int:
        """Bytes of the staging slots on the device (allocated at the first update)."""
        slots = [
            *(slot for ring in self._slots.values() for slot in ring),
            *self._grad_slots.values(),
        ]
        return sum(t.numel() * t.element_size() for slot in slots for t in slot)

    def start(self) -> None:
        """At ``step()``, before the updates are queued: the lane's copies and
        kernels come after the work queued so far (the last backward and its
        reductions) and after the last step's copies back."""
        if self.up is not None and self.down is not None:
            self.up.wait_stream(torch.cuda.current_stream(self.device))
            self.up.wait_stream(self.down)

    def settle(self) -> None:
        """Wait until the homes hold every update queued so far (a host wait)."""
        if self._last is not None:
            self._last.synchronize()

    def _buffers(self, dtypes: tuple[torch.dtype, ...]) -> list[torch.Tensor]:
        """One buffer of a window per dtype, on the device, allocated on
        ``up`` (see [Note: staging allocated on its own stream]); freed with
        the lane, so reused only after the copies of both streams."""
        if self.up is None or self.down is None:
            return [torch.empty(self.window, dtype=d, device=self.device) for d in dtypes]
        with torch.cuda.stream(self.up):
            made = [torch.empty(self.window, dtype=d, device=self.device) for d in dtypes]
        for t in made:
            t.record_stream(self.down)
        return made

    # [Note: staging allocated on its own stream] The staging slots are
    # allocated at their first use, in an update: on the CPU-step worker
    # thread, whose current stream is the device's default stream (the
    # compute stream unless the user set another). Allocated there, a slot
    # could take a block the main thread had just freed on that stream with
    # kernels of the next forward still queued over it; ``up`` had waited for
    # the compute stream at ``start()``, before those were queued, so
    # ``up``'s copies into the slot and those kernels raced. On H200 machines
    # this trained a 4.24B GPT under Gemini's auto placement wrong from its
    # first update in 4 of 8 benchmark runs whose lane took 38 or 39 chunks
    # (the first lane chunk's parameters off by 6% of their sum at the next
    # forward, in the run that measured it); docs/benchmarks.md, "Offloaded
    # steps, 2026-12-04 (later)". Allocated with ``up`` current, a slot's
    # block comes from ``up``'s pool, whose earlier users ran on ``up`` in
    # order; ``down`` only reads a slot, after ``up``'s event, and is
    # recorded, so the block outlives its copies.

    def _slot(
        self, dtypes: tuple[torch.dtype, ...], numel: int, grad: torch.dtype | None
    ) -> tuple[list, Any]:
        """The next staging slot's buffers (master, moments, new values, and
        with ``grad`` a buffer for gradients copied from the host), cut to
        ``numel``, and the event its last copies back recorded."""
        if dtypes not in self._slots:
            self._slots[dtypes] = [tuple(self._buffers(dtypes)) for _ in range(_SLOTS)]
            cuda = self.up is not None
            self._free[dtypes] = [torch.cuda.Event() if cuda else None for _ in range(_SLOTS)]
            self._next[dtypes] = 0
        i = self._next[dtypes]
        self._next[dtypes] = (i + 1) % _SLOTS
        buffers = [t[:numel] for t in self._slots[dtypes][i]]
        if grad is not None:
            ring = self._grad_slots.get((*dtypes, grad))
            if ring is None:
                ring = self._grad_slots[(*dtypes, grad)] = self._buffers((grad,) * _SLOTS)
            buffers.append(ring[i][:numel])
        return buffers, self._free[dtypes][i]

    def run(
        self, homes: LaneHomes, total: int, launches: list[Launch], div_scale: float,
        out_dtype: torch.dtype, write: Callable[[torch.Tensor, tuple[int, int]], None] | None,
        progress: LaneProgress | None = None, out_home: torch.Tensor | None = None,
    ) -> None:  # fmt: skip
        """Step ``total`` elements of ``homes``, one window after the other:
        ``write(out, (w0, w1))`` gets each window's new values in
        ``out_dtype`` (on ``up``, after the kernels; copy them where they go
        on the device); or, with ``out_home`` (pinned host memory of
        ``total`` elements), they are copied there on ``down`` beside the
        homes, and the ``stored`` event covers them. With ``progress`` (one
        per unit and step, given again to its retry) a run that failed goes
        on from the first window not yet stepped."""
        dtypes = (homes.master.dtype, torch.float32, torch.float32, out_dtype)
        hosted = {
            g.dtype for _, _, items in launches for _, _, g in items if g.device.type == "cpu"
        }
        if len(hosted) > 1:
            raise AssertionError(f"LaneStaging.run: host gradients of several dtypes ({hosted})")
        # Host gradients cross in a fifth buffer (on a CPU device the kernel reads them there).
        grad = hosted.pop() if hosted and self.up is not None else None
        homes.host_values = out_home is not None
        for w0 in range(progress.done if progress else 0, total, self.window):
            w1 = min(total, w0 + self.window)
            staged = self._slot(dtypes, w1 - w0, grad)
            self._step_window(homes, launches, (w0, w1), div_scale, staged, (write, out_home))
            if progress is not None:
                progress.done = w1

    def _step_window(
        self, homes: LaneHomes, launches: list[Launch], window: tuple[int, int],
        div_scale: float, staged: tuple[list, Any],
        to: tuple[Callable | None, torch.Tensor | None],
    ) -> None:  # fmt: skip
        """Elements ``window``: homes (and host gradients) to a staging slot,
        the kernels, the new values to ``write`` or ``out_home`` (``to``),
        the slot back home."""
        from zerostack.fused_adam import adam_update  # checked by check_lane_optimizer

        w0, w1 = window
        (master, m, v, out, *host_grad), free = staged
        up = self.up
        with torch.cuda.stream(up) if up is not None else contextlib.nullcontext():
            if up is not None:
                up.wait_event(free)  # the slot's last copies back are done
            for stage, home in zip((master, m, v), homes.flat(), strict=True):
                stage.copy_(home[w0:w1], non_blocking=True)
            for hyper, step, items in launches:
                spans = [(max(off, w0), min(off + n, w1), off, g) for off, n, g in items]
                cut = [
                    (lo - w0, hi - w0, g[lo - off : hi - off])
                    for lo, hi, off, g in spans
                    if lo < hi
                ]
                if not cut:
                    continue
                grads = [self._grad_on_device(g, host_grad, a, b) for a, b, g in cut]
                ps, ms, vs, outs = ([t[a:b] for a, b, _ in cut] for t in (master, m, v, out))
                adam_update(ps, grads, ms, vs, step=step, div_scale=div_scale, outs=outs,
                            **hyper)  # fmt: skip
            if to[0] is not None:
                to[0](out, window)
            if up is not None:
                homes.updated.record(up)
        self._store(homes, (master, m, v, out), window, free, to[1])

    def _grad_on_device(
        self, grad: torch.Tensor, host_grad: list[torch.Tensor], a: int, b: int
    ) -> torch.Tensor:
        """``grad`` where the kernel reads it, on ``up``: itself on the
        device (recorded there: the step may drop it before the kernel
        runs), or copied into the slot's gradient buffer at ``[a:b]``."""
        if self.up is None:
            return grad
        if grad.device.type == "cpu":
            return host_grad[0][a:b].copy_(grad, non_blocking=True)
        grad.record_stream(self.up)
        return grad

    def _store(
        self, homes: LaneHomes, staged: tuple[torch.Tensor, ...], window: tuple[int, int],
        free: Any, out_home: torch.Tensor | None,
    ) -> None:  # fmt: skip
        """The stepped masters and moments of ``window`` back into their
        homes (and the new values into ``out_home``): on ``down``, after the
        kernel; then the slot may be taken again."""
        w0, w1 = window
        down = self.down
        with torch.cuda.stream(down) if down is not None else contextlib.nullcontext():
            if down is not None:
                down.wait_event(homes.updated)
            for home, stage in zip(homes.flat(), staged[:3], strict=True):
                home[w0:w1].copy_(stage, non_blocking=True)
            if out_home is not None:
                out_home[w0:w1].copy_(staged[3], non_blocking=True)
            if down is not None:
                homes.stored.record(down)
                free.record(down)
                self._last = homes.stored
