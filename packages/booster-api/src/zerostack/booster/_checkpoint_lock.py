"""One save at a time per checkpoint path.

[Note: checkpoint save lock] Two processes (or two jobs) saving to one path
at once used to race: one save's clean-up removed the other's temporary
directory (``FileNotFoundError``) or torch's writer failed half-way. A save
now first takes an exclusive ``flock`` on ``.<name>.lock`` beside the
checkpoint (the process that renames the result in place takes it: rank 0
of a multi-rank save) and holds it until the new checkpoint is in place or
the save failed. A second save to the path fails at once with
``CheckpointSaveError`` naming the lock file and its holder (pid, host, the
call, when), which the holder writes into the file. The kernel drops a lock
when its process dies, so a save killed with SIGKILL never blocks the next
one; when the file still names a process of this host that is gone, the
next save takes the lock over with a warning. On a file system without
``flock`` (Lustre mounted without ``-o flock``) saves go on unlocked, with a
warning once. Checkpoint loads do not take the lock.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import socket
import time
from collections.abc import Iterator

from zerostack.booster._checkpoint_errors import CheckpointSaveError

logger = logging.getLogger(__name__)
_UNSUPPORTED = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)
_warned_unsupported = False


def lock_path(path: str) -> str:
    parent, base = os.path.split(os.path.abspath(path))
    return os.path.join(parent, f".{base}.lock")


def _holder(fd: int) -> dict:
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        return json.loads(os.read(fd, 4096).decode() or "{}")
    except (OSError, ValueError):
        return {}


def _wait_for_holder(fd: int, timeout: float = 2.0) -> dict:
    # The holder writes its name just after taking the lock; a save that
    # fails in between would otherwise name "a process" instead of a pid.
    deadline = time.monotonic() + timeout
    holder = _holder(fd)
    while not holder and time.monotonic() < deadline:
        time.sleep(0.01)
        holder = _holder(fd)
    return holder


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _describe(holder: dict) -> str:
    if not holder:
        return "a process that has not written its name yet"
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("time", 0)))
    return (
        f"pid {holder.get('pid')} on host {holder.get('host')} ({holder.get('api')}, since {since})"
    )


@contextlib.contextmanager
def save_lock(path: str, api: str) -> Iterator[None]:
    """Hold ``path``'s save lock (see [Note: checkpoint save lock]).

    Raises:
        CheckpointSaveError: another process holds it.
    """
    global _warned_unsupported
    lock = lock_path(path)
    host = socket.gethostname()
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                holder = _wait_for_holder(fd)
                os.close(fd)
                raise CheckpointSaveError(
                    f"{api}: another save to {path} is running (got the lock {lock} held by "
                    f"{_describe(holder)}); wait for it to finish or save to another path",
                    exc.errno,
                ) from None
            os.close(fd)
            if exc.errno not in _UNSUPPORTED:
                raise
            if not _warned_unsupported:
                _warned_unsupported = True
                logger.warning(
                    "%s: the file system at %s cannot lock files (got %s); two saves to one "
                    "path at once are not detected there",
                    api,
                    os.path.dirname(lock),
                    exc,
                )
            yield
            return
        # The holder before us may have removed the file between our open and
        # our lock: then we locked an unlinked inode, and must lock the new file.
        try:
            same = os.path.samestat(os.fstat(fd), os.stat(lock))
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    try:
        previous = _holder(fd)
        pid = previous.get("pid")
        here = previous.get("host") == host and pid != os.getpid()
        if here and isinstance(pid, int) and not _alive(pid):
            logger.warning(
                "%s: taking over the save lock %s of %s, which is no longer running (its "
                "save was interrupted)",
                api,
                lock,
                _describe(previous),
            )
        me = {"pid": os.getpid(), "host": host, "api": api, "time": time.time()}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(me).encode(), 0)
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(lock)  # while still held, so no other save holds this inode
        os.close(fd)
