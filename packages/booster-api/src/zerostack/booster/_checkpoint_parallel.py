"""Per-rank parallel model and optimizer checkpoints: each rank writes its
own part (``sharded_state_dict()``, see [Note: sharded state format])
through DCP (see [Note: pieces in DCP]) into one temporary directory that
replaces the checkpoint atomically (see [Note: parallel checkpoint save]);
a load reads the ranges this rank holds, at any world size and with any
plugin. Nothing is gathered: a rank materializes at most its own share
(DCP's writer copies one piece at a time to compact it).

[Note: parallel checkpoint integrity] DCP stores no sizes or checksums, so
a truncated ``.distcp`` file used to fail deep in torch's zip reader without
the file's name. Each rank hashes the files it wrote (in parallel) and rank
0 writes them all into the checkpoint record (see [Note: checkpoint
record]); the save id is in every file name (``__<rank>_<save id>_0.distcp``)
and so in ``.metadata``. A load checks the record's files before DCP reads
any, and that ``.metadata`` names this save's files only. Checkpoints from
before the record (``zerostack-files-<rank>.json`` per rank, sizes and
SHA-256 of its files) load with ``verify=False`` only; their per-rank
records are still checked for sizes.

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
from zerostack.booster import _checkpoint_record as record
from zerostack.booster._checkpoint_dcp import Piece
from zerostack.chunk import persistent_buffers

logger = logging.getLogger(__name__)
FORMAT = "zerostack.dcp/1"
_MODEL, _STATE = "model/", "state/"
_LEGACY_RECORDS = "zerostack-files-*.json"


def check(api: str, path: str, *, verify: bool, collective: bool = True) -> None:
    """Check a parallel checkpoint before DCP reads it (see [Note: parallel
    checkpoint integrity]); with ``collective``, every rank calls it.

    Raises:
        CheckpointCorruptError: naming the missing record, or the missing,
            truncated, altered file or the file of another save.
    """
    found = record.check(api, path, verify=verify, collective=collective)
    if found is not None:
        engine.check_save_id(api, path, found["save_id"])
        return
    for record_file in sorted(glob.glob(os.path.join(glob.escape(path), _LEGACY_RECORDS))):
        try:
            with open(record_file) as f:
                records = json.load(f)
        except (OSError, ValueError) as exc:
            raise files.CheckpointCorruptError(
                f"{api}: checkpoint file {record_file} is unreadable (got {exc}); copy the "
                "whole checkpoint directory again or load another checkpoint"
            ) from exc
        for name, rec in records.items():
            files.verify_file(os.path.join(path, name), rec, api, check_hash=False)


def _files_of(save: Any) -> None:
    """Record the files this rank's DCP save wrote (rank 0: ``.metadata`` too)."""
    prefix = engine.file_prefix(save.rank, save.save_id)
    for name in sorted(os.listdir(save.path)):
        if name.startswith(prefix) or (save.rank == 0 and name == engine.METADATA_FILE):
            save.add(name)


def _save(api: str, path: str, kind: str, state: dict[str, Any], extra: Any = None) -> None:
    with atomic.collective_dir(path, api, kind=kind) as save:
        save.needed_bytes = files.nbytes(
            {k: v.tensor if isinstance(v, Piece) else v for k, v in state.items()}
        )
        engine.save(save.path, state, save.save_id)
        _files_of(save)
        if extra is not None and save.rank == 0:
            extra(save.path)
    logger.info("%s: every rank wrote its part of %s", api, path)


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
    shapes.update({n: b.shape for n, b in persistent_buffers(model.unwrap()).items()})
    return shapes


def save_model(api: str, model: Any, path: str, extra: Any = None) -> None:
    """Every rank writes its part of ``model`` into the directory ``path``;
    rank 0 then calls ``extra(directory)`` (e.g. to write ``config.json``)."""
    state: dict[str, Any] = {_MODEL + name: v for name, v in model.sharded_state_dict().items()}
    if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
        # Buffers are whole on every rank and may differ (BatchNorm's
        # statistics): rank 0's alone, as the one-file layout saves them. Of
        # keys every rank wrote, the checkpoint engine kept one rank's each,
        # not always the same rank's (running_mean of one, running_var of another).
        for name in persistent_buffers(model.unwrap()):
            state.pop(_MODEL + name, None)
    state["meta"] = _meta("model", _shapes(model))
    _save(api, path, "model", state, extra)


