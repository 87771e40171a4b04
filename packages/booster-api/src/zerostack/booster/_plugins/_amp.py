"""Booster(mixed_precision="fp16"/"bf16"): torch.autocast around forward and
the criterion, and torch.amp.GradScaler for fp16 (ColossalAI's
FP16TorchMixedPrecision), for plugins that leave precision to the Booster
(no plugin, TorchDDPPlugin)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

_API = "Booster"
_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
# ColossalAI's other names: valid there, not built here.
_NOT_BUILT = ("fp16_apex", "fp16_naive", "fp8")


class MixedPrecision:
    """Automatic mixed precision: parameters stay fp32, forward and the
    criterion run under ``torch.autocast(dtype)``, and fp16 losses are
    scaled by a ``torch.amp.GradScaler`` (steps with inf/nan gradients are
    skipped and the scale backs off).

    Args:
        precision: "fp16" or "bf16".
        **scaler_kwargs: fp16: torch.amp.GradScaler's init_scale,
            growth_factor, backoff_factor, growth_interval (its defaults).

    Raises:
        ValueError: an unknown precision.
        NotImplementedError: one of ColossalAI's other precisions.
        TypeError: scaler keywords with "bf16".
    """

    def __init__(self, precision: str, **scaler_kwargs: Any) -> None:
        self.precision = check_precision(precision)
        self.dtype = _DTYPES[precision]
        if scaler_kwargs and precision != "fp16":
            raise TypeError(
                f"{_API}: GradScaler arguments are for fp16 (got {sorted(scaler_kwargs)} with "
                f"{precision!r}); bf16 needs no loss scaling"
            )
        self.scaler_kwargs = scaler_kwargs

    def configure(self, model: Any, optimizer: Any, criterion: Callable | None) -> tuple:
        """Turn autocast on in ``model`` (a TorchDDPModel) and the GradScaler
        in ``optimizer`` (a TorchDDPOptimizer); wrap ``criterion``."""
        device_type = model.device_type
        model.autocast_dtype = self.dtype
        if optimizer is not None and self.precision == "fp16":
            optimizer.scaler = torch.amp.GradScaler(device_type, **self.scaler_kwargs)
        if criterion is not None:
            criterion = AutocastCriterion(criterion, device_type, self.dtype)
        return model, optimizer, criterion

    def __repr__(self) -> str:
        return f"MixedPrecision({self.precision!r})"


class FP16TorchMixedPrecision(MixedPrecision):
    """ColossalAI's ``FP16TorchMixedPrecision`` (``colossalai.booster.mixed_precision``):
    ``MixedPrecision("fp16")`` with the GradScaler's settings, for
    ``Booster(mixed_precision=FP16TorchMixedPrecision(...))``.

    Args:
        init_scale: the first loss scale. Default 2**16.
        growth_factor: the scale's growth after ``growth_interval`` finite
            steps. Default 2.0.
        backoff_factor: the scale's factor after an inf/nan step. Default 0.5.
        growth_interval: finite steps between growths. Default 2000.
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
    ) -> None:
        super().__init__(
            "fp16", init_scale=init_scale, growth_factor=growth_factor,
            backoff_factor=backoff_factor, growth_interval=growth_interval,
        )  # fmt: skip


class BF16MixedPrecision(MixedPrecision):
    """ColossalAI's ``BF16MixedPrecision``: ``MixedPrecision("bf16")``."""

    def __init__(self) -> None:
        super().__init__("bf16")


class AutocastCriterion:
    """``criterion`` called under ``torch.autocast``."""

    def __init__(self, criterion: Callable, device_type: str, dtype: torch.dtype) -> None:
        self.criterion, self.device_type, self.dtype = criterion, device_type, dtype

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with torch.autocast(self.device_type, dtype=self.dtype):
            return self.criterion(*args, **kwargs)


def check_precision(precision: object) -> str:
    """``precision`` if it is "fp16" or "bf16".

    Raises:
        TypeError: not a string.
        NotImplementedError: "fp16_apex", "fp16_naive" or "fp8".
        ValueError: another string.
    """
    if not isinstance(precision, str):
        raise TypeError(
            f"{_API}: mixed_precision must be 'fp16', 'bf16' or None (got "
            f"{type(precision).__name__}); pass a string or a MixedPrecision"
        )
    if precision in _NOT_BUILT:
        raise NotImplementedError(
            f"{_API}: mixed_precision={precision!r} is not implemented; use 'fp16' "
            "(torch.amp) or 'bf16'"
        )
    if precision not in _DTYPES:
        raise ValueError(
            f"{_API}: mixed_precision must be 'fp16' or 'bf16' (got {precision!r}); "
            "fp32 training needs no mixed_precision"
        )
    return precision
