"""Dev-only test helpers for zerostack: never a runtime dependency of a package."""

from zerostack.testing.__about__ import __version__
from zerostack.testing._model import GPTConfig, TinyGPT, make_batch, num_parameters
from zerostack.testing._spawn import SpawnError, spawn
from zerostack.testing._tolerance import (
    assert_close,
    loss_tolerance,
    tolerance,
    training_tolerance,
)

__all__ = [
    "GPTConfig",
    "SpawnError",
    "TinyGPT",
    "__version__",
    "assert_close",
    "loss_tolerance",
    "make_batch",
    "num_parameters",
    "spawn",
    "tolerance",
    "training_tolerance",
]
