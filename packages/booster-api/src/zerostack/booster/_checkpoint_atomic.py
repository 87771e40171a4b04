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
removes it (two saves to one path at once are not supported).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import shutil
import uuid
import warnings
from collections.abc import Iterator

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
def atomic_path(path: str, *, is_dir: bool) -> Iterator[str]:
    """Yield a temporary sibling of ``path`` to write; on a normal exit move it
    onto ``path``, on an exception remove it. See [Note: atomic checkpoint save].

    With ``is_dir`` the sibling is created as an empty directory; otherwise the
    caller creates the file. Files written under a directory must be fsynced
    by the caller (``fsync_file``) before the block ends.
    """
    final = os.path.abspath(path)
    parent = os.path.dirname(final)
    os.makedirs(parent, exist_ok=True)
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


def _all_outcomes(error: BaseException | None, world: int) -> list[str | None]:
    """Every rank's error (as text), or None where it succeeded: a collective."""
    mine = None if error is None else f"{type(error).__name__}: {error}"
    if world == 1:
        return [mine]
    import torch.distributed as dist

    out: list[str | None] = [None] * world
    dist.all_gather_object(out, mine)
    return out


def _raise_failed(api: str, path: str, outcomes: list[str | None], error: BaseException | None):
    if error is not None:
        raise error
    failed = [(r, e) for r, e in enumerate(outcomes) if e is not None]
    if failed:
        rank, message = failed[0]
        raise RuntimeError(
            f"{api}: rank {rank} failed to write {path} (got {message}); see rank {rank}'s "
            "traceback, fix it and save again"
        )


@contextlib.contextmanager
def collective_dir(path: str, api: str) -> Iterator[str]:
    """Every rank writes its own files under one temporary sibling directory
    of ``path``; once all of them finished, rank 0 moves it onto ``path``
    (see [Note: atomic checkpoint save]). A failure on any rank removes the
    temporary directory and raises on every rank; every rank must enter.
    The ranks must share the file system at ``path``.

    [Note: parallel checkpoint save] No rank waits for another to write:
    the only collectives are the broadcast of the temporary name, the
    exchange of outcomes (also the barrier before the rename) and the
    broadcast of the rename's outcome.
    """
    final = os.path.abspath(path)
    rank, world = _rank_world()
    tmp, error = None, None
    if rank == 0:
        try:
            os.makedirs(os.path.dirname(final), exist_ok=True)
            prepare(final)
            tmp = _sibling(final, _TMP_TAG)
            os.mkdir(tmp)
        except BaseException as exc:
            error = exc
    if world > 1:
        import torch.distributed as dist

        box = [tmp]
        dist.broadcast_object_list(box, src=0)
        tmp = box[0]
    outcomes = _all_outcomes(error, world)
    _raise_failed(api, final, outcomes, error)
    error = None
    try:
        yield tmp
    except BaseException as exc:
        error = exc
    outcomes = _all_outcomes(error, world)
    if any(o is not None for o in outcomes):
        if rank == 0:
            _remove(tmp)
        _raise_failed(api, final, outcomes, error)
    error = None
    if rank == 0:
        try:
            fsync_dir(tmp)
            _replace_dir(tmp, final)
            fsync_dir(os.path.dirname(final))
        except BaseException as exc:
            _remove(tmp)
            error = exc
    if world > 1:
        outcomes = [None] * world
        import torch.distributed as dist

        box = [None if error is None else f"{type(error).__name__}: {error}"]
        dist.broadcast_object_list(box, src=0)
        outcomes[0] = box[0]
    _raise_failed(api, final, outcomes if world > 1 else [None], error)
