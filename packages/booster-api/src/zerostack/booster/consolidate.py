"""Turn a saved model checkpoint into a Hugging Face directory, on a CPU
without ``torch.distributed``::

    python -m zerostack.booster.consolidate CKPT OUT [--size-per-shard MB]

``CKPT`` is what ``CheckpointIO.save_model`` wrote: a single torch or
safetensors file, a sharded directory (torch or safetensors shards plus an
index), or a parallel directory (one DCP file per rank, read one tensor at a
time). ``OUT`` becomes a directory of ``model-0000i-of-0000N.safetensors``
files, ``model.safetensors.index.json`` and, when ``CKPT`` is a directory that
has them, a copy of ``config.json`` and ``generation_config.json``; with a
config, ``transformers.AutoModel*.from_pretrained(OUT)`` loads it.

The source is read one file at a time and checked against its recorded sizes
and hashes; ``OUT`` is written atomically (a previous ``OUT`` stays whole
until the new one is complete).
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
from collections.abc import Iterator
from typing import Any

import torch

from zerostack.booster import _checkpoint_atomic as atomic
from zerostack.booster import _checkpoint_dcp as engine
from zerostack.booster import _checkpoint_files as files
from zerostack.booster import _checkpoint_parallel as parallel_io
from zerostack.booster import _checkpoint_record as record
from zerostack.booster._checkpoint_errors import CheckpointSaveError

logger = logging.getLogger(__name__)

_API = "consolidate"
_MB = 1024 * 1024
_MODEL_INDEX_STEMS = ("model.safetensors.index", "pytorch_model.bin.index")
_MODEL_FILES = (files.SAFE_WEIGHTS_NAME, files.WEIGHTS_NAME)
_COPIED = (files.CONFIG_NAME, files.GENERATION_CONFIG_NAME)


def _dcp_sources(path: str) -> Iterator[dict[str, Any]]:
    """A parallel (DCP) model checkpoint, one whole tensor at a time, in the
    shapes it was saved with. See zerostack.booster._checkpoint_parallel."""
    meta = parallel_io.read_meta(_API, path, "model")
    keys = engine.saved_keys(path)
    for key, md in keys.items():
        if not key.startswith("model/"):
            continue
        name = key[len("model/") :]
        flat = torch.empty(tuple(md.size), dtype=md.properties.dtype)
        engine.load(path, {key: flat})
        yield {name: flat.view(meta["shapes"].get(name, list(md.size)))}


def _sources(path: str, verify: bool) -> Iterator[dict[str, Any]]:
    if engine.is_dcp_dir(path):
        parallel_io.check(_API, path, verify=verify, collective=False)
        yield from _dcp_sources(path)
        return
    if os.path.isdir(path):
        # See [Note: checkpoint record]: once it vouched, the files' own checks are skipped.
        check = verify and not record.check_present(_API, path, verify=verify, collective=False)
        index = files.find_index(path, _MODEL_INDEX_STEMS, _API)
        if index is not None:
            if check:
                record.require_for_index(_API, path, files.read_index(index, _API), verify=verify)
            for _, part in files.iter_index_files(index, _API, check_hash=check):
                yield part
            return
        for name in _MODEL_FILES:
            if os.path.isfile(os.path.join(path, name)):
                yield files.read_state(os.path.join(path, name), _API, check=check)
                return
        raise ValueError(
            f"{_API}: {path} holds no model checkpoint (got files {sorted(os.listdir(path))[:8]}); "
            "pass a directory save_model(shard=True) wrote, or a model file"
        )
    yield files.read_state(path, _API, check=verify)


def consolidate(
    checkpoint: str | os.PathLike,
    out: str | os.PathLike,
    *,
    size_per_shard: int = 1024,
    verify: bool = True,
) -> list[str]:
    """Write a model checkpoint as a Hugging Face safetensors directory.

    Args:
        checkpoint: a file or directory ``CheckpointIO.save_model`` wrote.
        out: the directory to write (replaced whole, atomically).
        size_per_shard: most MB per safetensors file (a larger tensor gets a
            file of its own). Default 1024.
        verify: the source must have its record (a directory zerostack
            wrote) and match its recorded sizes and hashes; False for a
            checkpoint written before the records (sizes only). Default True.

    Returns:
        The names of the files written under ``out``.

    Raises:
        FileNotFoundError: nothing at ``checkpoint``.
        CheckpointCorruptError: a source file is missing, truncated or altered.
        TypeError: the checkpoint holds values that are not tensors.
        ValueError: a bad ``size_per_shard``; ``out`` is an existing file or
            is ``checkpoint`` itself.
    """
    source = atomic.resolve_for_load(os.fspath(checkpoint), _API)
    target = os.path.abspath(os.fspath(out))
    _check_args(source, target, size_per_shard)
    limit = size_per_shard * _MB
    with atomic.atomic_path(target, is_dir=True, api=_API) as tmp:
        parts: list[tuple[str, list[str]]] = []
        buffer: dict[str, torch.Tensor] = {}
        buffered = 0
        total = numel = 0

        def flush() -> None:
            nonlocal buffer, buffered
            name = f".part-{len(parts):05d}"
            files.write_safetensors(os.path.join(tmp, name), buffer)
            parts.append((name, list(buffer)))
            buffer, buffered = {}, 0

        for part in _sources(source, verify):
            for key, value in part.items():
                _check_tensor(key, value, source)
                size = files.nbytes(value)
                if buffer and buffered + size > limit:
                    flush()
                buffer[key] = value
                buffered += size
                total += size
                numel += value.numel()
            del part
        if buffer or not parts:
            flush()
        weight_map, records = _name_shards(tmp, parts)
        written = list(records)
        index = os.path.join(tmp, files.SAFE_WEIGHTS_INDEX_NAME)
        files.write_index(index, weight_map, records, total, {"total_parameters": numel})
        atomic.fsync_file(index)
        written.append(files.SAFE_WEIGHTS_INDEX_NAME)
        written += _copy_side_files(source, tmp)
        record.seal(tmp, save_id=record.allocate_save_id(), kind="model", files=records)
        written.append(record.RECORD_NAME)
    logger.info("%s: wrote %d files (%d bytes of tensors) to %s", _API, len(written), total, target)
    return written


def _name_shards(
    tmp: str, parts: list[tuple[str, list[str]]]
) -> tuple[dict[str, str], dict[str, dict[str, Any]]]:
    """Rename the written parts to Hugging Face's shard names, in order;
    returns the index's weight map and each file's record."""
    weight_map: dict[str, str] = {}
    records: dict[str, dict[str, Any]] = {}
    for i, (temp_name, keys) in enumerate(parts):
        name = files.shard_file_name(files.SAFE_WEIGHTS_NAME, i, len(parts))
        os.replace(os.path.join(tmp, temp_name), os.path.join(tmp, name))
        atomic.fsync_file(os.path.join(tmp, name))
        records[name] = files.file_record(os.path.join(tmp, name))
        weight_map.update(dict.fromkeys(keys, name))
    return weight_map, records


def _copy_side_files(source: str, tmp: str) -> list[str]:
    """Copy a source directory's _COPIED files (config.json, ...); returns their names."""
    copied = []
    if os.path.isdir(source):
        for name in _COPIED:
            if os.path.isfile(os.path.join(source, name)):
                shutil.copyfile(os.path.join(source, name), os.path.join(tmp, name))
                atomic.fsync_file(os.path.join(tmp, name))
                copied.append(name)
    return copied


