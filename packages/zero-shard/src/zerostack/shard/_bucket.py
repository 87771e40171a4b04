"""The ZeRO-1/2 layout: each parameter's piece (``_Shard``) and the buckets
that carry gradients down and parameters back up (``_Bucket``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from zerostack.chunk import pinned_empty
from zerostack.shard import _partition as part
from zerostack.shard._grad_guard import ShardedGradient, local_grad

if TYPE_CHECKING:
    from zerostack.shard._device_lane import LaneHomes


@dataclass(slots=True)
class _Shard:
    """One model parameter and this rank's piece of it.

    [Note: per-parameter pieces] Every parameter is flattened, zero-padded to
    a multiple of the group size and cut into equal pieces; rank r owns piece
    r of every parameter (a parameter smaller than the group leaves some
    ranks a piece of padding only). Padding stays zero through Adam, weight
    decay and clipping, so it never changes a result.
    """

    param: torch.Tensor
    index: int
    name: str
    piece: int  # elements per rank's piece
    master: torch.Tensor  # this rank's piece, stepped by the inner optimizer
    grad: torch.Tensor | None = None  # reduced gradient piece (accumulated)
    ready: bool = False  # its gradient arrived in the current backward
    used: bool = False  # it had a gradient at some point since the last step
    copy_out: torch.Tensor | None = None  # low-precision pinned buffer (cpu_offload)
    # What param.grad holds once the gradient is taken (see [Note: sharded param.grad]).
    guard: ShardedGradient | None = None


class _Bucket:
    """Consecutive shards whose gradients travel in one collective: row r of
    the bucket's (world, piece_total) buffer holds rank r's pieces, in order."""

    __slots__ = (
        "copied",
        "host_grads",
        "host_params",
        "lane",
        "launched",
        "norm_sq",
        "offsets",
        "on_host",
        "piece_total",
        "reduced",
        "send_buf",
        "shards",
        "work",
        "written",
    )

    def __init__(self, shards: list[_Shard]) -> None:
        self.shards = shards
        self.offsets: list[int] = []
        total = 0
        for s in shards:
            self.offsets.append(total)
            total += s.piece
        self.piece_total = total
        # One reduction in flight or done and not yet consumed by the step:
        self.launched = False
        self.work = None  # the async collective, until waited on
        # Stage 2: the reduce-scattered piece (piece_total); stage 1: the
        # all-reduced buffer (world, piece_total), of which row `rank` is ours.
        self.reduced: torch.Tensor | None = None
        # Stage 2: the (world, piece_total) input of the reduce-scatter, kept
        # only until its collective completes (see GradientReduction._launch).
        self.send_buf: torch.Tensor | None = None
        self.norm_sq: torch.Tensor | None = None  # squared norm of this rank's reduced piece
        self.on_host = False  # cpu_offload: the reduced piece is already queued to host_grads
        self.host_grads: torch.Tensor | None = None  # cpu_offload: pinned, see pin_offload_buffers
        self.host_params: torch.Tensor | None = None
        # cpu_offload with gpu_update_fraction: the pinned host homes of a
        # bucket the device's Adam updates (no host_grads nor host_params
        # then); see [Note: Adam where the bandwidth is].
        self.lane: LaneHomes | None = None
        # cpu_offload on CUDA, see [Note: offloaded step pipeline]: recorded
        # on the write-back stream after host_params went to the device (the
        # worker may overwrite host_params only then) and after the
        # parameters were written (a forward waits for it).
        self.copied: torch.cuda.Event | None = None
        self.written: torch.cuda.Event | None = None

    def wait(self) -> None:
        """Wait for the collective in flight, then drop the reduce-scatter input."""
        if self.work is not None:
            self.work.wait()
            self.work = None
        self.send_buf = None

    def clear(self) -> None:
        """Forget this step's reduction (after waiting for it)."""
        self.wait()
        self.launched = False
        self.reduced = None
        self.norm_sq = None
        self.on_host = False


