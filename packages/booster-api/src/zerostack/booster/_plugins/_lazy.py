"""Models built under LazyInitContext: the initialiser a plugin passes when the
model is a Hugging Face transformers model, so that users never write one."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn


def is_lazy(model: nn.Module) -> bool:
    """True when ``model`` has meta tensors (built under LazyInitContext)."""
    return any(t.is_meta for t in (*model.parameters(), *model.buffers()))


def transformers_init_fn(model: nn.Module) -> Callable[[nn.Module], None] | None:
    """The model-level initialiser of a transformers ``PreTrainedModel``
    (``initialize_weights``, else ``apply(_init_weights)``), None for other models.

    transformers skips its own initialisation on the meta device, and some of
    its layers (GPT-2's Conv1D) have no ``reset_parameters``; its
    ``initialize_weights`` draws every weight as ``from_config`` would.
    """
    # By name: importing transformers to check would cost seconds.
    if not any(c.__name__ == "PreTrainedModel" for c in type(model).__mro__):
        return None
    if callable(getattr(model, "initialize_weights", None)):
        return _initialize_weights
    if callable(getattr(model, "_init_weights", None)):
        return _apply_init_weights
    return None


def _initialize_weights(model: Any) -> None:  # a transformers PreTrainedModel
    model.initialize_weights()


def _apply_init_weights(model: Any) -> None:
    model.apply(model._init_weights)
