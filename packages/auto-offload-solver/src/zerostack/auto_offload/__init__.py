"""Plan and run parameter offload under a device memory budget."""

from zerostack.auto_offload.__about__ import __version__
from zerostack.auto_offload._amp import AMPOptimizer
from zerostack.auto_offload._api import memory_optimize, plan_offload
from zerostack.auto_offload._module import BaseOffloadModule
from zerostack.auto_offload._profile import NOT_NVML, HardwareProfile
from zerostack.auto_offload._region import Region
from zerostack.auto_offload._region_manager import RegionManager
from zerostack.auto_offload._runtime import (
    OffloadRuntime,
    runtime_asyn_offload_apply_pass,
    runtime_syn_offload_apply_pass,
)
from zerostack.auto_offload._simulator import (
    ActivationProfile,
    AsynTrainingSimulator,
    RegionCost,
    SynTrainingSimulator,
    TrainingSimulator,
    region_costs,
)
from zerostack.auto_offload._solver import (
    AsynGreedySolver,
    MemoryBudgetError,
    Solver,
    SolverFactory,
    SynGreedySolver,
)
from zerostack.auto_offload._trace import (
    NodeInfo,
    parameter_size,
    propagate,
    retarget_devices,
    trace_model,
)

__all__ = [
    "NOT_NVML",
    "AMPOptimizer",
    "ActivationProfile",
    "AsynGreedySolver",
    "AsynTrainingSimulator",
    "BaseOffloadModule",
    "HardwareProfile",
    "MemoryBudgetError",
    "NodeInfo",
    "OffloadRuntime",
    "Region",
    "RegionCost",
    "RegionManager",
    "Solver",
    "SolverFactory",
    "SynGreedySolver",
    "SynTrainingSimulator",
    "TrainingSimulator",
    "__version__",
    "memory_optimize",
    "parameter_size",
    "plan_offload",
    "propagate",
    "region_costs",
    "retarget_devices",
    "runtime_asyn_offload_apply_pass",
    "runtime_syn_offload_apply_pass",
    "trace_model",
]
