"""AutoOffloadPlugin: zerostack-auto-offload's planned parameter offload
(``memory_optimize`` + ``AMPOptimizer``) behind the Booster, on one device."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from zerostack.booster._interface import ModelWrapper
from zerostack.booster._plugins._base import (
    BoostedOptimizer,
    Plugin,
    attach_scheduler,
    refuse_backward_inputs,
)
from zerostack.booster._plugins._contract import (
    incompatible,
    refuse_moves,
    with_prefix,
    without_prefix,
)
from zerostack.booster._plugins._state import (
    ModelFacts,
    frozen_names,
    full_to_positional,
    positional_to_full,
    scaler_state,
)
from zerostack.chunk import rank_and_world
from zerostack.shard import SCALER_KEYS, LossScalerConfig, check_clip_args, check_max_norm

_API = "AutoOffloadPlugin"
_SOLVERS = ("asyn", "syn")
_SCALER = LossScalerConfig()  # the loss scaler's defaults (ColossalAI's, as its AMPOptimizer)
_PRECISIONS = ("fp16", "bf16")


class AutoOffloadModel(ModelWrapper):
    """A model made by ``memory_optimize``: calls run the planned graph;
    checkpoints hold its fp32 masters by the model's names."""

    _API = "AutoOffloadModel"
    module: Any  # the BaseOffloadModule (not an nn.Module)

    def __init__(self, offload: Any, facts: ModelFacts) -> None:
        super().__init__(offload)
        self._facts = facts

    def unwrap(self, unwrap_peft: bool = True) -> nn.Module:
        """The traced module (its parameters are the device copies)."""
        return self.module.model

    def train(self, mode: bool = True) -> AutoOffloadModel:
        """Training mode only: the graph was traced in it (``eval()`` raises,
        see BaseOffloadModule.train)."""
        self.module.train(mode)
        return super().train(mode)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        _refuse_hooks(f"{self._API}.forward", self.unwrap(), "the traced module's submodules")
        return self.module(*args, **kwargs)

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Any:
        """The traced module's (device) parameters, named as in ``state_dict()``."""
        inner = f"{prefix}.module" if prefix else "module"
        return self.unwrap().named_parameters(inner, recurse, remove_duplicate)

    def _apply(self, fn: Any, recurse: bool = True) -> AutoOffloadModel:
        # See [Note: boosted model methods]
        module = self.unwrap()
        refuse_moves(self._API, _API, fn, [*module.parameters(), *module.buffers()])
        return self

    def state_dict(  # type: ignore[override]  # torch.nn.Module.state_dict, whole-model
        self, *args: Any, destination: Any = None, prefix: str = "", keep_vars: bool = False
    ) -> dict[str, torch.Tensor]:
        """The fp32 masters and buffers keyed as torch keys a wrapped module
        (``"module." + name``); see [Note: boosted model methods].

        Raises:
            NotImplementedError: ``keep_vars=True`` (the masters live on the host).
        """
        if args or keep_vars:
            raise NotImplementedError(
                f"{self._API}.state_dict: positional arguments and keep_vars=True are not "
                f"supported (got {len(args)} positional, keep_vars={keep_vars!r}); the fp32 "
                "masters are not the module's parameters: call state_dict() for their values"
            )
        return with_prefix(self.module.state_dict(), prefix, destination)

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        """torch's ``load_state_dict`` with ``state_dict()``'s keys, into the
        fp32 masters (the next forward uploads them)."""
        own, stray = without_prefix(self._API, state_dict, strict, assign)
        self.load_full_state_dict(own, strict=strict)
        return incompatible(self._facts.dtypes, own, stray)

    def full_state_dict(self, only_rank_0: bool = True) -> dict[str, torch.Tensor]:
        """The fp32 masters and buffers; see [Note: full state format]."""
        return self._facts.export_model(self.module.state_dict())

    def load_full_state_dict(
        self, state_dict: dict[str, torch.Tensor], strict: bool = True
    ) -> None:
        """Load weights by name into the masters (the next forward uploads them).

        Raises:
            KeyError: with ``strict``, a name is missing or unknown.
        """
        if not strict:  # names not given keep their values; unknown ones are left out
            current = self.module.state_dict()
            state_dict = {**current, **{k: v for k, v in state_dict.items() if k in current}}
        self.module.load_state_dict(state_dict)


