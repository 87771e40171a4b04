"""ZeroOptimizer's settings as one frozen config: the one place their
defaults and checks live (booster-api's LowLevelZeroPlugin builds it)."""

from __future__ import annotations

from dataclasses import InitVar, dataclass, fields
from typing import Any

import torch

from zerostack.shard._clip import check_max_norm

CPU_UPDATE_NUMEL = 2**26
"""With ``cpu_offload``, the elements one CPU Adam call gathers from
consecutive buckets (``ZeroOptimizer.cpu_update_numel``); see [Note: CPU
Adam calls span buckets] in ``_optimizer.py``."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ZeroConfig:
    """Every setting of a ZeRO stage 1/2 optimizer but the process group and
    the loss scaler (see ZeroOptimizer, which takes them as keywords)."""

    stage: int = 2
    """1: optimizer states sharded; 2: gradients too. Default 2."""
    reduce_bucket_size: int = 2**24
    """Elements per gradient bucket. Default 2**24."""
    overlap_communication: bool = True
    """Reduce during backward (side stream on CUDA). Default True."""
    communication_dtype: torch.dtype | None = None
    """Dtype gradients travel in. Default None (the parameters')."""
    cpu_offload: bool = False
    """Masters and optimizer states on the CPU. Default False."""
    overlap_cpu_step: bool = True
    """With cpu_offload, update buckets on a worker thread. Default True."""
    gpu_update_fraction: float | str | None = None
    """With cpu_offload, the share of the offloaded elements (whole buckets,
    spread through the order the next forward uses them) whose Adam update runs in the compute
    device's fused Adam, masters and states streamed from and back to the
    host; 0.0 updates all in CPU Adam. In [0, 1], or "auto": the share the
    step-time model finds fastest on this machine. Default None: "auto"
    with cpu_offload (0.0 where no split can run), else 0.0."""
    cpu_update_numel: int = CPU_UPDATE_NUMEL
    """With cpu_offload, a CPU Adam call steps consecutive buckets until it
    holds this many elements of this rank's pieces (1: one call per
    bucket). Default 2**26."""
    master_weights: bool = True
    """Keep fp32 masters for fp16/bf16 parameters. Default True."""
    max_norm: float = 0.0
    """Clip the global gradient norm to this (0: off). Default 0.0."""
    gc_every_n_steps: int = 50
    """Python's cycle collector runs every this many steps (0: left alone;
    checked by CollectorSchedule when the optimizer is built). Default 50."""
    api: InitVar[str] = "ZeroOptimizer"
    """The entry point named in error messages (not a setting). Default "ZeroOptimizer"."""

    def __post_init__(self, api: str) -> None:
        if self.stage not in (1, 2):
            raise ValueError(
                f"{api}: stage must be 1 or 2 (got {self.stage!r}); use gemini for stage 3"
            )
        size = self.reduce_bucket_size
        if isinstance(size, bool) or not isinstance(size, int):
            raise TypeError(f"{api}: reduce_bucket_size must be an int (got {size!r})")
        if size < 1:
            raise ValueError(f"{api}: reduce_bucket_size must be >= 1 (got {size})")
        check_max_norm(api, self.max_norm)
        if self.gpu_update_fraction is not None:
            check_fraction(api, self.gpu_update_fraction)
        check_cpu_update_numel(api, self.cpu_update_numel)
        dtype = self.communication_dtype
        if dtype is not None and (
            not isinstance(dtype, torch.dtype) or not dtype.is_floating_point
        ):
            raise TypeError(
                f"{api}: communication_dtype must be a floating-point torch.dtype or None "
                f"(got {dtype!r})"
            )
        for name in ("overlap_communication", "cpu_offload", "overlap_cpu_step", "master_weights"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{api}: {name} must be a bool (got {getattr(self, name)!r})")


def check_fraction(api: str, fraction: object) -> None:
    """``gpu_update_fraction``: a number in [0, 1], or ``"auto"``."""
    if fraction == "auto":
        return
    if isinstance(fraction, bool) or not isinstance(fraction, int | float):
        raise TypeError(
            f"{api}: gpu_update_fraction must be a number in [0, 1] or 'auto' (got {fraction!r}); "
            "e.g. 0.25"
        )
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(
            f"{api}: gpu_update_fraction must be in [0, 1] (got {fraction!r}); 0 updates all that is "
            "offloaded in CPU Adam, 1 all of it in the GPU's Adam"
        )


def check_cpu_update_numel(api: str, numel: object) -> None:
    """``cpu_update_numel``: an int >= 1 (TypeError for a non-int, as
    ``reduce_bucket_size``; ValueError for one below 1)."""
    hint = "e.g. 2**26 (the default), or 1 for one CPU Adam call per bucket"
    if isinstance(numel, bool) or not isinstance(numel, int):
        raise TypeError(f"{api}: cpu_update_numel must be an int (got {numel!r}); {hint}")
    if numel < 1:
        raise ValueError(f"{api}: cpu_update_numel must be >= 1 (got {numel}); {hint}")


def changed_fields(given: Any, default: Any) -> list[str]:
    """The names of the fields in which the config ``given`` differs from
    ``default``, in field order: the options a user set to something else."""
    return [f.name for f in fields(given) if getattr(given, f.name) != getattr(default, f.name)]


def as_kwargs(config: Any) -> dict[str, Any]:
    """A config's fields as keyword arguments (shallow, unlike ``dataclasses.asdict``)."""
    return {f.name: getattr(config, f.name) for f in fields(config)}
