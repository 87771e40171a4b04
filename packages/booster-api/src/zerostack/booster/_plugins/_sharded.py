"""What every plugin's ``sharded_state_dict`` / ``load_sharded_state_dict``
shares: this rank's part of the model and optimizer by name, as pieces of
flattened tensors (see zerostack.booster._checkpoint_dcp, [Note: pieces in
DCP]), never gathered.

[Note: sharded state format] Model: ``{name: Piece | tensor}`` with the first
name of every parameter (``named_parameters()`` order) and every persistent
buffer, each flattened to 1-D: parameters in fp32, buffers in their dtype
before wrapping. A ``Piece`` is this rank's range (``local_ranges()``); a
plain tensor is whole and the same on every rank (DCP writes it once).
Optimizer: ``{"state": {name: {key: Piece | tensor}}, "param_groups":
[{..., "params": [names]}], "loss_scaler": dict | None}``, per-element
states as pieces over the parameter's range, the step a float32 scalar.
Loading hands each wrapper the same structure with plain 1-D tensors
holding its ``local_ranges()`` (read from a checkpoint of any plugin and
world size).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from zerostack.booster._checkpoint_dcp import Piece
from zerostack.chunk import persistent_buffers

Ranges = dict[str, tuple[int, int, int]]  # name -> (start, end, numel) of the flattened tensor


def buffer_state(module: nn.Module, dtypes: dict[str, torch.dtype]) -> dict[str, torch.Tensor]:
    """Persistent buffers, flat, in their dtype before wrapping (whole, plain)."""
    out = {}
    for name, b in persistent_buffers(module).items():
        dtype = dtypes.get(name, b.dtype) if b.is_floating_point() else b.dtype
        out[name] = b.detach().reshape(-1).to("cpu", dtype)
    return out


def buffer_ranges(module: nn.Module) -> Ranges:
    return {n: (0, b.numel(), b.numel()) for n, b in persistent_buffers(module).items()}


@torch.no_grad()
def load_buffers(module: nn.Module, values: dict[str, torch.Tensor]) -> None:
    """Copy flat values into the persistent buffers that ``values`` names."""
    for name, b in persistent_buffers(module).items():
        if name in values:
            b.copy_(values[name].reshape(b.shape))


def optimizer_pieces(
    per_param: dict[str, dict[str, Any]], ranges: Ranges
) -> dict[str, dict[str, Any]]:
    """This rank's per-parameter optimizer state (``{name: {key: tensor of the
    range, or scalar}}``) as pieces: 1-D tensors over the parameter's range,
    the step as a float32 scalar, other scalars as tensors."""
    out: dict[str, dict[str, Any]] = {}
    for name, entry in per_param.items():
        start, end, numel = ranges[name]
        mine: dict[str, Any] = {}
        for k, v in entry.items():
            if k == "master":
                continue
            if torch.is_tensor(v) and v.dim() == 1 and v.numel() == end - start:
                mine[k] = Piece(v.detach().float(), start, numel)
            elif k == "step":
                mine[k] = torch.tensor(float(v), dtype=torch.float32)
            else:
                mine[k] = v.detach().clone() if torch.is_tensor(v) else v
        out[name] = mine
    return out


def whole_pieces(state: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """A whole (replicated) per-parameter state, flattened: plain tensors."""
    return {
        name: {
            k: v.detach().reshape(-1) if torch.is_tensor(v) and v.dim() > 0 else v
            for k, v in entry.items()
        }
        for name, entry in state.items()
    }
