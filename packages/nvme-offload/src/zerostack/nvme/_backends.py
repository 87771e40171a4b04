"""Disk I/O backends: tensornvme (io_uring or libaio) and plain threads.

Every backend does the same thing: asynchronous whole-tensor writes and reads
of named regions of one file, and a wait that returns when they are done.
[Note: one write, one read] The caller alternates strictly per key (write,
read, write, ...) and keeps each tensor alive and untouched until the wait:
tensornvme frees a key's disk space when it is read back (a second read
fails with "Read error, tensor not found") and reads the tensor's memory at
execution time, not at submission. Every backend forgets a key once it is
read, so that a caller reading a key twice fails on the thread backend too,
not only on machines with tensornvme; a caller that reads a key and wants it
kept on disk writes it back (StateSwapper.read, PrefetchPipeline.cancel).

[Note: tensornvme 0.1.0's waits] Measured by benchmarks/nvme.py on a 1 GiB
key with the page cache dropped (so the read goes to the disk):
* its Python ``sync_read_events`` is bound to the C++ write wait: with
  io_uring it returned 13 us after the read was submitted, with 4064 of
  4096 sampled elements still unread. So a read is waited for with
  ``synchronize()`` (all requests, the writes in flight too: its
  csrc/offload.cpp binds both ``sync_read_events`` and
  ``sync_write_events`` to the write wait, so no read-only wait is
  reachable from Python).
* every wait holds the GIL: a thread waking every 1 ms woke once in a
  0.475 s ``synchronize()``, so nothing else in the process (the next
  forward's launches, a CPU update on a worker thread) moves while it
  waits, and no timeout can fire.
* it never looks at a request's result: a failed or short read or write
  (an I/O error, a full disk) is not reported.
So the default backend is "threads" (os.pwrite / os.preadv, every byte
counted, errors raised, GIL released); "uring" and "aio" are used only
when asked for by name.
"""

from __future__ import annotations

import ctypes
import os
from abc import ABC, abstractmethod
from concurrent.futures import Future, ThreadPoolExecutor

import torch

BACKEND_ENV = "ZEROSTACK_NVME_BACKEND"
BACKENDS = ("uring", "aio", "threads")


def tensornvme_backends() -> set[str]:
    """The tensornvme backends this machine can run (empty without tensornvme)."""
    try:
        from tensornvme._C import get_backends, probe_backend
    except ImportError:
        return set()
    return {b for b in get_backends() if probe_backend(b)}


def _as_bytes(tensor: torch.Tensor) -> memoryview:
    # A view of the tensor's own bytes (no numpy: torch's CPU wheel lacks it).
    # The caller keeps the tensor alive while the view is in use.
    nbytes = tensor.numel() * tensor.element_size()
    return memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr())).cast("B")


class Backend(ABC):
    """Asynchronous writes and reads of whole tensors to named file regions."""

    name: str

    def __init__(self) -> None:
        self._readable: set[str] = set()  # keys written and not read back since

    def write(self, key: str, tensor: torch.Tensor) -> object:
        """Start writing ``tensor`` (contiguous, CPU) as ``key``; return a handle."""
        handle = self._write(key, tensor)
        self._readable.add(key)
        return handle

    def read(self, key: str, tensor: torch.Tensor) -> object:
        """Start reading ``key`` into ``tensor`` (same byte size); return a
        handle. The key is then off disk until written again (see [Note: one
        write, one read])."""
        if key not in self._readable:
            raise AssertionError(
                f"nvme: read of key {key!r}, which is not on disk (never written, or read back "
                "since its last write); see [Note: one write, one read]"
            )
        handle = self._read(key, tensor)
        self._readable.discard(key)
        return handle

    @abstractmethod
    def _write(self, key: str, tensor: torch.Tensor) -> object:
        """Submit the write of ``write``."""

    @abstractmethod
    def _read(self, key: str, tensor: torch.Tensor) -> object:
        """Submit the read of ``read``."""

    @abstractmethod
    def wait(self, handle: object) -> None:
        """Block until that request is done (or raise its error). A backend
        that cannot wait for one request waits for all of its kind."""

    @abstractmethod
    def wait_all(self) -> None:
        """Block until every started request is done."""

    @abstractmethod
    def close(self) -> None:
        """Wait for pending I/O and release the file."""


