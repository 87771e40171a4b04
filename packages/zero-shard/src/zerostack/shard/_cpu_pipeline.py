"""The one CPU-step pipeline: the updates of a step whose states live on the
host, by key, on worker threads or inline, and the rule for an update that
fails. Most run in CPU Adam; the device lanes of ZeroOptimizer and
GeminiOptimizer (``gpu_update_fraction``) queue others in the device's Adam
under the same keys (``submit(..., lane="device")``, see [Note: Adam where
the bandwidth is]).

It knows nothing of what it updates: an owner submits ``update(*args)``
under an int key (ZeroOptimizer: the position in write-back order of the
first bucket a CPU Adam call steps, or of a device-lane bucket;
GeminiOptimizer: a chunk's index), waits for a key before using what the
update wrote, and writes it back itself. Keys are finished in their order
(ascending) wherever the owner finishes several.

[Note: a failed CPU update] An exception from an update (a failed NVMe
read, a kernel call that raises) is kept with its call: the update's inputs
(ZeroOptimizer's gradient pieces, a Gemini chunk's reduced gradient, which
sits in place of its parameter shard) stay untouched and its result is not
written back. The one rule: where the owner first waits for that key (its
write-back: ZeroOptimizer in write-back order, Gemini when the chunk is next
used or at the end of ``step()``), the update runs once more, inline; if
that fails too, ``CpuStepError`` (with the key as ``index``) is raised and
the update stays kept, so every later wait for it (the next forward,
backward, ``step()``, ``wait_updates()`` or
``GeminiOptimizer.retry_failed_updates()``) runs it again first, in key
order. Once the cause is removed the run goes on exactly as without the
fault. An update on the worker that failed unseen is picked up by
``harvest`` (Gemini's forward and step start with it).

ZeroOptimizer keeps its step unfinished while a kept update fails:
``backward`` refuses, ``step()`` again finishes it, ``zero_grad()`` drops the
failed updates (``drop_failed``: their parameters keep their values).
Gemini's ``step()`` goes on with the other chunks and raises at its end; the
failed chunk keeps its gradient until its update succeeds.

What is restored: an optimizer that raises before it changes anything
(HybridAdam/CPUAdam check every argument first, and put back the step
counts of the parameters whose kernel never ran) leaves the masters and
states as before, so the retry gives the uninterrupted run's values. What is
not: a fault after a kernel ran (a later piece of states on disk failing
after earlier ones were written, a second launch for parameters at another
step count) leaves those pieces updated and their step count advanced
(and where Gemini wrote the new shard in place over the gradient, see
zerostack.gemini's [Note: CPU-step buffers], their gradient is gone); the
retry steps them again, and the result differs from the uninterrupted run
(not detected). A Gemini forward interrupted by the error in a gather is
abandoned: its activations are dropped, call forward again. On several ranks
a ZeRO write-back is an all-gather: a fault on one rank alone leaves the
others waiting in it until the process group's timeout ends the job (as a
dead peer does); the retry serves faults every rank sees, or one rank. A
ZeRO write-back that raises after its update succeeded leaves that bucket
and the rest of its CPU Adam call to the next write-back, which writes them
before anything else.

[Note: a dropped owner is freed] The pipeline keeps no pending call: an
owner's update is a bound method of the owner (or holds one), so a pending
call kept here would close a reference cycle owner -> pipeline -> call ->
owner. Then an optimizer dropped with its last step's updates still running
(the usual end of a training loop: nothing waits for them) stayed alive
until the next full cycle collection, with its masters, states and device
buffers: a ``gc.collect()`` at once found the worker still holding the call
and freed nothing. Measured: 6.9 GB of the GPU (GPT-2 1.5B under ZeRO-2
``cpu_offload``) still allocated when the next configuration of one
benchmark process started. The executor holds a call while it is queued
or running, and only a failed call is kept after (``_again``), to run again
as [Note: a failed CPU update] says; so an owner is freed by reference
counting as soon as the user's last reference and its queued and running
updates are gone (unless an update failed and is kept: then at the next
cycle collection).

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
PyTorch's 0.285 s). Now the update of CPU Adam call i+1 (consecutive
buckets, see ZeroOptimizer's [Note: CPU Adam calls span buckets]) runs on
the worker while the buckets of call i cross PCIe and are all-gathered, and
with ``module`` given ``step()`` returns once the updates are queued: a
module's forward pre-hook waits only for the calls that hold its
parameters, so the next forward (~1/3 of forward + backward) runs beside
the updates. That leaves about forward + backward + CPU Adam - forward +
the last call's copies: ~0.6 s.
No update starts before ``step()``, with or without clipping: an update
started during backward (as this pipeline once did without clipping, for
about forward + max(backward, CPU Adam) + the last copy) could not be taken
back when the batch is dropped after an exception (see [Note: dropping a
batch]), nor clipped by a ``clip_grad_by_norm`` that comes after it. CPU
Adam stays the bound, at its host memory bandwidth, while PCIe and the GPU's
Adam idle; ``gpu_update_fraction`` moves a share f of the buckets (spread
through write-back order) to the device's Adam, fed over PCIe from pinned host
homes (12 B each way per parameter; its gradients stay on the device and
its new parameters are made there), so CPU Adam does 1 - f: [Note: Adam
where the bandwidth is] says how, [Note: step-time floor] which f finishes
first; ``cpu_offload`` takes that f by default ("auto").

Clipping and overflow: each bucket's squared norm is computed on the device
when it is reduced (backward), so ``step()`` needs one all-reduce and one
host read before any update is queued; the updates then carry the clip and
loss-scale factor as ``div_scale``. An fp16 overflow queues no update at all.

Order: write-backs are collectives (all-gathers) at N > 1, so every rank
issues them in one fixed order (``ZeroOptimizer._order``, the order in which
forward uses the buckets); a forward pre-hook that needs bucket k first
writes back every pending bucket before k and the rest of k's CPU Adam
call, and all of them are written back before the next gradient reduction
or any other collective of the optimizer.
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
finished (a host sync) before ``step()`` queues any update. A device-lane
bucket's write-back waits (on the device) for its ``updated`` event instead,
and copies nothing to the device: at N = 1 its parameters hold the step
already, at N > 1 it all-gathers this rank's pieces from them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from zerostack.chunk import phase

logger = logging.getLogger(__name__)
_THREAD_PREFIX = "zerostack-cpu-step"


class CpuStepError(RuntimeError):
    """A CPU optimizer update failed twice; see [Note: a failed CPU update].

    Attributes:
        index: the key of the failed update: GeminiOptimizer's chunk index,
            ZeroOptimizer's position in write-back order of the failed
            update's first bucket (a CPU Adam call steps several).
    """

    def __init__(self, message: str, index: int) -> None:
        super().__init__(message)
        self.index = index

    @property
    def chunk_index(self) -> int:
        """GeminiOptimizer's name for ``index``: the chunk whose update failed."""
        return self.index


