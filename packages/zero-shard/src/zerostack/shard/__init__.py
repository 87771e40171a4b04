"""ZeRO stage 1/2 and the sharding numerics every ZeRO stage shares."""

from zerostack.shard.__about__ import __version__
from zerostack.shard._clip import clip_coefficient, grad_stats
from zerostack.shard._loss_scaler import DynamicLossScaler
from zerostack.shard._optimizer import ZeroOptimizer
from zerostack.shard._partition import rank_and_world, shard_bounds, shard_numel

__all__ = [
    "DynamicLossScaler",
    "ZeroOptimizer",
    "__version__",
    "clip_coefficient",
    "grad_stats",
    "rank_and_world",
    "shard_bounds",
    "shard_numel",
]