class BufferRing:
    """A few flat device buffers, allocated at first use and then handed out
    in turn for ever: the per-bucket scratch of a step (reduce-scatter
    inputs, all-gather outputs) costs no allocation after the first step.

    [Note: persistent bucket buffers] A buffer is handed out again only
    ``len(ring)`` takes later. Every user of a ring issues its work on one
    stream (or, for a collective, orders that stream after it: an NCCL
    ``wait()`` or a synchronous collective makes the issuing stream wait), and
    waits for take ``k`` to finish before take ``k + len(ring)`` is written:
    the reduce-scatter of bucket ``i`` is waited on when bucket ``i + 1`` is
    launched (``GradientReduction._launch``), and the all-gathers of the step are
    synchronous on their stream. So no ``record_stream`` is needed: the
    buffers are never freed, and reuse is ordered by the stream itself.
    Before this, each bucket allocated its buffers afresh on the side stream
    every step, and the caching allocator's cross-stream frees (held back
    until the side stream's events completed) made step times vary by 30%.
    """

    __slots__ = ("_bufs", "_next", "allocations", "device", "dtype", "numel")

    def __init__(self, slots: int, numel: int, dtype: torch.dtype, device: torch.device) -> None:
        self._bufs: list[torch.Tensor] = []
        self._next = 0
        self.allocations = 0  # buffers allocated so far (at most ``slots``)
        self.numel, self.dtype, self.device = numel, dtype, device
        self._bufs = [torch.empty(0)] * slots

    def take(self, numel: int) -> torch.Tensor:
        """The next buffer's first ``numel`` elements (contents undefined)."""
        if numel > self.numel:
            raise AssertionError(f"BufferRing: {numel} elements asked, slots hold {self.numel}")
        i = self._next
        self._next = (i + 1) % len(self._bufs)
        if self._bufs[i].numel() != self.numel:
            self._bufs[i] = torch.empty(self.numel, dtype=self.dtype, device=self.device)
            self.allocations += 1
        return self._bufs[i][:numel]

    def data_ptrs(self) -> list[int]:
        """Where the buffers are (tests check that they stay put)."""
        return [b.data_ptr() for b in self._bufs if b.numel()]


def make_shards(
    optimizer: torch.optim.Optimizer,
    *,
    world: int,
    rank: int,
    master_device: torch.device,
    master_weights: bool,
    names: dict[int, str],
) -> list[_Shard]:
    """This rank's piece of every parameter, as a master that replaces the
    parameter inside the optimizer's param groups."""
    shards: list[_Shard] = []
    for group in optimizer.param_groups:
        masters = []
        for p in group["params"]:
            piece = part.shard_numel(p.numel(), world)
            full = part.padded_flat(p.detach(), world)
            mine = full[rank * piece : (rank + 1) * piece]
            dtype = torch.float32 if master_weights else p.dtype
            master = mine.to(device=master_device, dtype=dtype).clone()
            if hasattr(master, "grad_dtype"):
                master.grad_dtype = None  # torch >= 2.10: CPUAdam takes bf16/fp16 grads as they are
            index = len(shards)
            name = names.get(id(p), f"param {index}")
            guard = ShardedGradient(p.shape, p.dtype, p.device, "ZeroOptimizer")
            shards.append(_Shard(p, index, name, piece, master, guard=guard))
            masters.append(master)
        group["params"] = masters
    return shards


def make_buckets(shards: list[_Shard], world: int, reduce_bucket_size: int) -> list[_Bucket]:
    """Buckets of at most ``reduce_bucket_size`` elements (a larger parameter
    gets one of its own), in reverse parameter order: the order in which
    backward produces gradients."""
    buckets: list[_Bucket] = []
    current: list[_Shard] = []
    size = 0
    for s in reversed(shards):
        if current and size + s.piece * world > reduce_bucket_size:
            buckets.append(_Bucket(current))
            current, size = [], 0
        current.append(s)
        size += s.piece * world
    if current:
        buckets.append(_Bucket(current))
    return buckets


