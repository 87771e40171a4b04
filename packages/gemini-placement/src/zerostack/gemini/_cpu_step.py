"""Gemini's chunk layer over zerostack.shard's CpuUpdatePipeline (which
owns the worker thread, the pending and failed updates and their retry, see
its [Note: a failed CPU update]): the pinned host buffers, the staging
events and the write-back of every chunk. GeminiOptimizer builds one and
owns its life; GeminiDDP only waits for a chunk before it uses it
(``GeminiDDP.await_update``); AutoPlacement only asks whether a chunk is
busy (``chunk in pipeline``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from zerostack.chunk import Chunk, ChunkManager, phase, pinned_empty
from zerostack.shard import CpuStepError, CpuUpdatePipeline, wait_event

__all__ = ["CpuStepError", "CpuStepPipeline", "write_back"]


class CpuStepPipeline:
    """Updates of CPU-held master chunks, possibly on a worker thread, and the
    write-back of updated masters into their parameter chunks.

    Args:
        manager: the chunk manager of the model.
        compute_device: where gathered chunks live (pins host buffers on CUDA).
        overlap: run updates on a worker thread (else inline, at ``submit``).
    """

    def __init__(self, manager: ChunkManager, compute_device: torch.device, overlap: bool) -> None:
        self.manager = manager
        self._pin = compute_device.type == "cuda"
        self.updates = CpuUpdatePipeline(
            "GeminiOptimizer", "chunk {}", overlap, compute_device, retry_at="forward or step"
        )
        self._chunks: dict[int, Chunk] = {}  # chunk index -> chunk, of the held updates
        # See [Note: CPU-step buffers]. Staging buffers of pending chunks, and
        # the free ones, reused by any chunk of the same size and dtype.
        self._host_values: dict[Chunk, torch.Tensor] = {}  # fp16/bf16 results on their way
        self._host_grads: dict[Chunk, torch.Tensor] = {}  # pinned copies of reduced gradients
        # Free buffers, each with the event of the last copy that read it (None: none pending).
        self._free: dict[tuple[int, torch.dtype], list[tuple[torch.Tensor, Any]]] = {}
        self._free_lock = threading.Lock()  # the worker and the hooks both take buffers
        self._staged: dict[Chunk, torch.cuda.Event] = {}
        # Gradients go to the host on a stream of their own, chunk by chunk as
        # backward reduces them (see [Note: gradients leave during backward]).
        self._d2h = torch.cuda.Stream(compute_device) if self._pin else None
        # See [Note: Gemini's device lane]: the lane's chunks held now, by the
        # homes whose ``updated`` (or ``stored``) event their write-back waits for; and what
        # waits for the lane's copies back (the optimizer's lane's settle).
        self._lane_homes: dict[Chunk, Any] = {}
        self.lane_settle: Callable[[], None] | None = None

    # -- lifetime ------------------------------------------------------------------

    def close(self) -> None:
        """Let running updates end (errors kept, not raised) and stop the worker."""
        self.updates.close()

    @property
    def overlapping(self) -> bool:
        return self.updates.overlapping

    def settle(self) -> None:
        """Wait until no update is running on the worker (nothing is written
        back: no collective), nor a device-lane copy back to the host, for
        readers of the optimizer's figures."""
        self.updates.settle()
        self.settle_lane()

    def settle_lane(self) -> None:
        """Wait until the device lane's homes hold its copies back (a host
        wait; nothing without a lane). A lane chunk's master is its pinned
        home, so anything that reads the masters outside an update (a
        write-back from them) waits for this first."""
        if self.lane_settle is not None:
            self.lane_settle()

    @property
    def wait_s(self) -> float:
        """Seconds callers waited for updates (the exposed CPU step)."""
        return self.updates.wait_s

    @property
    def update_s(self) -> float:
        """Seconds spent in CPU updates (hidden unless waited for)."""
        return self.updates.update_s

    # -- host buffers ----------------------------------------------------------------

    # [Note: CPU-step buffers] A CPU update writes the chunk's new fp16/bf16
    # shard either straight into the chunk's share, where that share is a
    # host tensor (a shard kept on the CPU: the update's copy-out overwrites
    # the reduced gradient element by element, after reading it), or into a
    # staging buffer that the write-back copies to the device. Staging
    # buffers (and the pinned copies of device-held gradients) exist only
    # while their chunk's update is pending: the write-back hands them back
    # to a free list that any chunk of the same size reuses. So host memory
    # holds no per-chunk copy of the model (which kept 2 B/param, more once
    # the pinned allocator rounded each buffer up to a power of two), and the
    # staging bytes are at most the pending device-held chunks' shards. A
    # chunk of the device lane takes none of them: its gradient stays on the
    # device, or has landed in its pinned host shard, and its update writes
    # the chunk's shard where it lives (see [Note: Gemini's device lane]).

    def _take(self, numel: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
        """A free buffer of ``numel`` ``dtype`` elements, or a new one. Of the
        free ones, the first given back whose copy to the device is done,
        else the first given back (whose copy was queued first): the last
        one given back waited for the GPU to run every kernel queued before
        its write-back's copy, while the forward waited for this update (on
        an H200, 0.18 s a step of the 4.24B GPT's split step; docs/benchmarks.md,
        "Offloaded steps, 2026-12-03")."""
        with self._free_lock:
            free = self._free.get((numel, dtype))
            buf, pending = None, None
            if free:
                done = next((k for k, (_, e) in enumerate(free) if e is None or e.query()), None)
                buf, event = free.pop(0 if done is None else done)
                pending = event if done is None else None
        if buf is None:  # kept for reuse: exactly its size (see [Note: exact pinned buffers])
            return pinned_empty(numel, dtype) if pin else torch.empty(numel, dtype=dtype)
        if pending is not None:  # an asynchronous copy to the device may still read it
            wait_event(pending)
        return buf

    def _give(self, buf: torch.Tensor | None, event: Any = None) -> None:
        if buf is not None:
            with self._free_lock:
                self._free.setdefault((buf.numel(), buf.dtype), []).append((buf, event))

    def host_values(self, chunk: Chunk) -> torch.Tensor:
        """Where the CPU step writes ``chunk``'s new fp16/bf16 shard: the
        chunk's own share when it is a host tensor, else a (pinned) staging
        buffer held until the write-back. See [Note: CPU-step buffers]."""
        buf = self._host_values.get(chunk)
        if buf is None:
            share = chunk.shard
            if share is not None and not chunk.is_gathered and share.device.type == "cpu":
                return share
            buf = self._take(chunk.shard_size, chunk.dtype, self._pin)
            self._host_values[chunk] = buf
        return buf

    def host_buffers(self, kind: str) -> list[torch.Tensor]:
        """The host buffers held now: ``"values"`` (staged fp16/bf16 shards,
        free ones included) or ``"grads"`` (pinned copies of device-held
        gradients)."""
        # Snapshots first (one C call each): the worker may add a buffer meanwhile.
        if kind == "values":
            with self._free_lock:
                free = [b for bufs in self._free.values() for b, _ in bufs]
            return [*list(self._host_values.values()), *free]
        return list(self._host_grads.values())

    # [Note: gradients leave during backward] A CPU-held chunk's reduced
    # gradient (2 B a parameter) crosses to a pinned host buffer as soon as
    # backward has reduced it, on a copy stream of its own: beside the rest
    # of backward, whose kernels leave PCIe idle. These copies used to be
    # queued on the compute stream at the end of backward, all of them after
    # its last kernel. On an H200, back-to-back processes, the 4.24B GPT
    # under a 24 GiB cap (clipped, the split by default): backward 0.441 s
    # before, 0.359 s after (plain PyTorch's 0.384), the step 1.081 s before,
    # 1.001 s after (docs/benchmarks.md, "Offloaded steps, 2026-12-03 fourth
    # session"). The gradient stays where it is until the update
    # that read its copy has run (the worker waits for the copy's event
    # first). Three paths write over a gradient whose copy may be in
    # flight, and none reads that copy: an fp16 step skipped for overflow
    # and unscaled fp16 gradients (``_drop_grads``) write the parameters
    # back, and the next backward copies into the same buffer on the same
    # stream, after the torn copy; a dropped batch gives the buffer back with
    # the copy's event, which the buffer's next taker waits for.

    def stage_grad(self, chunk: Chunk, grad: torch.Tensor) -> None:
        """Start copying a device-held reduced gradient to a pinned host
        buffer, on the copy stream, after the work queued so far on the
        current stream (the reduction that wrote it)."""
        if grad.device.type == "cpu" or self._d2h is None:
            return
        buf = self._host_grads.get(chunk)
        if buf is None:
            buf = self._take(grad.numel(), grad.dtype, True)
            self._host_grads[chunk] = buf
        self._d2h.wait_stream(torch.cuda.current_stream(grad.device))
        with phase("zerostack::stage_grad"), torch.cuda.stream(self._d2h):
            buf.copy_(grad, non_blocking=True)
            event = torch.cuda.Event(blocking=True)  # a host waits for it: no spinning
            event.record(self._d2h)
        grad.record_stream(self._d2h)  # the allocator keeps it until the copy read it
        self._staged[chunk] = event

    def host_grad(self, chunk: Chunk, grad: torch.Tensor) -> torch.Tensor:
        """``grad`` on the host: itself, or its staged copy once the copy is done."""
        if grad.device.type == "cpu":
            return grad
        event = self._staged.pop(chunk, None)
        if event is not None:
            wait_event(event)
        return self._host_grads[chunk]

    def _release(self, chunk: Chunk) -> None:
        """The write-back is issued (or the batch dropped): ``chunk``'s staging
        buffers go back to the free list; a pinned values buffer with the
        event of its (asynchronous) copy to the device, which the next taker
        waits for; a gradient buffer with the event of its copy from the
        device where no update waited for that copy (a dropped batch)."""
        values = self._host_values.pop(chunk, None)
        event = None
        if values is not None and values.is_pinned():
            event = torch.cuda.Event()
            event.record()
        self._give(values, event)
        self._give(self._host_grads.pop(chunk, None), self._staged.pop(chunk, None))

    # -- updates -------------------------------------------------------------------

    def submit(
        self, chunk: Chunk, update: Callable[..., None], *args: Any, lane: Any = None
    ) -> bool:
        """Run ``update(*args)`` for ``chunk``: on the worker, its write-back
        following in ``await_chunk``; or now, written back at once. False
        when it failed inline (kept: ``await_chunk`` runs it once more, see
        zerostack.shard's [Note: a failed CPU update]). ``lane``: the homes
        of a device-lane update (see [Note: Gemini's device lane]), which
        writes the chunk's shard itself, on the device or in host memory."""
        self._chunks[chunk.index] = chunk
        if lane is not None:
            self._lane_homes[chunk] = lane
            submitted = self.updates.submit(chunk.index, update, *args, lane="device")
        else:
            submitted = self.updates.submit(chunk.index, _in_phase, update, *args)
        if not submitted:
            return False
        if not self.updates.overlapping:
            self.await_chunk(chunk)  # a synchronous step: written back at once
        return True

    def __contains__(self, chunk: object) -> bool:
        """True while ``chunk`` has an update that is not written back:
        pending, or failed and kept to run again."""
        return isinstance(chunk, Chunk) and chunk.index in self.updates

    def pending(self) -> list[Chunk]:
        """The chunks whose update is queued or running (not failed), in chunk order."""
        return [self._chunks[k] for k in self.updates.pending]

    @property
    def failed(self) -> list[int]:
        """Indices of the chunks whose update failed and is still to run."""
        return self.updates.failed

    def drop_staged(self, chunk: Chunk) -> None:
        """Give back the staging buffers of ``chunk``'s gradient of a
        dropped batch (none while an update of it is pending or kept)."""
        if chunk not in self:
            self._release(chunk)

    def await_chunk(self, chunk: Chunk) -> None:
        """Finish ``chunk``'s update, if any, and write its new shard back; a
        failed one is run once more here, inline.

        Raises:
            CpuStepError: the update failed twice (see zerostack.shard's
                [Note: a failed CPU update]).
        """
        if chunk not in self:
            return
        self.updates.wait(chunk.index)
        del self._chunks[chunk.index]
        self._finish(chunk)

    def _finish(self, chunk: Chunk) -> None:
        """Write ``chunk``'s update back (from its staging buffer, or in place;
        a device-lane chunk's shard holds it once its ``updated`` event is,
        or, where the lane wrote the new values into host memory, its
        ``stored`` event, which the host waits for: the next gather copies
        from there, and a CPU update or a zero fill writes there)."""
        homes = self._lane_homes.pop(chunk, None)
        if homes is not None and homes.updated is not None:
            if homes.host_values:
                with phase("zerostack::write_back"):
                    t0 = time.perf_counter()
                    homes.stored.synchronize()
                    self.updates.count_wait(time.perf_counter() - t0)
            else:
                torch.cuda.current_stream(chunk.compute_device).wait_event(homes.updated)
        write_back(self.manager, chunk, self._host_values.get(chunk), staged=True)
        self._release(chunk)

    def await_all(self) -> None:
        """Finish every pending update (not the failed ones), in chunk order,
        and the device lane's copies back to the host."""
        for chunk in self.pending():
            self.await_chunk(chunk)
        self.settle_lane()

    def await_kept_gathered(self) -> None:
        """Finish the pending updates of kept-gathered chunks, in chunk order.

        [Note: write-back order] Writing back a kept-gathered chunk is an
        all-gather, so every rank must issue those write-backs in the same
        order at the same point of the program: GeminiDDP calls this at the
        start of every forward, no update starts before step(), and step()
        finishes the previous step's updates in chunk order. Sharded
        chunks write back locally (no collective), so they may finish in any
        hook, whenever their chunk is next needed.
        """
        for chunk in self.pending():
            if chunk.keep_gathered:
                self.await_chunk(chunk)

    def check(self) -> None:
        """Run the failed updates again (and those that failed on the worker
        since, without being waited for), in chunk order; every later forward
        and step calls this first.

        Raises:
            CpuStepError: an update failed again; nothing else changed.
        """
        self.updates.harvest()
        for index in self.updates.failed:
            self.await_chunk(self._chunks[index])


@torch.no_grad()
def write_back(
    manager: ChunkManager, chunk: Chunk, host_values: torch.Tensor | None = None,
    staged: bool = False,
) -> None:  # fmt: skip
    """The updated master becomes ``chunk``'s parameter shard (cast) again:
    from ``host_values`` (the CPU step's fp16/bf16 output), from the paired
    master chunk (``host_values`` None), or, with ``staged`` and no
    ``host_values``, as the CPU step already wrote it into the share (see
    [Note: CPU-step buffers]). See [Note: write-back order]."""
    with phase("zerostack::write_back"):
        if chunk.is_gathered and chunk.can_release:
            manager.release_chunk(chunk)  # a stale gathered copy (gradient accumulation)
        if host_values is not None:
            chunk.write_share(host_values, non_blocking=True)
        elif not staged:
            chunk.copy_from_paired()
        manager.consume_grad(chunk)
        if chunk.keep_gathered:
            chunk.sync_gathered()


def _in_phase(update: Callable[..., None], *args: Any) -> None:
    with phase("zerostack::cpu_update"):
        update(*args)