def write_failed(error: OSError) -> bool:
    """zerostack.nvme's NVMeWriteError (not imported: nvme is fused-adam's
    optional extra): the update completed, its states stay in RAM."""
    return type(error).__name__ == "NVMeWriteError"


# [Note: the device lane's own worker] A device-lane update (``lane="device"``,
# see [Note: Adam where the bandwidth is]) only queues copies and kernels,
# but that queueing is Python and torch calls, window by window and
# parameter by parameter. On the one worker it ran before the first CPU Adam
# call, every step: ZeroOptimizer's split of GPT-2 XL's shape (share 0.39) on
# an H200 took 0.295-0.318 s a step in its updates, of which CPU Adam's kernel
# 0.240-0.249 s; with every update in CPU Adam, 0.354-0.363 s and 0.331-0.340 s
# (docs/benchmarks.md, "2026-12-05 seventeenth session"). The CPU update
# phase is the bound of these steps (the next forward waits for it), so the
# lane's updates run on a second worker and CPU Adam starts at once. Each
# worker takes its own lane's keys in order; the owner waits for keys in
# order whichever worker ran them; the two share no lock (the CPU updates'
# and the lane's staging lock are the owners' own) and touch different
# masters and states (the inner optimizer steps only the masters with a
# ``.grad``, which the lane never sets).


def wait_event(event: Any) -> None:
    """Wait on the host for a CUDA ``event`` to complete; one already
    complete is not waited for. ``query`` keeps the GIL, ``synchronize``
    lets it go and must take it back: on the CPU-step worker, while the
    main thread runs the next forward's Python, that is a handover both ways
    for an event that is, as a rule, long done (see zerostack.fused_adam's
    [Note: few torch calls on the CPU-step worker])."""
    if not event.query():
        event.synchronize()


def _cuda_index(device: torch.device) -> int | None:
    """The CUDA device the worker makes current (None off CUDA)."""
    if device.type != "cuda":
        return None
    return device.index if device.index is not None else torch.cuda.current_device()


