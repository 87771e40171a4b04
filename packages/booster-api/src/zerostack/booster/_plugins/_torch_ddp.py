"""TorchDDPPlugin: torch's DistributedDataParallel behind the Booster, and the
plain path the Booster takes without a plugin."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from zerostack.booster._interface import ModelWrapper
from zerostack.booster._plugins._base import (
    BoostedOptimizer,
    Plugin,
    attach_scheduler,
    compute_device,
    nothing,
)
from zerostack.booster._plugins._sharded import (
    buffer_ranges,
    buffer_state,
    load_buffers,
    whole_pieces,
)
from zerostack.booster._plugins._state import (
    ModelFacts,
    full_to_positional,
    param_name,
    param_names,
    positional_to_full,
    scaler_state,
)
from zerostack.chunk import rank_and_world

_DDP_DEFAULTS = dict(
    broadcast_buffers=True, bucket_cap_mb=25, find_unused_parameters=False,
    check_reduction=False, gradient_as_bucket_view=False, static_graph=False,
)  # fmt: skip


class TorchDDPModel(ModelWrapper):
    """A model under torch DDP (or plain, in one process without a plugin).

    ``autocast_dtype`` (set by ``Booster(mixed_precision=...)``) runs
    forward under ``torch.autocast``.
    """

    def __init__(self, module: nn.Module, ddp_kwargs: dict[str, Any] | None) -> None:
        facts = ModelFacts.of(module)
        super().__init__(DDP(module, **ddp_kwargs) if ddp_kwargs is not None else module)
        self._facts = facts
        self.device_type = next(module.parameters(), torch.empty(0)).device.type
        self.autocast_dtype: torch.dtype | None = None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.autocast_dtype is None:
            return self.module(*args, **kwargs)
        with torch.autocast(self.device_type, dtype=self.autocast_dtype):
            return self.module(*args, **kwargs)

    def unwrap(self) -> nn.Module:
        return self.module.module if isinstance(self.module, DDP) else self.module

    def full_state_dict(self, only_rank_0: bool = True) -> dict[str, torch.Tensor]:
        """The whole model (every rank holds it whole); see [Note: full state format]."""
        if only_rank_0 and rank_and_world()[0] != 0:
            return {}
        return self._facts.export_model(self.unwrap().state_dict())

    def load_full_state_dict(
        self, state_dict: dict[str, torch.Tensor], strict: bool = True
    ) -> None:
        """Load the whole model on this rank (every rank passes the same dict)."""
        self.unwrap().load_state_dict(state_dict, strict=strict)

    def local_ranges(self) -> dict[str, tuple[int, int, int]]:
        """Everything whole: every rank holds the whole model."""
        module = self.unwrap()
        out = {n: (0, p.numel(), p.numel()) for n, p in module.named_parameters()}
        return {**out, **buffer_ranges(module)}

    def sharded_state_dict(self) -> dict[str, Any]:
        """The whole model as plain flat tensors (the same on every rank: DCP
        writes each once, spread over the ranks); see [Note: sharded state format]."""
        module = self.unwrap()
        out: dict[str, Any] = {
            n: p.detach().reshape(-1).float() for n, p in module.named_parameters()
        }
        out.update(buffer_state(module, self._facts.dtypes))
        return out

    @torch.no_grad()
    def load_sharded_state_dict(self, values: dict[str, torch.Tensor]) -> None:
        """Whole flat tensors into the parameters and buffers they name."""
        module = self.unwrap()
        for n, p in module.named_parameters():
            if n in values:
                p.copy_(values[n].reshape(p.shape))
        load_buffers(module, values)

    @contextlib.contextmanager
    def no_sync(self):
        """DDP's no_sync (nothing to skip in a single process)."""
        with self.module.no_sync() if isinstance(self.module, DDP) else nothing():
            yield


