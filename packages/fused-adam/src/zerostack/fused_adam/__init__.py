"""Adam optimizers on fast CPU (C++/SIMD) and CUDA (multi-tensor) kernels."""

from zerostack.fused_adam.__about__ import __version__
from zerostack.fused_adam._adam import CPUAdam, FusedAdam, HybridAdam
from zerostack.fused_adam._functional import adam_update
from zerostack.fused_adam._kernels import (
    available_simd_levels,
    backend_info,
    cuda_kernel_available,
    set_cpu_schedule,
    set_simd_level,
)

__all__ = [
    "CPUAdam",
    "FusedAdam",
    "HybridAdam",
    "__version__",
    "adam_update",
    "available_simd_levels",
    "backend_info",
    "cuda_kernel_available",
    "set_cpu_schedule",
    "set_simd_level",
]
