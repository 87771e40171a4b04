"""A DeepSpeed ZeRO-1/2 ``ds_config.json`` read as LowLevelZeroPlugin arguments
and the training settings the plugin applies at ``prepare_dataloader`` and
``boost`` (see zerostack.booster._plugins._deepspeed_train).

[Note: DeepSpeed keys] Every key of the config gets one of four rules, in
the tables below (docs/migration/deepspeed.md has a row for each, checked
against these tables by integration_tests/test_docs_snippets.py):
  _Mapped      read by the code here: it takes effect.
  _AtDefault   accepted at DeepSpeed's default; another value cannot be
               honoured and is reported.
  _NoEffect    accepted; when it asks for something (a value other than the
               quiet one) it is listed in the one warning with the reason.
  _Any         accepted with any value: what it asks for always holds here.
A top-level section whose ``"enabled"`` is false asks for nothing and is
accepted whole. Every key that cannot be honoured (and every bad value) is
collected and raised together in ONE DeepSpeedConfigError; every key that
has no effect is listed in ONE warning. Nothing is ignored silently.

"auto" (which the Hugging Face Trainer fills in from its own arguments) is
resolved where a source exists: the bucket sizes from the model's hidden
size at ``boost`` (reduce_bucket_size = hidden x hidden, as the Trainer
does), the batch keys from ``prepare_dataloader``'s batch size. Any other
"auto" is reported.
"""

from __future__ import annotations

import inspect
import json
import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from zerostack.booster._plugins._base import PRECISION_DTYPES

_API = "LowLevelZeroPlugin.from_deepspeed_config"
_ALWAYS = object()  # a _NoEffect key that asks for something at every value
_AUTO = "auto"


@dataclass(frozen=True, slots=True)
class _Mapped:
    what: str  # what it becomes (docs only)


@dataclass(frozen=True, slots=True)
class _AtDefault:
    default: Any
    hint: str  # what to do instead


@dataclass(frozen=True, slots=True)
class _NoEffect:
    quiet: Any  # the value that asks for nothing (_ALWAYS: none does)
    why: str


@dataclass(frozen=True, slots=True)
class _Any:
    why: str


_NVME_ONLY = "an NVMe setting: no effect with offload to the CPU"
_STAGE3 = "a ZeRO-3 key: no effect at stage 1 or 2, as in DeepSpeed"
_FP32_MASTERS = "the master weights and gradients are fp32: remove it"

