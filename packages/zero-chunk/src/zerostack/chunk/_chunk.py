"""Chunk: one contiguous buffer holding many tensors, gathered or sharded."""

from __future__ import annotations

import logging
import warnings
import weakref
from collections import Counter
from typing import Any

import torch
import torch.distributed as dist

from zerostack.chunk import _comm
from zerostack.chunk._pinned import pinned_empty
from zerostack.chunk._state import TRANSITIONS, TensorInfo, TensorState
from zerostack.chunk._streams import GatheredBytes, Handle, _CopyIn, copy_stream, landing_stream

logger = logging.getLogger(__name__)
_warned_pin = False


class ChunkFullError(RuntimeError):
    """The tensor does not fit in the space the chunk has left."""


def default_compute_device() -> torch.device:
    """The compute device when none is given: the current CUDA device, else the CPU."""
    return (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )


def check_device(api: str, name: str, value: object, optional: bool = False) -> torch.device:
    """``value`` as a device where chunks can live: a parsed torch.device, not
    meta, and CUDA only where CUDA is available; errors name ``api`` and the
    argument ``name`` (``optional``: the caller also takes None, and says so)."""
    if not isinstance(value, torch.device | str):
        kinds = "a torch.device, str or None" if optional else "a torch.device or str"
        raise TypeError(f"{api}: {name} must be {kinds} (got {value!r})")
    try:
        device = torch.device(value)
    except RuntimeError:
        raise ValueError(
            f"{api}: {name} is not a device (got {value!r}); pass e.g. 'cpu' or 'cuda'"
        ) from None
    if device.type == "meta":
        raise ValueError(
            f"{api}: {name} cannot be meta (got {value!r}); chunks hold real memory: pass "
            "'cpu' or 'cuda', and build meta models under LazyInitContext"
        )
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{api}: {name} is {value!r} but CUDA is not available; pass 'cpu'")
    return device


def _check_tensor(api: str, tensor: object) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{api}: expected a tensor (got {type(tensor).__name__})")


def _empty_on(numel: int, dtype: torch.dtype, device: torch.device, pin: bool) -> torch.Tensor:
    """``numel`` elements on ``device``; on the CPU pinned at their exact size
    when asked (a shard moves only when its placement is decided: see [Note:
    exact pinned buffers] in ``_pinned.py``)."""
    global _warned_pin
    if pin and device.type == "cpu":
        if torch.cuda.is_available():
            return pinned_empty(numel, dtype)
        if not _warned_pin:
            _warned_pin = True
            warnings.warn("Chunk: pin_memory=True has no effect without CUDA", stacklevel=3)
    return torch.empty(numel, dtype=dtype, device=device)


