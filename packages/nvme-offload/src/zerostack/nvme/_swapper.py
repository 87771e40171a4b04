"""StateSwapper: named fp32 buffers kept on disk, read back through a
prefetch pipeline so that disk I/O hides behind the optimizer's compute."""

from __future__ import annotations

import errno
import logging
import os
import shutil
import tempfile
import weakref
from collections.abc import Sequence

import torch

from zerostack.nvme._backends import Backend, open_backend, resolve_backend

logger = logging.getLogger(__name__)
_logged_backends: set[tuple[str, str]] = set()


class NVMeSpaceError(OSError):
    """The offload directory cannot hold the states (full disk or file size limit)."""


def _cleanup(io: Backend, fd: int, workdir: str) -> None:
    try:
        io.close()
        os.close(fd)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _make_workdir(directory: str | os.PathLike | None) -> str:
    if directory is None:
        return tempfile.mkdtemp(prefix="zerostack-nvme-")
    if not isinstance(directory, str | os.PathLike):
        raise TypeError(
            f"nvme: the offload directory must be a path or None (got {directory!r}); "
            "pass nvme_offload_dir as a str or os.PathLike"
        )
    directory = os.fspath(directory)
    try:
        os.makedirs(directory, exist_ok=True)
        # Our own subdirectory: cleanup never touches the user's files.
        return tempfile.mkdtemp(prefix="zerostack-nvme-", dir=directory)
    except OSError as exc:
        raise ValueError(
            f"nvme: cannot create or write the offload directory {directory!r} ({exc.strerror}); "
            "pass a writable nvme_offload_dir"
        ) from None


