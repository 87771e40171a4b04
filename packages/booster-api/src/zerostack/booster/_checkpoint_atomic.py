"""Atomic replacement of a checkpoint path (a file or a directory).

[Note: atomic checkpoint save] A save writes everything under a temporary
sibling (``.<name>.tmp-<token>``, same directory, so the same filesystem) and
moves it onto ``<name>`` only once every byte is written and fsynced:

- a file, or a directory where nothing exists yet: one ``os.replace``;
- a directory over an existing one: Linux ``renameat2(RENAME_EXCHANGE)``
  swaps the two atomically, and the old one (now at the temporary name) is
  removed; where the filesystem cannot exchange, the old one is renamed aside
  first (``.<name>.old-<token>``), the new one renamed in, the old one removed.

A process killed at any point therefore leaves either the previous checkpoint
or the new one at ``<name>``; in the fallback's one window between its two
renames, the previous one is whole at the ``.old-`` name, where
:func:`resolve_for_load` finds it and the next save puts it back. A killed
save leaves its temporary sibling behind; the next save to the same path
removes it, under the save lock that keeps two saves from one path (see
[Note: checkpoint save lock]).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import errno
import logging
import os
import shutil
import uuid
import warnings
from collections.abc import Iterator
from typing import Any

from zerostack.booster import _checkpoint_errors as errors
from zerostack.booster import _checkpoint_record as record
from zerostack.booster._checkpoint_lock import save_lock

logger = logging.getLogger(__name__)

_TMP_TAG = ".tmp-"
_OLD_TAG = ".old-"
_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def _sibling(path: str, tag: str) -> str:
    parent, base = os.path.split(os.path.abspath(path))
    token = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
    return os.path.join(parent, f".{base}{tag}{token}")


def _siblings(path: str, tag: str) -> list[str]:
    parent, base = os.path.split(os.path.abspath(path))
    start = f".{base}{tag}"
    try:
        names = os.listdir(parent)
    except FileNotFoundError:
        return []
    return sorted(os.path.join(parent, n) for n in names if n.startswith(start))


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def _bytes_under(path: str) -> int:
    total = 0
    for root, _, names in os.walk(path):
        for name in names:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, name)).st_size
    return total


def fsync_dir(path: str) -> None:
    """Make a rename or a new entry in ``path`` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def fsync_file(path: str) -> None:
    """Flush a written file's bytes to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _exchange(a: str, b: str) -> bool:
    """Swap two paths atomically; False where the platform or filesystem cannot."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p]
    renameat2.argtypes += [ctypes.c_uint]
    renameat2.restype = ctypes.c_int
    rc = renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EXDEV, errno.EPERM):
        return False
    raise OSError(err, os.strerror(err), b)


def _replace_dir(tmp: str, final: str) -> None:
    if not os.path.lexists(final):
        os.replace(tmp, final)
        return
    if _exchange(tmp, final):
        _remove(tmp)  # the previous checkpoint, swapped out
        return
    old = _sibling(final, _OLD_TAG)
    os.rename(final, old)
    os.replace(tmp, final)
    fsync_dir(os.path.dirname(os.path.abspath(final)))
    _remove(old)


def prepare(path: str) -> None:
    """Clean up after saves to ``path`` that were killed: put back a previous
    checkpoint left aside, remove temporary siblings. Rank 0 only."""
    asides = _siblings(path, _OLD_TAG)
    if asides and not os.path.lexists(path):
        logger.warning("restoring %s, left aside by an interrupted save, to %s", asides[-1], path)
        os.rename(asides[-1], path)
        asides = asides[:-1]
    for stale in _siblings(path, _TMP_TAG) + asides:
        logger.info("removing %s, left by an interrupted save", stale)
        _remove(stale)


@contextlib.contextmanager
def atomic_path(path: str, *, is_dir: bool, api: str = "save") -> Iterator[str]:
    """Yield a temporary sibling of ``path`` to write; on a normal exit move it
    onto ``path``, on an exception remove it. See [Note: atomic checkpoint
    save]. Holds ``path``'s save lock throughout (see [Note: checkpoint save
    lock]).

    With ``is_dir`` the sibling is created as an empty directory; otherwise the
    caller creates the file. Files written under a directory must be fsynced
    by the caller (``fsync_file``) before the block ends.

    Raises:
        CheckpointSaveError: another save to ``path`` is running.
    """
    final = os.path.abspath(path)
    parent = os.path.dirname(final)
    os.makedirs(parent, exist_ok=True)
    with save_lock(final, api):
        prepare(final)
        tmp = _sibling(final, _TMP_TAG)
        if is_dir:
            os.mkdir(tmp)
        try:
            yield tmp
            if is_dir:
                fsync_dir(tmp)
                _replace_dir(tmp, final)
            else:
                fsync_file(tmp)
                os.replace(tmp, final)
        except BaseException:
            _remove(tmp)
            raise
        fsync_dir(parent)


