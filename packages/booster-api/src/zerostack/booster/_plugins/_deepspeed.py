"""A DeepSpeed ZeRO-1/2 config read as LowLevelZeroPlugin arguments.

[Note: DeepSpeed keys] Mapped:
  zero_optimization.stage (1, 2)           -> stage (0: TorchDDPPlugin; 3: GeminiPlugin)
  zero_optimization.reduce_bucket_size     -> reduce_bucket_size_in_m (elements / 2**20)
  zero_optimization.overlap_comm           -> overlap_communication
  zero_optimization.offload_optimizer.device "cpu" / "none" -> cpu_offload
  zero_optimization.cpu_offload (legacy)   -> cpu_offload
  fp16.enabled / bf16.enabled              -> precision "fp16" / "bf16" (else "fp32")
  fp16.initial_scale_power                 -> initial_scale = 2**power (DeepSpeed's 16 when absent)
  fp16.loss_scale_window                   -> growth_interval
  fp16.hysteresis                          -> hysteresis
  fp16.min_loss_scale                      -> min_scale
  gradient_clipping                        -> max_norm
  communication_data_type                  -> communication_dtype
Absent keys take LowLevelZeroPlugin's defaults, except the fp16 scaler's,
which take DeepSpeed's (initial scale 2**16). overlap_comm and
reduce_bucket_size change speed, never results.

Accepted silently when they hold DeepSpeed's default (the value in
``_DEFAULTS``), refused otherwise: the other zero_optimization keys
(allgather_partitions, allgather_bucket_size, reduce_scatter,
contiguous_gradients, round_robin_gradients, the stage-3 keys, ...),
offload_optimizer's other keys (pin_memory may also be true: buffers are
pinned whenever CUDA is present), fp16.loss_scale (0: dynamic),
fp16.consecutive_hysteresis, fp16.auto_cast, and the top-level
gradient_accumulation_steps, steps_per_print, wall_clock_breakdown,
prescale_gradients, gradient_predivide_factor, sparse_gradients,
memory_breakdown, dump_state; zero_allow_untested_optimizer takes any value
(every torch optimizer is allowed). Every other key that is set raises
NotImplementedError naming it: the batch sizes (the dataloader's), the
optimizer and scheduler (built by the user), offload_param (ZeRO-3),
activation checkpointing, profilers and monitors, ...
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from zerostack.booster._plugins._base import PRECISION_DTYPES

_API = "LowLevelZeroPlugin.from_deepspeed_config"
_ABSENT = object()

# DeepSpeed's defaults of keys accepted only at their default.
_DEFAULTS: dict[str, dict[str, Any]] = {
    "": {
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10,
        "wall_clock_breakdown": False,
        "prescale_gradients": False,
        "gradient_predivide_factor": 1.0,
        "sparse_gradients": False,
        "memory_breakdown": False,
        "dump_state": False,
    },
    "zero_optimization": {
        "allgather_partitions": True,
        "allgather_bucket_size": 500_000_000,
        "reduce_scatter": True,
        "contiguous_gradients": True,
        "round_robin_gradients": False,
        "elastic_checkpoint": False,
        "ignore_unused_parameters": True,
        "legacy_stage1": False,
        "load_from_fp32_weights": True,
        "sub_group_size": 1_000_000_000,
        "stage3_max_live_parameters": 1_000_000_000,
        "stage3_max_reuse_distance": 1_000_000_000,
        "stage3_prefetch_bucket_size": 50_000_000,
        "stage3_param_persistence_threshold": 100_000,
        "stage3_gather_16bit_weights_on_model_save": False,
        "stage3_gather_fp16_weights_on_model_save": False,
        "zero_hpz_partition_size": 1,
        "zero_quantized_weights": False,
        "zero_quantized_gradients": False,
        "mics_shard_size": -1,
    },
    "zero_optimization.offload_optimizer": {
        "buffer_count": 4,
        "fast_init": False,
        "ratio": 1.0,
        "nvme_path": None,
    },
    "fp16": {"loss_scale": 0, "consecutive_hysteresis": False, "auto_cast": False},
    "bf16": {},
}
# What to do instead, for keys users often carry over.
_HINTS = {
    "train_batch_size": "the batch size is the dataloader's: plugin.prepare_dataloader(dataset, batch_size=...)",
    "train_micro_batch_size_per_gpu": "the batch size is the dataloader's: plugin.prepare_dataloader(dataset, batch_size=...)",
    "gradient_accumulation_steps": "accumulate with booster.no_sync(model, optimizer) around all but the last micro-batch",
    "optimizer": "build the optimizer yourself (e.g. HybridAdam(model.parameters(), lr=...)) and pass it to booster.boost",
    "scheduler": "build the lr scheduler on your optimizer and pass it to booster.boost(lr_scheduler=...)",
    "zero_optimization.offload_param": "parameter offload is ZeRO-3: use GeminiPlugin(offload_param_frac=...)",
    "zero_optimization.offload_optimizer.device": "NVMe: use HybridAdam(nvme_offload_fraction=...) under GeminiPlugin",
    "activation_checkpointing": "checkpoint activations in the model (torch.utils.checkpoint, or gradient_checkpointing_enable() in transformers)",
}  # fmt: skip
_COMM_DTYPES = PRECISION_DTYPES


def deepspeed_to_kwargs(config: Mapping[str, Any] | str | os.PathLike) -> dict[str, Any]:
    """LowLevelZeroPlugin's arguments for a DeepSpeed config; see [Note: DeepSpeed keys].

    Args:
        config: the DeepSpeed config, a dict or the path of a JSON file.

    Returns:
        Keyword arguments of LowLevelZeroPlugin.

    Raises:
        TypeError: ``config`` or one of its sections is not a dict.
        ValueError: a stage other than 0-3, fp16 and bf16 both enabled, an
            unknown communication_data_type, or an "auto" value.
        NotImplementedError: stage 0 or 3, NVMe offload, parameter offload,
            or any other key that is set and has no equivalent.
    """
    if isinstance(config, (str, os.PathLike)):
        with open(config) as f:
            config = json.load(f)
    top = _section(config, "")
    zero = _section(top.pop("zero_optimization", {}), "zero_optimization")
    fp16 = _section(top.pop("fp16", {}), "fp16")
    bf16 = _section(top.pop("bf16", {}), "bf16")
    offload = zero.pop("offload_optimizer", None)
    offload = _section(offload or {}, "zero_optimization.offload_optimizer")
    kwargs = {**_zero_kwargs(zero, offload), **_precision_kwargs(fp16, bf16)}
    if "gradient_clipping" in top:
        kwargs["max_norm"] = float(top.pop("gradient_clipping"))
    comm = top.pop("communication_data_type", None)
    if comm is not None:
        if comm not in _COMM_DTYPES:
            raise ValueError(
                f"{_API}: communication_data_type must be 'fp16', 'bf16' or 'fp32' (got {comm!r})"
            )
        kwargs["communication_dtype"] = _COMM_DTYPES[comm]
    top.pop("zero_allow_untested_optimizer", None)

    for where, rest in (
        ("", top),
        ("zero_optimization", zero),
        ("zero_optimization.offload_optimizer", offload),
        ("fp16", fp16),
        ("bf16", bf16),
    ):
        defaults = _DEFAULTS[where]
        for key, value in rest.items():
            if defaults.get(key, _ABSENT) != value:
                _refuse(f"{where}.{key}" if where else key, value)
    return kwargs


def _section(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise TypeError(
            f"{_API}: {where or 'the config'} must be a dict (got {type(value).__name__})"
        )
    for key, v in value.items():
        if isinstance(v, str) and v == "auto":
            raise ValueError(
                f"{_API}: {where + '.' if where else ''}{key} is 'auto' (got 'auto'); "
                "'auto' is filled in by the Hugging Face Trainer: put the value itself"
            )
    return dict(value)


def _refuse(key: str, value: Any) -> None:
    hint = _HINTS.get(key, "remove it, or leave it at DeepSpeed's default")
    raise NotImplementedError(
        f"{_API}: {key} has no equivalent in LowLevelZeroPlugin (got {value!r}); {hint}"
    )


def _zero_kwargs(zero: dict[str, Any], offload: dict[str, Any]) -> dict[str, Any]:
    """The stage, buckets, overlap and offload keys (popped from ``zero`` and ``offload``)."""
    kwargs: dict[str, Any] = {}
    stage = zero.pop("stage", 0)
    if stage == 3:
        raise NotImplementedError(
            f"{_API}: zero_optimization.stage 3 (parameters sharded too) is GeminiPlugin's "
            "(got 3); use GeminiPlugin(...) for ZeRO-3"
        )
    if stage == 0:
        raise NotImplementedError(
            f"{_API}: zero_optimization.stage 0 (plain data parallelism) has no ZeRO plugin "
            "(got 0, DeepSpeed's default when zero_optimization is absent); use TorchDDPPlugin()"
        )
    if stage not in (1, 2):
        raise ValueError(f"{_API}: zero_optimization.stage must be 0-3 (got {stage!r})")
    kwargs["stage"] = stage
    if "reduce_bucket_size" in zero:
        kwargs["reduce_bucket_size_in_m"] = float(zero.pop("reduce_bucket_size")) / 2**20
    if "overlap_comm" in zero:
        kwargs["overlap_communication"] = bool(zero.pop("overlap_comm"))
    param_offload = zero.pop("offload_param", None)
    if param_offload and param_offload.get("device", "none") != "none":
        _refuse("zero_optimization.offload_param", param_offload)
    cpu_offload = bool(zero.pop("cpu_offload", False))
    device = offload.pop("device", "none")
    if device == "nvme":
        _refuse("zero_optimization.offload_optimizer.device", device)
    if device not in ("cpu", "none"):
        raise ValueError(
            f"{_API}: zero_optimization.offload_optimizer.device must be 'cpu', 'nvme' or "
            f"'none' (got {device!r})"
        )
    offload.pop("pin_memory", None)  # pinned whenever CUDA is present
    kwargs["cpu_offload"] = cpu_offload or device == "cpu"
    return kwargs


def _precision_kwargs(fp16: dict[str, Any], bf16: dict[str, Any]) -> dict[str, Any]:
    """The precision and fp16 loss-scaler keys (popped from ``fp16`` and ``bf16``)."""
    kwargs: dict[str, Any] = {}
    fp16_on, bf16_on = bool(fp16.pop("enabled", False)), bool(bf16.pop("enabled", False))
    if fp16_on and bf16_on:
        raise ValueError(f"{_API}: fp16.enabled and bf16.enabled are both true; enable one")
    kwargs["precision"] = "fp16" if fp16_on else "bf16" if bf16_on else "fp32"
    if fp16_on:
        kwargs["initial_scale"] = 2.0 ** fp16.pop("initial_scale_power", 16)
        for ds_key, ours in (
            ("loss_scale_window", "growth_interval"),
            ("hysteresis", "hysteresis"),
            ("min_loss_scale", "min_scale"),
        ):
            if ds_key in fp16:
                kwargs[ours] = fp16.pop(ds_key)
    else:  # the scaler's keys have no effect without fp16, as in DeepSpeed
        for key in ("initial_scale_power", "loss_scale_window", "hysteresis", "min_loss_scale"):
            fp16.pop(key, None)
    return kwargs
