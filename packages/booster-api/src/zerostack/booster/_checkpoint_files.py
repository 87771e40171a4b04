"""Checkpoint files on disk: the Hugging Face names and index, safetensors and
torch files, shards of at most a given size, and the integrity records that
let a load name the file that was cut short or changed.

[Note: checkpoint integrity] Every file a save writes can be checked before
it is read:

- a sharded directory's index (``*.index.json``) holds, under
  ``metadata.zerostack.files``, each file's byte size and sha256; a load
  compares the size (cheap) and the hash (one read) before deserializing;
- a single safetensors file holds the sha256 of its tensors (names, dtypes,
  shapes and bytes, in name order) in its header metadata
  (``zerostack.sha256``), checked after the tensors are read;
- a single torch file is a zip whose central directory holds every member's
  CRC-32 (written with torch's CRC option forced on), checked before
  ``torch.load``, which does not check them itself.

Files written by other tools (a Hugging Face export) lack these records and
are read unchecked, apart from what their readers detect. A directory
zerostack wrote also holds the record of [Note: checkpoint record], which a
load requires.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
import zipfile
from collections.abc import Callable, Iterator
from typing import Any

import torch

from zerostack.booster._checkpoint_atomic import fsync_file
from zerostack.booster._checkpoint_errors import CheckpointCorruptError

SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
WEIGHTS_NAME = "pytorch_model.bin"
WEIGHTS_INDEX_NAME = "pytorch_model.bin.index.json"
OPTIM_NAME = "pytorch_optim.bin"
OPTIM_INDEX_NAME = "pytorch_optim.bin.index.json"
OPTIM_GROUPS_NAME = "pytorch_optim_group.bin"
CONFIG_NAME = "config.json"
GENERATION_CONFIG_NAME = "generation_config.json"

FORMAT = "zerostack.checkpoint/1"
_MB = 1024 * 1024
_HASH_BLOCK = 8 * _MB
_SHA_KEY = "zerostack.sha256"


# --- names ---------------------------------------------------------------


def add_prefix(name: str, prefix: str | None) -> str:
    """ColossalAI's naming: ``prefix`` goes before the last extension
    (``model.safetensors`` -> ``model.<prefix>.safetensors``)."""
    if not prefix:
        return name
    stem, ext = name.rsplit(".", 1)
    return f"{stem}.{prefix}.{ext}"


def shard_file_name(name: str, index: int, count: int) -> str:
    """``model.safetensors`` -> ``model-00001-of-00003.safetensors`` (``index`` from 0)."""
    stem, ext = name.rsplit(".", 1)
    return f"{stem}-{index + 1:05d}-of-{count:05d}.{ext}"


def find_index(directory: str, stems: tuple[str, ...], api: str) -> str | None:
    """The one index file in ``directory`` whose name starts with one of
    ``stems`` (e.g. ``model.safetensors.index``), the first stem winning; None
    when there is none.

    Raises:
        ValueError: several indexes of one stem (saves with different prefixes).
    """
    names = sorted(os.listdir(directory))
    for stem in stems:
        pattern = re.compile(re.escape(stem) + r"(\.[^/]+)?\.json$")
        found = [n for n in names if pattern.fullmatch(n)]
        if len(found) > 1:
            raise ValueError(
                f"{api}: {directory} holds several checkpoint indexes (got {found}); "
                "keep one save per directory"
            )
        if found:
            return os.path.join(directory, found[0])
    return None


# --- sizes and shards ------------------------------------------------------


def nbytes(value: Any) -> int:
    """Bytes of the tensors in ``value`` (a tensor, or a dict/list of them)."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(nbytes(v) for v in value.values())
    if isinstance(value, list | tuple):
        return sum(nbytes(v) for v in value)
    return 0


def plan_shards(sizes: list[tuple[str, int]], limit_bytes: int) -> list[list[str]]:
    """Cut names, in order, into runs of at most ``limit_bytes``; an item larger
    than the limit gets a shard of its own, as Hugging Face does."""
    shards: list[list[str]] = []
    current: list[str] = []
    current_bytes = 0
    for name, size in sizes:
        if current and current_bytes + size > limit_bytes:
            shards.append(current)
            current, current_bytes = [], 0
        current.append(name)
        current_bytes += size
    if current:
        shards.append(current)
    return shards


