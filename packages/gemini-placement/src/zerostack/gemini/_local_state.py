"""What this rank owns of a GeminiDDP model and its GeminiOptimizer, by
parameter name, without gathering anything: the pieces a per-rank parallel
checkpoint writes and reads.

[Note: local ranges] A chunk is split in equal shares; parameter ``p`` sits
at ``[info.offset, info.end)`` of its chunk, so this rank owns the
intersection of that with its share ``[rank * shard_size, (rank + 1) *
shard_size)``: elements ``[start, end)`` of ``p`` flattened, possibly none.
Over the ranks the ranges of one parameter tile it exactly once. Trainable
parameters are read from their fp32 master chunk, frozen ones from their
own chunk. Every tensor handed out is a view of this rank's share (no copy).
"""

from __future__ import annotations

from typing import Any

import torch

from zerostack.chunk import Chunk
from zerostack.gemini._cpu_step import write_back
from zerostack.gemini._ddp import GeminiDDP

_API = "GeminiDDP.load_local_state"


def _local(chunk: Chunk, t: torch.Tensor) -> tuple[int, int, torch.Tensor]:
    """``(start, end, view)``: ``t``'s elements this rank owns. See [Note: local ranges]."""
    info = chunk.tensors_info[t]
    lo = chunk.rank * chunk.shard_size
    a, b = max(info.offset, lo), min(info.end, lo + chunk.shard_size)
    if a >= b:
        return 0, 0, chunk.local_share()[:0]
    return a - info.offset, b - info.offset, chunk.local_share()[a - lo : b - lo]


def local_ranges(ddp: GeminiDDP) -> dict[str, tuple[int, int, int]]:
    """``{name: (start, end, numel)}``: the flattened elements of every
    parameter (first name of tied ones) this rank owns."""
    out = {}
    for p in ddp.params:
        t = ddp.masters.get(p, p)
        start, end, _ = _local(ddp.chunk_manager.get_chunk(t), t)
        out[ddp.param_names[p]] = (start, end, _numel(ddp, t))
    return out


def _numel(ddp: GeminiDDP, t: torch.Tensor) -> int:
    info = ddp.chunk_manager.get_chunk(t).tensors_info[t]
    return info.end - info.offset


def local_model_state(ddp: GeminiDDP) -> dict[str, tuple[int, int, torch.Tensor]]:
    """``{name: (start, end, values)}``: this rank's elements of every
    parameter (fp32 masters for trainable ones, views, no copy)."""
    ddp.wait_updates()
    out = {}
    for p in ddp.params:
        t = ddp.masters.get(p, p)
        out[ddp.param_names[p]] = _local(ddp.chunk_manager.get_chunk(t), t)
    return out


@torch.no_grad()
def load_local_model_state(ddp: GeminiDDP, values: dict[str, torch.Tensor]) -> None:
    """Write this rank's elements of the parameters (``local_ranges`` sizes,
    any float dtype) into the masters and the parameter chunks; a
    collective (kept-gathered chunks are synchronised). Parameters not in
    ``values`` keep theirs.

    Raises:
        ValueError: a value has another number of elements than this rank's range.
    """
    ddp.drop_batch_for_load()
    ddp.wait_updates()
    touched: set[Chunk] = set()
    for p in ddp.params:
        name = ddp.param_names[p]
        if name not in values:
            continue
        t = ddp.masters.get(p, p)
        chunk = ddp.chunk_manager.get_chunk(t)
        start, end, view = _local(chunk, t)
        value = values[name].reshape(-1)
        if value.numel() != end - start:
            raise ValueError(
                f"{_API}: {name} has {value.numel()} elements for this rank, its range "
                f"[{start}, {end}) holds {end - start}; pass values sized by local_ranges()"
            )
        view.copy_(value)
        touched.add(ddp.chunk_manager.get_chunk(p))
    for chunk in ddp.param_chunks:  # the same order on every rank: collectives inside
        if chunk.paired_chunk is not None:
            write_back(ddp.chunk_manager, chunk)  # the masters become the parameters
        elif chunk.keep_gathered:
            chunk.sync_gathered()
        elif chunk in touched and chunk.is_gathered:
            chunk.commit_share()  # the values went into the gathered copy: keep them
            if chunk.can_release:
                ddp.chunk_manager.release_chunk(chunk)