def resolve_for_load(path: str, api: str) -> str:
    """``path``, or the previous checkpoint an interrupted save left aside there.

    Raises:
        FileNotFoundError: nothing at ``path`` and nothing left aside.
    """
    if os.path.lexists(path):
        return path
    asides = _siblings(path, _OLD_TAG)
    if asides:
        warnings.warn(
            f"{api}: {path} is missing because a save there was interrupted; loading the "
            f"previous checkpoint from {asides[-1]} (the next save to {path} puts it back)",
            stacklevel=3,
        )
        return asides[-1]
    raise FileNotFoundError(
        f"{api}: no checkpoint at {path} (got a path that does not exist); "
        "pass the path a save wrote"
    )


def _rank_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _all_gather(obj: Any, world: int) -> list[Any]:
    if world == 1:
        return [obj]
    import torch.distributed as dist

    out: list[Any] = [None] * world
    dist.all_gather_object(out, obj)
    return out


def _broadcast(obj: Any, world: int) -> Any:
    if world == 1:
        return obj
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def fail_everywhere(
    api: str,
    path: str,
    summaries: list[dict[str, Any] | None],
    own: BaseException | None,
    needed_bytes: int | None,
) -> None:
    """Raise one ``CheckpointSaveError`` on every rank for the first failed
    rank of ``summaries`` (a collective: rank 0 words the message, after the
    failed save's files are gone; see [Note: checkpoint save errors])."""
    rank, world = _rank_world()
    first = next(s for s in summaries if s is not None)
    message = errors.compose(api, path, first, needed_bytes) if rank == 0 else None
    raise errors.save_error(_broadcast(message, world), first, own, needed_bytes)


@dataclasses.dataclass(slots=True)
class DirSave:
    """A rank's view of a collective save (see :func:`collective_dir`)."""

    path: str
    """The temporary directory every rank writes into."""
    save_id: str
    """The save's id (see [Note: checkpoint record])."""
    rank: int
    files: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    """The records of the files this rank wrote (:meth:`add`)."""
    needed_bytes: int = 0
    """This rank's bytes to write, for the message of a full disk."""

    def add(self, name: str) -> None:
        """Record ``name`` (relative to :attr:`path`), a file this rank wrote
        and fsynced: hashed here, in parallel with the other ranks."""
        from zerostack.booster._checkpoint_files import file_record

        self.files[name] = {**file_record(os.path.join(self.path, name)), "rank": self.rank}


@contextlib.contextmanager
def collective_dir(path: str, api: str, *, kind: str) -> Iterator[DirSave]:
    """Every rank writes its own files under one temporary sibling directory
    of ``path``; once all of them finished, rank 0 writes the checkpoint
    record (see [Note: checkpoint record]) and moves the directory onto
    ``path`` (see [Note: atomic checkpoint save]), holding ``path``'s save
    lock from before the first write (see [Note: checkpoint save lock]). A
    failure on any rank removes the temporary directory and raises
    ``CheckpointSaveError`` on every rank (see [Note: checkpoint save
    errors]); every rank must enter. The ranks must share the file system
    at ``path``.

    [Note: parallel checkpoint save] No rank waits for another to write:
    the only collectives are the broadcast of the temporary name, the
    exchange of outcomes and file records (also the barrier before the
    record and the rename) and the broadcast of the rename's outcome.
    """
    final = os.path.abspath(path)
    rank, world = _rank_world()
    tmp = save_id = error = None
    with contextlib.ExitStack() as lock:
        if rank == 0:
            try:
                os.makedirs(os.path.dirname(final), exist_ok=True)
                lock.enter_context(save_lock(final, api))
                prepare(final)
                tmp = _sibling(final, _TMP_TAG)
                os.mkdir(tmp)
                save_id = record.allocate_save_id()
            except BaseException as exc:
                error = exc
        summary = None if error is None else errors.summarize(error, rank)
        tmp, save_id, summary = _broadcast((tmp, save_id, summary), world)
        if summary is not None:  # rank 0 could not start (the lock is held, say)
            fail_everywhere(api, final, [summary], error, None)
        save = DirSave(tmp, save_id, rank)
        token = record.enter_save(save_id)
        try:
            yield save
        except BaseException as exc:
            error = exc
        finally:
            record.exit_save(token)
        mine = None if error is None else errors.summarize(error, rank)
        reports = _all_gather((mine, save.files, save.needed_bytes), world)
        if any(r[0] is not None for r in reports):
            needed = sum(r[2] for r in reports)
            if rank == 0:
                needed = max(needed, _bytes_under(tmp))  # what the save got to write
                _remove(tmp)
            fail_everywhere(api, final, [r[0] for r in reports], error, needed or None)
        if rank == 0:
            try:
                merged = {name: rec for r in reports for name, rec in r[1].items()}
                record.seal(tmp, save_id=save_id, kind=kind, world_size=world, files=merged)
                _replace_dir(tmp, final)
                fsync_dir(os.path.dirname(final))
            except BaseException as exc:
                _remove(tmp)
                error = exc
        summary = None if error is None else errors.summarize(error, rank)
        summary = _broadcast(summary, world)
        if summary is not None:
            fail_everywhere(api, final, [summary], error, sum(r[2] for r in reports) or None)
