"""zerostack's Booster: one call that wraps a model, optimizer, dataloader and
scheduler for a plugin (DDP, ZeRO-1/2, Gemini, auto-offload), and checkpoints that move
between plugins and world sizes."""

from zerostack.booster.__about__ import __version__
from zerostack.booster._booster import Booster
from zerostack.booster._checkpoint import CheckpointIO
from zerostack.booster._checkpoint_errors import CheckpointCorruptError, CheckpointSaveError
from zerostack.booster._interface import ModelWrapper, OptimizerWrapper
from zerostack.booster._launch import launch, launch_from_torch
from zerostack.booster._plugins import (
    AutoOffloadModel,
    AutoOffloadOptimizer,
    AutoOffloadPlugin,
    BF16MixedPrecision,
    DeepSpeedConfigError,
    FP16TorchMixedPrecision,
    GeminiModel,
    GeminiOptimizerWrapper,
    GeminiPlugin,
    LowLevelZeroModel,
    LowLevelZeroOptimizer,
    LowLevelZeroPlugin,
    MixedPrecision,
    Plugin,
    TorchDDPModel,
    TorchDDPOptimizer,
    TorchDDPPlugin,
)
from zerostack.chunk import ColoInitContext, LazyInitContext

__all__ = [
    "AutoOffloadModel",
    "AutoOffloadOptimizer",
    "AutoOffloadPlugin",
    "BF16MixedPrecision",
    "Booster",
    "CheckpointCorruptError",
    "CheckpointIO",
    "CheckpointSaveError",
    "ColoInitContext",
    "DeepSpeedConfigError",
    "FP16TorchMixedPrecision",
    "GeminiModel",
    "GeminiOptimizerWrapper",
    "GeminiPlugin",
    "LazyInitContext",
    "LowLevelZeroModel",
    "LowLevelZeroOptimizer",
    "LowLevelZeroPlugin",
    "MixedPrecision",
    "ModelWrapper",
    "OptimizerWrapper",
    "Plugin",
    "TorchDDPModel",
    "TorchDDPOptimizer",
    "TorchDDPPlugin",
    "__version__",
    "launch",
    "launch_from_torch",
]