def local_optim_state(opt: Any) -> dict[str, Any]:
    """GeminiOptimizer's state as this rank holds it, by parameter name:
    ``{"params": {name: {key: view of this rank's range, or a scalar}},
    "param_group": hyperparameters, "scaler": state or None}``; ranges as
    :func:`local_ranges` (masters left out: the model carries them)."""
    ddp = opt.module
    ddp.wait_updates()
    packed = opt.optimizer.state_dict()["state"]  # positional; disk-held states come back here
    params: dict[str, dict[str, Any]] = {}
    for i, (chunk, master_chunk) in enumerate(opt.pairs):
        state = packed.get(i, {})
        lo = master_chunk.rank * master_chunk.shard_size
        for p in chunk.tensors_info:
            if not p.requires_grad:
                continue
            info = master_chunk.tensors_info[ddp.masters[p]]
            a = max(info.offset, lo)
            b = max(a, min(info.end, lo + master_chunk.shard_size))
            entry = {}
            for k, v in state.items():
                if torch.is_tensor(v) and v.dim() > 0 and v.numel() == master_chunk.shard_size:
                    entry[k] = v[a - lo : b - lo]
                else:  # the step count, one per chunk
                    entry[k] = v.detach().clone() if torch.is_tensor(v) else v
            params[ddp.param_names[p]] = entry
    return {
        "params": params,
        "param_group": {k: v for k, v in opt.param_groups[0].items() if k != "params"},
        "scaler": opt.scaler.state_dict() if opt.scaler is not None else None,
    }


@torch.no_grad()
def load_local_optim_state(opt: Any, local: dict[str, Any]) -> None:
    """Load :func:`local_optim_state`-shaped state (each tensor this rank's
    range of its parameter, from any world size's checkpoint): the inner
    optimizer's state over the master shards, the hyperparameters, the
    scaler. The masters keep their values. A chunk takes the scalar state
    (the step) of its first parameter that has one.

    Raises:
        ValueError: a tensor has another number of elements than the range.
    """
    ddp = opt.module
    ddp.drop_batch_for_load()
    ddp.wait_updates()
    state: dict[int, dict[str, Any]] = {}
    for i, (chunk, master_chunk) in enumerate(opt.pairs):
        master = opt.masters[i]
        lo = master_chunk.rank * master_chunk.shard_size
        whole: dict[str, Any] = {}
        for p in chunk.tensors_info:
            name = ddp.param_names[p]
            entry = local["params"].get(name)
            if not p.requires_grad or not entry:
                continue
            info = master_chunk.tensors_info[ddp.masters[p]]
            a = max(info.offset, lo)
            b = max(a, min(info.end, lo + master_chunk.shard_size))
            for k, v in entry.items():
                if not (torch.is_tensor(v) and v.dim() == 1):
                    whole.setdefault(k, v.clone() if torch.is_tensor(v) else v)
                    continue
                if v.numel() != b - a:
                    raise ValueError(
                        f"GeminiOptimizer.load_local_state_dict: {k} of {name} has {v.numel()} "
                        f"elements, this rank's range {b - a}; pass pieces sized by local_ranges()"
                    )
                buf = whole.setdefault(k, torch.zeros(master_chunk.shard_size, dtype=v.dtype))
                buf[a - lo : b - lo].copy_(v)
        if whole:
            state[i] = {
                k: v.to(master.device) if torch.is_tensor(v) and v.dim() == 1 else v
                for k, v in whole.items()
            }
    hyper = dict(local["param_group"])
    opt.param_groups[0].update(hyper)
    inner = {**opt.optimizer.param_groups[0], **hyper, "params": list(range(len(opt.masters)))}
    opt.optimizer.load_state_dict({"state": state, "param_groups": [inner]})
    if opt.scaler is not None and local.get("scaler") is not None:
        opt.scaler.load_state_dict(local["scaler"])
