"""The checkpoint record: the file a directory checkpoint is valid by.

[Note: checkpoint record] Every checkpoint directory zerostack writes (a
per-rank parallel save, the Hugging Face export and the gathered sharded
layouts, ``Booster.save_state``) holds ``zerostack-checkpoint.json``,
written last, after every rank's files are complete and fsynced and just
before the directory is renamed into place::

    {"format": "zerostack.checkpoint/2", "save_id": "<16 hex>", "kind": "model",
     "world_size": 2,
     "files": {"__0_<save_id>_0.distcp": {"size_bytes": ..., "sha256": ..., "rank": 0}, ...}}

It names every file of the directory (each rank hashes the files it wrote,
in parallel, and rank 0 writes the union); a subdirectory that is a
checkpoint of its own (``save_state``'s ``model/``) is named by its record
alone, whose hash pins its files. One save id marks every part of a save:
it is in the per-rank file names of a parallel save and in their DCP
``.metadata``, in the records of ``save_state``'s model and optimizer
directories and in its per-rank files.

A load reads the record first and refuses the directory without it
(``CheckpointCorruptError`` naming the record and the path), then checks
every file it names before any is read: present, its size, its SHA-256
(the ranks share the files to hash), and that each part carries the record's
save id, so files of different saves do not load as one state.
``verify=False`` (for checkpoints written before the records) skips the
SHA-256 and accepts a directory without a record, with a warning once.

A single-file checkpoint carries its checks inside (the zip's CRC-32 of
every member, the safetensors header's SHA-256; see [Note: checkpoint
integrity]) and is renamed into place whole, so it needs no record.
"""

from __future__ import annotations

import contextvars
import json
import logging
import os
import uuid
import warnings
from typing import Any

import torch.distributed as dist

from zerostack.booster._checkpoint_errors import CheckpointCorruptError

logger = logging.getLogger(__name__)
RECORD_NAME = "zerostack-checkpoint.json"
FORMAT = "zerostack.checkpoint/2"
_active_save_id: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "zerostack_save_id", default=None
)
_warned_unverified: set[str] = set()


def allocate_save_id() -> str:
    """The running save's id when one encloses this one (``save_state``), else a new one."""
    return _active_save_id.get() or uuid.uuid4().hex[:16]


def enter_save(save_id: str) -> contextvars.Token:
    """Saves started until :func:`exit_save` belong to ``save_id``."""
    return _active_save_id.set(save_id)


def exit_save(token: contextvars.Token) -> None:
    _active_save_id.reset(token)


def _is_lock(name: str) -> bool:
    return name.startswith(".") and name.endswith(".lock")


def _walk(directory: str) -> list[str]:
    """Every file under ``directory`` (relative names) that a record names:
    a subdirectory with a record of its own contributes that record only."""
    out = []
    for root, dirs, names in os.walk(directory):
        rel = os.path.relpath(root, directory)
        if rel != "." and RECORD_NAME in names:
            out.append(os.path.join(rel, RECORD_NAME))
            dirs[:] = []
            continue
        dirs.sort()
        for name in sorted(names):
            if (rel == "." and name == RECORD_NAME) or _is_lock(name):
                continue
            out.append(name if rel == "." else os.path.join(rel, name))
    return out


def seal(
    directory: str,
    *,
    save_id: str,
    kind: str,
    world_size: int = 1,
    files: dict[str, dict[str, Any]] | None = None,
) -> None:
    """Write ``directory``'s record, last (see [Note: checkpoint record]):
    ``files`` holds the records the ranks already made; every other file
    under ``directory`` is hashed here."""
    from zerostack.booster._checkpoint_atomic import fsync_dir, fsync_file
    from zerostack.booster._checkpoint_files import file_record

    known = dict(files or {})
    for name in _walk(directory):
        if name not in known:
            known[name] = file_record(os.path.join(directory, name))
    record = {
        "format": FORMAT,
        "save_id": save_id,
        "kind": kind,
        "world_size": world_size,
        "files": dict(sorted(known.items())),
    }
    path = os.path.join(directory, RECORD_NAME)
    with open(path, "w") as f:
        json.dump(record, f, indent=1)
        f.write("\n")
    fsync_file(path)
    fsync_dir(directory)