# section ("" = top level) -> key -> rule. See [Note: DeepSpeed keys].
RULES: dict[str, dict[str, Any]] = {
    "": {
        "train_batch_size": _Mapped("checked, and the batch size per rank of prepare_dataloader"),
        "train_micro_batch_size_per_gpu": _Mapped("prepare_dataloader's batch size per rank"),
        "gradient_accumulation_steps": _Mapped("optimizer.step() steps every N micro-steps"),
        "gradient_clipping": _Mapped("max_norm"),
        "communication_data_type": _Mapped("communication_dtype"),
        "optimizer": _Mapped("built at boost when boost gets no optimizer"),
        "scheduler": _Mapped("built at boost when boost gets no lr scheduler"),
        "zero_optimization": _Mapped("stage, buckets, overlap, offload"),
        "allgather_size": _Mapped(
            'with "zero_optimization": true, the all-gather bucket size (DeepSpeed\'s older format)'
        ),
        "fp16": _Mapped("precision fp16 and the loss scaler"),
        "bf16": _Mapped("precision bf16"),
        "activation_checkpointing": _Mapped("cpu_checkpointing"),
        "zero_allow_untested_optimizer": _Any("every torch optimizer is allowed"),
        "zero_force_ds_cpu_optimizer": _Any(
            "with CPU offload Adam and AdamW step through zerostack's CPU kernel"
        ),
        "prescale_gradients": _Any("gradients are divided by the world size before the reduction"),
        "steps_per_print": _NoEffect(_ALWAYS, "no progress report is printed: log the loss yourself"),
        "wall_clock_breakdown": _NoEffect(
            False, "no timings are printed: use torch.profiler (phases named zerostack::*)"
        ),
        "dump_state": _NoEffect(False, "nothing is printed at initialization"),
        "memory_breakdown": _NoEffect(False, "nothing is printed: read torch.cuda.memory_stats()"),
        "gradient_predivide_factor": _NoEffect(
            1.0, "gradients are divided by the world size once, before the reduction"
        ),
        "disable_python_gc": _NoEffect(
            False, "ZeroOptimizer runs Python's collector on its own schedule (gc_every_n_steps)"
        ),
        "sparse_gradients": _AtDefault(False, "sparse gradients are not implemented: remove it"),
        "gradient_allreduce_op": _AtDefault(
            "mean", "gradients are averaged over the ranks: multiply the loss by the world size"
        ),
    },
    "zero_optimization": {
        "stage": _Mapped("stage (1 or 2)"),
        "reduce_bucket_size": _Mapped("the bucket size"),
        "allgather_bucket_size": _Mapped("the bucket size, when smaller"),
        "overlap_comm": _Mapped("overlap_communication"),
        "offload_optimizer": _Mapped("cpu_offload"),
        "offload_param": _Mapped("none only"),
        "cpu_offload": _Mapped("cpu_offload"),
        "elastic_checkpoint": _Any("checkpoints always load at another world size"),
        "allgather_partitions": _NoEffect(
            True, "the parameters are always all-gathered after the step (the same results)"
        ),
        "reduce_scatter": _NoEffect(
            True, "stage 2 always reduce-scatters, stage 1 all-reduces (the same results)"
        ),
        "contiguous_gradients": _NoEffect(True, "gradients are always packed into bucket buffers"),
        "round_robin_gradients": _NoEffect(False, "a speed option of DeepSpeed's offload copies"),
        "ignore_unused_parameters": _NoEffect(True, "unused parameters never stop training"),
        "legacy_stage1": _NoEffect(False, "DeepSpeed's older stage-1 code"),
        "compute_grad_norm": _NoEffect(True, "the norm is computed for the fp16 overflow check"),
        "parameter_alignment": _NoEffect(False, "pieces are padded to equal sizes per rank"),
        "sub_group_size": _NoEffect(1_000_000_000, _STAGE3),
        "stage3_max_live_parameters": _NoEffect(1_000_000_000, _STAGE3),
        "stage3_max_reuse_distance": _NoEffect(1_000_000_000, _STAGE3),
        "stage3_prefetch_bucket_size": _NoEffect(50_000_000, _STAGE3),
        "stage3_param_persistence_threshold": _NoEffect(100_000, _STAGE3),
        "stage3_gather_16bit_weights_on_model_save": _NoEffect(False, _STAGE3),
        "stage3_gather_fp16_weights_on_model_save": _NoEffect(False, _STAGE3),
        "stage3_module_granularity_threshold": _NoEffect(0, _STAGE3),
        "zero_hpz_partition_size": _NoEffect(1, _STAGE3),
        "zero_quantized_weights": _NoEffect(False, _STAGE3),
        "log_trace_cache_warnings": _NoEffect(False, _STAGE3),
        "load_from_fp32_weights": _AtDefault(
            True, "checkpoints always restore the fp32 master weights: remove it"
        ),
        "zero_quantized_gradients": _AtDefault(
            False, 'quantized gradients are not implemented: use communication_data_type "bf16"'
        ),
        "mics_shard_size": _AtDefault(-1, "MiCS is not implemented: remove it"),
    },
    "zero_optimization.offload_optimizer": {
        "device": _Mapped('"cpu" -> cpu_offload'),
        "pin_memory": _Any("the offload buffers are pinned whenever CUDA is present"),
        "buffer_count": _NoEffect(4, _NVME_ONLY),
        "fast_init": _NoEffect(False, _NVME_ONLY),
        "nvme_path": _NoEffect(None, _NVME_ONLY),
        "ratio": _AtDefault(
            1.0, "a part of the optimizer on the GPU is GeminiPlugin(offload_optim_frac=...)"
        ),
    },
    "fp16": {
        "enabled": _Mapped('precision "fp16"'),
        "initial_scale_power": _Mapped("initial_scale = 2**power"),
        "loss_scale_window": _Mapped("growth_interval"),
        "hysteresis": _Mapped("hysteresis"),
        "min_loss_scale": _Mapped("min_scale"),
        "auto_cast": _Any("floating inputs are cast to fp16 either way (cast_inputs=True)"),
        "loss_scale": _AtDefault(0, "a static loss scale is not implemented: use 0 (dynamic)"),
        "consecutive_hysteresis": _AtDefault(
            False, "the hysteresis refills only when the scale grows: remove it"
        ),
        "fp16_master_weights_and_grads": _AtDefault(False, _FP32_MASTERS),
    },
    "bf16": {
        "enabled": _Mapped('precision "bf16"'),
        "bf16_master_weights_and_grads": _AtDefault(False, _FP32_MASTERS),
        "bf16_optimizer_states": _AtDefault(False, "optimizer states are fp32: remove it"),
    },
    "activation_checkpointing": {
        "cpu_checkpointing": _Mapped("checkpoint inputs in pinned host memory"),
        "partition_activations": _NoEffect(
            False, "it splits activations over tensor-parallel ranks: there are none here"
        ),
        "contiguous_memory_optimization": _NoEffect(False, "it serves partition_activations"),
        "number_checkpoints": _NoEffect(None, "it sizes contiguous_memory_optimization's buffer"),
        "synchronize_checkpoint_boundary": _NoEffect(False, "a debugging synchronization"),
        "profile": _NoEffect(False, "no per-checkpoint timings are logged"),
    },
}  # fmt: skip
# Sections with an "enabled" key that zerostack does not implement; with
# "enabled": false (or absent) they ask for nothing.
_OFF_ONLY = {
    "amp": "apex AMP is not used: use fp16 or bf16",
    "torch_autocast": 'parameters train in the config\'s precision: use "bf16": {"enabled": true}',
    "flops_profiler": "use torch.profiler or torch.utils.flop_counter.FlopCounterMode",
    "tensorboard": "log the loss yourself (torch.utils.tensorboard)",
    "wandb": "log the loss yourself (wandb.log)",
    "comet": "log the loss yourself",
    "csv_monitor": "log the loss yourself",
}
# Batch keys: positive ints, or "auto" (prepare_dataloader's batch size fills them in).
BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
# The config's optimizer types built at boost (DeepSpeed's names, any case;
# any other torch.optim class by its exact name, as DeepSpeed imports them).
_ADAM_PARAMS = {"lr", "betas", "eps", "weight_decay", "bias_correction", "adam_w_mode",
                "torch_adam", "amsgrad"}  # fmt: skip