class StateSwapper:
    """Keeps fp32 buffers, one per key, in a file and swaps them through RAM.

    Args:
        directory: where the file goes; a fresh temporary directory when None.
            Either way the swapper works in its own subdirectory and removes it
            when it is closed, garbage-collected or the interpreter exits.
        backend: "uring", "aio" (tensornvme) or "threads"; None reads
            $ZEROSTACK_NVME_BACKEND, else "threads" (tensornvme's backends
            only by name: see [Note: tensornvme 0.1.0's waits]).
        prefetch_depth: how many keys ahead are read while one is computed.
            Default 2.

    Raises:
        ValueError: bad depth, unknown or unavailable backend, unwritable directory.
    """

    def __init__(
        self,
        directory: str | os.PathLike | None = None,
        *,
        backend: str | None = None,
        prefetch_depth: int = 2,
    ) -> None:
        if (
            isinstance(prefetch_depth, bool)
            or not isinstance(prefetch_depth, int)
            or prefetch_depth < 1
        ):
            raise ValueError(f"nvme: prefetch_depth must be an int >= 1 (got {prefetch_depth!r})")
        self.backend = resolve_backend(backend)
        self.prefetch_depth = prefetch_depth
        self.workdir = _make_workdir(directory)
        self.path = os.path.join(self.workdir, "states.bin")
        try:
            self._io = open_backend(self.backend, self.path)
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        except Exception:
            shutil.rmtree(self.workdir, ignore_errors=True)
            raise
        # Runs on close(), on garbage collection and at exit, whichever comes first.
        self._finalizer = weakref.finalize(self, _cleanup, self._io, self._fd, self.workdir)
        self._numel: dict[str, int] = {}
        self._on_disk: set[str] = set()
        self._resident: dict[str, torch.Tensor] = {}  # keys whose last write failed
        self._reserved = 0
        # Slots of the pipeline: depth reads ahead, one computing, one writing.
        self._slots: list[torch.Tensor] = []
        if (self.backend, self.workdir) not in _logged_backends:
            _logged_backends.add((self.backend, self.workdir))
            logger.info(
                "nvme: backend %s, files in %s, prefetch depth %d",
                self.backend,
                self.workdir,
                prefetch_depth,
            )

    # -- registration and space ----------------------------------------------

    def register(self, key: str, numel: int) -> None:
        """Declare ``key`` as an fp32 buffer of ``numel`` elements and reserve its disk space.

        Raises:
            NVMeSpaceError: the directory cannot hold it; nothing was written.
        """
        self._check_open("register")
        if not isinstance(key, str):
            raise TypeError(f"nvme: register: key must be a str (got {key!r})")
        if isinstance(numel, bool) or not isinstance(numel, int) or numel < 1:
            raise ValueError(f"nvme: register: numel must be an int >= 1 (got {numel!r})")
        if key in self._numel:
            if self._numel[key] != numel:
                raise ValueError(
                    f"nvme: key {key!r} registered again with another size (got numel {numel}, "
                    f"registered with {self._numel[key]})"
                )
            return
        needed = self._reserved + 4 * numel
        try:
            # Reserve now, so that a full disk fails here, before any state
            # has left memory, and never in the middle of a step.
            os.posix_fallocate(self._fd, 0, needed)
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
                raise
            free = shutil.disk_usage(self.workdir).free
            raise NVMeSpaceError(
                exc.errno,
                f"nvme: not enough space in {self.workdir!r} for optimizer states: "
                f"{needed} bytes needed, {self._reserved} reserved so far, {free} free on the "
                f"disk ({exc.strerror}); free space or pass another nvme_offload_dir",
            ) from None
        self._reserved = needed
        self._numel[key] = numel

    @property
    def reserved_bytes(self) -> int:
        return self._reserved

    def is_on_disk(self, key: str) -> bool:
        return key in self._on_disk

    def holds(self, key: str) -> bool:
        """Whether ``key`` has a value: on disk, or kept in RAM after a failed write."""
        return key in self._on_disk or key in self._resident

    def release(self, key: str) -> None:
        """Forget ``key``: its value (read it first to keep it) and its
        reservation, which a later ``register`` may take (the file keeps its
        size). A key never registered is ignored."""
        self._check_open("release")
        if key not in self._numel:
            return
        if key in self._on_disk:
            self._drop(key)
        self._resident.pop(key, None)
        self._reserved -= 4 * self._numel.pop(key)

    # -- whole-buffer operations (checkpoints, first writes) -----------------

    def write(self, key: str, tensor: torch.Tensor) -> None:
        """Write ``tensor`` (fp32, ``numel`` elements) as ``key`` and wait."""
        self._check(key, tensor)
        if key in self._on_disk:
            self._drop(key)
        self._resident.pop(key, None)
        self._io.wait(self._io.write(key, tensor))
        self._on_disk.add(key)

    def read(self, key: str, out: torch.Tensor) -> torch.Tensor:
        """Copy ``key``'s current value into ``out``; the key stays where it is."""
        self._check(key, out, "read")
        if key in self._resident:
            return out.copy_(self._resident[key])
        if key not in self._on_disk:
            raise RuntimeError(f"nvme: key {key!r} was never written")
        self._io.wait(self._io.read(key, out))
        # See [Note: one write, one read]: a read releases the disk copy.
        self._io.wait(self._io.write(key, out))
        return out

    def _drop(self, key: str) -> None:
        # A key is rewritten only after it was read (see [Note: one write, one read]).
        scratch = torch.empty(self._numel[key], dtype=torch.float32)
        self._io.wait(self._io.read(key, scratch))
        self._on_disk.discard(key)

    def _check_open(self, api: str) -> None:
        if not self._finalizer.alive:
            raise RuntimeError(
                f"nvme: {api}: the swapper is closed (its files are removed); build a new "
                "StateSwapper"
            )

    def _check(self, key: str, tensor: torch.Tensor, api: str = "write") -> None:
        self._check_open(api)
        if key not in self._numel:
            raise RuntimeError(f"nvme: key {key!r} was not registered")
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(
                f"nvme: {api}: the buffer must be a tensor (got {type(tensor).__name__})"
            )
        if tensor.dtype != torch.float32:
            raise TypeError(
                f"nvme: {api}: the buffer for {key!r} must be float32 (got {tensor.dtype})"
            )
        if (
            tensor.device.type != "cpu"
            or tensor.numel() != self._numel[key]
            or not tensor.is_contiguous()
        ):
            raise ValueError(
                f"nvme: {api}: the buffer for {key!r} must be a contiguous CPU tensor of "
                f"{self._numel[key]} elements (got {tensor.numel()} elements on "
                f"{tensor.device}, contiguous={tensor.is_contiguous()})"
            )

    # -- the pipeline ----------------------------------------------------------

    def pipeline(self, keys: Sequence[str]) -> PrefetchPipeline:
        """A read -> compute -> write pass over ``keys`` in this order.

        Raises:
            TypeError: ``keys`` is a str, not a sequence of keys.
            ValueError: a key was not registered.
            RuntimeError: the swapper is closed.
        """
        self._check_open("pipeline")
        if isinstance(keys, str):
            raise TypeError(f"nvme: pipeline: keys must be a sequence of keys (got {keys!r})")
        keys = list(keys)
        unknown = [k for k in keys if k not in self._numel]
        if unknown:
            raise ValueError(
                f"nvme: pipeline: keys not registered (got {unknown[:5]}); register them first"
            )
        return PrefetchPipeline(self, keys)

    def _slot_buffers(self, count: int, numel: int) -> list[torch.Tensor]:
        if len(self._slots) < count or self._slots[0].numel() < numel:
            pin = torch.cuda.is_available()
            self._slots = [
                torch.empty(numel, dtype=torch.float32, pin_memory=pin) for _ in range(count)
            ]
        return self._slots

    def host_buffers(self) -> list[torch.Tensor]:
        """The host memory the swapper holds now: the pipeline's slots
        (prefetch_depth + 2 buffers of the largest key, fewer for fewer
        keys), and keys kept in
        RAM after a failed write."""
        return [*self._slots, *self._resident.values()]

    def close(self) -> None:
        """Wait for pending I/O, remove the files. Idempotent."""
        self._finalizer()


class NVMeWriteError(OSError):
    """A write of optimizer state failed; the data was kept in memory."""


