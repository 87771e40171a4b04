"""Models built under LazyInitContext, as a plugin sees them."""

from __future__ import annotations

from torch import nn


def is_lazy(model: nn.Module) -> bool:
    """True when ``model`` has meta tensors (built under LazyInitContext)."""
    return any(t.is_meta for t in (*model.parameters(), *model.buffers()))
