"""zerostack's Booster: one call that wraps a model, optimizer, dataloader and
scheduler for a plugin (DDP, ZeRO-1/2, Gemini), and checkpoints that move
between plugins and world sizes."""

from zerostack.booster.__about__ import __version__
from zerostack.booster._checkpoint import CheckpointIO
from zerostack.booster._checkpoint_files import CheckpointCorruptError
from zerostack.booster._interface import ModelWrapper, OptimizerWrapper

__all__ = [
    "CheckpointCorruptError",
    "CheckpointIO",
    "ModelWrapper",
    "OptimizerWrapper",
    "__version__",
]
