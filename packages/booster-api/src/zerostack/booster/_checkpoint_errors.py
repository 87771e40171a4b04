"""The checkpoint errors, and the first line of a failed save's.

[Note: checkpoint save errors] A failed save raises ``CheckpointSaveError``
(an ``Exception``) on every rank, with the same first line there, naming the
root cause: the deepest ``OSError`` in the failure (torch's
``CheckpointException`` from ``torch.distributed.checkpoint`` is a
``BaseException`` that slips past ``except Exception``, and its text starts
with ``CheckpointException ranks:dict_keys([0])``; torch's zip writer turns
a full disk into ``PytorchStreamWriter failed writing file``, the
``OSError`` only in ``__context__``; safetensors' writer keeps only
``(os error 28)`` in its text). A full disk reads
``no space left on device: X needed, Y free at PATH``: X the bytes the save
writes, Y ``shutil.disk_usage`` after the failed save's files were removed.
The previous checkpoint at the path is left as it was (see [Note: atomic
checkpoint save]).
"""

from __future__ import annotations

import errno as errno_codes
import os
import re
import shutil
from typing import Any

from torch.distributed.checkpoint.api import CheckpointException


class CheckpointCorruptError(ValueError):
    """A checkpoint is incomplete or altered since it was saved: a file or
    its record is missing, truncated or changed, or files of different
    saves are mixed.

    The message names the file. See [Note: checkpoint integrity] and
    [Note: checkpoint record].
    """


class CheckpointSaveError(RuntimeError):
    """A save failed; raised on every rank, the root cause in the first line.
    The previous checkpoint at the path is unchanged.

    Attributes:
        errno: the root cause's ``errno`` (e.g. ``errno.ENOSPC``), or None.

    See [Note: checkpoint save errors].
    """

    def __init__(
        self, message: str, errno: int | None = None, *, cause: dict[str, Any] | None = None
    ) -> None:
        super().__init__(message)
        self.errno = errno
        self._cause = cause  # the summary an enclosing save words its own message from


def _children(exc: BaseException) -> list[tuple[BaseException, int | None]]:
    out: list[tuple[BaseException, int | None]] = []
    if isinstance(exc, CheckpointException):
        for rank, failure in sorted(exc.failures.items()):
            out.append((failure[0] if isinstance(failure, tuple) else failure, rank))
    for linked in (exc.__cause__, exc.__context__):
        if linked is not None:
            out.append((linked, None))
    return out


def root_cause(exc: BaseException) -> tuple[BaseException, int | None]:
    """``(cause, rank)``: the deepest ``OSError`` with an errno in ``exc``'s
    chain (through ``CheckpointException.failures``, ``__cause__`` and
    ``__context__``), else the innermost exception of the first chain; the
    rank DCP reported it from, where it did."""
    seen: set[int] = set()
    stack: list[tuple[BaseException, int | None]] = [(exc, None)]
    innermost: tuple[BaseException, int | None] = (exc, None)
    found: tuple[BaseException, int | None] | None = None
    while stack:
        current, rank = stack.pop(0)
        if id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno is not None:
            found = (current, rank)  # a deeper one, found later, wins
        children = [(c, rank if r is None else r) for c, r in _children(current)]
        if children and innermost[0] is current:
            innermost = children[0]
        stack.extend(children)
    return found if found is not None else innermost


def format_bytes(n: int) -> str:
    for unit, size in (("GB", 1 << 30), ("MB", 1 << 20), ("kB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def free_bytes(path: str) -> tuple[str, int | None]:
    """``(directory, free bytes)`` of the nearest existing directory of ``path``."""
    directory = os.path.abspath(path)
    while not os.path.isdir(directory) and os.path.dirname(directory) != directory:
        directory = os.path.dirname(directory)
    try:
        return directory, shutil.disk_usage(directory).free
    except OSError:
        return directory, None


def summarize(exc: BaseException, rank: int) -> dict[str, Any]:
    """What another rank needs to name ``exc``'s root cause (picklable)."""
    if isinstance(exc, CheckpointSaveError):
        if exc._cause is not None:
            return exc._cause
        return {"message": str(exc).split("\n")[0], "errno": exc.errno}
    cause, where = root_cause(exc)
    code = getattr(cause, "errno", None)
    if code is None:  # safetensors' Rust writer: "I/O error: ... (os error 28)"
        found = re.search(r"\(os error (\d+)\)", str(cause))
        code = int(found.group(1)) if found else None
    return {
        "rank": rank if where is None else where,
        "cause": f"{type(cause).__name__}: {cause}".split("\n")[0],
        "errno": code,
    }


def compose(api: str, path: str, summary: dict[str, Any], needed_bytes: int | None) -> str:
    """The message of a failed save of ``path`` from a :func:`summarize`
    (see [Note: checkpoint save errors]). Call after the failed save's files
    are gone, so the free space is what a retry has."""
    if "message" in summary:
        return summary["message"]
    code = summary.get("errno")
    needed_bytes = max(needed_bytes or 0, summary.get("needed_bytes") or 0) or None
    where = f"on rank {summary['rank']}: {summary['cause']}"
    # A failed save leaves what was there; a path that held nothing holds nothing.
    had = os.path.lexists(path)
    keep = (
        f"the previous checkpoint at {path} is unchanged" if had else f"nothing is left at {path}"
    )
    if code in (errno_codes.ENOSPC, errno_codes.EDQUOT):
        directory, free = free_bytes(os.path.dirname(os.path.abspath(path)))
        need = "an unknown amount" if needed_bytes is None else format_bytes(needed_bytes)
        have = "unknown" if free is None else format_bytes(free)
        what = "no space left on device" if code == errno_codes.ENOSPC else "disk quota exceeded"
        return (
            f"{api}: {what}: {need} needed, {have} free at {directory} (got {where}); "
            f"free space or save to another file system; {keep}"
        )
    return f"{api}: could not write {path} (got {where}); fix the cause and save again; {keep}"


def save_error(
    message: str, summary: dict[str, Any], own: BaseException | None, needed_bytes: int | None
) -> BaseException:
    """The error a rank raises: ``CheckpointSaveError``, caused by its own
    failure; a KeyboardInterrupt or SystemExit of this rank stays itself."""
    if isinstance(own, (KeyboardInterrupt, SystemExit)):
        return own
    cause = None if "message" in summary else {**summary, "needed_bytes": needed_bytes}
    error = CheckpointSaveError(message, summary.get("errno"), cause=cause)
    error.__cause__ = own
    return error
