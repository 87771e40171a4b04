"""The buffers a module's state dict holds, for every wrapper that saves or
loads them beside its chunked parameters."""

from __future__ import annotations

import torch
from torch import nn


def persistent_buffers(module: nn.Module, remove_duplicate: bool = True) -> dict[str, torch.Tensor]:
    """The buffers ``module.state_dict()`` holds (not the non-persistent
    ones), by name.

    Args:
        module: the model.
        remove_duplicate: a buffer that several submodules hold appears once,
            under its first name (as ``named_buffers``); False: under each
            name, as ``state_dict()`` keys it. Default True.
    """
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for prefix, m in module.named_modules():
        for name, b in m._buffers.items():
            if b is None or name in m._non_persistent_buffers_set:
                continue
            if remove_duplicate and id(b) in seen:
                continue
            seen.add(id(b))
            out[f"{prefix}.{name}" if prefix else name] = b
    return out