def read(api: str, directory: str) -> dict[str, Any] | None:
    """The record of ``directory``, None when it has none.

    Raises:
        CheckpointCorruptError: the record cannot be read or is not one.
    """
    path = os.path.join(directory, RECORD_NAME)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            record = json.load(f)
    except (OSError, ValueError) as exc:
        raise CheckpointCorruptError(
            f"{api}: checkpoint record {path} cannot be read (got {type(exc).__name__}: {exc}); "
            "it was altered after the save: copy the checkpoint again or load another one"
        ) from exc
    files = record.get("files") if isinstance(record, dict) else None
    if record.get("format") != FORMAT or not isinstance(files, dict) or not record.get("save_id"):
        raise CheckpointCorruptError(
            f"{api}: checkpoint record {path} is not a zerostack record (got format "
            f"{record.get('format') if isinstance(record, dict) else type(record).__name__!r}); "
            "copy the checkpoint again or load another one"
        )
    return record


def warn_unverified(api: str) -> None:
    """The one warning of ``verify=False``."""
    if api in _warned_unverified:
        return
    _warned_unverified.add(api)
    warnings.warn(
        f"{api}: verify=False loads checkpoints without their record and without SHA-256 "
        "checks: a damaged file or files of different saves may load as wrong values; use it "
        "only for checkpoints written before zerostack wrote checkpoint records",
        UserWarning,
        stacklevel=4,
    )


def missing(api: str, directory: str) -> CheckpointCorruptError:
    return CheckpointCorruptError(
        f"{api}: checkpoint record {os.path.join(directory, RECORD_NAME)} is missing (got a "
        f"checkpoint directory {directory} without it); the save that wrote it did not finish "
        "or the record was removed, so its files cannot be checked: load another checkpoint, "
        "or pass verify=False for a checkpoint written before zerostack wrote records"
    )


def _rank_world(collective: bool) -> tuple[int, int]:
    if collective and dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def check(
    api: str, directory: str, *, verify: bool, collective: bool = True
) -> dict[str, Any] | None:
    """Check ``directory`` against its record before anything reads it (see
    [Note: checkpoint record]); the record, or None without one when
    ``verify`` is False. With ``collective`` (every rank calls it) each rank
    checks a share of the files and every rank raises the first error.

    Raises:
        CheckpointCorruptError: the record is missing (``verify``) or
            unreadable; a file is missing, of another size, of another
            SHA-256 (``verify``) or of another save.
    """
    record = read(api, directory)
    if record is None:
        if verify:
            raise missing(api, directory)
        return None
    from zerostack.booster._checkpoint_files import verify_file

    rank, world = _rank_world(collective)
    names = list(record["files"])[rank::world]

    def sizes() -> None:  # first, so that a file of another save's record reads as missing
        for name in names:
            path = os.path.join(directory, name)
            verify_file(path, record["files"][name], api, check_hash=False, source=RECORD_NAME)
            if os.path.basename(name) == RECORD_NAME:  # a part saved with this one
                nested = read(api, os.path.dirname(path)) or {}
                check_save_id(api, path, record["save_id"], nested.get("save_id"))

    def hashes() -> None:
        for name in names:
            path = os.path.join(directory, name)
            verify_file(path, record["files"][name], api, check_hash=True, source=RECORD_NAME)

    for step in (sizes, hashes) if verify else (sizes,):
        error = None
        try:
            step()
        except CheckpointCorruptError as exc:
            error = str(exc)
        if world > 1:
            errors: list[str | None] = [None] * world
            dist.all_gather_object(errors, error)
            error = next((e for e in errors if e is not None), None)
        if error is not None:
            raise CheckpointCorruptError(error)
    return record


def check_present(api: str, directory: str, *, verify: bool, collective: bool = True) -> bool:
    """:func:`check` a directory that has a record; True then (the record
    vouched for every file), False for a file or a directory without one."""
    if not os.path.isfile(os.path.join(directory, RECORD_NAME)):
        return False
    check(api, directory, verify=verify, collective=collective)
    return True


def require_for_index(api: str, directory: str, index: dict[str, Any], *, verify: bool) -> None:
    """A directory without a record: refused when its index says zerostack
    wrote it (and ``verify``); a Hugging Face directory another tool wrote
    loads as it is."""
    meta = index.get("metadata")
    if verify and isinstance(meta, dict) and "zerostack" in meta:
        raise missing(api, directory)


def check_save_id(api: str, path: str, want: str, got: Any) -> None:
    """Refuse a part of a checkpoint (``path``) that another save wrote."""
    if got != want:
        raise CheckpointCorruptError(
            f"{api}: checkpoint file {path} belongs to another save (got save id {got!r}, the "
            f"checkpoint's record holds {want!r}); files of different saves were mixed: copy "
            "the whole checkpoint directory of one save"
        )
