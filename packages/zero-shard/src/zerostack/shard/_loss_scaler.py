"""DynamicLossScaler: fp16 loss scaling with hysteresis (bf16/fp32 need none)."""

from __future__ import annotations

import math
from dataclasses import InitVar, dataclass, fields, replace
from typing import Any

_API = "DynamicLossScaler"


@dataclass(frozen=True, kw_only=True, slots=True)
class LossScalerConfig:
    """The settings of the fp16 loss scaler, under ColossalAI's names; the one
    place their defaults live (wrappers and plugins build it)."""

    initial_scale: float = 2.0**16
    """Starting scale. Default 2**16."""
    min_scale: float = 1.0
    """Never below this. Default 1."""
    growth_factor: float = 2.0
    """Multiplier after ``growth_interval`` clean steps. Default 2."""
    backoff_factor: float = 0.5
    """Multiplier on overflow (once hysteresis is used up). Default 0.5."""
    growth_interval: int = 1000
    """Clean steps before growing. Default 1000."""
    hysteresis: int = 2
    """Overflows tolerated before backing off. Default 2."""
    max_scale: float = 2.0**32
    """Never above this. Default 2**32."""
    api: InitVar[str] = _API
    """The name errors begin with (a plugin passes its own). Not a setting."""

    def __post_init__(self, api: str) -> None:
        def bad(field: str, value: object, rule: str) -> ValueError:
            return ValueError(f"{api}: {field} {rule} (got {value!r})")

        for name in ("initial_scale", "min_scale", "growth_factor", "backoff_factor", "max_scale"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise TypeError(f"{api}: {name} must be a number (got {value!r})")
        for name in ("growth_interval", "hysteresis"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{api}: {name} must be an int (got {value!r})")
        if not self.min_scale > 0:
            raise bad("min_scale", self.min_scale, "must be > 0")
        if not self.min_scale <= self.initial_scale <= self.max_scale:
            raise bad("initial_scale", self.initial_scale, "must lie in [min_scale, max_scale]")
        if not self.growth_factor > 1:
            raise bad("growth_factor", self.growth_factor, "must be > 1")
        if not 0 < self.backoff_factor < 1:
            raise bad("backoff_factor", self.backoff_factor, "must be in (0, 1)")
        if self.growth_interval < 1:
            raise bad("growth_interval", self.growth_interval, "must be >= 1")
        if self.hysteresis < 1:
            raise bad("hysteresis", self.hysteresis, "must be >= 1")


# The loss scaler's keyword arguments (ColossalAI's names), in one place.
SCALER_KEYS: tuple[str, ...] = tuple(f.name for f in fields(LossScalerConfig))


class DynamicLossScaler:
    """Scale the loss so fp16 gradients do not underflow; back off on overflow.

    Args:
        config: the settings. Default None: built from ``settings``.
        **settings: LossScalerConfig's fields (``initial_scale``, ...), read
            back as this object's attributes; one assigned replaces
            ``config`` (checked, from the next ``update``).

    Raises:
        TypeError: ``config`` and keywords together, an unknown keyword or a
            value of the wrong type.
        ValueError: a value LossScalerConfig refuses.
    """

    __slots__ = ("_clean_steps", "_hysteresis_left", "config", "scale")

    def __init__(self, *, config: LossScalerConfig | None = None, **settings: Any) -> None:
        if config is not None and (settings or not isinstance(config, LossScalerConfig)):
            raise TypeError(
                f"{_API}: pass a LossScalerConfig or its keyword arguments (got "
                f"{type(config).__name__} and {sorted(settings)})"
            )
        self.config = config if config is not None else LossScalerConfig(**settings)
        self.scale = float(self.config.initial_scale)  # the current scale
        self._clean_steps = 0
        self._hysteresis_left = self.config.hysteresis

    def __getattr__(self, name: str) -> Any:
        if name in SCALER_KEYS:
            return getattr(self.config, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        # A setting assigned (``scaler.growth_interval = 100``) takes effect
        # from the next update, checked as the constructor checks it.
        if name in SCALER_KEYS:
            object.__setattr__(self, "config", replace(self.config, **{name: value}))
        else:
            object.__setattr__(self, name, value)

    def __repr__(self) -> str:
        return f"DynamicLossScaler(scale={self.scale}, {self.config})"

    def update(self, found_inf: bool) -> None:
        """After a step: back off on overflow (after hysteresis), grow after
        ``growth_interval`` clean steps."""
        c = self.config
        if found_inf:
            self._clean_steps = 0
            self._hysteresis_left -= 1
            if self._hysteresis_left <= 0:
                self.scale = max(c.min_scale, self.scale * c.backoff_factor)
            return
        self._clean_steps += 1
        if self._clean_steps >= c.growth_interval:
            self._clean_steps = 0
            self._hysteresis_left = c.hysteresis
            self.scale = min(c.max_scale, self.scale * c.growth_factor)

    def state_dict(self) -> dict:
        return {
            "scale": self.scale,
            "clean_steps": self._clean_steps,
            "hysteresis_left": self._hysteresis_left,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore ``state_dict()`` output.

        Raises:
            ValueError: keys are missing, or the scale is not a finite number > 0.
        """
        keys = {"scale", "clean_steps", "hysteresis_left"}
        if not isinstance(state, dict) or not keys <= state.keys():
            got = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise ValueError(
                f"DynamicLossScaler.load_state_dict: state must hold {sorted(keys)} (got {got})"
            )
        scale = state["scale"]
        if not isinstance(scale, int | float) or not 0 < scale < math.inf:
            raise ValueError(
                f"DynamicLossScaler.load_state_dict: scale must be a finite number > 0 (got {scale!r})"
            )
        self.scale = float(state["scale"])
        self._clean_steps = int(state["clean_steps"])
        self._hysteresis_left = int(state["hysteresis_left"])
