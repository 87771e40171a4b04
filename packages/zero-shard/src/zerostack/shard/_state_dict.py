"""ZeroOptimizer's three state-dict formats, each a save and a load:

- per rank (``state_dict``): this rank's masters and the inner optimizer's
  state as it holds them, loadable by the same rank at the same world size;
- full (``full_state_dict``): every parameter's whole master and state,
  all-gathered on every rank, loadable at any world size;
- local (``local_state_dict``): this rank's ``local_ranges`` of each
  parameter without any gather, for per-rank parallel checkpoints that load
  at any world size.

Each reads the inner optimizer only with no CPU update running and the
users' hyperparameters pushed into it, and ends a load by all-gathering the
loaded masters into the parameters.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

import torch

from zerostack.chunk import all_gather_into, set_collective_label
from zerostack.shard import _partition as part
from zerostack.shard._bucket import _Shard

if TYPE_CHECKING:
    from zerostack.shard._optimizer import ZeroOptimizer

_API = "ZeroOptimizer"
_RANK_KEYS = ("optimizer", "masters", "scaler", "layout")
_FULL_KEYS = ("params", "param_groups", "scaler", "numels")


def _scaler_state(zero: ZeroOptimizer) -> dict[str, Any] | None:
    return zero.scaler.state_dict() if zero.scaler is not None else None


def _load_scaler(zero: ZeroOptimizer, state: dict[str, Any] | None) -> None:
    if zero.scaler is not None and state is not None:
        zero.scaler.load_state_dict(state)


def check_state_keys(api: str, state: object, keys: tuple[str, ...]) -> None:
    """Raise TypeError unless ``state`` is a dict with ``keys``; ``api`` is
    the loader (``"ZeroOptimizer.load_state_dict"``), whose saver the
    message names."""
    if not isinstance(state, dict) or not set(keys) <= state.keys():
        got = sorted(state) if isinstance(state, dict) else type(state).__name__
        saver = api.rsplit(".", 1)[-1].replace("load_", "")
        raise TypeError(
            f"{api}: the state must be a dict with {list(keys)} (got {got}); pass "
            f"what {saver}() returned"
        )


def _check_layout(zero: ZeroOptimizer, numels: list[int], api: str) -> None:
    mine = [s.param.numel() for s in zero.shards]
    if numels != mine:
        raise ValueError(
            f"{_API}.{api}: the state is for another model ({len(numels)} params of sizes "
            f"{numels[:4]}..., this one has {len(mine)} of sizes {mine[:4]}...)"
        )


def _entry(s: _Shard, state: dict[str, Any], piece: Any) -> dict[str, Any]:
    """One parameter's inner-optimizer ``state``: each piece-sized tensor
    through ``piece``, the rest (e.g. the step count) as a copy, not the
    live value."""
    out = {}
    for k, v in state.items():
        if torch.is_tensor(v) and v.dim() > 0 and v.numel() == s.piece:
            out[k] = piece(v)
        else:
            out[k] = v.detach().clone() if torch.is_tensor(v) else copy.deepcopy(v)
    return out


# -- per rank ----------------------------------------------------------------------------


def rank_state_dict(zero: ZeroOptimizer) -> dict[str, Any]:
    """``ZeroOptimizer.state_dict``."""
    zero._settle()
    return {
        "optimizer": zero.optimizer.state_dict(),
        "masters": [s.master.detach().clone() for s in zero.shards],
        "scaler": _scaler_state(zero),
        "layout": {
            "world": zero.world,
            "rank": zero.rank,
            "numels": [s.param.numel() for s in zero.shards],
        },
    }


def load_rank_state_dict(zero: ZeroOptimizer, state: dict[str, Any]) -> None:
    """``ZeroOptimizer.load_state_dict``."""
    check_state_keys(f"{_API}.load_state_dict", state, _RANK_KEYS)
    zero.wait_updates()
    layout = state["layout"]
    _check_layout(zero, layout["numels"], "load_state_dict")
    masters = state["masters"]
    bad = [
        i
        for i, (s, m) in enumerate(zip(zero.shards, masters, strict=False))
        if not isinstance(m, torch.Tensor) or m.shape != s.master.shape
    ]
    if len(masters) != len(zero.shards) or bad:
        raise ValueError(
            f"{_API}.load_state_dict: masters must be {len(zero.shards)} tensors shaped like "
            f"this rank's pieces (got {len(masters)}, first mismatch at {bad[:1]})"
        )
    if (layout["world"], layout["rank"]) != (zero.world, zero.rank):
        raise ValueError(
            f"{_API}.load_state_dict: saved by rank {layout['rank']} of {layout['world']}, this is rank "
            f"{zero.rank} of {zero.world}; save with full_state_dict() and load with load_full_state_dict()"
        )
    # A copy: torch's loaders alias the given tensors when dtype and device match.
    zero.optimizer.load_state_dict(copy.deepcopy(state["optimizer"]))
    zero._pull_hyper()
    with torch.no_grad():
        for s, m in zip(zero.shards, state["masters"], strict=True):
            s.master.copy_(m)
    _load_scaler(zero, state["scaler"])
    zero._gather_params()


# -- full (gathered) ---------------------------------------------------------------------


def full_state_dict(zero: ZeroOptimizer) -> dict[str, Any]:
    """``ZeroOptimizer.full_state_dict``."""
    zero._settle()
    packed = zero.optimizer.state_dict()
    per_param: list[dict[str, Any]] = []
    for i, s in enumerate(zero.shards):
        entry: dict[str, Any] = {"master": _gather_piece(zero, s.master, s)}
        entry.update(
            _entry(s, packed["state"].get(i, {}), lambda v, s=s: _gather_piece(zero, v, s))
        )
        per_param.append(entry)
    return {
        "params": per_param,
        "param_groups": copy.deepcopy(packed["param_groups"]),
        "scaler": _scaler_state(zero),
        "numels": [s.param.numel() for s in zero.shards],
    }


def _gather_piece(zero: ZeroOptimizer, t: torch.Tensor, s: _Shard) -> torch.Tensor:
    src = t.detach().reshape(-1).to(zero.device)
    full = torch.empty(zero.world * s.piece, dtype=src.dtype, device=zero.device)
    set_collective_label("gathering a parameter's state for a checkpoint")
    all_gather_into(full, src, zero.group)
    return full[: s.param.numel()].cpu()


def load_full_state_dict(zero: ZeroOptimizer, full: dict[str, Any]) -> None:
    """``ZeroOptimizer.load_full_state_dict``."""
    check_state_keys(f"{_API}.load_full_state_dict", full, _FULL_KEYS)
    _check_layout(zero, full["numels"], "load_full_state_dict")
    zero.wait_updates()
    params = full["params"]
    bad = [
        i
        for i, (s, e) in enumerate(zip(zero.shards, params, strict=False))
        if not isinstance(e, dict)
        or not isinstance(e.get("master"), torch.Tensor)
        or e["master"].numel() != s.param.numel()
    ]
    if len(params) != len(zero.shards) or bad:
        raise ValueError(
            f"{_API}.load_full_state_dict: params must hold {len(zero.shards)} entries, each "
            f"with the parameter's whole master (got {len(params)}, first mismatch at {bad[:1]})"
        )
    state: dict[int, dict[str, Any]] = {}
    with torch.no_grad():
        for i, (s, entry) in enumerate(zip(zero.shards, full["params"], strict=True)):
            mine = {}
            for k, v in entry.items():
                if torch.is_tensor(v) and v.numel() == s.param.numel() and v.dim() == 1:
                    v = part.padded_flat(v, zero.world)[
                        zero.rank * s.piece : (zero.rank + 1) * s.piece
                    ]
                mine[k] = v
            s.master.copy_(mine.pop("master"))
            if mine:
                state[i] = mine
    zero.optimizer.load_state_dict({"state": state, "param_groups": full["param_groups"]})
    zero._pull_hyper()
    _load_scaler(zero, full["scaler"])
    zero._gather_params()


# -- this rank's part (per-rank parallel checkpoints) ------------------------------------


def local_ranges(zero: ZeroOptimizer) -> list[tuple[int, int]]:
    """``ZeroOptimizer.local_ranges``."""
    return [part.shard_bounds(s.param.numel(), zero.world, zero.rank) for s in zero.shards]


def local_state_dict(zero: ZeroOptimizer) -> dict[str, Any]:
    """``ZeroOptimizer.local_state_dict``."""
    zero._settle()
    packed = zero.optimizer.state_dict()
    params: list[dict[str, Any]] = []
    for i, (s, (start, end)) in enumerate(zip(zero.shards, local_ranges(zero), strict=True)):
        n = end - start
        entry: dict[str, Any] = {"master": s.master.detach().reshape(-1)[:n]}
        entry.update(_entry(s, packed["state"].get(i, {}), lambda v, n=n: v.reshape(-1)[:n]))
        params.append(entry)
    return {
        "params": params,
        "param_groups": copy.deepcopy(packed["param_groups"]),
        "scaler": _scaler_state(zero),
    }


@torch.no_grad()
def load_local_state_dict(zero: ZeroOptimizer, local: dict[str, Any]) -> None:
    """``ZeroOptimizer.load_local_state_dict``."""
    zero._settle()
    if len(local["params"]) != len(zero.shards):
        raise ValueError(
            f"{_API}.load_local_state_dict: {len(local['params'])} parameters given, this "
            f"optimizer has {len(zero.shards)}; pass one entry per parameter"
        )
    state: dict[int, dict[str, Any]] = {}
    masters = False
    ranges = local_ranges(zero)
    for i, (s, entry, (start, end)) in enumerate(
        zip(zero.shards, local["params"], ranges, strict=True)
    ):
        mine = {k: _local_piece(s, i, k, v, end - start) for k, v in entry.items()}
        if "master" in mine:
            s.master.copy_(mine.pop("master").view_as(s.master))
            masters = True
        if mine:
            state[i] = mine
    groups = local.get("param_groups") or zero.optimizer.state_dict()["param_groups"]
    if state or local.get("param_groups"):
        zero.optimizer.load_state_dict({"state": state, "param_groups": groups})
        zero._pull_hyper()
    _load_scaler(zero, local.get("scaler"))
    if masters:
        zero._gather_params()


def _local_piece(s: _Shard, i: int, key: str, v: Any, n: int) -> Any:
    """A loaded value of parameter ``i``: a 1-d tensor of this rank's ``n``
    range elements becomes a zero-padded piece on the master's device; the
    rest (e.g. the step count) is kept as given."""
    if not (torch.is_tensor(v) and v.dim() == 1):
        return v
    if v.numel() != n:
        raise ValueError(
            f"{_API}.load_local_state_dict: {key} of parameter {i} has {v.numel()} "
            f"elements, this rank's range {n}; slice by local_ranges()"
        )
    piece = torch.zeros(s.piece, dtype=v.dtype, device=s.master.device)
    piece[:n].copy_(v)
    return piece
