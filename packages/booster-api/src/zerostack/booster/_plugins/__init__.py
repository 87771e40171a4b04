"""The plugins: one private module each (see zerostack.booster for the public names)."""

from zerostack.booster._plugins._amp import (
    BF16MixedPrecision,
    FP16TorchMixedPrecision,
    MixedPrecision,
)
from zerostack.booster._plugins._auto_offload import (
    AutoOffloadModel,
    AutoOffloadOptimizer,
    AutoOffloadPlugin,
)
from zerostack.booster._plugins._base import Plugin
from zerostack.booster._plugins._deepspeed import DeepSpeedConfigError
from zerostack.booster._plugins._gemini import GeminiModel, GeminiOptimizerWrapper, GeminiPlugin
from zerostack.booster._plugins._low_level_zero import (
    LowLevelZeroModel,
    LowLevelZeroOptimizer,
    LowLevelZeroPlugin,
)
from zerostack.booster._plugins._torch_ddp import (
    DefaultPlugin,
    TorchDDPModel,
    TorchDDPOptimizer,
    TorchDDPPlugin,
)

__all__ = [
    "AutoOffloadModel",
    "AutoOffloadOptimizer",
    "AutoOffloadPlugin",
    "BF16MixedPrecision",
    "DeepSpeedConfigError",
    "DefaultPlugin",
    "FP16TorchMixedPrecision",
    "GeminiModel",
    "GeminiOptimizerWrapper",
    "GeminiPlugin",
    "LowLevelZeroModel",
    "LowLevelZeroOptimizer",
    "LowLevelZeroPlugin",
    "MixedPrecision",
    "Plugin",
    "TorchDDPModel",
    "TorchDDPOptimizer",
    "TorchDDPPlugin",
]
