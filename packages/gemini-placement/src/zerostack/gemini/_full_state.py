"""A GeminiOptimizer's whole-model state by parameter name (every rank's
shards gathered): ``full_state_dict`` / ``load_full_state_dict``, loadable
at any world size and chunk size."""

from __future__ import annotations

from typing import Any

import torch

from zerostack.chunk import Chunk, all_gather_into, set_collective_label
from zerostack.gemini._cpu_step import write_back
from zerostack.shard import check_state_keys

_API = "GeminiOptimizer"


def _trainable(opt: Any) -> list[torch.Tensor]:
    return [p for p in opt.module.params if p.requires_grad]


@torch.no_grad()
def full_optim_state(opt: Any) -> dict[str, Any]:
    """See ``GeminiOptimizer.full_state_dict``."""
    opt.module.wait_updates()
    # Positional: states on disk (nvme_offload_fraction) come back from
    # the inner state_dict as file-backed tensors, one chunk at a time.
    packed = opt.optimizer.state_dict()["state"]
    per_chunk: dict[Chunk, dict[str, Any]] = {}
    for i, ((chunk, master_chunk), master) in enumerate(zip(opt.pairs, opt.masters, strict=True)):
        state = packed.get(i, {})
        whole = {"master": _gather_chunk(master, master_chunk)}
        for k, v in state.items():
            if torch.is_tensor(v) and v.dim() > 0 and v.numel() == master.numel():
                whole[k] = _gather_chunk(v, master_chunk)
            else:  # e.g. the step count
                whole[k] = v.detach().clone() if torch.is_tensor(v) else v
        per_chunk[chunk] = whole
    params = {}
    for p in _trainable(opt):
        chunk = opt.manager.get_chunk(p)
        info = chunk.tensors_info[p]
        params[opt.module.param_names[p]] = {
            k: v[info.offset : info.end].clone() if _is_chunk_tensor(v, chunk) else v
            for k, v in per_chunk[chunk].items()
        }
    return {
        "params": params,
        "param_group": {k: v for k, v in opt.param_groups[0].items() if k != "params"},
        "scaler": opt.scaler.state_dict() if opt.scaler is not None else None,
    }


@torch.no_grad()
def load_full_optim_state(opt: Any, full: dict[str, Any]) -> None:
    """See ``GeminiOptimizer.load_full_state_dict``."""
    check_state_keys(f"{_API}.load_full_state_dict", full, ("params", "param_group", "scaler"))
    module = opt.module
    module.drop_batch_for_load()
    module.wait_updates()
    names = [module.param_names[p] for p in _trainable(opt)]
    missing = [n for n in names if n not in full["params"]]
    if missing:
        raise KeyError(f"{_API}.load_full_state_dict: no state for {missing[:5]}")
    # Sizes are checked before the first master is written: a bad entry
    # leaves the model and the optimizer as they were.
    for chunk, _ in opt.pairs:
        for t, info in chunk.tensors_info.items():
            name = module.param_names[t]
            for k, v in full["params"][name].items():
                if torch.is_tensor(v) and v.dim() == 1 and v.numel() != info.numel:
                    raise ValueError(
                        f"{_API}.load_full_state_dict: {name} has {v.numel()} elements in "
                        f"the state ({k}), {info.numel} in the model"
                    )
    state: dict[int, dict[str, Any]] = {}
    for i, (chunk, _) in enumerate(opt.pairs):
        master = opt.masters[i]
        whole: dict[str, Any] = {}
        for t, info in chunk.tensors_info.items():
            entry = full["params"][module.param_names[t]]
            for k, v in entry.items():
                if not (torch.is_tensor(v) and v.dim() == 1):
                    whole.setdefault(k, v.clone() if torch.is_tensor(v) else v)
                    continue
                if v.numel() != info.end - info.offset:
                    raise ValueError(
                        f"{_API}.load_full_state_dict: {module.param_names[t]} has {v.numel()} "
                        f"elements in the state, {info.end - info.offset} in the model"
                    )
                buf = whole.setdefault(k, torch.zeros(chunk.chunk_size, dtype=v.dtype))
                buf[info.offset : info.end].copy_(v)
        lo, hi = chunk.rank * chunk.shard_size, (chunk.rank + 1) * chunk.shard_size
        mine = {
            k: v[lo:hi].to(master.device) if _is_chunk_tensor(v, chunk) else v
            for k, v in whole.items()
        }
        master.copy_(mine.pop("master"))
        if mine:
            state[i] = mine
    hyper = dict(full["param_group"])
    opt.param_groups[0].update(hyper)
    inner = {
        **opt.optimizer.param_groups[0],
        **hyper,
        "params": list(range(len(opt.masters))),
    }
    opt.optimizer.load_state_dict({"state": state, "param_groups": [inner]})
    if opt.scaler is not None and full["scaler"] is not None:
        opt.scaler.load_state_dict(full["scaler"])
    for chunk, _ in opt.pairs:
        write_back(opt.manager, chunk)


def _gather_chunk(t: torch.Tensor, chunk: Chunk) -> torch.Tensor:
    """The whole chunk from every rank's shard ``t``, on the CPU."""
    if chunk.world_size == 1:
        return t.detach().cpu().clone()
    device = chunk.compute_device
    out = torch.empty(chunk.chunk_size, dtype=t.dtype, device=device)
    set_collective_label(f"gathering chunk {chunk.index}'s state for a checkpoint")
    all_gather_into(out, t.detach().to(device), chunk.process_group)
    return out.cpu()


def _is_chunk_tensor(v: Any, chunk: Chunk) -> bool:
    return torch.is_tensor(v) and v.dim() == 1 and v.numel() == chunk.chunk_size
