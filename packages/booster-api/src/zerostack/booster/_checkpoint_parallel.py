"""Per-rank parallel model and optimizer checkpoints: each rank writes its
own part (``sharded_state_dict()``, see [Note: sharded state format])
through DCP (see [Note: pieces in DCP]) into one temporary directory that
replaces the checkpoint atomically (see [Note: parallel checkpoint save]);
a load reads the ranges this rank holds, at any world size and with any
plugin. Nothing is gathered: a rank materializes at most its own share
(DCP's writer copies one piece at a time to compact it).

[Note: parallel checkpoint integrity] DCP stores no sizes or checksums, so
a truncated ``.distcp`` file used to fail deep in torch's zip reader without
the file's name. Each rank therefore writes ``zerostack-files-<rank>.json``
beside its files (``{name: {"size_bytes", "sha256"}}`` of the
``__<rank>_*.distcp`` it wrote; rank 0 adds ``.metadata``), and a load
checks every recorded file before DCP reads any: the sizes always, the
SHA-256 when ``CheckpointIO(verify=True)`` (the default; it reads every
file once more). Checkpoints without records (older ones) load unchecked.

Keys in the DCP directory: ``model/<name>`` (model), ``state/<name>/<key>``,
``param_groups``, ``loss_scaler`` (optimizer), and ``meta`` (format, kind,
shapes).
"""

from __future__ import annotations

import glob
import json
import logging
import os
from typing import Any

import torch

from zerostack.booster import _checkpoint_atomic as atomic
from zerostack.booster import _checkpoint_dcp as engine
from zerostack.booster import _checkpoint_files as files
from zerostack.booster._checkpoint_dcp import Piece

logger = logging.getLogger(__name__)
FORMAT = "zerostack.dcp/1"
_MODEL, _STATE = "model/", "state/"
_RECORDS = "zerostack-files-{rank}.json"


def write_records(directory: str) -> None:
    """This rank's [Note: parallel checkpoint integrity] records, fsynced."""
    rank = _rank()
    names = sorted(glob.glob(os.path.join(glob.escape(directory), f"__{rank}_*.distcp")))
    if rank == 0 and os.path.isfile(os.path.join(directory, engine.METADATA_FILE)):
        names.append(os.path.join(directory, engine.METADATA_FILE))
    records = {os.path.basename(n): files.file_record(n) for n in names}
    path = os.path.join(directory, _RECORDS.format(rank=rank))
    with open(path, "w") as f:
        json.dump(records, f, indent=1)
    atomic.fsync_file(path)


def verify_records(api: str, path: str, *, check_hash: bool) -> None:
    """Check every file the ranks recorded (see [Note: parallel checkpoint integrity]).

    Raises:
        CheckpointCorruptError: naming the missing, truncated or altered file.
    """
    for record_file in sorted(
        glob.glob(os.path.join(glob.escape(path), _RECORDS.format(rank="*")))
    ):
        try:
            with open(record_file) as f:
                records = json.load(f)
        except (OSError, ValueError) as exc:
            raise files.CheckpointCorruptError(
                f"{api}: checkpoint file {record_file} is unreadable (got {exc}); copy the "
                "whole checkpoint directory again or load another checkpoint"
            ) from exc
        for name, record in records.items():
            files.verify_file(os.path.join(path, name), record, api, check_hash=check_hash)


def _meta(kind: str, shapes: dict[str, Any]) -> dict[str, Any]:
    return {"format": FORMAT, "kind": kind, "shapes": {k: list(v) for k, v in shapes.items()}}


def read_meta(api: str, path: str, kind: str) -> dict[str, Any]:
    """The ``meta`` object of a parallel checkpoint (read by every rank).

    Raises:
        ValueError: the directory holds another kind of checkpoint.
    """
    state = engine.load(path, {"meta": None})
    meta = state.get("meta") or {}
    if meta.get("format") != FORMAT or meta.get("kind") != kind:
        raise ValueError(
            f"{api}: {path} is not a parallel {kind} checkpoint (got {meta.get('kind')!r} "
            f"in format {meta.get('format')!r}); pass the directory save_{kind}(shard=True) wrote"
        )
    return meta


def _shapes(model: Any) -> dict[str, Any]:
    facts = getattr(model, "_facts", None)
    shapes = dict(facts.shapes) if facts is not None else {}
    for name, (_, _, numel) in model.local_ranges().items():
        shapes.setdefault(name, [numel])
    from zerostack.booster._plugins._sharded import persistent_buffers

    shapes.update({n: b.shape for n, b in persistent_buffers(model.unwrap()).items()})
    return shapes