def pack_grads(bucket: _Bucket, buf: torch.Tensor, stream: torch.cuda.Stream | None) -> None:
    """Move each parameter's gradient into the (world, piece_total) ``buf``:
    rank r's piece to row r. The model's ``.grad`` becomes the shard's guard
    (see [Note: sharded param.grad]).

    [Note: one copy a bucket] The copies go in one ``torch._foreach_copy_``
    (one multi-tensor launch at one rank; at several, where a piece's rows
    are a strided view of ``buf``, torch copies them one by one, as before),
    and ``buf`` is zeroed first only when the
    gradients leave part of it unwritten (a parameter without a gradient,
    the zero padding of pieces at several ranks). The backward's host time
    is close to its kernels' on an H200 (GPT-2 XL, 145 buckets of about four
    parameters; profiled backwards left the device idle while the hooks
    ran, docs/benchmarks.md, "Offloaded steps, 2026-12-04 tenth session"),
    so at one rank the packing launches one copy a bucket, not one a
    parameter. The backward's time did not change measurably there (same
    section)."""
    dsts: list[torch.Tensor] = []
    srcs: list[torch.Tensor] = []
    whole = buf.shape[0] * bucket.piece_total  # elements the gradients must cover
    for s, off in zip(bucket.shards, bucket.offsets, strict=True):
        g = local_grad(s.param)
        if g is not None:
            s.used = True
            # Whole rows in one copy, the padded tail in another.
            flat, n = g.reshape(-1), g.numel()
            rows = n // s.piece
            if rows:
                dsts.append(buf[:rows, off : off + s.piece])
                srcs.append(flat[: rows * s.piece].view(rows, s.piece))
            if n - rows * s.piece:
                dsts.append(buf[rows, off : off + n - rows * s.piece])
                srcs.append(flat[rows * s.piece :])
            whole -= n
            if stream is not None:
                g.record_stream(stream)
            s.guard.local = None  # type: ignore[union-attr]  # the reduced piece replaces it
            s.guard.cleared = False  # type: ignore[union-attr]
            s.param.grad = s.guard
        s.ready = False
    if whole:
        buf.zero_()
    if dsts:
        torch._foreach_copy_(dsts, srcs)


def pin_offload_buffers(
    buckets: list[_Bucket],
    optimizer: torch.optim.Optimizer,
    comm_dtype: torch.dtype | None,
    *,
    pin: bool,
    copy_out: bool,
) -> None:
    """One pinned host buffer per bucket each way, so a bucket crosses PCIe
    as one copy: reduced gradients down in the communication dtype (CPUAdam
    reads bf16/fp16 gradients as they are), updated parameters up in the
    parameter dtype, written by the CPU kernel's fused copy-out when
    ``copy_out``. Device-lane buckets get none (see [Note: Adam where the
    bandwidth is])."""
    for bucket in buckets:
        if bucket.lane is not None:
            continue
        p_dtype = bucket.shards[0].param.dtype
        g_dtype = comm_dtype or p_dtype
        bucket.host_grads = host_buffer(bucket.piece_total, g_dtype, pin)
        bucket.host_params = host_buffer(bucket.piece_total, p_dtype, pin)
        for s, off in zip(bucket.shards, bucket.offsets, strict=True):
            view = bucket.host_params[off : off + s.piece]
            view.copy_(s.master)  # the step refreshes it; params without grads keep this
            if copy_out:
                s.copy_out = view
                optimizer.set_copy_out(s.master, view)  # type: ignore[attr-defined]


def host_buffer(numel: int, dtype: torch.dtype, pin: bool, zero: bool = False) -> torch.Tensor:
    """A long-lived host buffer (a bucket's, a device lane's home): pinned at
    its exact size when ``pin`` (see zerostack.chunk's [Note: exact pinned
    buffers]); zeros when ``zero``."""
    if pin:
        return pinned_empty(numel, dtype, zero=zero)
    return (torch.zeros if zero else torch.empty)(numel, dtype=dtype)
