"""What a chunk's asynchronous operations hand back and the side streams
they run on, and the running count of gathered bytes a chunk reports to."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch


class GatheredBytes:
    """A running count of the gathered buffers' bytes of the chunks that
    report to it (``Chunk.report_gathered_to``).

    Attributes:
        nbytes: the sum of ``buffer_bytes`` over the reporting chunks that
            are gathered now.
    """

    __slots__ = ("nbytes",)

    def __init__(self) -> None:
        self.nbytes = 0

    def __repr__(self) -> str:
        return f"GatheredBytes({self.nbytes})"


class Handle:
    """An asynchronous chunk collective; ``wait()`` finishes it (idempotent)."""

    def __init__(self, work: Any, finish: Callable[[], None]) -> None:
        self._work = work
        self._finish: Callable[[], None] | None = finish

    def wait(self) -> None:
        if self._finish is None:
            return
        if self._work is not None:
            self._work.wait()
        finish, self._finish = self._finish, None
        finish()

    def is_completed(self) -> bool:
        return self._finish is None


_side_streams: dict[tuple[torch.device, str], Any] = {}
_side_streams_lock = threading.Lock()  # the CPU-step worker gathers too


def _side_stream(device: torch.device, kind: str) -> Any:
    if device.index is None:
        device = torch.device(device.type, torch.cuda.current_device())
    stream = _side_streams.get((device, kind))
    if stream is None:
        with _side_streams_lock:
            stream = _side_streams.setdefault((device, kind), torch.cuda.Stream(device))
    return stream


def copy_stream(device: torch.device) -> Any:
    """The side stream that prefetched gathers copy host shards on (one per
    CUDA device; see [Note: a prefetch copies beside compute])."""
    return _side_stream(device, "gather")


def landing_stream(device: torch.device) -> Any:
    """The side stream that reduced shares are copied to pinned host memory
    on (one per CUDA device; see [Note: a reduced share lands on the host])."""
    return _side_stream(device, "land")


class _CopyIn:
    """The work of a gather whose host-to-device copy runs on the copy stream:
    ``wait()`` makes the current stream wait for the copy, or for the
    all-gather issued after it on the collective's stream."""

    def __init__(self, device: torch.device, collective: Any) -> None:
        self._device, self._collective = device, collective
        self._copied = copy_stream(device).record_event() if collective is None else None

    def wait(self) -> None:
        if self._copied is None:
            self._collective.wait()
        else:
            torch.cuda.current_stream(self._device).wait_event(self._copied)
