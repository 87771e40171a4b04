"""DynamicLossScaler: fp16 loss scaling with hysteresis (bf16/fp32 need none)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(kw_only=True, slots=True)
class DynamicLossScaler:
    """Scale the loss so fp16 gradients do not underflow; back off on overflow.

    The defaults are the project's defaults everywhere.
    """

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

    def __post_init__(self) -> None:
        def bad(field: str, value: object, rule: str) -> ValueError:
            return ValueError(f"DynamicLossScaler: {field} {rule} (got {value!r})")

        for name in ("initial_scale", "min_scale", "growth_factor", "backoff_factor", "max_scale"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise TypeError(f"DynamicLossScaler: {name} must be a number (got {value!r})")
        for name in ("growth_interval", "hysteresis"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"DynamicLossScaler: {name} must be an int (got {value!r})")
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
        self.scale = float(self.initial_scale)
        self._clean_steps = 0
        self._hysteresis_left = self.hysteresis

    scale: float = field(init=False, default=0.0)
    """The current scale (starts at initial_scale)."""
    _clean_steps: int = field(init=False, default=0)
    _hysteresis_left: int = field(init=False, default=0)

    def update(self, found_inf: bool) -> None:
        """After a step: back off on overflow (after hysteresis), grow after
        ``growth_interval`` clean steps."""
        if found_inf:
            self._clean_steps = 0
            self._hysteresis_left -= 1
            if self._hysteresis_left <= 0:
                self.scale = max(self.min_scale, self.scale * self.backoff_factor)
            return
        self._clean_steps += 1
        if self._clean_steps >= self.growth_interval:
            self._clean_steps = 0
            self._hysteresis_left = self.hysteresis
            self.scale = min(self.max_scale, self.scale * self.growth_factor)

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