SCHEDULERS = ("WarmupLR", "WarmupDecayLR")


class DeepSpeedConfigError(NotImplementedError, ValueError):
    """Every key of a DeepSpeed config that LowLevelZeroPlugin cannot honour
    (and every bad value), in one error: ``problems`` lists them, one line
    each with the reason and what to do. Both a ValueError (a bad value) and
    a NotImplementedError (a key with no equivalent)."""

    def __init__(self, problems: list[str], source: str) -> None:
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(
            f"{_API}: {len(problems)} key(s) of the DeepSpeed config cannot be honoured (got "
            f"{source}); fix all of them and run again:\n{lines}"
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class DeepSpeedSettings:
    """What a DeepSpeed config asks of training beyond LowLevelZeroPlugin's
    arguments (applied by zerostack.booster._plugins._deepspeed_train)."""

    train_batch_size: int | None = None
    """train_batch_size; None when absent or "auto". Default None."""
    micro_batch_size: int | None = None
    """train_micro_batch_size_per_gpu; None when absent or "auto". Default None."""
    gradient_accumulation_steps: int | None = None
    """gradient_accumulation_steps; None when absent or "auto". Default None."""
    reduce_bucket_size: int | str | None = None
    """Elements, "auto", or None (the plugin's default). Default None."""
    allgather_bucket_size: int | str | None = None
    """Elements, "auto", or None (no limit of its own). Default None."""
    cpu_checkpointing: bool = False
    """Keep the tensors the forward saves outside checkpointed regions in
    pinned host memory. Default False."""
    optimizer: dict[str, Any] | None = None
    """The config's optimizer section ({"type", "params"}). Default None."""
    scheduler: dict[str, Any] | None = None
    """The config's scheduler section ({"type", "params"}). Default None."""
    auto_keys: tuple[str, ...] = field(default=())
    """The keys that were "auto". Default ()."""


def deepspeed_to_kwargs(config: Mapping[str, Any] | str | os.PathLike) -> dict[str, Any]:
    """LowLevelZeroPlugin's arguments for a DeepSpeed config; see [Note: DeepSpeed keys].

    Args:
        config: the DeepSpeed config, a dict or the path of a JSON file.

    Returns:
        Keyword arguments of LowLevelZeroPlugin.

    Raises:
        TypeError: ``config`` is neither a dict nor a path.
        DeepSpeedConfigError: every key that cannot be honoured, together.
    """
    return read_deepspeed_config(config)[0]


def read_deepspeed_config(
    config: Mapping[str, Any] | str | os.PathLike, world_size: int | None = None
) -> tuple[dict[str, Any], DeepSpeedSettings]:
    """The plugin's arguments and the training settings of a DeepSpeed config.

    Warns once (UserWarning) listing every key that has no effect here.

    Args:
        config: the DeepSpeed config, a dict or the path of a JSON file.
        world_size: checks the batch keys against it when given. Default None.

    Returns:
        ``(kwargs, settings)``.

    Raises:
        TypeError: ``config`` is neither a dict nor a path to a JSON object.
        DeepSpeedConfigError: every key that cannot be honoured, together.
    """
    source = repr(os.fspath(config)) if isinstance(config, str | os.PathLike) else "a dict"
    if isinstance(config, str | os.PathLike):
        with open(config) as f:
            config = json.load(f)
    if not isinstance(config, Mapping):
        raise TypeError(
            f"{_API}: config must be a dict or the path of a JSON file holding one (got "
            f"{type(config).__name__}); pass ds_config.json's path or its dict"
        )
    reader = _Reader()
    kwargs, settings = reader.read(dict(config))
    if world_size is not None and not reader.problems:
        from zerostack.booster._plugins._deepspeed_train import resolve_batch

        try:
            resolve_batch(settings, world_size, None, _API)
        except ValueError as error:
            reader.problems.append(str(error).removeprefix(f"{_API}: "))
    if reader.problems:
        raise DeepSpeedConfigError(reader.problems, source)
    if reader.no_effect:
        lines = "\n".join(f"  - {n}" for n in reader.no_effect)
        warnings.warn(
            f"{_API}: {len(reader.no_effect)} key(s) of the DeepSpeed config have no effect "
            f"here (got {source}); remove them to silence this:\n{lines}",
            UserWarning,
            stacklevel=3,
        )
    return kwargs, settings


def bucket_elements(sizes: Mapping[str, int]) -> int:
    """The bucket size of ``reduce_bucket_size`` and ``allgather_bucket_size``
    (either may be absent): ZeroOptimizer all-gathers the updated parameters
    in the buckets it reduces in, so the smaller of the two bounds both; an
    absent reduce_bucket_size is LowLevelZeroPlugin's default."""
    from zerostack.booster._plugins._low_level_zero import LowLevelZeroPlugin

    default = inspect.signature(LowLevelZeroPlugin).parameters["reduce_bucket_size_in_m"].default
    reduce = sizes.get("reduce_bucket_size", int(default * 2**20))
    return int(min(reduce, sizes.get("allgather_bucket_size", reduce)))


class _Reader:
    """One pass over a config: the kwargs, the settings, and every problem
    and no-effect key found on the way (see [Note: DeepSpeed keys])."""

    def __init__(self) -> None:
        self.problems: list[str] = []
        self.no_effect: list[str] = []
        self.autos: list[str] = []
        self.buckets: dict[str, int | str] = {}

    def bad(self, key: str, value: Any, what: str, fix: str) -> None:
        self.problems.append(f"{key} {what} (got {value!r}); {fix}")

    def section(self, value: Any, where: str) -> dict[str, Any] | None:
        if value is None:
            return {}
        if not isinstance(value, Mapping):
            self.bad(where, value, "must be a dict", "write it as a JSON object")
            return None
        return dict(value)

    def read(self, top: dict[str, Any]) -> tuple[dict[str, Any], DeepSpeedSettings]:
        kwargs: dict[str, Any] = {}
        self.boolean_zero(top)
        raw = {
            name: self.section(top.pop(name, None), name)
            for name in ("zero_optimization", "fp16", "bf16", "activation_checkpointing")
        }
        zero = raw["zero_optimization"]
        offload = self.section(zero.pop("offload_optimizer", None) if zero else None,
                               "zero_optimization.offload_optimizer")  # fmt: skip
        sections: dict[str, dict[str, Any]] = {k: v or {} for k, v in raw.items()}
        sections["offload"] = offload or {}
        if zero is not None and offload is not None:  # else reported as not a dict
            kwargs.update(self.zero(sections["zero_optimization"], sections["offload"]))
        kwargs.update(self.precision(sections["fp16"], sections["bf16"]))
        batch = {k: self.positive_int(k, top.pop(k)) for k in BATCH_KEYS if k in top}
        if "gradient_clipping" in top:
            clip = top.pop("gradient_clipping")
            if self.number("gradient_clipping", clip, minimum=0.0):
                kwargs["max_norm"] = float(clip)
        comm = top.pop("communication_data_type", None)
        if comm is not None:
            if comm in PRECISION_DTYPES:
                kwargs["communication_dtype"] = PRECISION_DTYPES[comm]
            else:
                self.bad("communication_data_type", comm, "must be 'fp16', 'bf16' or 'fp32'",
                         "pick one of them")  # fmt: skip
        act = sections["activation_checkpointing"]
        cpu_ckpt = act.pop("cpu_checkpointing", False)
        if not isinstance(cpu_ckpt, bool):
            self.bad("activation_checkpointing.cpu_checkpointing", cpu_ckpt, "must be a bool",
                     "write true or false")  # fmt: skip
        optimizer = self.optimizer(top.pop("optimizer", None))
        scheduler = self.scheduler(top.pop("scheduler", None))
        for name in list(top):
            rule = RULES[""].get(name)
            value = top[name]
            if rule is not None or not isinstance(value, Mapping):
                continue
            if value.get("enabled", False if name in _OFF_ONLY else None) is False:
                top.pop(name)  # a section switched off asks for nothing
            elif name in _OFF_ONLY:
                top.pop(name)
                self.bad(
                    name, value, "is not implemented", f"set enabled to false; {_OFF_ONLY[name]}"
                )
        self.rest("", top)
        self.rest("zero_optimization", sections["zero_optimization"])
        self.rest("zero_optimization.offload_optimizer", sections["offload"])
        self.rest("fp16", sections["fp16"])
        self.rest("bf16", sections["bf16"])
        self.rest("activation_checkpointing", act)
        settings = DeepSpeedSettings(
            train_batch_size=batch.get("train_batch_size"),
            micro_batch_size=batch.get("train_micro_batch_size_per_gpu"),
            gradient_accumulation_steps=batch.get("gradient_accumulation_steps"),
            reduce_bucket_size=self.buckets.get("reduce_bucket_size"),
            allgather_bucket_size=self.buckets.get("allgather_bucket_size"),
            cpu_checkpointing=cpu_ckpt is True,
            optimizer=optimizer,
            scheduler=scheduler,
            auto_keys=tuple(self.autos),
        )
        return kwargs, settings

    def rest(self, where: str, rest: dict[str, Any]) -> None:
        """The keys no code above read: by their rule, or unknown."""
        rules = RULES[where]
        for key, value in rest.items():
            name = f"{where}.{key}" if where else key
            rule = rules.get(key)
            if isinstance(rule, _Any):
                continue
            if isinstance(rule, _NoEffect):
                if rule.quiet is _ALWAYS or value != rule.quiet:
                    self.no_effect.append(f"{name} (got {value!r}): {rule.why}")
            elif isinstance(rule, _AtDefault):
                if value != rule.default:
                    self.bad(name, value, f"can only be {json.dumps(rule.default)}", rule.hint)
            elif value == _AUTO:
                self.no_source(name, value)
            else:
                self.bad(name, value, "has no equivalent in LowLevelZeroPlugin", "remove it")

    # -- values ------------------------------------------------------------------------

    def auto(self, key: str, value: Any) -> bool:
        if value == _AUTO:
            self.autos.append(key)
            return True
        return False

    def positive_int(self, key: str, value: Any) -> int | None:
        if self.auto(key, value):
            return None
        if isinstance(value, bool) or not isinstance(value, int | float) or value != int(value) \
                or value < 1:  # fmt: skip
            self.bad(key, value, "must be a positive int or 'auto'", "put the number itself")
            return None
        return int(value)

    def number(self, key: str, value: Any, minimum: float) -> bool:
        if isinstance(value, bool) or not isinstance(value, int | float) or not value >= minimum:
            fix = ("put the value itself ('auto' is the Hugging Face Trainer's)"
                   if value == _AUTO else f"put a number >= {minimum:g}")  # fmt: skip
            self.bad(key, value, f"must be a number >= {minimum:g}", fix)
            return False
        return True

    # -- zero_optimization -------------------------------------------------------------

    def boolean_zero(self, top: dict[str, Any]) -> None:
        """DeepSpeed's older ``"zero_optimization": true`` (its getting-started
        config) is read as DeepSpeed reads it: stage 1 with the top-level
        ``allgather_size`` (default 5e8) as ``allgather_bucket_size``;
        ``false`` is stage 0. DeepSpeed reads ``allgather_size`` nowhere else."""
        value = top.get("zero_optimization")
        size = top.pop("allgather_size", None)
        if not isinstance(value, bool):
            if size is not None:
                self.no_effect.append(
                    f"allgather_size (got {size!r}): DeepSpeed reads it only with "
                    '"zero_optimization": true; put zero_optimization.allgather_bucket_size'
                )
            return
        top["zero_optimization"] = {"stage": int(value)}
        # A bad size is named as the user wrote it, not as the key it maps to.
        if value and (size is None or self.number("allgather_size", size, minimum=1.0)):
            top["zero_optimization"]["allgather_bucket_size"] = 5e8 if size is None else size

    def zero(self, zero: dict[str, Any], offload: dict[str, Any]) -> dict[str, Any]:
        kwargs: dict[str, Any] = {}
        stage = zero.pop("stage", 0)
        if stage == 3:
            self.bad("zero_optimization.stage", 3, "3 shards the parameters too: that is GeminiPlugin's",
                     "use GeminiPlugin(...) for ZeRO-3")  # fmt: skip
        elif stage == 0:
            self.bad("zero_optimization.stage", 0,
                     "0 (DeepSpeed's default when absent) is plain data parallelism, no ZeRO",
                     "use TorchDDPPlugin()")  # fmt: skip
        elif stage not in (1, 2) or isinstance(stage, bool):
            self.bad("zero_optimization.stage", stage, "must be 0-3", "put 1 or 2")
        else:
            kwargs["stage"] = stage
        for key in ("reduce_bucket_size", "allgather_bucket_size"):
            if key in zero:
                name = f"zero_optimization.{key}"
                size = zero.pop(key)
                if self.auto(name, size):
                    self.buckets[key] = _AUTO
                elif self.number(name, size, minimum=1.0):
                    self.buckets[key] = int(size)
        if self.buckets and _AUTO not in self.buckets.values():
            sizes = {k: int(v) for k, v in self.buckets.items()}
            kwargs["reduce_bucket_size_in_m"] = bucket_elements(sizes) / 2**20
        if "overlap_comm" in zero:
            kwargs["overlap_communication"] = bool(zero.pop("overlap_comm"))
        param_offload = self.section(
            zero.pop("offload_param", None), "zero_optimization.offload_param"
        )
        if param_offload and param_offload.get("device", "none") not in ("none", None):
            self.bad("zero_optimization.offload_param", param_offload,
                     "(parameter offload) is ZeRO-3", "use GeminiPlugin(offload_param_frac=...)")  # fmt: skip
        cpu_offload = zero.pop("cpu_offload", False)
        device = offload.pop("device", "none")
        if device == "nvme":
            self.bad("zero_optimization.offload_optimizer.device", device, "is not implemented",
                     "NVMe: use HybridAdam(nvme_offload_fraction=...) under GeminiPlugin")  # fmt: skip
        elif device not in ("cpu", "none", None):
            self.bad("zero_optimization.offload_optimizer.device", device,
                     "must be 'cpu', 'nvme' or 'none'", "put 'cpu' or 'none'")  # fmt: skip
        kwargs["cpu_offload"] = cpu_offload is True or device == "cpu"
        if device != "cpu":  # the NVMe keys matter only for NVMe
            for key in ("buffer_count", "fast_init", "nvme_path"):
                offload.pop(key, None)
        return kwargs

    def precision(self, fp16: dict[str, Any], bf16: dict[str, Any]) -> dict[str, Any]:
        kwargs: dict[str, Any] = {}
        on = {}
        for name, section in (("fp16", fp16), ("bf16", bf16)):
            enabled = section.pop("enabled", False)
            if enabled == _AUTO:
                self.bad(f"{name}.enabled", enabled, "is 'auto', which has no source here",
                         "put true or false")  # fmt: skip
            on[name] = enabled is True
        if on["fp16"] and on["bf16"]:
            self.bad("fp16.enabled and bf16.enabled", True, "are both true", "enable one")
        kwargs["precision"] = "fp16" if on["fp16"] else "bf16" if on["bf16"] else "fp32"
        for name, section in (("fp16", fp16), ("bf16", bf16)):
            if not on[name]:
                section.clear()  # a section switched off asks for nothing, as in DeepSpeed
        if on["fp16"]:
            power = fp16.pop("initial_scale_power", 16)
            if self.number("fp16.initial_scale_power", power, minimum=0.0):
                kwargs["initial_scale"] = 2.0**power
            for ds_key, ours in (
                ("loss_scale_window", "growth_interval"),
                ("hysteresis", "hysteresis"),
                ("min_loss_scale", "min_scale"),
            ):
                if ds_key in fp16:
                    kwargs[ours] = fp16.pop(ds_key)
        return kwargs

    # -- optimizer and scheduler -------------------------------------------------------

    def spec(self, section: Any, name: str, check: Any) -> dict[str, Any] | None:
        """The ``{"type", "params"}`` of the optimizer or scheduler section,
        checked by ``check(kind, params)``; None when absent or reported."""
        spec = self.section(section, name)
        if not spec:
            return None
        kind = spec.pop("type", None)
        params = self.section(spec.pop("params", None), f"{name}.params")
        for key in spec:
            self.bad(f"{name}.{key}", spec[key], "has no equivalent in LowLevelZeroPlugin",
                     "remove it")  # fmt: skip
        if params is None:
            return None
        problems = len(self.problems)
        for key, value in params.items():
            if value == _AUTO:
                self.no_source(f"{name}.params.{key}", value)
        check(kind, params)
        return None if len(self.problems) > problems else {"type": kind, "params": params}

    def no_source(self, key: str, value: Any) -> None:
        self.bad(key, value, "is 'auto', which has no source here",
                 "put the value itself ('auto' is the Hugging Face Trainer's)")  # fmt: skip

    def optimizer(self, section: Any) -> dict[str, Any] | None:
        return self.spec(section, "optimizer", self.check_optimizer)

    def check_optimizer(self, kind: Any, params: dict[str, Any]) -> None:
        if not isinstance(kind, str):
            self.bad("optimizer.type", kind, "must be a name", 'put e.g. "AdamW"')
        elif kind.lower() in ("adam", "adamw"):
            if params.get("amsgrad", False):
                self.bad("optimizer.params.amsgrad", params["amsgrad"],
                         "is not implemented by DeepSpeed's or zerostack's fused Adam",
                         "remove it, or build torch.optim.AdamW(amsgrad=True) and pass it to boost")  # fmt: skip
            for key in set(params) - _ADAM_PARAMS:
                self.bad(f"optimizer.params.{key}", params[key], f"is not an argument of {kind}",
                         f"use {sorted(_ADAM_PARAMS)}")  # fmt: skip
        elif isinstance(getattr(torch.optim, kind, None), type) and issubclass(
            getattr(torch.optim, kind), torch.optim.Optimizer
        ):
            signature = inspect.signature(getattr(torch.optim, kind))
            for key in set(params) - set(signature.parameters) - {"params"}:
                self.bad(f"optimizer.params.{key}", params[key],
                         f"is not an argument of torch.optim.{kind}", "remove it")  # fmt: skip
        else:
            self.bad("optimizer.type", kind,
                     "is not Adam, AdamW or a torch.optim class (DeepSpeed's own optimizers, "
                     "e.g. Lamb or OneBitAdam, are not implemented)",
                     "build the optimizer yourself and pass it to booster.boost")  # fmt: skip

    def scheduler(self, section: Any) -> dict[str, Any] | None:
        return self.spec(section, "scheduler", self.check_scheduler)

    def check_scheduler(self, kind: Any, params: dict[str, Any]) -> None:
        if kind not in SCHEDULERS:
            self.bad("scheduler.type", kind, f"is not one of {list(SCHEDULERS)}",
                     "build the lr scheduler on your optimizer (torch.optim.lr_scheduler) and "
                     "pass it to booster.boost(lr_scheduler=...)")  # fmt: skip
            return
        from zerostack.booster._plugins._deepspeed_train import WarmupDecayLR, WarmupLR

        cls = WarmupLR if kind == "WarmupLR" else WarmupDecayLR
        names = set(inspect.signature(cls).parameters) - {"optimizer", "last_epoch"}
        for key in set(params) - names:
            self.bad(f"scheduler.params.{key}", params[key], f"is not an argument of {kind}",
                     f"use {sorted(names)}")  # fmt: skip
        if params.get("warmup_type", "log") not in ("log", "linear"):
            self.bad("scheduler.params.warmup_type", params["warmup_type"],
                     "must be 'log' or 'linear'", "pick one of them")  # fmt: skip
        if kind == "WarmupDecayLR" and "total_num_steps" not in params:
            self.bad("scheduler.params.total_num_steps", None, "is required by WarmupDecayLR",
                     "put the number of optimizer steps of the run")  # fmt: skip
