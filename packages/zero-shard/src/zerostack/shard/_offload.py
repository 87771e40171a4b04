"""cpu_offload's step, piece by piece: the CPU update of each bucket on a
worker thread, the write-back of the updated pieces in a fixed order.

[Note: offloaded step pipeline] With ``cpu_offload`` a step moves, per
parameter and per rank (N ranks, bf16/fp16 parameters, fp32 masters):

- device to host: the reduced gradient piece, 2/N bytes, queued per bucket
  on the reduce stream during backward (hidden there already);
- CPU Adam: reads master, exp_avg, exp_avg_sq (12 B) and the gradient
  (2 B), writes the three back (12 B) and the bf16/fp16 copy-out (2 B): 28
  bytes of host memory traffic per element of this rank's piece, so it is
  memory-bound. GPT-2 1.5B (1.56e9 elements) on one H200 host (16 cores,
  ~118 GB/s measured): floor 0.37 s, measured 0.38-0.43 s (docs/benchmarks.md,
  2026-11-29), i.e. ~0.25 ns per element; two ranks on one host share that
  bandwidth, so the host's total stays about the same;
- host to device: the updated piece, 2/N bytes (3.1 GB on one GPU: 0.16-0.19 s
  measured as the step did it, ~60 ms at PCIe Gen5's ~50 GB/s), then, at
  N > 1, an all-gather of the piece over NVLink.

Done one after the other, as before this pipeline, the step was forward +
backward (0.27 s) + CPU Adam + parameters back: 0.71 s (0.40x of plain
PyTorch's 0.285 s). Now the update of bucket i+1 runs on the worker while
bucket i crosses PCIe and is all-gathered, and with ``module`` given
``step()`` returns once the updates are queued: a module's forward pre-hook
waits only for the buckets that hold its parameters, so the next forward
(~1/3 of forward + backward) runs beside the updates. That leaves about
forward + backward + CPU Adam - forward + the last bucket's copy: ~0.6 s.
No update starts before ``step()``, with or without clipping: an update
started during backward (as this pipeline once did without clipping, for
about forward + max(backward, CPU Adam) + the last copy) could not be taken
back when the batch is dropped after an exception (see [Note: dropping a
batch]), nor clipped by a ``clip_grad_by_norm`` that comes after it. CPU
Adam stays the bound; what is left is its bandwidth.

Clipping and overflow: each bucket's squared norm is computed on the device
when it is reduced (backward), so ``step()`` needs one all-reduce and one
host read before any update is queued; the updates then carry the clip and
loss-scale factor as ``div_scale``. An fp16 overflow queues no update at all.

Order: write-backs are collectives (all-gathers) at N > 1, so every rank
issues them in one fixed order (``ZeroOptimizer._order``, the order in which
forward uses the buckets); a forward pre-hook that needs bucket k first
writes back every pending bucket before k, and all of them are written back
before the next gradient reduction or any other collective of the optimizer.
On one rank a pre-hook also writes back the later buckets whose updates are
done (their H2D copies start early); on several it does not, so the all-
gathers sit at the same points of the program on every rank, also among
collectives the model itself issues in forward. Streams: the write-backs run
on their own CUDA stream, which waits for the compute stream once when the
updates are queued (the last backward is done with the parameters); a
forward waits for the ``written`` event of each bucket it needs, and the
next backward (or any reader through the optimizer) for the whole stream.
The worker overwrites a bucket's pinned ``host_params`` only after the
``copied`` event of its last H2D copy; the gradients' D2H copies are
finished (a host sync) before ``step()`` queues any update.

[Note: a failed CPU update in ZeRO] An update that raises (a failed NVMe
read, a kernel call that raises) is kept with its arguments: its masters and
states are as before (HybridAdam/CPUAdam check everything first and put back
the step counts of parameters whose kernel never ran), its gradient pieces
stay untouched until the next backward, which first finishes it. Where it
surfaces (``pop``: the write-back of that bucket, in order) it is run once
more at once, inline; if that fails too a ``RuntimeError`` is raised and the
bucket stays at the head of the order, so every later write-back (the next
forward, backward, ``step()`` or ``wait_updates()``) runs it again first.
Once the cause is removed the run goes on exactly as without the fault. A
synchronous step (no worker) runs every bucket's update first and raises at
the failed one's write-back; ZeroOptimizer then keeps the step unfinished:
``backward`` refuses, ``step()`` again finishes it, ``zero_grad()`` drops
the failed updates (their parameters keep their values). Not restored: a
fault after a kernel ran (a later piece of states on disk failing after
earlier ones were written, a second launch for parameters at another step
count) is stepped again by the retry. On several ranks a write-back is an
all-gather: a fault on one rank alone leaves the others waiting in it until
the process group's timeout ends the job (as a dead peer does); the retry
serves faults every rank sees, or one rank.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

logger = logging.getLogger(__name__)
_THREAD_PREFIX = "zero-cpu-step"


class OffloadPipeline:
    """The CPU updates of a step in flight, in write-back order.

    Args:
        api: the owner's name, for messages.
        overlap: run updates on a worker thread (else inline, at ``submit``).
        device: the compute device (a write-back stream on CUDA).
    """

    def __init__(self, api: str, overlap: bool, device: torch.device) -> None:
        self.api = api
        self._executor = None
        if overlap:
            # On CUDA the worker syncs on events: with the rank's device made
            # current first, or the runtime would set up a context on GPU 0.
            cuda = device.type == "cuda"
            self._executor = ThreadPoolExecutor(
                1, thread_name_prefix=_THREAD_PREFIX,
                initializer=torch.cuda.set_device if cuda else None,  # type: ignore[arg-type]
                initargs=(device,) if cuda else (),  # type: ignore[arg-type]
            )  # fmt: skip
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.pending: deque[tuple[int, Future | None]] = deque()  # (position, update)
        self._calls: dict[int, tuple[Callable[..., None], tuple]] = {}  # position -> its update
        self.failed: set[int] = set()  # positions whose update failed, to run again
        self.round_open = False  # written pieces the compute stream has not waited for all of
        self.update_s = 0.0  # seconds of CPU updates (hidden unless waited for)
        self.wait_s = 0.0  # seconds the main thread waited for them (exposed)
        self.worker_updates = 0  # updates that ran on the worker thread

    @property
    def overlapping(self) -> bool:
        return self._executor is not None

    def settle(self) -> None:
        """Wait until no update is running on the worker (errors stay in
        their futures, nothing is written back: no collective), for readers
        of the optimizer's figures between steps."""
        if threading.current_thread().name.startswith(_THREAD_PREFIX):
            return  # the worker itself: its own update is the one running
        for _, future in self.pending:
            if future is not None:
                future.exception()

    def close(self) -> None:
        """Finish what is pending (errors kept, not raised) and stop the worker."""
        for _, future in self.pending:
            if future is not None:
                future.exception()
        self.pending.clear()
        if self._executor is not None:
            # The owner may be freed by the worker itself (its last task held
            # it): a thread cannot join itself.
            on_worker = threading.current_thread().name.startswith(_THREAD_PREFIX)
            self._executor.shutdown(wait=not on_worker)
            self._executor = None

    def submit(self, position: int, update: Callable[..., None], *args: Any) -> None:
        """Queue ``update(*args)``, written back at ``position`` in the order."""
        queue = self.pending
        self._calls[position] = (update, args)
        if self._executor is None:
            try:
                self._run(update, *args)
            except (
                Exception
            ) as error:  # raised at its write-back, see [Note: a failed CPU update in ZeRO]
                self._failed_once(position, error)
            queue.append((position, None))
        else:
            queue.append((position, self._executor.submit(self._run, update, *args)))

    def _run(self, update: Callable[..., None], *args: Any) -> None:
        t0 = time.perf_counter()
        update(*args)
        if threading.current_thread().name.startswith(_THREAD_PREFIX):
            self.worker_updates += 1
        self.update_s += time.perf_counter() - t0

    def next_done(self) -> bool:
        """True when the next update in order has finished (or ran inline)."""
        future = self.pending[0][1]
        return future is None or future.done()

    def pop(self) -> int:
        """Wait for the next update in order; its position. A failed update
        runs once more, inline; see [Note: a failed CPU update in ZeRO].

        Raises:
            RuntimeError: the update failed twice; it stays next in order.
        """
        position, future = self.pending[0]
        self._settle(position, future)
        self.pending[0] = (position, None)
        if position in self.failed:
            self._retry(position)
        self.pending.popleft()
        self._calls.pop(position, None)
        return position

    def drop_failed(self) -> list[int]:
        """Forget the failed updates (their parameters keep their values);
        their positions."""
        dropped = sorted(self.failed)
        self.pending = deque(e for e in self.pending if e[0] not in self.failed)
        for position in dropped:
            self._calls.pop(position, None)
        self.failed.clear()
        return dropped

    def _settle(self, position: int, future: Future | None) -> None:
        """Wait for ``future`` (the update at ``position``); a failure is kept."""
        if future is None:
            return
        t0 = time.perf_counter()
        error = future.exception()
        self.wait_s += time.perf_counter() - t0
        if error is not None:
            self._failed_once(position, error)

    def _failed_once(self, position: int, error: BaseException) -> None:
        logger.warning(
            "%s: the CPU update of bucket %d (in write-back order) failed (%s: %s); it will "
            "run again", self.api, position, type(error).__name__, error,
        )  # fmt: skip
        self.failed.add(position)

    def _retry(self, position: int) -> None:
        update, args = self._calls[position]
        try:
            self._run(update, *args)
        except Exception as error:
            failed = RuntimeError(
                f"{self.api}: the CPU update of bucket {position} (in write-back order) failed "
                f"({type(error).__name__}: {error}); it is kept with its gradients: remove the "
                "cause and go on (the next forward, backward or step runs it again), or reload "
                "a checkpoint"
            )
            logger.error("%s", failed)
            raise failed from error
        self.failed.discard(position)
        logger.info("%s: the CPU update of bucket %d ran again and succeeded", self.api, position)