def save_model(api: str, model: Any, path: str, extra: Any = None) -> None:
    """Every rank writes its part of ``model`` into the directory ``path``;
    rank 0 then calls ``extra(directory)`` (e.g. to write ``config.json``)."""
    state: dict[str, Any] = {_MODEL + name: v for name, v in model.sharded_state_dict().items()}
    state["meta"] = _meta("model", _shapes(model))
    with atomic.collective_dir(path, api) as tmp:
        engine.save(tmp, state)
        write_records(tmp)
        if extra is not None and _rank() == 0:
            extra(tmp)
    logger.info("%s: every rank wrote its part of %s", api, path)


def _rank() -> int:
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _dest(api: str, key: str, md: Any, ranges: tuple[int, int, int]) -> Piece:
    start, end, numel = ranges
    if not isinstance(md, engine.TensorStorageMetadata) or tuple(md.size) != (numel,):
        raise ValueError(
            f"{api}: {key} is saved with shape {tuple(getattr(md, 'size', ()))}, this model's "
            f"has {numel} elements; load a checkpoint of the same model"
        )
    return Piece(torch.empty(end - start, dtype=md.properties.dtype), start, numel)


def load_model(api: str, model: Any, path: str, strict: bool) -> None:
    """Read this rank's ranges of ``model`` from a parallel checkpoint.

    Raises:
        ValueError: with ``strict``, names missing on either side; a size differs.
    """
    read_meta(api, path, "model")
    keys = engine.saved_keys(path)
    saved = {k[len(_MODEL) :] for k in keys if k.startswith(_MODEL)}
    ranges = model.local_ranges()
    missing, unexpected = sorted(set(ranges) - saved), sorted(saved - set(ranges))
    if strict and (missing or unexpected):
        raise ValueError(
            f"{api}: {path} does not match the model (got missing names {missing[:8]}, "
            f"unexpected names {unexpected[:8]}); load the checkpoint of this model, or pass "
            "strict=False"
        )
    dest = {
        _MODEL + n: _dest(api, _MODEL + n, keys[_MODEL + n], r)
        for n, r in ranges.items()
        if n in saved
    }
    engine.load(path, dest)
    model.load_sharded_state_dict({k[len(_MODEL) :]: p.tensor for k, p in dest.items()})


def save_optimizer(api: str, optimizer: Any, path: str) -> None:
    """Every rank writes its part of ``optimizer`` into the directory ``path``."""
    sd = optimizer.sharded_state_dict()
    state: dict[str, Any] = {
        f"{_STATE}{name}/{k}": v for name, entry in sd["state"].items() for k, v in entry.items()
    }
    state["param_groups"] = sd["param_groups"]
    state["loss_scaler"] = sd["loss_scaler"]
    state["meta"] = _meta("optimizer", {})
    with atomic.collective_dir(path, api) as tmp:
        engine.save(tmp, state)
        write_records(tmp)
    logger.info("%s: every rank wrote its part of %s", api, path)


def load_optimizer(api: str, optimizer: Any, path: str) -> None:
    """Read this rank's ranges of the optimizer state from a parallel checkpoint.

    Raises:
        KeyError: the checkpoint holds states of parameters the optimizer lacks.
    """
    read_meta(api, path, "optimizer")
    keys = engine.saved_keys(path)
    ranges = optimizer.local_ranges()
    dest: dict[str, Any] = {"param_groups": None, "loss_scaler": None}
    for key, md in keys.items():
        if not key.startswith(_STATE):
            continue
        name, k = key[len(_STATE) :].rsplit("/", 1)
        if name not in ranges:
            raise KeyError(
                f"{api}: the optimizer state has parameters this optimizer does not (got "
                f"{name!r}); load a state saved from the same model"
            )
        is_piece = isinstance(md, engine.TensorStorageMetadata) and len(md.size) == 1
        if is_piece and md.size[0] == ranges[name][2] and k != "step":
            dest[key] = _dest(api, key, md, ranges[name])
        elif isinstance(md, engine.TensorStorageMetadata):
            dest[key] = torch.empty(tuple(md.size), dtype=md.properties.dtype)
        else:
            dest[key] = None
    out = engine.load(path, dest)
    state: dict[str, dict[str, Any]] = {}
    for key, v in out.items():
        if key.startswith(_STATE):
            name, k = key[len(_STATE) :].rsplit("/", 1)
            state.setdefault(name, {})[k] = v.tensor if isinstance(v, Piece) else v
    optimizer.load_sharded_state_dict(
        {"state": state, "param_groups": out["param_groups"], "loss_scaler": out["loss_scaler"]}
    )
