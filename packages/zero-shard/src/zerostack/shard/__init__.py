"""ZeRO stage 1/2 and the sharding numerics every ZeRO stage shares."""

from zerostack.shard.__about__ import __version__
from zerostack.shard._clip import clip_coefficient, grad_stats
from zerostack.shard._gc import CollectorSchedule
from zerostack.shard._hyper import hyperparameters, mark_stepped, stepping_twin
from zerostack.shard._loss_scaler import DynamicLossScaler
from zerostack.shard._mixed_precision import (
    StepPlan,
    make_loss_scaler,
    plan_step,
    step_with_div_scale,
    takes_div_scale,
)
from zerostack.shard._optimizer import ZeroOptimizer
from zerostack.shard._partition import shard_bounds, shard_numel

__all__ = [
    "CollectorSchedule",
    "DynamicLossScaler",
    "StepPlan",
    "ZeroOptimizer",
    "__version__",
    "clip_coefficient",
    "grad_stats",
    "hyperparameters",
    "make_loss_scaler",
    "mark_stepped",
    "plan_step",
    "shard_bounds",
    "shard_numel",
    "step_with_div_scale",
    "stepping_twin",
    "takes_div_scale",
]