class ThreadBackend(Backend):
    """``os.pwrite`` / ``os.pread`` on a thread pool (they release the GIL).

    Each key has a fixed region of the file, assigned at its first write, so a
    failed write never disturbs another key's bytes.
    """

    name = "threads"

    def __init__(self, path: str, num_threads: int = 4) -> None:
        super().__init__()
        self.path = path
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        self._num_threads = num_threads
        self._pool = ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix="zs-nvme")
        self._pid = os.getpid()
        self._regions: dict[str, tuple[int, int]] = {}
        self._end = 0
        self._pending: list[Future] = []

    def _region(self, key: str, nbytes: int) -> int:
        if key not in self._regions:
            self._regions[key] = (self._end, nbytes)
            self._end += nbytes
        offset, size = self._regions[key]
        if size != nbytes:
            raise AssertionError(f"nvme: key {key} changed size ({size} -> {nbytes} bytes)")
        return offset

    def _pwrite(self, view: memoryview, offset: int) -> None:
        done = 0
        while done < len(view):
            done += os.pwrite(self._fd, view[done:], offset + done)

    def _pread(self, view: memoryview, offset: int) -> None:
        done = 0
        while done < len(view):
            n = os.preadv(self._fd, [view[done:]], offset + done)
            if n == 0:
                raise OSError(f"nvme: unexpected end of file reading {self.path}")
            done += n

    def _submit(self, fn, key: str, tensor: torch.Tensor) -> Future:
        view = _as_bytes(tensor)
        if self._pid != os.getpid():
            # A forked child has none of the pool's threads: a submit would
            # wait for ever. Futures pending at the fork are not the child's.
            self._pid, self._pending = os.getpid(), []
            self._pool = ThreadPoolExecutor(self._num_threads, thread_name_prefix="zs-nvme")
        future = self._pool.submit(fn, view, self._region(key, len(view)))
        self._pending = [f for f in self._pending if not f.done()]
        self._pending.append(future)
        return future

    def _write(self, key: str, tensor: torch.Tensor) -> Future:
        return self._submit(self._pwrite, key, tensor)

    def _read(self, key: str, tensor: torch.Tensor) -> Future:
        return self._submit(self._pread, key, tensor)

    def wait(self, handle: object) -> None:
        if handle is not None:
            handle.result()  # type: ignore[attr-defined]

    def wait_all(self) -> None:
        pending, self._pending = self._pending, []
        for f in pending:
            f.exception()

    def close(self) -> None:
        if self._fd < 0:
            return
        self._pool.shutdown(wait=True)
        os.close(self._fd)
        self._fd = -1


class TensorNVMeBackend(Backend):
    """tensornvme's Offloader: io_uring ("uring") or libaio ("aio")."""

    def __init__(self, path: str, backend: str, n_entries: int = 16) -> None:
        from tensornvme._C import Offloader

        super().__init__()
        self.name = backend
        self.path = path
        self._off = Offloader(path, n_entries, backend)
        self._alive: dict[str, list[torch.Tensor]] = {"w": [], "r": []}

    @staticmethod
    def _exact(tensor: torch.Tensor) -> torch.Tensor:
        # tensornvme sizes a request by the tensor's whole storage, so a view
        # into a larger buffer is re-wrapped as a tensor owning just its bytes.
        return torch.frombuffer(_as_bytes(tensor), dtype=torch.uint8)

    def _submit(self, kind: str, key: str, tensor: torch.Tensor) -> str:
        exact = self._exact(tensor)
        self._alive[kind].append(exact)  # alive until the wait: I/O runs later
        (self._off.async_write if kind == "w" else self._off.async_read)(exact, key, None)
        return kind

    def _write(self, key: str, tensor: torch.Tensor) -> str:
        return self._submit("w", key, tensor)

    def _read(self, key: str, tensor: torch.Tensor) -> str:
        return self._submit("r", key, tensor)

    def wait(self, handle: object) -> None:
        # tensornvme waits for all requests of a kind, not for one; its
        # read wait is the write wait (see [Note: tensornvme 0.1.0's waits]).
        if handle == "w":
            self._off.sync_write_events()
            self._alive["w"].clear()
        elif handle == "r":
            self.wait_all()

    def wait_all(self) -> None:
        self._off.synchronize()
        for pending in self._alive.values():
            pending.clear()

    def close(self) -> None:
        if self._off is not None:
            self._off.synchronize()
            self._off = None


# tensornvme builds from source against the installed torch (its setup.py
# runs cmake and looks for liburing.a on LIBRARY_PATH); the nvme README's Install.
TENSORNVME_INSTALL = (
    "apt-get install -y liburing-dev libaio-dev cmake, then WITH_ROOT=1 "
    "LIBRARY_PATH=/usr/lib/x86_64-linux-gnu pip install --no-build-isolation tensornvme==0.1.0"
)


def resolve_backend(name: str | None) -> str:
    """Pick a backend: ``name``, else $ZEROSTACK_NVME_BACKEND, else "threads"
    (see [Note: tensornvme 0.1.0's waits])."""
    requested = name or os.environ.get(BACKEND_ENV) or "threads"
    if requested not in BACKENDS:
        raise ValueError(
            f"nvme: unknown backend (got {requested!r}); use one of {', '.join(BACKENDS)}"
        )
    available = tensornvme_backends() if requested != "threads" else set()
    if requested != "threads" and requested not in available:
        hint = (
            f"install tensornvme ({TENSORNVME_INSTALL})"
            if not available
            else f"this machine's tensornvme offers {sorted(available)}"
        )
        raise ValueError(f"nvme: backend {requested!r} is not available; {hint}, or use 'threads'")
    return requested


def open_backend(name: str, path: str) -> Backend:
    if name == "threads":
        return ThreadBackend(path)
    return TensorNVMeBackend(path, name)
