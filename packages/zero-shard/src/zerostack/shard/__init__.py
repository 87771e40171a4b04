"""ZeRO stage 1/2 and the sharding numerics every ZeRO stage shares."""

from zerostack.shard.__about__ import __version__
from zerostack.shard._clip import (
    check_clip_args,
    check_max_norm,
    clip_coefficient,
    clip_grads_,
    grad_stats,
    norm_part,
    record_clip,
)
from zerostack.shard._config import ZeroConfig, as_kwargs, changed_fields, check_fraction
from zerostack.shard._cpu_pipeline import (
    CpuStepError,
    CpuUpdatePipeline,
    wait_event,
    write_failed,
)
from zerostack.shard._flat import check_flat_optimizer
from zerostack.shard._gc import CollectorSchedule
from zerostack.shard._grad_guard import (
    ShardedGradient,
    grad_scaler_refusal,
    local_grad,
    say_zero_grads_are_dropped,
)
from zerostack.shard._hyper import (
    hyperparameters,
    mark_stepped,
    refuse_user_add_param_group,
    refuse_user_state_dict,
    stepping_twin,
    with_user_step_hooks,
)
from zerostack.shard._lane import (
    LANE_HYPER,
    LaneHomes,
    LaneStaging,
    check_lane_optimizer,
    lane_members,
    lane_refusal,
)
from zerostack.shard._loss_scaler import SCALER_KEYS, DynamicLossScaler, LossScalerConfig
from zerostack.shard._machine import (
    PROFILE_ENV,
    best_gpu_update_fraction,
    machine_profile,
    measure_machine,
    resolve_gpu_update_fraction,
    split_beats_cpu_only,
)
from zerostack.shard._mixed_precision import (
    StepPlan,
    make_loss_scaler,
    plan_step,
    step_with_div_scale,
    takes_div_scale,
)
from zerostack.shard._optimizer import TrainingState, ZeroOptimizer
from zerostack.shard._partition import shard_bounds, shard_numel
from zerostack.shard._rank0_sync import sync_from_rank0
from zerostack.shard._state_dict import check_state_keys
from zerostack.shard._step_model import FloorEstimate, MachineProfile, StepFloor, step_floor
from zerostack.shard._structure import fix_structure

__all__ = [
    "LANE_HYPER",
    "PROFILE_ENV",
    "SCALER_KEYS",
    "CollectorSchedule",
    "CpuStepError",
    "CpuUpdatePipeline",
    "DynamicLossScaler",
    "FloorEstimate",
    "LaneHomes",
    "LaneStaging",
    "LossScalerConfig",
    "MachineProfile",
    "ShardedGradient",
    "StepFloor",
    "StepPlan",
    "TrainingState",
    "ZeroConfig",
    "ZeroOptimizer",
    "__version__",
    "as_kwargs",
    "best_gpu_update_fraction",
    "changed_fields",
    "check_clip_args",
    "check_flat_optimizer",
    "check_fraction",
    "check_lane_optimizer",
    "check_max_norm",
    "check_state_keys",
    "clip_coefficient",
    "clip_grads_",
    "fix_structure",
    "grad_scaler_refusal",
    "grad_stats",
    "hyperparameters",
    "lane_members",
    "lane_refusal",
    "local_grad",
    "machine_profile",
    "make_loss_scaler",
    "mark_stepped",
    "measure_machine",
    "norm_part",
    "plan_step",
    "record_clip",
    "refuse_user_add_param_group",
    "refuse_user_state_dict",
    "resolve_gpu_update_fraction",
    "say_zero_grads_are_dropped",
    "shard_bounds",
    "shard_numel",
    "split_beats_cpu_only",
    "step_floor",
    "step_with_div_scale",
    "stepping_twin",
    "sync_from_rank0",
    "takes_div_scale",
    "wait_event",
    "with_user_step_hooks",
    "write_failed",
]
