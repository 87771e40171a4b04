"""The CPU part of GeminiOptimizer's step, and the write-backs of every
chunk: one owner for the worker thread, the updates still pending, the
pinned host buffers, the staging events and the error of a failed update.

GeminiDDP only asks it to finish a chunk's update before the chunk is used
(``await_chunk``); AutoPlacement only asks whether a chunk is busy
(``chunk in pipeline``); GeminiOptimizer submits updates and writes back.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from zerostack.chunk import Chunk, ChunkManager, phase

logger = logging.getLogger(__name__)


class CpuStepError(RuntimeError):
    """A CPU optimizer update failed; see [Note: a failed CPU update].

    Attributes:
        chunk_index: the index of the chunk whose update failed.
    """

    def __init__(self, message: str, chunk_index: int) -> None:
        super().__init__(message)
        self.chunk_index = chunk_index


# [Note: a failed CPU update] An exception from the optimizer in a CPU-held
# chunk's update (a failed NVMe read, a kernel call that raises) does not
# write that chunk back: its parameter shard keeps the reduced gradient and
# the update is remembered with its arguments (the gradient, div_scale, the
# hyperparameters of its step). The error is raised as CpuStepError where it
# surfaces: at the end of step() (inline: after every other chunk of the
# step was updated), or on the worker's next wait: the next forward, or a
# gather in the middle of one. Every later forward and step (and
# GeminiOptimizer.retry_failed_updates) first runs the failed updates again,
# in chunk order; once they succeed, the failed step is complete and training
# goes on exactly as without the fault; while they fail, CpuStepError again.
#
# What is restored: an optimizer that raises before it changes anything
# (HybridAdam/CPUAdam check every argument first, and put back the step
# counts of the parameters whose kernel never ran) leaves the chunk's master
# and states as before the failed step, so the retry gives the uninterrupted
# run's values. What is not: a fault after the kernel began on the chunk (a
# failed NVMe read of a later piece of its states under nvme_offload_fraction,
# after earlier pieces were updated and written) leaves those pieces updated
# and the step count advanced (and where the new shard is written in place
# over the gradient, see [Note: CPU-step buffers], their gradient is gone); the retry steps them again, and the result
# differs from the uninterrupted run (not detected). A forward interrupted
# by the error in a gather is abandoned: its activations are dropped, call
# forward again.


class CpuStepPipeline:
    """Updates of CPU-held master chunks, possibly on a worker thread, and the
    write-back of updated masters into their parameter chunks.

    Args:
        manager: the chunk manager of the model.
        compute_device: where gathered chunks live (pins host buffers on CUDA).
    """

    def __init__(self, manager: ChunkManager, compute_device: torch.device) -> None:
        self.manager = manager
        self._pin = compute_device.type == "cuda"
        self._executor: ThreadPoolExecutor | None = None
        self._pending: dict[Chunk, Future] = {}  # param chunk -> its running update
        # See [Note: CPU-step buffers]. Staging buffers of pending chunks, and
        # the free ones, reused by any chunk of the same size and dtype.
        self._host_values: dict[Chunk, torch.Tensor] = {}  # fp16/bf16 results on their way
        self._host_grads: dict[Chunk, torch.Tensor] = {}  # pinned copies of reduced gradients
        # Free buffers, each with the event of the last copy that read it (None: none pending).
        self._free: dict[tuple[int, torch.dtype], list[tuple[torch.Tensor, Any]]] = {}
        self._free_lock = threading.Lock()  # the worker and the hooks both take buffers
        self._staged: dict[Chunk, torch.cuda.Event] = {}
        self._calls: dict[Chunk, tuple[Callable[..., None], tuple]] = {}  # pending updates' calls
        self._failed: dict[Chunk, tuple[Callable[..., None], tuple]] = {}  # to run again
        self._new_errors: list[CpuStepError] = []  # failed inline, raised at the end of the step
        self.wait_s = 0.0  # time callers spent waiting for updates (exposed CPU time)
        self.update_s = 0.0  # time spent in CPU updates (hidden unless waited for)

    # -- lifetime ------------------------------------------------------------------

    def start(self, overlap: bool) -> None:
        """Run updates on a worker thread (``overlap``) or inline."""
        self.close()
        if overlap:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="gemini-cpu-step")

    def close(self) -> None:
        """Finish what is pending (errors are kept, not raised) and stop the worker."""
        for future in self._pending.values():
            future.exception()  # waits; the error stays in the future
        if self._executor is not None:
            # The optimizer may be freed by the worker itself (its last task
            # held it): a thread cannot join itself.
            on_worker = threading.current_thread().name.startswith("gemini-cpu-step")
            self._executor.shutdown(wait=not on_worker)
            self._executor = None

    @property
    def overlapping(self) -> bool:
        return self._executor is not None

    def settle(self) -> None:
        """Wait until no update is running on the worker (errors stay in
        their futures, nothing is written back: no collective), for readers
        of the optimizer's figures between steps."""
        if threading.current_thread().name.startswith("gemini-cpu-step"):
            return  # the worker itself: its own update is the one running
        for future in list(self._pending.values()):
            future.exception()

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
    # staging bytes are at most the pending device-held chunks' shards.

    def _take(self, numel: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
        with self._free_lock:
            free = self._free.get((numel, dtype))
            buf, event = free.pop() if free else (None, None)
        if buf is None:
            return torch.empty(numel, dtype=dtype, pin_memory=pin)
        if event is not None:  # an asynchronous copy to the device may still read it
            event.synchronize()
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

    def stage_grad(self, chunk: Chunk, grad: torch.Tensor) -> None:
        """Start copying a device-held reduced gradient to a pinned host buffer."""
        if grad.device.type == "cpu":
            return
        buf = self._host_grads.get(chunk)
        if buf is None:
            buf = self._take(grad.numel(), grad.dtype, True)
            self._host_grads[chunk] = buf
        buf.copy_(grad, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._staged[chunk] = event

    def host_grad(self, chunk: Chunk, grad: torch.Tensor) -> torch.Tensor:
        """``grad`` on the host: itself, or its staged copy once the copy is done."""
        if grad.device.type == "cpu":
            return grad
        event = self._staged.pop(chunk, None)
        if event is not None:
            event.synchronize()
        return self._host_grads[chunk]

    def _written_back(self, chunk: Chunk) -> torch.Tensor | None:
        """``chunk``'s staged values for its write-back (None: written in place)."""
        return self._host_values.get(chunk)

    def _release(self, chunk: Chunk) -> None:
        """The write-back is issued: ``chunk``'s staging buffers go back to the
        free list; a pinned values buffer with the event of its (asynchronous)
        copy to the device, which the next taker waits for. (A gradient
        buffer's copy was waited for before the update read it.)"""
        values = self._host_values.pop(chunk, None)
        event = None
        if values is not None and values.is_pinned():
            event = torch.cuda.Event()
            event.record()
        self._give(values, event)
        self._give(self._host_grads.pop(chunk, None))
        self._staged.pop(chunk, None)

    # -- updates -------------------------------------------------------------------

    def submit(self, chunk: Chunk, update: Callable[..., None], *args: Any) -> None:
        """Run ``update(*args)`` for ``chunk``: on the worker, its write-back
        following in ``await_chunk``; or now, written back at once. An inline
        update that fails is remembered (see [Note: a failed CPU update]) and
        its error raised by ``raise_new_errors``."""
        if self._executor is None:
            try:
                self._run(update, *args)
            except Exception as error:  # the same error as from the worker
                self._new_errors.append(self._remember(chunk, (update, args), error))
                return
            self._finish(chunk)  # a synchronous step
        else:
            self._calls[chunk] = (update, args)
            self._pending[chunk] = self._executor.submit(self._run, update, *args)

    def defer(self, error: CpuStepError) -> None:
        """Raise ``error`` at the next ``raise_new_errors`` (the end of the step)."""
        self._new_errors.append(error)

    def raise_new_errors(self) -> None:
        """Raise the first error of the inline updates that failed since the last call.

        Raises:
            CpuStepError: an inline update failed.
        """
        errors, self._new_errors = self._new_errors, []
        if errors:
            raise errors[0]

    def _run(self, update: Callable[..., None], *args: Any) -> None:
        t0 = time.perf_counter()
        with phase("zerostack::cpu_update"):
            update(*args)
        self.update_s += time.perf_counter() - t0

    def __contains__(self, chunk: object) -> bool:
        """True while ``chunk`` has an update that is not written back."""
        return chunk in self._pending

    def pending(self) -> list[Chunk]:
        return list(self._pending)

    def holds(self, chunk: Chunk) -> bool:
        """True while ``chunk`` has an update that is not written back:
        pending, or failed and kept to run again."""
        return chunk in self._pending or chunk in self._failed

    def drop_staged(self, chunk: Chunk) -> None:
        """Give back the staging buffers of ``chunk``'s gradient of a
        dropped batch (none while an update of it is pending or kept)."""
        if not self.holds(chunk):
            self._release(chunk)

    def await_chunk(self, chunk: Chunk) -> None:
        """Finish ``chunk``'s pending update and write its new shard back; a
        failed one is run once more here, inline.

        Raises:
            CpuStepError: the update failed twice (see [Note: a failed CPU update]).
        """
        if chunk in self._failed:
            self._retry(chunk)
            return
        if chunk not in self._pending:
            return
        future = self._pending.pop(chunk)
        call = self._calls.pop(chunk)
        t0 = time.perf_counter()
        error = future.exception()
        self.wait_s += time.perf_counter() - t0
        if error is not None:
            logger.warning(
                "GeminiOptimizer: the CPU update of chunk %d failed (%s: %s); running it again",
                chunk.index, type(error).__name__, error,
            )  # fmt: skip
            self._failed[chunk] = call
            self._retry(chunk)
            return
        self._finish(chunk)

    def _finish(self, chunk: Chunk) -> None:
        """Write ``chunk``'s update back (from its staging buffer, or in place)."""
        self.write_back(chunk, self._written_back(chunk), staged=True)
        self._release(chunk)

    def await_all(self) -> None:
        """Finish every pending update, in chunk order."""
        for chunk in sorted(self._pending, key=_index):
            self.await_chunk(chunk)

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
        for chunk in sorted(self._pending, key=_index):
            if chunk.keep_gathered:
                self.await_chunk(chunk)

    def check(self) -> None:
        """Run the failed updates again (and those that failed on the worker
        since, without being waited for), in chunk order; every later forward
        and step calls this first.

        Raises:
            CpuStepError: an update failed again; nothing else changed.
        """
        for chunk, future in list(self._pending.items()):
            if future.done() and future.exception() is not None:
                del self._pending[chunk]
                self._failed[chunk] = self._calls.pop(chunk)
        for chunk in sorted(self._failed, key=_index):
            self._retry(chunk)

    @property
    def failed(self) -> list[int]:
        """Indices of the chunks whose update failed and is still to run."""
        return sorted(c.index for c in self._failed)

    def _retry(self, chunk: Chunk) -> None:
        update, args = self._failed[chunk]
        try:
            self._run(update, *args)
        except Exception as error:
            raise self._remember(chunk, (update, args), error) from error
        del self._failed[chunk]
        logger.info(
            "GeminiOptimizer: the CPU update of chunk %d ran again and succeeded", chunk.index
        )
        self._finish(chunk)

    def _remember(self, chunk: Chunk, call: tuple, error: BaseException) -> CpuStepError:
        self._failed[chunk] = call
        failed = CpuStepError(
            f"GeminiOptimizer: the CPU update of chunk {chunk.index} failed "
            f"({type(error).__name__}: {error}); it is kept with its gradient: remove the cause "
            "and go on (the next forward or step runs it again), or reload a checkpoint",
            chunk.index,
        )
        failed.__cause__ = error
        logger.error("%s", failed)
        return failed

    # -- write-back ------------------------------------------------------------------

    @torch.no_grad()
    def write_back(
        self, chunk: Chunk, host_values: torch.Tensor | None, staged: bool = False
    ) -> None:
        """The updated master becomes ``chunk``'s parameter shard (cast) again:
        from ``host_values`` (the CPU step's fp16/bf16 output), from the
        paired master chunk (``host_values`` None), or, with ``staged`` and no
        ``host_values``, as the CPU step already wrote it into the share
        (see [Note: CPU-step buffers]). See [Note: write-back order]."""
        with phase("zerostack::write_back"):
            if chunk.is_gathered and chunk.can_release:
                self.manager.release_chunk(chunk)  # a stale gathered copy (gradient accumulation)
            if host_values is not None:
                chunk.write_share(host_values, non_blocking=True)
            elif not staged:
                chunk.copy_from_paired()
            self.manager.consume_grad(chunk)
            if chunk.keep_gathered:
                chunk.sync_gathered()


def _index(chunk: Chunk) -> int:
    return chunk.index
