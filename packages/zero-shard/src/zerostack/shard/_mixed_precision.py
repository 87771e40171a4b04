"""The mixed-precision step every ZeRO stage shares: the loss scaler, the
decision taken from the all-reduced gradient statistics, and ``div_scale``
applied to optimizers that lack it.

[Note: overflow policy] Only the fp16 loss scaler skips steps. With an fp16
scaler a non-finite global gradient norm is an overflow: the step is skipped
and the scale backs off (torch.amp.GradScaler, DeepSpeed and ColossalAI do
the same). bf16 and fp32 gradients are applied as they are, inf/nan
included, as torch's optimizers, DDP and FSDP apply them (and ColossalAI's
bf16 paths): no scale can be at fault there, and skipping would hide the
problem. A warning names the non-finite norm either way. ZeroOptimizer and
GeminiOptimizer both decide through ``plan_step``.
"""

from __future__ import annotations

import functools
import inspect
import logging
import math
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from zerostack.shard._clip import clip_coefficient
from zerostack.shard._loss_scaler import SCALER_KEYS, DynamicLossScaler

logger = logging.getLogger(__name__)


def make_loss_scaler(
    api: str, fp16: bool, loss_scaler: DynamicLossScaler | None, scaler_kwargs: dict[str, Any]
) -> DynamicLossScaler | None:
    """The fp16 loss scaler of a wrapper: ``loss_scaler`` as given, or one built
    from ColossalAI's keyword names (``initial_scale``, ``min_scale``, ...);
    None for bf16/fp32 models (which need none).

    Raises:
        TypeError: an unknown scaler keyword, or both an instance and keywords.
    """
    unknown = sorted(set(scaler_kwargs) - set(SCALER_KEYS))
    if unknown:
        raise TypeError(
            f"{api}: unknown keyword arguments {unknown}; the loss scaler takes "
            f"{', '.join(SCALER_KEYS)}"
        )
    if loss_scaler is not None and not isinstance(loss_scaler, DynamicLossScaler):
        raise TypeError(
            f"{api}: loss_scaler must be a DynamicLossScaler or None (got "
            f"{type(loss_scaler).__name__}); for a fixed scale pass initial_scale="
        )
    if loss_scaler is not None and scaler_kwargs:
        raise TypeError(
            f"{api}: pass either loss_scaler or its keyword arguments (got both: "
            f"{sorted(scaler_kwargs)}); set them on the DynamicLossScaler"
        )
    if not fp16:
        if loss_scaler is not None or scaler_kwargs:
            warnings.warn(
                f"{api}: the loss scaler has no effect without fp16 parameters (got "
                f"{'loss_scaler' if loss_scaler is not None else sorted(scaler_kwargs)}); "
                "bf16 and fp32 need no loss scaling",
                UserWarning,
                stacklevel=3,
            )
        return None
    return loss_scaler if loss_scaler is not None else DynamicLossScaler(**scaler_kwargs)


@dataclass(frozen=True, slots=True)
class StepPlan:
    """What one optimizer step does, decided from the global gradient statistics."""

    skip: bool
    """The step is skipped (fp16 overflow, see [Note: overflow policy])."""
    grad_norm: float
    """The global L2 norm of the unscaled gradients (inf/nan when non-finite)."""
    div_scale: float
    """Divide every gradient by this before the update (loss scale and
    clipping together); -1.0 when there is nothing to divide."""


def plan_step(
    api: str,
    norm_sq: float,
    scaler: DynamicLossScaler | None,
    max_norm: float,
    clip: float = 1.0,
) -> StepPlan:
    """Turn the all-reduced squared gradient norm (of the scaled gradients)
    into the step's plan, and update the loss scaler. ``clip``: the
    coefficient ``clip_grad_by_norm`` recorded since the last step, which
    ``max_norm`` clips after (see [Note: gradient clipping]). See [Note:
    overflow policy]."""
    scale = scaler.scale if scaler is not None else 1.0
    finite = math.isfinite(norm_sq)
    grad_norm = math.sqrt(norm_sq) / scale if finite else norm_sq
    if scaler is not None:
        scaler.update(not finite)
        if not finite:
            logger.warning(
                "%s: gradient overflow (norm %s), step skipped; loss scale now %s",
                api, norm_sq, scaler.scale,
            )  # fmt: skip
            return StepPlan(skip=True, grad_norm=grad_norm, div_scale=-1.0)
    elif not finite:
        logger.warning(
            "%s: the gradient norm is %s; applied as torch's optimizers would (only fp16 "
            "loss scaling skips steps)", api, norm_sq,
        )  # fmt: skip
    combined = clip * clip_coefficient(grad_norm * clip, max_norm) / scale
    return StepPlan(
        skip=False, grad_norm=grad_norm, div_scale=1.0 / combined if combined != 1.0 else -1.0
    )


_TAKES_DIV_SCALE: dict[type, bool] = {}


def takes_div_scale(optimizer: torch.optim.Optimizer) -> bool:
    """True when ``optimizer.step`` divides gradients itself (fused-adam's)."""
    kind = type(optimizer)
    if kind not in _TAKES_DIV_SCALE:
        # The class's step: an instance's may be a wrapper (an lr scheduler's, ZeroOptimizer's).
        _TAKES_DIV_SCALE[kind] = "div_scale" in inspect.signature(kind.step).parameters
    return _TAKES_DIV_SCALE[kind]


def step_with_div_scale(
    optimizer: torch.optim.Optimizer, div_scale: float, *, hooks: bool = True
) -> None:
    """``optimizer.step()`` on gradients divided by ``div_scale`` (-1: as they
    are): passed through where the optimizer takes it, else the gradients
    are divided in place first (one foreach call). ``hooks=False`` steps
    through the class's step without torch's hook wrapper: an inner step of
    a wrapper whose own ``step()`` runs the hooks (zerostack.shard's [Note:
    the user's step hooks])."""
    step: Any = optimizer.step if hooks else functools.partial(unhooked_step(optimizer), optimizer)
    if takes_div_scale(optimizer):
        step(div_scale=div_scale)
        return
    if div_scale > 0:
        params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        for p in params:
            # fp16/bf16 gradients of fp32 masters: scaled in fp32, since the
            # factor (clip / loss scale, ~1e-6) rounds badly or to 0 in fp16.
            if p.grad.dtype != p.dtype and p.grad.dtype.itemsize < p.dtype.itemsize:
                p.grad = p.grad.to(p.dtype)
        if params:
            torch._foreach_mul_([p.grad for p in params], 1.0 / div_scale)
    step()


def unhooked_step(optimizer: torch.optim.Optimizer) -> Any:
    """The class's ``step`` function without the wrapper torch puts around it
    at construction (``Optimizer.profile_hook_step``: the global and the
    instance's step hooks, a profiler range); the class's own where there
    is no such wrapper."""
    step: Any = type(optimizer).step
    return step.__wrapped__ if getattr(step, "hooked", False) else step