class TorchDDPOptimizer(BoostedOptimizer):
    """The user's torch optimizer next to a TorchDDPModel; ``scaler`` (a
    torch.amp.GradScaler, set by ``Booster(mixed_precision="fp16")``)
    scales backward and unscales in ``step``."""

    _API = "TorchDDPOptimizer"

    def __init__(self, optimizer: torch.optim.Optimizer, model: TorchDDPModel) -> None:
        super().__init__(optimizer)
        self._model = model
        self.scaler: torch.amp.GradScaler | None = None
        # An optimizer over another model's parameters fails here, not at saving.
        names = param_names(model.unwrap())
        for p in self._params():
            param_name(self._API, names, p)

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, scaled when a GradScaler is on."""
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def _step(self, *args: Any, **kwargs: Any) -> Any:
        if self.scaler is None:
            return self.optim.step(*args, **kwargs)
        out = self.scaler.step(self.optim, *args, **kwargs)
        self.scaler.update()
        return out

    def _params(self) -> list[torch.Tensor]:
        return [p for g in self.optim.param_groups for p in g["params"]]

    def full_state_dict(self) -> dict[str, Any]:
        """See [Note: full state format]; torch's positions become names."""
        facts = self._model._facts
        state, groups = positional_to_full(
            self._API, self.optim.state_dict(), self._params(),
            param_names(self._model.unwrap()), facts.shapes,
        )  # fmt: skip
        scaler = self.scaler.state_dict() if self.scaler is not None else None
        return {"state": state, "param_groups": groups, "loss_scaler": scaler}

    def local_ranges(self) -> dict[str, tuple[int, int, int]]:
        return self._model.local_ranges()

    def sharded_state_dict(self) -> dict[str, Any]:
        """The whole state, flat and plain (every rank holds it); see
        [Note: sharded state format]."""
        full = self.full_state_dict()
        return {**full, "state": whole_pieces(full["state"])}

    def load_sharded_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Whole flat states (this rank's ranges are whole): as
        :meth:`load_full_state_dict`."""
        self.load_full_state_dict(state_dict)

    def load_full_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load the [Note: full state format] (from any plugin and world size).

        Raises:
            KeyError: the state names a parameter this optimizer lacks.
            ValueError: a state tensor's size differs from its parameter's.
        """
        positional = full_to_positional(
            self._API, state_dict, self.optim.state_dict(), self._params(),
            param_names(self._model.unwrap()), flat=False,
        )  # fmt: skip
        self.optim.load_state_dict(positional)
        if self.scaler is not None:
            saved = scaler_state(self.scaler.state_dict(), state_dict.get("loss_scaler"))
            if saved is not None:
                self.scaler.load_state_dict(saved)


class TorchDDPPlugin(Plugin):
    """torch DDP: every rank holds the whole model and optimizer; gradients
    are all-reduced in buckets during backward. Precision is left to
    ``Booster(mixed_precision=...)``.

    Args:
        broadcast_buffers: DistributedDataParallel's, as are bucket_cap_mb,
            find_unused_parameters, check_reduction, gradient_as_bucket_view
            and static_graph (its defaults: True, 25, False, False, False, False).

    Raises:
        RuntimeError (at configure): torch.distributed is not initialised.
    """

    def __init__(
        self,
        broadcast_buffers: bool = True,
        bucket_cap_mb: int = 25,
        find_unused_parameters: bool = False,
        check_reduction: bool = False,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
    ) -> None:
        given = dict(
            broadcast_buffers=broadcast_buffers,
            bucket_cap_mb=bucket_cap_mb,
            find_unused_parameters=find_unused_parameters,
            check_reduction=check_reduction,
            gradient_as_bucket_view=gradient_as_bucket_view,
            static_graph=static_graph,
        )
        # Only what differs from DDP's defaults (the same as the seed's):
        # torch 2.13 warns whenever broadcast_buffers is passed at all.
        self.ddp_kwargs = {k: v for k, v in given.items() if v != _DDP_DEFAULTS[k]}

    def support_no_sync(self) -> bool:
        return True

    def supported_precisions(self) -> list[str]:
        return ["fp16", "bf16", "fp32"]

    def _wrap_kwargs(self) -> dict[str, Any] | None:
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                f"{type(self).__name__}: torch.distributed is not initialised; call "
                "zerostack.booster.launch_from_torch() first (under torchrun), or use "
                "Booster() without a plugin in a single process"
            )
        return self.ddp_kwargs

    def _device(self) -> torch.device:
        return compute_device()

    def configure(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | TorchDDPOptimizer | None = None,
        criterion: Callable | None = None,
        dataloader: Any = None,
        lr_scheduler: Any = None,
    ) -> tuple:
        """Move the model to the current device and wrap it in DDP; wrap the optimizer."""
        if not isinstance(model, TorchDDPModel):
            kwargs = self._wrap_kwargs()
            model = TorchDDPModel(model.to(self._device()), kwargs)
        if optimizer is not None and not isinstance(optimizer, TorchDDPOptimizer):
            user = optimizer
            optimizer = TorchDDPOptimizer(optimizer, model)
            attach_scheduler(lr_scheduler, optimizer, user)
        return model, optimizer, criterion, dataloader, lr_scheduler

    def no_sync(self, model: nn.Module | None = None, optimizer: Any = None):
        """DDP's no_sync on ``model``.

        Raises:
            ValueError: ``model`` is not a model boosted by this plugin.
        """
        if not isinstance(model, TorchDDPModel):
            raise ValueError(
                f"{type(self).__name__}.no_sync: pass the boosted model (got "
                f"{type(model).__name__}); booster.no_sync(model)"
            )
        return model.no_sync()


class DefaultPlugin(TorchDDPPlugin):
    """What ``Booster()`` does without a plugin: the model on ``device``,
    under DDP when a process group of more than one rank exists, plain
    otherwise; precision from ``Booster(mixed_precision=...)``."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device

    def control_device(self) -> bool:
        return False

    def _wrap_kwargs(self) -> dict[str, Any] | None:
        if rank_and_world()[1] > 1:
            return self.ddp_kwargs
        return None

    def _device(self) -> torch.device:
        return self.device