class PrefetchPipeline:
    """Hooks for a per-key optimizer step: ``pre_step``, ``pre_update(i)``,
    ``post_update(i)``, ``post_step``, as in ColossalAI's NVMe optimizer, with
    ``prefetch_depth`` keys being read while key ``i`` is computed and
    finished keys written back behind it.

    A key never written before starts as zeros (fresh optimizer state). A
    write that fails keeps that key's updated buffer in memory, so the step
    completes and nothing is lost; ``post_step`` then raises NVMeWriteError.
    """

    def __init__(self, swapper: StateSwapper, keys: list[str]) -> None:
        self.s = swapper
        self.keys = keys
        self.depth = swapper.prefetch_depth
        max_numel = max((swapper._numel[k] for k in keys), default=0)
        # depth slots being read, one computing, one still being written;
        # never more than there are keys (a small model's states are not
        # outweighed by their staging).
        count = min(self.depth + 2, len(keys))
        self.slots = swapper._slot_buffers(count, max_numel) if keys else []
        self._reads: dict[int, object] = {}
        self._writes: dict[int, tuple] = {}  # slot -> (key index, handle)
        self._next_read = 0
        self._errors: list[str] = []
        self._computing: set[int] = set()  # pre_update(i) called, post_update(i) not yet

    def _slot(self, i: int) -> int:
        return i % len(self.slots)

    def _buf(self, i: int) -> torch.Tensor:
        return self.slots[self._slot(i)][: self.s._numel[self.keys[i]]]

    def _finish_write(self, slot: int) -> None:
        pending = self._writes.pop(slot, None)
        if pending is None:
            return
        i, handle = pending
        try:
            self.s._io.wait(handle)
        except OSError as exc:
            key = self.keys[i]
            self.s._on_disk.discard(key)
            self.s._resident[key] = self._buf(i).clone()
            self._errors.append(f"{key} ({4 * self._buf(i).numel()} bytes): {exc}")

    def _issue_read(self) -> None:
        i = self._next_read
        self._finish_write(self._slot(i))  # the slot's previous key must be on disk first
        key = self.keys[i]
        if key in self.s._on_disk:
            self._reads[i] = self.s._io.read(key, self._buf(i))
        self._next_read += 1

    def pre_step(self) -> None:
        while self._next_read < min(self.depth, len(self.keys)):
            self._issue_read()

    def _check_index(self, api: str, i: int) -> None:
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < len(self.keys):
            raise ValueError(
                f"nvme: PrefetchPipeline.{api}: i must be an int in [0, {len(self.keys)}) "
                f"(got {i!r})"
            )

    def pre_update(self, i: int) -> torch.Tensor:
        """Wait for key ``i``'s buffer and start the next read; return the buffer."""
        self._check_index("pre_update", i)
        while self._next_read <= min(i + self.depth, len(self.keys) - 1):
            self._issue_read()
        key, buf = self.keys[i], self._buf(i)
        if i in self._reads:
            self.s._io.wait(self._reads.pop(i))
            self.s._on_disk.discard(key)
        elif key in self.s._resident:
            buf.copy_(self.s._resident.pop(key))
        else:
            buf.zero_()
        self._computing.add(i)
        return buf

    def post_update(self, i: int) -> None:
        """Start writing key ``i``'s updated buffer back."""
        self._check_index("post_update", i)
        if i not in self._computing:
            raise RuntimeError(
                f"nvme: PrefetchPipeline.post_update({i}) without pre_update({i}); call "
                "pre_update(i), update the buffer it returns, then post_update(i)"
            )
        self._computing.discard(i)
        self._writes[self._slot(i)] = (i, self.s._io.write(self.keys[i], self._buf(i)))
        self.s._on_disk.add(self.keys[i])

    def drain_writes(self) -> None:
        """Wait for the writes issued so far, leaving the pass open (for a
        reader of the bytes on disk between two updates); a write that
        failed is kept in memory and reported by ``post_step``, as ever."""
        for slot in list(self._writes):
            self._finish_write(slot)

    def cancel(self) -> None:
        """Stop before every key was updated: reads in flight are waited for
        and their keys stay on disk, unchanged; a key given by ``pre_update``
        and not handed back by ``post_update`` (its update failed) goes back
        as its buffer holds it; writes drained as in ``post_step``."""
        for i in sorted(self._reads):
            self.s._io.wait(self._reads.pop(i))
            self._computing.add(i)
        # See [Note: one write, one read]: a read took its key off disk
        # (tensornvme freed it); the bytes go back.
        for i in sorted(self._computing):
            self.post_update(i)
        self.post_step()

    def post_step(self) -> None:
        """Block until every write is on disk; raise if any failed."""
        for slot in list(self._writes):
            self._finish_write(slot)
        if self._errors:
            raise NVMeWriteError(
                f"nvme: {len(self._errors)} state write(s) to {self.s.workdir!r} failed; the step "
                "completed and those states are kept in memory: " + "; ".join(self._errors)
            )