def _dest(api: str, key: str, md: Any, ranges: tuple[int, int, int]) -> Piece:
    start, end, numel = ranges
    if not isinstance(md, engine.TensorStorageMetadata) or tuple(md.size) != (numel,):
        raise ValueError(
            f"{api}: {key} is saved with shape {tuple(getattr(md, 'size', ()))}, this model's "
            f"has {numel} elements; load a checkpoint of the same model"
        )
    return Piece(torch.empty(end - start, dtype=md.properties.dtype), start, numel)


def load_model(api: str, model: Any, path: str, strict: bool) -> tuple[list[str], list[str]]:
    """Read this rank's ranges of ``model`` from a parallel checkpoint;
    ``(missing names, unexpected names)``.

    Raises:
        ValueError: with ``strict``, names missing on either side; a size differs.
    """
    _check_shapes(api, path, read_meta(api, path, "model").get("shapes") or {}, _shapes(model))
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
    return missing, unexpected


def _check_shapes(api: str, path: str, saved: dict[str, Any], mine: dict[str, Any]) -> None:
    """The saved tensors' shapes are the model's, name by name, before
    anything is read (pieces are flat: a tensor of another shape and the
    same size would load as its values in another order)."""
    wrong = [
        (name, tuple(saved[name]), tuple(mine[name]))
        for name in sorted(set(saved) & set(mine))
        if tuple(saved[name]) != tuple(mine[name])
    ]
    if wrong:
        raise ValueError(
            f"{api}: {path} holds tensors of other shapes than this model's (got {wrong[:4]} "
            "as (name, saved shape, model's shape)); load a checkpoint of this model"
        )


def save_optimizer(api: str, optimizer: Any, path: str) -> None:
    """Every rank writes its part of ``optimizer`` into the directory ``path``."""
    sd = optimizer.sharded_state_dict()
    state: dict[str, Any] = {
        f"{_STATE}{name}/{k}": v for name, entry in sd["state"].items() for k, v in entry.items()
    }
    state["param_groups"] = sd["param_groups"]
    state["loss_scaler"] = sd["loss_scaler"]
    state["meta"] = _meta("optimizer", {})
    _save(api, path, "optimizer", state)


def load_optimizer(api: str, optimizer: Any, path: str) -> None:
    """Read this rank's ranges of the optimizer state from a parallel checkpoint.

    Raises:
        KeyError: the checkpoint holds states of parameters the optimizer lacks.
        ValueError: a state's size differs from its parameter's (a state of
            another model), before anything is read; its parameter groups
            list other parameters than the optimizer's (the plugin's
            ``load_sharded_state_dict`` checks before it loads anything).
    """
    read_meta(api, path, "optimizer")
    keys = engine.saved_keys(path)
    ranges = optimizer.local_ranges()
    dest: dict[str, Any] = {"param_groups": None, "loss_scaler": None}
    wrong = []
    for key, md in keys.items():
        if not key.startswith(_STATE):
            continue
        name, k = key[len(_STATE) :].rsplit("/", 1)
        if name not in ranges:
            raise KeyError(
                f"{api}: the optimizer state has parameters this optimizer does not (got "
                f"{name!r}); load a state saved from the same model"
            )
        # Every 1-d state but the step count is element-wise, a piece of the
        # parameter's numel (see [Note: sharded state format]). One of
        # another numel used to be read whole and, where its size happened
        # to equal this rank's range, loaded as every rank's piece.
        is_piece = isinstance(md, engine.TensorStorageMetadata) and len(md.size) == 1
        if is_piece and k != "step" and md.size[0] != ranges[name][2]:
            wrong.append((name, k, md.size[0], ranges[name][2]))
        elif is_piece and k != "step":
            dest[key] = _dest(api, key, md, ranges[name])
        elif isinstance(md, engine.TensorStorageMetadata):
            dest[key] = torch.empty(tuple(md.size), dtype=md.properties.dtype)
        else:
            dest[key] = None
    if wrong:
        raise ValueError(
            f"{api}: {path} holds optimizer states of other sizes than this optimizer's "
            f"parameters (got {sorted(wrong)[:4]} as (name, state, saved elements, parameter's "
            "elements)); load the state of the same model"
        )
    out = engine.load(path, dest)
    state: dict[str, dict[str, Any]] = {}
    for key, v in out.items():
        if key.startswith(_STATE):
            name, k = key[len(_STATE) :].rsplit("/", 1)
            state.setdefault(name, {})[k] = v.tensor if isinstance(v, Piece) else v
    optimizer.load_sharded_state_dict(
        {"state": state, "param_groups": out["param_groups"], "loss_scaler": out["loss_scaler"]}
    )
