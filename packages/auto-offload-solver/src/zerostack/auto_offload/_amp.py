"""AMPOptimizer: loss scaling, clipping and the CPU step of the fp32 masters."""

from __future__ import annotations

import logging
import math

import torch

from zerostack.auto_offload._module import BaseOffloadModule
from zerostack.shard import (
    SCALER_KEYS,
    DynamicLossScaler,
    LossScalerConfig,
    check_max_norm,
    make_loss_scaler,
    plan_step,
    step_with_div_scale,
)

logger = logging.getLogger(__name__)

_SCALER = LossScalerConfig()  # the loss scaler's defaults (ColossalAI's, as its AMPOptimizer)


class AMPOptimizer:
    """Steps the fp32 masters of a :class:`BaseOffloadModule` on the CPU.

    ``optimizer`` may be built on ``module.master_parameters()`` or on the
    model's parameters (``module.parameters()`` or ``module.model.parameters()``,
    as ColossalAI did); the latter are swapped for their masters, states
    included. With fused-adam's ``HybridAdam``/``CPUAdam`` the step reads the
    half-precision gradients as they came back, divides by the loss scale and
    the clipping factor inside the kernel, and writes the half copy that the
    next forward uploads in the same pass. fp16 uses zero-shard's
    ``DynamicLossScaler`` (a step with an inf/nan gradient is skipped and the
    scale backs off); bf16 needs no scaling. See zero-shard's
    [Note: overflow policy].

    Args:
        optimizer: a torch optimizer (fused-adam's for speed).
        module: the offloaded module.
        initial_scale: the fp16 loss scaler's first scale. Default 2**16.
        growth_factor: the scale's growth after growth_interval clean steps. Default 2.
        backoff_factor: the scale's factor after an overflow. Default 0.5.
        growth_interval: clean steps before the scale grows. Default 1000.
        hysteresis: overflows tolerated before backing off. Default 2.
        min_scale: the least scale. Default 1.
        max_scale: the largest scale. Default 2**32. (The scaler's arguments
            are warned about and unused in bf16.)
        clipping_norm: clip the global gradient L2 norm to this; 0 turns it
            off. Default 0.
        norm_type: only 2.0 is supported. Default 2.0.

    Raises:
        NotImplementedError: ``norm_type`` other than 2.
        ValueError: a parameter of ``optimizer`` that is not the module's, or
            a negative ``clipping_norm``.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        module: BaseOffloadModule,
        initial_scale: float = _SCALER.initial_scale,
        growth_factor: float = _SCALER.growth_factor,
        backoff_factor: float = _SCALER.backoff_factor,
        growth_interval: int = _SCALER.growth_interval,
        hysteresis: int = _SCALER.hysteresis,
        min_scale: float = _SCALER.min_scale,
        max_scale: float = _SCALER.max_scale,
        clipping_norm: float = 0.0,
        norm_type: float = 2.0,
    ) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"AMPOptimizer: optimizer must be a torch.optim.Optimizer (got "
                f"{type(optimizer).__name__}); build it on module.parameters()"
            )
        if not isinstance(module, BaseOffloadModule):
            raise TypeError(
                f"AMPOptimizer: module must be the BaseOffloadModule memory_optimize returned "
                f"(got {type(module).__name__})"
            )
        check_max_norm("AMPOptimizer", clipping_norm, "clipping_norm")
        if norm_type != 2.0:
            raise NotImplementedError(f"AMPOptimizer: norm_type must be 2.0 (got {norm_type})")
        self.optim = optimizer
        self.module = module
        self.max_norm = float(clipping_norm)
        arguments = locals()
        given = {name: arguments[name] for name in SCALER_KEYS}
        fp16 = module.dtype == torch.float16
        kwargs = given if fp16 else {k: v for k, v in given.items() if v != getattr(_SCALER, k)}
        self.grad_scaler: DynamicLossScaler | None = make_loss_scaler(
            "AMPOptimizer", fp16, None, kwargs
        )
        self._bind_masters()
        self.last_grad_norm = 0.0
        self._clip_once: float | None = None  # clip_grad_norm's bound for the coming step

    def _bind_masters(self) -> None:
        masters = {id(m): m for m in self.module.master_parameters()}
        by_model = {id(p): self.module.master_of(p) for r in self.module.regions for p in r.params}
        # (master, its gradient in the host buffer or None, its half copy)
        self._views: list[tuple[torch.nn.Parameter, torch.Tensor | None, torch.Tensor]] = []
        for group in self.optim.param_groups:
            swapped = []
            for p in group["params"]:
                m = masters.get(id(p))
                m = by_model.get(id(p)) if m is None else m
                if m is None:
                    raise ValueError(
                        f"AMPOptimizer: the optimizer holds a tensor of shape {tuple(p.shape)} "
                        "that is not a parameter of the offloaded module; build it on "
                        "module.master_parameters() or module.parameters()"
                    )
                if m is not p and p in self.optim.state:
                    self.optim.state[m] = self.optim.state.pop(p)
                swapped.append(m)
            group["params"] = swapped
        has_copy_out = hasattr(self.optim, "set_copy_out")
        for region in self.module.regions:
            for p in region.params:
                begin, end = region.param_to_range[p]
                m = self.module.master_of(p)
                half = region.cpu_half[begin:end].view(p.shape)
                gets_grad = any(p is q for q in region.grad_params)
                grad = region.cpu_grad[begin:end].view(p.shape) if gets_grad else None
                self._views.append((m, grad, half))
                if has_copy_out and any(
                    m is q for g in self.optim.param_groups for q in g["params"]
                ):
                    self.optim.set_copy_out(m, half)  # type: ignore[attr-defined]
        self._copy_out = has_copy_out

    # -- the step ------------------------------------------------------------

    @property
    def loss_scale(self) -> float:
        """The current fp16 loss scale (1 in bf16)."""
        return self.grad_scaler.scale if self.grad_scaler is not None else 1.0

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of ``loss`` times the loss scale, through the module."""
        self.module.backward(loss * self.loss_scale if self.grad_scaler is not None else loss)

    def zero_grad(self, *args, **kwargs) -> None:
        """Forget the last gradients (they live in the regions' host buffers)."""
        self._clip_once = None
        self.module.zero_grad()
        self.optim.zero_grad(set_to_none=True)

    def clip_grad_norm(self, max_norm: float, norm_type: float = 2.0) -> float:
        """Clip the coming step's gradients to ``max_norm`` (folded into the
        step's division, so nothing is rewritten now) and return the current
        global norm of the unscaled gradients (one host read).

        Raises:
            NotImplementedError: ``norm_type`` other than 2.
        """
        if norm_type != 2.0:
            raise NotImplementedError(
                f"AMPOptimizer.clip_grad_norm: norm_type must be 2.0 (got {norm_type})"
            )
        # This step only, as torch's clip_grad_norm_ on this backward's
        # gradients; clipping_norm, if any, then clips what is left: together
        # the smaller of the two bounds.
        self._clip_once = float(max_norm)
        norm_sq = float(self.module.grad_norm_sq())
        return math.sqrt(norm_sq) / self.loss_scale if math.isfinite(norm_sq) else norm_sq

    def step(self, *args, **kwargs):
        """Update the masters from the last backward's gradients (skipped on an
        fp16 overflow) and refresh the half copies for the next upload.

        Returns:
            The inner optimizer's return value, or None when skipped.
        """
        if not self.module.grads_ready:
            raise RuntimeError(
                "AMPOptimizer.step: no gradients since the last step or zero_grad(); call "
                "AMPOptimizer.backward(loss) first"
            )
        # A forward since the backward (an evaluation) left regions on the
        # device with the old values: the next forward must upload the new.
        self.module.runtime.finish()
        norm_sq = float(self.module.grad_norm_sq())  # the step's one host read
        max_norm = self.max_norm
        if self._clip_once is not None:
            max_norm = self._clip_once if not max_norm else min(max_norm, self._clip_once)
        plan = plan_step("AMPOptimizer", norm_sq, self.grad_scaler, max_norm)
        self.last_grad_norm = plan.grad_norm
        if plan.skip:
            self.zero_grad()
            return None
        for master, grad, _ in self._views:
            # fused-adam's kernels read the half-precision gradient as it is;
            # torch's Adam refuses a gradient of another dtype than its param.
            if grad is not None and not self._copy_out and grad.dtype != master.dtype:
                grad = grad.to(master.dtype)
            master.grad = grad
        with torch.profiler.record_function("zerostack::cpu_update"):
            ret = step_with_div_scale(self.optim, plan.div_scale)
        # fused-adam's kernels wrote the half copies (copy-out): only what a
        # step hook wrote is copied now; any other optimizer's step, all of
        # them (it may write through p.data, which moves no version counter).
        # See BaseOffloadModule's [Note: half copies follow the masters].
        self.module.sync_halves(every_region=not self._copy_out)
        for master, _, _ in self._views:
            master.grad = None
        self.zero_grad()
        return ret

    # -- state ---------------------------------------------------------------

    @property
    def param_groups(self):
        return self.optim.param_groups

    def state_dict(self) -> dict:
        """The inner optimizer's state and the loss scaler's."""
        return {
            "optimizer": self.optim.state_dict(),
            "loss_scaler": self.grad_scaler.state_dict() if self.grad_scaler else None,
        }

    def load_state_dict(self, state: dict) -> None:
        """Load what :meth:`state_dict` returned."""
        self.optim.load_state_dict(state["optimizer"])
        if self.grad_scaler is not None and state.get("loss_scaler") is not None:
            self.grad_scaler.load_state_dict(state["loss_scaler"])