# --- writing ---------------------------------------------------------------


def tensors_sha256(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 over names, dtypes, shapes and bytes, in name order."""
    digest = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        digest.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        if t.numel():
            digest.update(t.reshape(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


def write_safetensors(
    path: str, tensors: dict[str, torch.Tensor], *, embed_sha256: bool = False
) -> None:
    """One safetensors file, ``{"format": "pt"}`` in its metadata (which
    ``from_pretrained`` requires), plus its tensors' sha256 when asked."""
    from safetensors.torch import save_file

    bad = [k for k, v in tensors.items() if not isinstance(v, torch.Tensor)]
    if bad:
        raise TypeError(
            f"CheckpointIO: safetensors holds tensors only (got non-tensor values for {bad[:5]}); "
            "save with use_safetensors=False"
        )
    # safetensors refuses tensors that share memory (views of one gathered buffer).
    seen: set[int] = set()
    out = {}
    for k, v in tensors.items():
        v = v.detach().cpu().contiguous()
        ptr = v.untyped_storage().data_ptr()
        if v.numel() and ptr in seen:
            v = v.clone()
        seen.add(ptr)
        out[k] = v
    tensors = out
    metadata = {"format": "pt"}
    if embed_sha256:
        metadata[_SHA_KEY] = tensors_sha256(tensors)
    save_file(tensors, path, metadata=metadata)


def write_torch(path: str, obj: Any) -> None:
    """``torch.save`` with the zip members' CRC-32 forced on (see [Note: checkpoint integrity])."""
    get = getattr(torch.serialization, "get_crc32_options", None)
    set_ = getattr(torch.serialization, "set_crc32_options", None)
    previous = get() if get is not None else True
    if set_ is not None and not previous:
        set_(True)
    try:
        # Through a Python file, so that a full disk keeps its OSError (ENOSPC)
        # in the chain; torch's own file writer reports "file write failed".
        with open(path, "wb") as f:
            torch.save(_compact(obj), f)
    finally:
        if set_ is not None and not previous:
            set_(previous)


def _compact(obj: Any) -> Any:
    """CPU tensors that own just their bytes: ``torch.save`` writes a view's whole
    storage, so a view of a gathered flat buffer would write the buffer again in
    every shard."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu()
        return t.clone() if t.untyped_storage().nbytes() > nbytes(t) else t
    if isinstance(obj, dict):
        return {k: _compact(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_compact(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_compact(v) for v in obj)
    return obj


def file_record(path: str) -> dict[str, Any]:
    """``{"size_bytes", "sha256"}`` of a written file."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_HASH_BLOCK):
            digest.update(block)
    return {"size_bytes": os.path.getsize(path), "sha256": digest.hexdigest()}


def write_index(
    path: str,
    weight_map: dict[str, str],
    files: dict[str, dict[str, Any]],
    total_size: int,
    extra_metadata: dict[str, Any] | None = None,
) -> None:
    """The Hugging Face index, with the [Note: checkpoint integrity] records."""
    metadata = {"total_size": total_size, **(extra_metadata or {})}
    metadata["zerostack"] = {"format": FORMAT, "files": files}
    with open(path, "w") as f:
        json.dump({"metadata": metadata, "weight_map": weight_map}, f, indent=2, sort_keys=False)
        f.write("\n")


def save_sharded(
    directory: str,
    state: dict[str, Any],
    *,
    file_name: str,
    index_name: str,
    limit_bytes: int,
    write: Callable[[str, dict[str, Any]], None],
    extra_files: dict[str, Any] | None = None,
    extra_metadata: dict[str, Any] | None = None,
) -> dict[str, dict[str, Any]]:
    """Write ``state`` as shards of at most ``limit_bytes`` plus an index.

    Args:
        directory: where to write (an empty temporary directory).
        state: ``{name: value}``; each value stays whole in one shard.
        file_name: the unsharded name the shard names derive from.
        index_name: the index's file name.
        limit_bytes: most bytes per shard (one larger value gets its own).
        write: writes ``{name: value}`` to a path.
        extra_files: ``{file name: object}`` written with :func:`write_torch`
            and recorded in the index (the optimizer's param groups).
        extra_metadata: more keys for the index's ``metadata``.

    Returns:
        ``{file name: {"size_bytes", "sha256"}}`` of every file written, index last.
    """
    sizes = [(name, nbytes(value)) for name, value in state.items()]
    shards = plan_shards(sizes, limit_bytes)
    weight_map: dict[str, str] = {}
    files: dict[str, dict[str, Any]] = {}

    def _done(name: str) -> None:
        full = os.path.join(directory, name)
        fsync_file(full)
        files[name] = file_record(full)

    for i, names in enumerate(shards):
        shard = shard_file_name(file_name, i, len(shards))
        write(os.path.join(directory, shard), {n: state[n] for n in names})
        weight_map.update(dict.fromkeys(names, shard))
        _done(shard)
    for name, obj in (extra_files or {}).items():
        write_torch(os.path.join(directory, name), obj)
        _done(name)
    write_index(
        os.path.join(directory, index_name),
        weight_map,
        files,
        sum(size for _, size in sizes),
        extra_metadata,
    )
    index_path = os.path.join(directory, index_name)
    fsync_file(index_path)
    return {**files, index_name: file_record(index_path)}


# --- reading ---------------------------------------------------------------


def _starts_with(path: str, magic: bytes) -> bool:
    with open(path, "rb") as f:
        return f.read(len(magic)) == magic


def _is_safetensors(path: str) -> bool:
    with open(path, "rb") as f:
        head = f.read(9)
    if head[:4] == b"PK\x03\x04":
        return False
    if len(head) == 9 and head[8:9] == b"{":
        return True
    return path.endswith(".safetensors")


def is_safetensors(path: str, api: str) -> bool:
    """Whether ``path`` is a safetensors file (by its first bytes)."""
    try:
        return _is_safetensors(path)
    except OSError as exc:
        raise CheckpointCorruptError(
            f"{api}: cannot read checkpoint file {path} (got {exc}); check that it exists "
            "and is readable"
        ) from exc


def read_index(path: str, api: str) -> dict[str, Any]:
    """The parsed index json, checked for a ``weight_map``."""
    try:
        with open(path) as f:
            index = json.load(f)
    except (OSError, ValueError) as exc:
        raise CheckpointCorruptError(
            f"{api}: index {path} cannot be read (got {type(exc).__name__}: {exc}); the save "
            "that wrote it did not finish or the file was altered: restore it or load "
            "another checkpoint"
        ) from exc
    if not isinstance(index, dict) or not isinstance(index.get("weight_map"), dict):
        raise CheckpointCorruptError(
            f"{api}: index {path} has no weight_map (got keys {sorted(index)[:5]}); "
            "pass the index a save wrote"
        )
    return index


def index_records(index: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The per-file size and sha256 an index holds; ``{}`` for a foreign index."""
    meta = index.get("metadata") or {}
    ours = meta.get("zerostack") if isinstance(meta, dict) else None
    return dict(ours.get("files", {})) if isinstance(ours, dict) else {}


def verify_file(
    path: str,
    record: dict[str, Any] | None,
    api: str,
    *,
    check_hash: bool,
    source: str = "the index",
) -> None:
    """Check a file against its record (in ``source``): present, its size, its sha256.

    Raises:
        CheckpointCorruptError: naming the file and what differs.
    """
    if not os.path.isfile(path):
        raise CheckpointCorruptError(
            f"{api}: checkpoint file {path} is missing (got no file where {source} "
            "points); copy the whole checkpoint directory, or load another checkpoint"
        )
    if not record:
        return
    size = os.path.getsize(path)
    want = record.get("size_bytes")
    if want is not None and size != want:
        what = "truncated" if size < want else "longer than saved"
        raise CheckpointCorruptError(
            f"{api}: checkpoint file {path} is {what} (got {size} bytes, {source} "
            f"records {want}); the save or a copy of it did not finish: copy it again "
            "or load another checkpoint"
        )
    if check_hash and record.get("sha256"):
        got = file_record(path)["sha256"]
        if got != record["sha256"]:
            raise CheckpointCorruptError(
                f"{api}: checkpoint file {path} is corrupt (got sha256 {got[:16]}..., "
                f"{source} records {record['sha256'][:16]}...); its bytes changed since the "
                "save, or it is a file of another save: copy the checkpoint again or load "
                "another one"
            )


def _verify_zip(path: str, api: str) -> None:
    """Check a torch zip file's member CRC-32s (members without one are skipped)."""
    try:
        with zipfile.ZipFile(path) as zf:
            for info in zf.infolist():
                if info.CRC == 0 and info.file_size > 0:
                    continue  # written with torch's CRC option off
                with zf.open(info) as member:
                    while member.read(_HASH_BLOCK):
                        pass
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as exc:
        raise CheckpointCorruptError(
            f"{api}: checkpoint file {path} is truncated or corrupt (got "
            f"{type(exc).__name__}: {exc}); the save or a copy of it did not finish or its "
            "bytes changed: copy it again or load another checkpoint"
        ) from exc


def read_torch(path: str, api: str, *, check_crc: bool) -> Any:
    """``torch.load`` onto the CPU with ``weights_only=True``, errors naming the file."""
    if check_crc and _starts_with(path, b"PK\x03\x04"):  # a zip (not the legacy format)
        _verify_zip(path, api)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise ValueError(
            f"{api}: {path} holds objects that weights_only loading refuses (got {exc}); "
            "allow their classes with torch.serialization.add_safe_globals"
        ) from exc
    except (RuntimeError, EOFError, OSError) as exc:
        raise CheckpointCorruptError(
            f"{api}: checkpoint file {path} is truncated or corrupt (got {type(exc).__name__}: "
            f"{exc}); copy it again or load another checkpoint"
        ) from exc


def read_safetensors(path: str, api: str, *, check_sha: bool) -> dict[str, torch.Tensor]:
    """All tensors of a safetensors file on the CPU, errors naming the file; with
    ``check_sha`` also the embedded sha256, where the file has one."""
    from safetensors import safe_open

    try:
        with safe_open(path, framework="pt", device="cpu") as f:
            metadata = f.metadata() or {}
            tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    except Exception as exc:  # safetensors raises its own SafetensorError and OSError
        raise CheckpointCorruptError(
            f"{api}: checkpoint file {path} is truncated or corrupt (got "
            f"{type(exc).__name__}: {exc}); copy it again or load another checkpoint"
        ) from exc
    if check_sha and _SHA_KEY in metadata:
        got = tensors_sha256(tensors)
        if got != metadata[_SHA_KEY]:
            raise CheckpointCorruptError(
                f"{api}: checkpoint file {path} is corrupt (got sha256 {got[:16]}... over its "
                f"tensors, its header records {metadata[_SHA_KEY][:16]}...); its bytes changed "
                "since the save: copy it again or load another checkpoint"
            )
    return tensors


def read_state(path: str, api: str, *, check: bool) -> dict[str, Any]:
    """A safetensors file's tensors or a torch file's dict, checked as its
    format allows when ``check`` (see [Note: checkpoint integrity])."""
    if is_safetensors(path, api):
        return read_safetensors(path, api, check_sha=check)
    state = read_torch(path, api, check_crc=check)
    if not isinstance(state, dict):
        raise ValueError(
            f"{api}: {path} does not hold a dict (got {type(state).__name__}); "
            "pass a checkpoint a save wrote"
        )
    return state


def iter_index_files(
    index_path: str, api: str, *, check_hash: bool
) -> Iterator[tuple[str, dict[str, Any]]]:
    """Each file an index points to, verified then read, one at a time:
    ``(file name, {name: value})``."""
    index = read_index(index_path, api)
    directory = os.path.dirname(index_path)
    records = index_records(index)
    for name in dict.fromkeys(index["weight_map"].values()):
        path = os.path.join(directory, name)
        verify_file(path, records.get(name), api, check_hash=check_hash)
        # The index already vouches for the bytes; skip the format's own check.
        yield name, read_state(path, api, check=check_hash and not records.get(name))