def _init_worker(cuda_index: int | None, idents: set[int]) -> None:
    # On CUDA the worker syncs on events and copies: with the rank's device
    # made current first, or the runtime would set up a context on GPU 0.
    idents.add(threading.get_ident())
    if cuda_index is not None:
        torch.cuda.set_device(cuda_index)


class CpuUpdatePipeline:
    """The CPU updates of a step, by int key, on worker threads (one for CPU
    Adam, one for the device lane) or inline.

    Args:
        api: the owner's name, for messages.
        unit: what a key names in messages: a text with ``{}`` for the key
            (e.g. ``"chunk {}"``), or a function of the key.
        overlap: run updates on worker threads (else inline, at ``submit``).
        device: the compute device (the worker's current CUDA device).
        retry_at: what runs a kept update again, for the error's message.
        write_back_stream: with a CUDA ``device``, a stream for the owner's
            write-backs (``stream``; else None).
    """

    def __init__(
        self, api: str, unit: str | Callable[[int], str], overlap: bool, device: torch.device,
        *, retry_at: str,
        write_back_stream: bool = False,
    ) -> None:  # fmt: skip
        self.api, self.unit, self.retry_at = api, unit, retry_at
        cuda = device.type == "cuda"
        # One worker for CPU Adam, one for the device lane's updates (a
        # thread starts at its first update): see [Note: the device lane's
        # own worker].
        self._executors: dict[str, ThreadPoolExecutor] = {}
        # This pipeline's workers (not another's: a finalizer or a step waiter
        # may run on any pipeline's worker); a set, not the pipeline, goes to
        # the threads, which must not hold the pipeline (see ``closer``).
        self._idents: set[int] = set()
        if overlap:
            for lane, suffix in (("CPU", ""), ("device", "-device-lane")):
                self._executors[lane] = ThreadPoolExecutor(
                    1, thread_name_prefix=_THREAD_PREFIX + suffix, initializer=_init_worker,
                    initargs=(_cuda_index(device), self._idents),
                )  # fmt: skip
        self._counting = threading.Lock()  # the two workers add to the figures below
        self.stream = torch.cuda.Stream(device) if cuda and write_back_stream else None
        self.round_open = False  # the owner's: a step's write-backs not all waited for yet
        # Held keys (not finished), each with the kernel its update runs in,
        # for messages. The call itself is kept only once it failed, to run
        # again: see [Note: a dropped owner is freed].
        self._held: dict[int, str] = {}
        self._again: dict[int, tuple[Callable[..., None], tuple]] = {}
        self._futures: dict[int, Future] = {}  # running on the worker, not waited for
        self._failed: set[int] = set()  # kept to run again
        self.update_s = 0.0  # seconds of CPU updates (hidden unless waited for)
        self.device_update_s = 0.0  # seconds of the device lane's updates (queueing its work)
        self.wait_s = 0.0  # seconds the owner waited for them (exposed)
        self.worker_updates = 0  # updates that ran on the worker thread

    def _name(self, key: int) -> str:
        return self.unit(key) if callable(self.unit) else self.unit.format(key)

    def _on_own_worker(self) -> bool:
        return threading.get_ident() in self._idents

    @property
    def overlapping(self) -> bool:
        return bool(self._executors)

    def __contains__(self, key: object) -> bool:
        """True while ``key`` has an update not finished: pending or failed."""
        return key in self._held

    @property
    def held(self) -> list[int]:
        """Keys with an update not finished (pending or failed), in order."""
        return sorted(self._held)

    @property
    def pending(self) -> list[int]:
        """Keys with an update queued or running and not failed, in order."""
        return sorted(k for k in self._held if k not in self._failed)

    @property
    def failed(self) -> list[int]:
        """Keys whose update failed and is kept to run again, in order."""
        return sorted(self._failed)

    def settle(self) -> None:
        """Wait until no update is running on the worker (errors stay in
        their futures, nothing is finished), for readers of the optimizer's
        figures between steps."""
        if self._on_own_worker():
            return  # the worker itself: its own update is the one running
        for future in list(self._futures.values()):
            future.exception()

    def close(self) -> None:
        """Let what is running end (errors kept, not raised) and stop the worker."""
        self.settle()
        for executor in self._executors.values():
            # The owner may be freed by a worker itself (its last task held
            # it): a thread cannot join itself.
            executor.shutdown(wait=not self._on_own_worker())
        self._executors = {}

    def closer(self) -> Callable[[], None]:
        """What stops the worker without holding this pipeline, for the
        owner's ``weakref.finalize``: a failed update kept to run again
        holds the owner (a bound method), so a finalizer holding the
        pipeline would keep the owner, its masters and states alive for the
        whole process. See [Note: a dropped owner is freed]."""
        executors, idents = list(self._executors.values()), self._idents

        def stop() -> None:
            for executor in executors:  # shutting down twice is harmless
                executor.shutdown(wait=threading.get_ident() not in idents)

        return stop

    def submit(self, key: int, update: Callable[..., None], *args: Any, lane: str = "CPU") -> bool:
        """Queue ``update(*args)`` under ``key``; inline, run it now. False
        when it failed inline (kept: see [Note: a failed CPU update]).
        ``lane`` names the kernel in messages ("CPU", or "device" for an
        update in the device's Adam, see [Note: Adam where the bandwidth is])."""
        self._held[key] = lane
        if self._executors:
            executor = self._executors["device" if lane == "device" else "CPU"]
            self._futures[key] = executor.submit(self._run, key, update, *args)
            return True
        try:
            self._run(key, update, *args)
        except Exception as error:  # raised where it is waited for
            self._failed_once(key, error)
            return False
        return True

    def _run(self, key: int, update: Callable[..., None], *args: Any) -> None:
        t0 = time.perf_counter()
        try:
            update(*args)
        except BaseException:
            self._again[key] = (update, args)  # read by the owner after the future's error
            raise
        with self._counting:
            if self._on_own_worker():
                self.worker_updates += 1
            if self._held.get(key) == "device":
                self.device_update_s += time.perf_counter() - t0
            else:
                self.update_s += time.perf_counter() - t0

    def next_done(self) -> bool:
        """True when the first held update has finished running (or ran inline)."""
        future = self._futures.get(min(self._held))
        return future is None or future.done()

    def count_wait(self, seconds: float) -> None:
        """Count ``seconds`` the owner waited for an update's results after
        ``wait`` (a device-lane copy into host memory) in ``wait_s``."""
        self.wait_s += seconds

    def wait(self, key: int) -> None:
        """Finish ``key``'s update (nothing to do when none is held); a failed
        one runs once more, here. See [Note: a failed CPU update].

        Raises:
            CpuStepError: the update failed again; it stays held.
        """
        future = self._futures.pop(key, None)
        if future is not None:
            t0 = time.perf_counter()
            with phase("zerostack::await_update"):
                error = future.exception()
            self.wait_s += time.perf_counter() - t0
            if error is not None:
                self._failed_once(key, error)
        if key in self._failed:
            self._retry(key)
        self._held.pop(key, None)
        self._again.pop(key, None)

    def pop(self) -> int:
        """``wait`` for the first held update; its key."""
        key = min(self._held)
        self.wait(key)
        return key

    def harvest(self) -> None:
        """Updates that failed on the worker, not waited for yet, are kept as failed."""
        for key, future in list(self._futures.items()):
            if future.done() and future.exception() is not None:
                del self._futures[key]
                self._failed_once(key, future.exception())  # type: ignore[arg-type]

    def drop_failed(self) -> list[int]:
        """Forget the failed updates (what they would have written keeps its
        value); their keys."""
        dropped = sorted(self._failed)
        for key in dropped:
            self._held.pop(key, None)
            self._again.pop(key, None)
        self._failed.clear()
        return dropped

    def _failed_once(self, key: int, error: BaseException) -> None:
        logger.warning(
            "%s: the %s update of %s failed (%s: %s); it will run again",
            self.api, self._held.get(key, "CPU"), self._name(key), type(error).__name__,
            error,
        )  # fmt: skip
        self._failed.add(key)

    def _retry(self, key: int) -> None:
        update, args = self._again[key]
        try:
            self._run(key, update, *args)
        except Exception as error:
            lane = self._held.get(key, "CPU")
            failed = CpuStepError(
                f"{self.api}: the {lane} update of {self._name(key)} failed "
                f"({type(error).__name__}: {error}); it is kept with its gradients: remove the "
                f"cause and go on (the next {self.retry_at} runs it again), or reload a "
                "checkpoint",
                key,
            )
            logger.error("%s", failed)
            raise failed from error
        self._failed.discard(key)
        logger.info(
            "%s: the %s update of %s ran again and succeeded",
            self.api, self._held.get(key, "CPU"), self._name(key),
        )  # fmt: skip