class Chunk:
    """``chunk_size`` elements of one dtype, holding tensors in the order they
    were appended, shared by a process group.

    Until ``close_chunk`` the chunk is a gathered buffer being filled. After it
    the chunk is either kept gathered (``keep_gathered``: every rank holds the
    whole buffer) or sharded: this rank keeps ``chunk_size / world`` elements
    (its shard) on the compute device or the CPU, and ``access`` gathers the
    whole buffer again when the tensors are needed.

    Args:
        chunk_size: elements; rounded up to a multiple of the group's size so
            every shard is equal.
        process_group: the group sharing the chunk (default: the default group,
            or a single process when torch.distributed is not initialised).
        dtype: the dtype of every tensor in the chunk.
        index: a number that names the chunk in messages. Default 0.
        compute_device: where the gathered buffer lives. Default: the current
            CUDA device, else the CPU.
        shard_device: where the shard lives after ``close_chunk``. Default:
            the compute device.
        keep_gathered: never shard. Default False.
        pin_memory: pin the shard when it is on the CPU (needs CUDA). Default False.

    Raises:
        ValueError: chunk_size < 1, or a dtype that is not floating point.
    """

    _unbound = False  # gathered, its tensors pointed away from the buffer (see reduce)

    def __init__(
        self,
        chunk_size: int,
        process_group: dist.ProcessGroup | None,
        dtype: torch.dtype,
        *,
        index: int = 0,
        compute_device: torch.device | str | None = None,
        shard_device: torch.device | str | None = None,
        keep_gathered: bool = False,
        pin_memory: bool = False,
    ) -> None:
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
            raise ValueError(f"Chunk: chunk_size must be an int >= 1 (got {chunk_size!r})")
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"Chunk: dtype must be a torch.dtype (got {dtype!r})")
        if not dtype.is_floating_point:
            raise ValueError(f"Chunk: dtype must be floating point (got {dtype})")
        if compute_device is not None:
            compute_device = check_device("Chunk", "compute_device", compute_device)
        if shard_device is not None:
            shard_device = check_device("Chunk", "shard_device", shard_device)
        self.index = index
        self.process_group = process_group
        self.rank, self.world_size = _comm.rank_and_world(process_group)
        self.shard_size = -(-chunk_size // self.world_size)
        self.chunk_size = self.shard_size * self.world_size
        self.dtype = dtype
        self.compute_device = (
            torch.device(compute_device) if compute_device else default_compute_device()
        )
        self.shard_device = torch.device(shard_device) if shard_device else self.compute_device
        self.keep_gathered = keep_gathered
        self.pin_memory = pin_memory
        self._book: GatheredBytes | None = None
        self._buffer: torch.Tensor | None = None
        self.buffer = torch.zeros(self.chunk_size, dtype=dtype, device=self.compute_device)
        self._shard: torch.Tensor | None = None
        self.utilized_size = 0
        self.closed = False
        self.tensors_info: dict[torch.Tensor, TensorInfo] = {}
        self.state_count: Counter[TensorState] = Counter()
        self.paired_chunk: Chunk | None = None
        self.grad_chunk: Chunk | None = None
        self._in_flight: Handle | None = None  # an async gather not yet waited on
        # See [Note: a reduced share lands on the host]: the event of its copy.
        self._landing: Any = None
        # See [Note: the reduced share's norm]: (norm, the share (weakly: a
        # dropped share is freed), its version).
        self._reduced_norm: tuple[torch.Tensor, weakref.ref, int] | None = None

    # -- filling -----------------------------------------------------------

    def append_tensor(self, tensor: torch.Tensor) -> None:
        """Copy ``tensor`` into the chunk and make its ``.data`` a view of it.

        Raises:
            RuntimeError: the chunk is closed.
            TypeError: the tensor's dtype is not the chunk's.
            ValueError: sparse, non-contiguous, meta or already registered tensor.
            ChunkFullError: not enough space left (the chunk is unchanged).
        """
        name = f"Chunk {self.index}.append_tensor"
        _check_tensor(name, tensor)
        if self.closed:
            raise RuntimeError(f"{name}: the chunk is closed; append to a new chunk")
        if tensor.dtype != self.dtype:
            raise TypeError(f"{name}: dtype {tensor.dtype} does not match the chunk's {self.dtype}")
        if tensor.is_sparse or not tensor.is_contiguous():
            raise ValueError(
                f"{name}: the tensor must be dense and contiguous (shape {tuple(tensor.shape)})"
            )
        if tensor in self.tensors_info:
            raise ValueError(
                f"{name}: the tensor (shape {tuple(tensor.shape)}) is already registered"
            )
        numel = tensor.numel()
        if self.utilized_size + numel > self.chunk_size:
            raise ChunkFullError(
                f"{name}: a tensor of {numel} elements does not fit "
                f"({self.chunk_size - self.utilized_size} of {self.chunk_size} left)"
            )
        if tensor.device.type == "meta":
            raise ValueError(
                f"{name}: the tensor (shape {tuple(tensor.shape)}) is on the meta device; build the model "
                "under LazyInitContext and use LazyInitContext.distribute"
            )
        view = self.buffer[self.utilized_size : self.utilized_size + numel]
        view.copy_(tensor.detach().reshape(-1))
        tensor.data = view.view(tensor.shape)
        self.tensors_info[tensor] = TensorInfo(
            self.utilized_size, self.utilized_size + numel, tensor.shape
        )
        self.state_count[TensorState.HOLD] += 1
        self.utilized_size += numel

    def close_chunk(self) -> None:
        """Stop appending; shard the chunk unless it is kept gathered."""
        if self.closed:
            raise RuntimeError(f"Chunk {self.index}.close_chunk: already closed")
        self.closed = True
        if not self.keep_gathered:
            mine = self.buffer[self.rank * self.shard_size : (self.rank + 1) * self.shard_size]
            self.shard = _empty_on(self.shard_size, self.dtype, self.shard_device, self.pin_memory)
            self.shard.copy_(mine)
            self._drop_buffer()

    # -- gather / release --------------------------------------------------

    @property
    def shard(self) -> torch.Tensor | None:
        """This rank's shard (None while the chunk is open or gathered for
        good); a reduced gradient's copy into it has landed (see [Note: a
        reduced share lands on the host])."""
        self._wait_landing()
        return self._shard

    @shard.setter
    def shard(self, value: torch.Tensor | None) -> None:
        self._wait_landing()  # a copy may still write the share this replaces
        self._shard = value

    def _wait_landing(self) -> None:
        landing = self._landing
        if landing is not None:
            landing.synchronize()
            if self._landing is landing:  # not a newer copy's, set meanwhile
                self._landing = None

    @property
    def buffer(self) -> torch.Tensor | None:
        """The gathered chunk (``chunk_size`` elements on the compute device);
        None while only the shard is held."""
        return self._buffer

    @buffer.setter
    def buffer(self, value: torch.Tensor | None) -> None:
        book = self._book
        if book is not None and (self._buffer is None) != (value is None):
            book.nbytes += self.buffer_bytes if value is not None else -self.buffer_bytes
        self._buffer = value

    @property
    def buffer_bytes(self) -> int:
        """Bytes of the gathered buffer when there is one: ``chunk_size``
        elements of ``dtype``."""
        return self.chunk_size * self.dtype.itemsize

    def report_gathered_to(self, book: GatheredBytes | None) -> None:
        """From now on keep ``book.nbytes`` counting this chunk's gathered
        buffer (``buffer_bytes`` while gathered, nothing while not). A
        placement asks for the bytes gathered at every gather: a running
        count, not a sum over every chunk each time.

        Args:
            book: the count to keep; None stops reporting (what this chunk
                added to its book is taken back).

        Raises:
            ValueError: the chunk reports to another book already (stop
                that first, with None): one count would miss it.
        """
        if book is not None and self._book is not None and book is not self._book:
            raise ValueError(
                f"Chunk {self.index}.report_gathered_to: the chunk reports to another "
                "GatheredBytes already; pass None first"
            )
        if self._book is not None and self._buffer is not None:
            self._book.nbytes -= self.buffer_bytes
        self._book = book
        if book is not None and self._buffer is not None:
            book.nbytes += self.buffer_bytes

    @property
    def is_gathered(self) -> bool:
        return self._buffer is not None

    @property
    def num_tensors(self) -> int:
        return len(self.tensors_info)

    def _rebind(self) -> None:
        self._in_flight = None
        self._unbound = False
        for t, info in self.tensors_info.items():
            t.data = self.buffer[info.offset : info.end].view(info.shape)

    def bind(self) -> None:
        """Point the tensors at the gathered buffer again if a reduce over
        the parameters unbound them (see ``reduce``): the step's write-back,
        or a forward recomputed in backward after the reduce (its values are
        then the gradients, as a sharded chunk's re-gather gives)."""
        if self._unbound:
            self._rebind()

    def _unbind(self) -> None:
        self._unbound = True
        for t in self.tensors_info:
            t.data = torch.empty(0, dtype=self.dtype, device=self.compute_device)

    def _drop_buffer(self) -> None:
        self.buffer = None
        self._unbind()

    def access(self, async_op: bool = False) -> Handle | None:
        """Gather the whole chunk on the compute device (all-gather of the shards).

        With ``async_op`` returns a Handle; the tensors point into the chunk
        once it is waited on (a later ``access``, ``release`` or ``reduce``
        waits for it first). A pinned shard on the host of a CUDA compute
        device is then copied on a side stream, beside the compute stream's
        work (see [Note: a prefetch copies beside compute]). A gathered
        chunk returns None at once.
        """
        self._check_closed("access")
        if self.is_gathered:
            self.settle()
            self.bind()
            return None
        self.buffer = torch.empty(self.chunk_size, dtype=self.dtype, device=self.compute_device)
        try:
            if async_op and self.compute_device.type == "cuda" and self._pinned_on_host():
                work = self._copy_in()
            else:
                shard = self.shard.to(self.compute_device, non_blocking=True)
                work = _comm.all_gather_into(self.buffer, shard, self.process_group, async_op)
        except BaseException:
            self.buffer = None  # not gathered: no garbage buffer that looks gathered
            raise
        handle = Handle(work, self._rebind)
        if not async_op:
            handle.wait()
            return None
        self._in_flight = handle
        return handle

    def _pinned_on_host(self) -> bool:
        return self.shard.device.type == "cpu" and self.shard.is_pinned()

    def _copy_in(self) -> _CopyIn:
        """The host shard to the gathered buffer on the copy stream.

        [Note: a prefetch copies beside compute] A gather issued ahead of
        use (Gemini's ``max_prefetch``) whose shard lives in pinned host
        memory copies it on a side stream, so the copy runs while the
        compute stream computes; a gather on the compute stream would wait
        for the kernels queued before it and hold back those queued after.
        (A pageable shard stays on the compute stream: its copy would make
        the host wait for the side stream, and so for the kernels queued
        before it.) Memory: the
        buffer (and the staging of an all-gather) is allocated in the
        compute stream's order and the copy stream first waits for the work
        queued there, so no earlier user of that memory is still running;
        the compute stream waits for the copy (``Handle.wait``) before any
        kernel reads the buffer, and a release or free comes after that
        wait, so the memory is reused in the compute stream's order only.
        With several ranks the all-gather is issued from the copy stream
        (the collective's stream waits for the copy) and waited as usual.
        Anything that reads or writes the chunk's buffer or shard finishes
        the gather first (``settle``: access, release, reduce, the share
        helpers, ``shard_move``). The host shard is read until the copy ends,
        and the host (or a device lane's copy back to it) writes it only in
        an optimizer update or a load: a
        chunk is not gathered ahead while its update is pending; a gather
        that was used is followed, before the update, by the blocking copy
        of its reduced gradient to the host (or the event the CPU step waits
        for), which comes after the compute stream's wait for the copy; and
        Gemini's placement waits for the gathers ahead left unused, the host
        too, at the end of a backward and when a batch is dropped or a
        checkpoint loaded (``Placement.drain``)."""
        side = copy_stream(self.compute_device)
        collective = None
        staging = (
            torch.empty(self.shard_size, dtype=self.dtype, device=self.compute_device)
            if self.world_size > 1  # See [Note: a collective over one rank]
            else None
        )
        side.wait_stream(torch.cuda.current_stream(self.compute_device))
        with torch.cuda.stream(side):
            if staging is None:
                self.buffer.copy_(self.shard, non_blocking=True)
            else:
                staging.copy_(self.shard, non_blocking=True)
                collective = _comm.all_gather_into(
                    self.buffer, staging, self.process_group, async_op=True
                )
        return _CopyIn(self.compute_device, collective)

    def settle(self) -> None:
        """Finish a gather issued with ``async_op``, and wait until a reduced
        share's copy to the host has landed (nothing if neither is in flight)."""
        if self._in_flight is not None:
            self._in_flight.wait()
        _ = self.shard  # See [Note: a reduced share lands on the host]

    def _land(self, share: torch.Tensor, out: torch.Tensor) -> None:
        """Copy the reduced ``out`` into the host ``share``.

        [Note: a reduced share lands on the host] A share whose home is
        pinned host memory (``pin_memory``, offloaded parameters) receives
        its reduced gradient asynchronously, on a side stream of its own
        (``landing_stream``), with an event recorded after the copy. A
        blocking copy made the host wait, in every chunk's reduction, for all
        the backward queued so far; a copy on the compute stream ran beside
        no kernel (docs/benchmarks.md, "Offloaded steps, 2026-12-02 fourth
        session"). The side stream first waits for the compute stream (the
        reduction wrote ``out``, its norm read it, and any gather that read
        the share was waited for there), and ``out``, freed on the compute
        stream, is recorded on the side stream, so the allocator does not
        reuse it before the copy ends. Nothing reads or writes the share
        before the copy ends: the host reaches it only through the ``shard``
        property, which waits for the event first (so do ``settle``, every
        helper that reads or writes the share, and every gather, which
        copies from the share); the optimizer step takes each gradient share
        through ``local_share``, so its CPU updates read landed gradients. A
        pageable share keeps the blocking copy: its copy makes the host wait
        anyway."""
        if out.device.type == "cuda" and share.is_pinned():
            side = landing_stream(out.device)
            side.wait_stream(torch.cuda.current_stream(out.device))  # `out` is reduced and read
            with torch.cuda.stream(side):
                share.copy_(out, non_blocking=True)
            out.record_stream(side)  # freed on the compute stream: kept until the copy ends
            landing = torch.cuda.Event(blocking=True)  # a host waits: no spinning
            landing.record(side)
            self._landing = landing
        else:
            share.copy_(out)

    @property
    def can_release(self) -> bool:
        """True when no tensor is in use (all HOLD or FREE) and the chunk is sharded."""
        idle = self.state_count[TensorState.HOLD] + self.state_count[TensorState.FREE]
        return not self.keep_gathered and idle == self.num_tensors

    def release(self) -> None:
        """Drop the gathered copy; the shard stays.

        Raises:
            RuntimeError: a tensor is in use, or the chunk is kept gathered.
        """
        self._check_closed("release")
        if not self.is_gathered:
            return
        self.settle()
        if not self.can_release:
            states = {s.name: c for s, c in self.state_count.items() if c}
            raise RuntimeError(
                f"Chunk {self.index}.release: cannot release (keep_gathered={self.keep_gathered}, "
                f"tensor states {states})"
            )
        self._drop_buffer()

    def zero_buffer(self) -> None:
        """A zeroed whole buffer in place of a gather, for a chunk whose values
        are not needed (gradients, none of them computed on this rank). Local:
        no collective. The tensors stay unbound until the next ``access``.

        Raises:
            RuntimeError: the chunk is gathered already.
        """
        self._check_closed("zero_buffer")
        if self.is_gathered:
            raise RuntimeError(f"Chunk {self.index}.zero_buffer: the chunk is gathered")
        self.buffer = torch.zeros(self.chunk_size, dtype=self.dtype, device=self.compute_device)

    # -- gradients ---------------------------------------------------------

    def init_grad_chunk(self) -> Chunk:
        """A zeroed, gathered chunk laid out like this one, to hold gradients.

        Created once and re-zeroed on later calls.
        """
        self._check_closed("init_grad_chunk")
        grad = self.grad_chunk
        if grad is None:
            grad = Chunk(
                self.chunk_size,
                self.process_group,
                self.dtype,
                index=self.index,
                compute_device=self.compute_device,
                shard_device=self.shard_device,
                keep_gathered=self.keep_gathered,
            )
            grad.closed = True
            self.grad_chunk = grad
        elif grad.buffer is None:
            grad.buffer = torch.zeros(self.chunk_size, dtype=self.dtype, device=self.compute_device)
        else:
            grad.buffer.zero_()
        return grad

    def grad_view(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor``'s slot in the gradient chunk (shaped like the tensor)."""
        info = self._info("grad_view", tensor)
        if self.grad_chunk is None or self.grad_chunk.buffer is None:
            raise RuntimeError(f"Chunk {self.index}.grad_view: call init_grad_chunk first")
        return self.grad_chunk.buffer[info.offset : info.end].view(info.shape)

    @property
    def can_reduce(self) -> bool:
        return self.state_count[TensorState.READY_FOR_REDUCE] == self.num_tensors

    def reduce(self, async_op: bool = False, *, accumulate: bool = False) -> Handle | None:
        """Average the gradients over the group.

        The gradients are the grad chunk's buffer, or, when there is no grad
        chunk, this chunk's own gathered buffer (gradients written over the
        parameters, `reuse_fp16_chunk`). Sharded chunks reduce-scatter, so each
        rank keeps the mean of its shard in ``shard`` (of the grad chunk, or of
        this chunk, replacing its parameter shard); kept-gathered chunks
        all-reduce in place. Every tensor goes back to HOLD. A reduce-scattered
        share's norm is taken on the compute device and kept
        (:meth:`reduced_norm`).

        With ``accumulate``, a sharded chunk's reduced share is added to the
        one the last reduction left (a gradient not consumed yet: backward
        on several batches before one step, as ColossalAI's Gemini
        accumulates with ``enable_gradient_accumulation``); its norm is the
        sum's. A kept-gathered grad chunk needs nothing of it: its buffer
        keeps the last mean, to which the next backward adds.

        Raises:
            RuntimeError: not every tensor is READY_FOR_REDUCE (the chunk is
                left unchanged), or there is no gathered gradient buffer.
        """
        self._check_closed("reduce")
        self.settle()
        if not self.can_reduce:
            states = {s.name: c for s, c in self.state_count.items() if c}
            raise RuntimeError(
                f"Chunk {self.index}.reduce: every tensor must be READY_FOR_REDUCE (states {states})"
            )
        target = self.grad_chunk if self.grad_chunk is not None else self
        if target.buffer is None:
            raise RuntimeError(f"Chunk {self.index}.reduce: no gathered gradient buffer to reduce")
        target._reduced_norm = None
        for t in self.tensors_info:
            self._transition(t, TensorState.HOLD)
        full = target.buffer
        if self.world_size > 1:
            full.div_(self.world_size)  # before the sum, so fp16 cannot overflow
        if self.keep_gathered:
            work = _comm.all_reduce_sum(full, self.process_group, async_op)
            handle = Handle(work, lambda: None)
            if target is self:
                # Gradients written over the parameters: the tensors hold
                # none of the chunk's values until sync_gathered (the write-
                # back of the step) points them at the buffer again, as a
                # sharded chunk's tensors are empty until its next gather.
                self._unbind()
        else:
            out = torch.empty(self.shard_size, dtype=self.dtype, device=self.compute_device)
            work = _comm.reduce_scatter_sum(out, full, self.process_group, async_op)

            def finish() -> None:
                self._take_reduced(target, out, accumulate)

            handle = Handle(work, finish)
        if not async_op:
            handle.wait()
            return None
        return handle

    def _take_reduced(self, target: Chunk, out: torch.Tensor, accumulate: bool) -> None:
        """``out``, this rank's reduced share, becomes ``target``'s shard (this
        chunk's or its grad chunk's, see ``reduce``), with ``accumulate``
        added to the grad chunk's last one first, its norm kept."""
        kept = target.shard if accumulate and target is not self else None
        if kept is not None:
            out.add_(kept.to(out.device, non_blocking=True))
        # See [Note: the reduced share's norm]. foreach, as zero-shard's
        # norm_part takes the shares' norms: the same kernel, the same rounding.
        norm = torch._foreach_norm([out], 2.0, dtype=torch.float32)[0]
        old = target.shard
        if self.shard_device == self.compute_device:
            target.shard = out
        elif (
            old is not None
            and old.device == self.shard_device
            and old.numel() == out.numel()
            and old.dtype == out.dtype
        ):
            # Into the host shard it replaces (stale parameters, or a
            # consumed gradient): no fresh pages every step, and a
            # pinned shard stays pinned instead of going to the
            # pinned allocator's cache.
            target._land(old, out)
        else:
            target.shard = out.to(self.shard_device)
        share = target._shard  # not the property: it would wait for the landing copy
        target._reduced_norm = (norm, weakref.ref(share), share._version)
        if target is self:
            self._drop_buffer()
        else:
            target.buffer = None

    # -- placement ---------------------------------------------------------

    def shard_move(self, device: torch.device | str, non_blocking: bool = False) -> None:
        """Move this rank's shard to ``device`` (pinned on the CPU when asked).
        With ``non_blocking``, a copy from a CUDA device into pinned host
        memory may still run on return: the host reaches the new shard only
        through the ``shard`` property, which waits for it (as for a reduced
        share landing, [Note: a reduced share lands on the host])."""
        self._check_closed("shard_move")
        device = check_device(f"Chunk {self.index}.shard_move", "device", device)
        self.settle()  # a copy in flight reads the shard
        if self.shard is None or self.shard.device == device:
            self.shard_device = device
            return
        landing = None
        if device.type == "cpu":
            source = self.shard
            moved = _empty_on(self.shard_size, self.dtype, device, self.pin_memory)
            moved.copy_(source, non_blocking=non_blocking)
            if non_blocking and source.device.type == "cuda" and moved.is_pinned():
                landing = torch.cuda.Event(blocking=True)  # a host waits: no spinning
                landing.record(torch.cuda.current_stream(source.device))
        else:
            moved = self.shard.to(device, non_blocking=non_blocking)
        self.shard, self.shard_device = moved, device
        self._landing = landing

    def memory_usage(self) -> dict[str, int]:
        """Bytes this chunk holds, by device type ("cpu", "cuda", ...)."""
        usage: Counter[str] = Counter()
        for t in (self.buffer, self._shard):  # sizes only: no wait for a landing copy
            if t is not None:
                usage[t.device.type] += t.numel() * t.element_size()
        return dict(usage)

    # -- numerics without host syncs ------------------------------------------

    # [Note: the reduced share's norm] Clipping and the overflow check need
    # the norm of every gradient share at the step. A share kept on the host
    # (offloaded masters) would be read there by torch's CPU norm, far slower
    # than the host's memory bandwidth (docs/benchmarks.md, 2026-12-02: most
    # of a 2B model's step). So reduce takes the share's norm on the compute
    # device, while the share is still there, and keeps it with a weak
    # reference to the share and the share's version counter: a torch op
    # that writes the share moves the counter, and a new share or a gathered
    # chunk does not match, so the record goes stale and the caller computes
    # the norm itself. A writer through the data pointer (fused-adam's
    # kernels writing new values into a share) moves no counter: its caller
    # calls forget_reduced_norm() first.
    def reduced_norm(self) -> torch.Tensor | None:
        """The fp32 2-norm of this rank's share as the last ``reduce`` left it.
        See [Note: the reduced share's norm].

        Returns:
            A 0-dim fp32 tensor on the compute device, or None when the share
            has changed since, was never reduce-scattered, was all-reduced
            (kept gathered) or ``forget_reduced_norm`` was called.
        """
        record = self._reduced_norm
        if record is None:
            return None
        norm, ref, version = record
        share = ref()
        if (
            self.is_gathered
            or share is None
            or share is not self._shard  # identity only: no wait for a landing copy
            or share._version != version
        ):
            self._reduced_norm = None
            return None
        return norm

    def forget_reduced_norm(self) -> None:
        """Drop the reduced share's norm: the share is about to be written in a
        way its version counter does not see. See [Note: the reduced share's norm]."""
        self._reduced_norm = None

    def local_share(self) -> torch.Tensor:
        """This rank's ``shard_size`` elements: the shard, or its slice of the
        gathered buffer (a view either way; a gather in flight is finished first)."""
        self.settle()
        if self.shard is not None and not self.is_gathered:
            return self.shard
        return self.buffer[self.rank * self.shard_size : (self.rank + 1) * self.shard_size]

    def write_share(self, values: torch.Tensor, non_blocking: bool = False) -> None:
        """Copy ``values`` (``shard_size`` elements) into this rank's share."""
        _check_tensor(f"Chunk {self.index}.write_share", values)
        if values.numel() != self.shard_size:
            raise ValueError(
                f"Chunk {self.index}.write_share: values must have the share's "
                f"{self.shard_size} elements (got {values.numel()})"
            )
        self.local_share().copy_(values, non_blocking=non_blocking)

    def commit_share(self) -> None:
        """After the gathered tensors were written: copy this rank's slice of
        the buffer into its shard, so a release keeps the new values."""
        self._check_closed("commit_share")
        self.settle()
        if self.shard is not None and self.is_gathered:
            lo = self.rank * self.shard_size
            self.shard.copy_(self.buffer[lo : lo + self.shard_size])

    def sync_gathered(self) -> None:
        """A kept-gathered chunk whose ranks each updated their own share:
        all-gather the shares into every rank's buffer (a collective)."""
        self._check_closed("sync_gathered")
        if not self.keep_gathered:
            raise RuntimeError(f"Chunk {self.index}.sync_gathered: the chunk is sharded")
        if self.world_size > 1:
            share = self.local_share().clone()
            _comm.all_gather_into(self.buffer, share, self.process_group, async_op=False)
        self.bind()

    def copy_into_slot(self, tensor: torch.Tensor, values: torch.Tensor | None) -> None:
        """Write ``values`` (``tensor``'s numel, any shape; None: zeros) over
        ``tensor``'s slot of the gathered buffer (its gradient over its value)."""
        api = f"Chunk {self.index}.copy_into_slot"
        info = self._info("copy_into_slot", tensor)
        if values is not None:
            _check_tensor(api, values)
            if values.numel() != info.numel:
                raise ValueError(
                    f"{api}: values must have the tensor's {info.numel} elements "
                    f"(got {values.numel()})"
                )
        if self.buffer is None:
            raise RuntimeError(f"{api}: the chunk is not gathered")
        slot = self.buffer[info.offset : info.end]
        if values is None:
            slot.zero_()
        else:
            slot.copy_(values.reshape(-1))

    def has_inf_or_nan(self) -> torch.Tensor:
        """A bool tensor on the data's device: any inf/nan in this rank's share."""
        return ~torch.isfinite(self.local_share()).all()

    def l2_norm_sq(self) -> torch.Tensor:
        """fp32 squared L2 norm of this rank's share, on its device; summed over
        the ranks it is the whole chunk's."""
        return self.local_share().float().pow(2).sum()

    # -- pairing with an fp32 master ---------------------------------------------

    def pair(self, master: Chunk) -> None:
        """Pair this fp16/bf16 chunk with its fp32 master chunk (same layout)."""
        if not isinstance(master, Chunk):
            raise TypeError(
                f"Chunk {self.index}.pair: master must be a Chunk (got {type(master).__name__})"
            )
        if master.chunk_size != self.chunk_size or master.world_size != self.world_size:
            raise ValueError(f"Chunk {self.index}.pair: the master chunk has another size or group")
        self.paired_chunk, master.paired_chunk = master, self

    def copy_from_paired(self) -> None:
        """Copy the paired master's data (shard, or whole buffer) into this chunk."""
        master = self.paired_chunk
        if master is None:
            raise RuntimeError(f"Chunk {self.index}.copy_from_paired: no paired chunk")
        self.settle()
        master.settle()
        if self.is_gathered and master.is_gathered:
            self.buffer.copy_(master.buffer)
        else:
            self.local_share().copy_(master.local_share())

    # -- states ------------------------------------------------------------------

    def tensor_state(self, tensor: torch.Tensor) -> TensorState:
        return self._info("tensor_state", tensor).state

    def _info(self, api: str, tensor: Any) -> TensorInfo:
        _check_tensor(f"Chunk {self.index}.{api}", tensor)
        info = self.tensors_info.get(tensor)
        if info is None:
            raise ValueError(
                f"Chunk {self.index}.{api}: the tensor (shape {tuple(tensor.shape)}) is not in "
                "this chunk"
            )
        return info

    def _transition(self, tensor: torch.Tensor, new: TensorState) -> None:
        info = self.tensors_info.get(tensor)
        if info is None:
            raise ValueError(
                f"chunk {self.index}: tensor of shape {tuple(tensor.shape)} is not in this chunk"
            )
        self.trans_info_state(info, new)

    def trans_info_state(self, info: TensorInfo, new: TensorState) -> None:
        """``trans_tensor_state`` for a caller holding the tensor's ``TensorInfo``
        (of this chunk's ``tensors_info``): no lookup by tensor, which costs a
        Python ``Tensor.__hash__`` call. The hooks' hot path.

        The only place a tensor's state changes. See [Note: tensor state table]."""
        old = info.state
        if new not in TRANSITIONS[old]:
            raise RuntimeError(
                f"chunk {self.index}: illegal transition {old.name} -> {new.name} "
                f"for tensor at offset {info.offset} (shape {tuple(info.shape)})"
            )
        info.state = new
        self.state_count[old] -= 1
        self.state_count[new] += 1

    def trans_tensor_state(self, tensor: torch.Tensor, new: TensorState) -> None:
        """Move ``tensor`` to ``new`` (checked against the transition table)."""
        if not isinstance(new, TensorState):
            raise TypeError(
                f"Chunk {self.index}.trans_tensor_state: new must be a TensorState (got {new!r})"
            )
        self._transition(tensor, new)

    def _check_closed(self, api: str) -> None:
        if not self.closed:
            raise RuntimeError(f"Chunk {self.index}.{api}: call close_chunk first")

    def __repr__(self) -> str:
        where = "gathered" if self.is_gathered else f"sharded on {self.shard_device}"
        return (
            f"Chunk({self.index}, {self.num_tensors} tensors, {self.utilized_size}/{self.chunk_size} "
            f"{self.dtype}, {where})"
        )