class AutoOffloadOptimizer(BoostedOptimizer):
    """An ``AMPOptimizer`` (fp32 masters stepped on the host, the fp16 loss
    scaler, clipping) next to an AutoOffloadModel."""

    _API = "AutoOffloadOptimizer"

    def __init__(self, optimizer: Any, model: AutoOffloadModel) -> None:
        super().__init__(optimizer)
        self._model = model
        offload = model.module
        self._names = {id(offload.master_of(p)): n for n, p in offload.model.named_parameters()}

    @property
    def scaler(self) -> Any:
        """The fp16 loss scaler (None in bf16)."""
        return self.optim.grad_scaler

    def backward(self, loss: torch.Tensor, inputs: Any = None, retain_graph: bool = False) -> None:
        """Backward through the planned graph, the loss scaled in fp16.

        Raises:
            NotImplementedError: ``retain_graph=True``, or ``inputs``.
        """
        refuse_backward_inputs(f"{self._API}.backward", inputs)
        if retain_graph:
            raise NotImplementedError(
                f"{self._API}.backward: retain_graph=True is not supported (got True): the "
                "planned graph frees what it offloaded as backward goes; add the losses and "
                "call backward once"
            )
        self.optim.backward(loss)

    def _step(self, closure: Callable[[], Any] | None = None) -> Any:
        return self._step_closure(closure)

    def clip_grad_by_norm(
        self,
        max_norm: float,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = False,
        foreach: bool | None = None,
    ) -> torch.Tensor:
        """AMPOptimizer.clip_grad_norm: the coming step's gradients clipped to
        ``max_norm`` (with the plugin's max_norm, the smaller bound), the norm
        of the unscaled gradients returned (see BoostedOptimizer.clip_grad_by_norm).

        Raises:
            NotImplementedError: ``norm_type`` other than 2.
            RuntimeError: the norm is not finite and ``error_if_nonfinite``.
        """
        api = f"{self._API}.clip_grad_by_norm"
        max_norm, norm_type = check_clip_args(api, max_norm, norm_type, error_if_nonfinite)
        if norm_type != 2.0:
            raise NotImplementedError(
                f"{api}: only the 2-norm is implemented here (got norm_type={norm_type}); "
                "pass norm_type=2.0"
            )
        norm = self.optim.clip_grad_norm(max_norm, 2.0)
        if error_if_nonfinite and not math.isfinite(norm):
            raise RuntimeError(
                f"{api}: the total norm of the gradients is not finite (got {norm}); "
                "pass error_if_nonfinite=False to skip this check"
            )
        return torch.tensor(norm, dtype=torch.float32)

    def _params(self) -> list[torch.Tensor]:
        return [p for g in self.optim.param_groups for p in g["params"]]

    def full_state_dict(self) -> dict[str, Any]:
        """See [Note: full state format]: the masters' states by name."""
        state, groups = positional_to_full(
            self._API, self.optim.optim.state_dict(), self._params(), self._names,
            self._model._facts.shapes,
        )  # fmt: skip
        scaler = self.scaler.state_dict() if self.scaler is not None else None
        return {"state": state, "param_groups": groups, "loss_scaler": scaler}

    def load_full_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load the [Note: full state format] (from any plugin and world size).

        Raises:
            KeyError: the state names a parameter this optimizer lacks.
            ValueError: the state's parameter groups list other parameters than
                this optimizer's (a state of another model); nothing is loaded.
            ValueError: a state tensor's size differs from its parameter's.
        """
        inner = self.optim.optim
        positional = full_to_positional(
            self._API, state_dict, inner.state_dict(), self._params(), self._names, flat=False,
            frozen=frozen_names(self._model.unwrap()),
        )  # fmt: skip
        inner.load_state_dict(positional)
        if self.scaler is not None:
            saved = scaler_state(self.scaler.state_dict(), state_dict.get("loss_scaler"))
            if saved is not None:
                self.scaler.load_state_dict(saved)


class AutoOffloadPlugin(Plugin):
    """Plan which parts of the model leave the device between forward and
    backward so that a training step fits ``memory_budget`` (see
    zerostack-auto-offload), on one device.

    The model is traced on ``example_inputs`` and specialised to their shapes:
    every batch must have them. Build the optimizer on ``model.parameters()``
    before ``boost`` (fused-adam's HybridAdam steps the host masters fastest).

    Args:
        memory_budget: device memory for the step, in GB as ColossalAI's
            (``memory_budget=16`` is 16 * 1024**3 bytes); ``<= 0`` means the
            whole device. Default -1.
        solver_name: "asyn" (uploads prefetched on side streams) or "syn".
            Default "asyn".
        precision: "fp16" (loss scaling) or "bf16". Default "fp16".
        example_inputs: one batch, as ``memory_optimize``'s ``inputs`` (a dict
            of keyword arguments or a tuple of positional ones). Required.
        initial_scale: the fp16 loss scaler's first scale. Default 2**16.
        growth_factor: the scale's growth after growth_interval clean steps. Default 2.
        backoff_factor: the scale's factor after an overflow. Default 0.5.
        growth_interval: clean steps before the scale grows. Default 1000.
        hysteresis: overflows tolerated before backing off. Default 2.
        min_scale: the least scale. Default 1.
        max_scale: the largest scale. Default 2**32.
        max_norm: clip the gradient norm to this; 0 turns clipping off. Default 0.
        profile: a ``HardwareProfile`` (default: measured on the device).
        device: the compute device (default: the current CUDA device; "cpu"
            runs the mechanics on the CPU, with the CPU's measured profile).

    Raises:
        ValueError: an unknown ``solver_name`` or ``precision``, or a negative
            ``max_norm``.
        NotImplementedError (at configure): more than one process (the plan
            is for one device; data parallelism is not built).
    """

    def __init__(
        self,
        memory_budget: float = -1.0,
        solver_name: str = "asyn",
        precision: str = "fp16",
        example_inputs: dict | tuple | None = None,
        initial_scale: float = _SCALER.initial_scale,
        growth_factor: float = _SCALER.growth_factor,
        backoff_factor: float = _SCALER.backoff_factor,
        growth_interval: int = _SCALER.growth_interval,
        hysteresis: int = _SCALER.hysteresis,
        min_scale: float = _SCALER.min_scale,
        max_scale: float = _SCALER.max_scale,
        max_norm: float = 0.0,
        profile: Any = None,
        device: torch.device | str | None = None,
    ) -> None:
        if solver_name not in _SOLVERS:
            raise ValueError(f"{_API}: solver_name must be one of {_SOLVERS} (got {solver_name!r})")
        if precision not in _PRECISIONS:
            raise ValueError(f"{_API}: precision must be one of {_PRECISIONS} (got {precision!r})")
        check_max_norm(_API, max_norm)
        self.memory_budget = memory_budget
        self.solver_name = solver_name
        self.precision = precision
        self.example_inputs = example_inputs
        self.max_norm = max_norm
        self.profile = profile
        self.device = device
        arguments = locals()
        self.scaler_kwargs: dict[str, Any] = {name: arguments[name] for name in SCALER_KEYS}

    def supported_precisions(self) -> list[str]:
        return list(_PRECISIONS)

    def control_precision(self) -> bool:
        return True

    def configure(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        criterion: Callable | None = None,
        dataloader: Any | None = None,
        lr_scheduler: Any | None = None,
    ) -> tuple[ModelWrapper, AutoOffloadOptimizer | None, Callable | None, Any, Any]:
        """Trace, plan and rewrite ``model``; wrap ``optimizer`` in an AMPOptimizer.

        Raises:
            ValueError: no ``example_inputs`` were given to the plugin.
            NotImplementedError: more than one process.
            MemoryBudgetError: no plan fits the budget (its message states
                the least budget that works).
        """
        from zerostack.auto_offload import AMPOptimizer, memory_optimize

        _, world = rank_and_world()
        if world > 1:
            raise NotImplementedError(
                f"{_API}: {world} processes; the offload plan is for one device and data "
                "parallelism over it is not built (use GeminiPlugin for several GPUs)"
            )
        if self.example_inputs is None:
            raise ValueError(
                f"{_API}: example_inputs is required: one batch as a dict of keyword "
                "arguments or a tuple of positional ones (the model is traced on it)"
            )
        _refuse_hooks(f"{_API}.configure", model, "the model's submodules")
        facts = ModelFacts.of(model)
        budget = self.memory_budget * 1024**3 if self.memory_budget > 0 else -1.0
        offload = memory_optimize(
            model, self.example_inputs, budget, self.solver_name, precision=self.precision,
            profile=self.profile, device=self.device,
        )  # fmt: skip
        wrapped = AutoOffloadModel(offload, facts)
        boosted = None
        if optimizer is not None:
            amp = AMPOptimizer(
                optimizer, offload, clipping_norm=self.max_norm, **self.scaler_kwargs
            )
            boosted = AutoOffloadOptimizer(amp, wrapped)
            attach_scheduler(lr_scheduler, boosted, optimizer)
        return wrapped, boosted, criterion, dataloader, lr_scheduler


def _refuse_hooks(api: str, root: nn.Module, where: str) -> None:
    """Forward hooks below the root never run: the model is traced into one
    graph that calls no submodule."""
    for name, m in root.named_modules():
        if m is not root and (m._forward_hooks or m._forward_pre_hooks):
            raise NotImplementedError(
                f"{api}: forward hooks on {where} do not run under AutoOffloadPlugin (got a hook "
                f"on {name!r}): the model is traced into one graph; register the hook on the "
                "boosted model itself, or use another plugin"
            )