def _check_args(source: str, target: str, size_per_shard: int) -> None:
    if (
        isinstance(size_per_shard, bool)
        or not isinstance(size_per_shard, int)
        or size_per_shard < 1
    ):
        raise ValueError(
            f"{_API}: size_per_shard must be a positive int of MB (got {size_per_shard!r}); "
            "pass e.g. 1024"
        )
    if os.path.isfile(target):
        raise ValueError(
            f"{_API}: out must be a directory (got the existing file {target}); pass a "
            "directory path"
        )
    if os.path.abspath(source) == target:
        raise ValueError(
            f"{_API}: out is the checkpoint itself (got {target}); pass another directory"
        )


def _check_tensor(key: str, value: object, source: str) -> None:
    if not isinstance(value, torch.Tensor):
        raise TypeError(
            f"{_API}: {key} in {source} is not a tensor (got "
            f"{type(value).__name__}); pass a model checkpoint"
        )


def main(argv: list[str] | None = None) -> int:
    """The command line; returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="python -m zerostack.booster.consolidate",
        description="Turn a zerostack model checkpoint into a Hugging Face safetensors directory.",
    )
    parser.add_argument("checkpoint", help="a file or directory CheckpointIO.save_model wrote")
    parser.add_argument("out", help="the directory to write (replaced whole)")
    parser.add_argument(
        "--size-per-shard", type=int, default=1024, help="most MB per file (default 1024)"
    )
    parser.add_argument(
        "--no-verify",
        action="store_true",
        help="skip the sha256 check of the source files and accept a checkpoint without its "
        "record (one written before zerostack wrote records)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        consolidate(
            args.checkpoint,
            args.out,
            size_per_shard=args.size_per_shard,
            verify=not args.no_verify,
        )
    except (OSError, ValueError, TypeError, CheckpointSaveError) as exc:
        logger.error("%s", exc)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
