"""What ``Booster.boost`` returns, and the one checkpoint format every plugin
speaks, so that a checkpoint saved with one plugin at one world size loads
with another plugin at another world size.

[Note: full state format] Model: ``{name: tensor}`` with the user's module's
parameter and persistent-buffer names (``unwrap().state_dict()`` keys), whole
tensors, fp32 for floating parameters, on the CPU. Optimizer:
``{"state": {name: {"step": tensor, "exp_avg": tensor shaped like the
parameter, ...}}, "param_groups": [{hyperparameters..., "params": [names]}],
"loss_scaler": dict | None}`` keyed by parameter name, never by position, so
it does not depend on how a plugin shards or orders parameters.

The per-rank counterpart, which nothing gathers, is the [Note: sharded state
format] (zerostack.booster._plugins._sharded).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch
from torch import nn


class ModelWrapper(nn.Module, ABC):
    """The model ``boost`` returns: calls go to the wrapped (plugin) model;
    ``unwrap()`` is the user's module."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    @abstractmethod
    def unwrap(self, unwrap_peft: bool = True) -> nn.Module:
        """The user's module (its parameters may be empty views while sharded).

        Args:
            unwrap_peft: ColossalAI's (it wraps a model its ``enable_lora``
                built for checkpointing); zerostack has no LoRA wrapping, so
                the user's module is returned either way. Default True.
        """

    @abstractmethod
    def full_state_dict(self, only_rank_0: bool = True) -> dict[str, torch.Tensor]:
        """The whole model in the [Note: full state format]; every rank takes
        part, ranks other than 0 may get ``{}`` when ``only_rank_0``."""

    @abstractmethod
    def load_full_state_dict(
        self, state_dict: dict[str, torch.Tensor], strict: bool = True
    ) -> None:
        """Load the [Note: full state format] (every rank passes the whole dict)."""

    def local_ranges(self) -> dict[str, tuple[int, int, int]]:
        """``{name: (start, end, numel)}``: the flattened elements of every
        parameter (first names) and persistent buffer this rank holds in
        :meth:`sharded_state_dict` (see [Note: sharded state format])."""
        raise NotImplementedError(
            f"{type(self).__name__}.local_ranges: no per-rank state; save with parallel=False"
        )

    def sharded_state_dict(self) -> dict[str, Any]:
        """This rank's part of the model, never gathered, in the [Note:
        sharded state format] (pieces of flattened tensors, or whole plain
        tensors where every rank holds the same)."""
        raise NotImplementedError(
            f"{type(self).__name__}.sharded_state_dict: no per-rank state; save with parallel=False"
        )

    def load_sharded_state_dict(self, values: dict[str, torch.Tensor]) -> None:
        """Load 1-D tensors holding this rank's :meth:`local_ranges` (names it
        lacks keep their values); a collective where the plugin syncs."""
        raise NotImplementedError(
            f"{type(self).__name__}.load_sharded_state_dict: no per-rank state; load a "
            "checkpoint saved with parallel=False"
        )


class OptimizerWrapper(ABC):
    """The optimizer ``boost`` returns: ``step``, ``zero_grad``,
    ``backward(loss)``, ``param_groups`` (what lr schedulers change)."""

    def __init__(self, optimizer: Any) -> None:
        self.optim = optimizer

    @property
    def param_groups(self) -> list[dict]:
        return self.optim.param_groups

    def step(self, *args: Any, **kwargs: Any) -> Any:
        return self.optim.step(*args, **kwargs)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optim.zero_grad(set_to_none=set_to_none)

    @abstractmethod
    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()`` as the plugin needs it (loss scaling, hooks)."""

    @abstractmethod
    def full_state_dict(self) -> dict[str, Any]:
        """The whole optimizer state in the [Note: full state format], on
        every rank (every rank takes part in the gathers)."""

    @abstractmethod
    def load_full_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load the [Note: full state format], saved at any world size."""

    def local_ranges(self) -> dict[str, tuple[int, int, int]]:
        """The model's ``local_ranges()``: the states' ranges are the parameters'."""
        raise NotImplementedError(
            f"{type(self).__name__}.local_ranges: no per-rank state; save with parallel=False"
        )

    def sharded_state_dict(self) -> dict[str, Any]:
        """This rank's part of the optimizer state, never gathered, in the
        [Note: sharded state format]."""
        raise NotImplementedError(
            f"{type(self).__name__}.sharded_state_dict: no per-rank state; save with parallel=False"
        )

    def load_sharded_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load the [Note: sharded state format] with 1-D tensors holding this
        rank's ranges (saved at any world size, by any plugin)."""
        raise NotImplementedError(
            f"{type(self).__name__}.load_sharded_state_dict: no per-rank state; load a "
            "checkpoint saved with parallel=False"
        )
