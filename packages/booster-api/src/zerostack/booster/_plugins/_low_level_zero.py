"""LowLevelZeroPlugin: ZeRO-1/2 (zerostack.shard.ZeroOptimizer) behind the Booster."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from zerostack.booster._checkpoint_dcp import Piece
from zerostack.booster._interface import ModelWrapper
from zerostack.booster._plugins._base import (
    PRECISION_DTYPES,
    BoostedOptimizer,
    Plugin,
    attach_scheduler,
    check_zero_options,
    refuse_backward_inputs,
    refuse_not_built,
    scaler_config,
    scaler_kwargs,
    warn_rank_local_running_stats,
)
from zerostack.booster._plugins._contract import incompatible, refuse_moves, without_prefix
from zerostack.booster._plugins._lazy import is_lazy
from zerostack.booster._plugins._sharded import (
    buffer_ranges,
    buffer_state,
    load_buffers,
    optimizer_pieces,
)
from zerostack.booster._plugins._state import (
    ModelFacts,
    check_group_params,
    check_names,
    check_same_groups,
    export_entry,
    frozen_names,
    import_entry,
    merge_hyper,
    param_names,
    saved_group,
    scaler_state,
)
from zerostack.chunk import (
    LazyInitContext,
    all_gather_into,
    default_compute_device,
    rank_and_world,
)
from zerostack.shard import (
    LossScalerConfig,
    ZeroConfig,
    ZeroOptimizer,
    as_kwargs,
    shard_bounds,
    sync_from_rank0,
)

logger = logging.getLogger(__name__)
_API = "LowLevelZeroPlugin"
_DTYPES = PRECISION_DTYPES
# The defaults of LowLevelZeroPlugin's arguments: ZeroConfig's and
# LossScalerConfig's, but for ColossalAI's LowLevelZeroPlugin's own stage 1,
# 12M-element buckets and first loss scale 2**32 (test_plugin_defaults.py
# holds them to it).
_ZERO = ZeroConfig(stage=1, reduce_bucket_size=12 * 2**20)
_SCALER = LossScalerConfig(initial_scale=2.0**32)


class LowLevelZeroModel(ModelWrapper):
    """A model whose parameters are cast to the plugin's precision; floating
    inputs are cast too (``cast_inputs``). Its fp32 weights are the ZeRO
    optimizer's masters, sharded over the ranks."""

    _API = "LowLevelZeroModel"

    def __init__(self, module: nn.Module, dtype: torch.dtype, cast_inputs: bool) -> None:
        facts = ModelFacts.of(module)
        super().__init__(module)
        self._facts = facts
        self.dtype = dtype
        self.cast_inputs = cast_inputs and dtype != torch.float32
        self.zero: ZeroOptimizer | None = None  # set when the optimizer is boosted with it
        self._aliases: dict[int, list[str]] = {}
        for name, p in module.named_parameters(remove_duplicate=False):
            self._aliases.setdefault(id(p), []).append(name)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.cast_inputs:
            args, kwargs = _cast(args, self.dtype), _cast(kwargs, self.dtype)
        return self.module(*args, **kwargs)

    def unwrap(self, unwrap_peft: bool = True) -> nn.Module:
        return self.module

    # Under a DeepSpeed config, the optimizer whose accumulation window
    # zero_grad() must keep (a weak reference: it holds this model).
    window_owner: Callable[[], Any] | None = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch's; under a DeepSpeed config with gradient accumulation the
        optimizer's (see [Note: DeepSpeed gradient accumulation]): called
        after ``step()`` inside a window it keeps the window's gradients."""
        owner = self.window_owner() if self.window_owner is not None else None
        if owner is not None:
            owner.zero_grad(set_to_none)
        else:
            super().zero_grad(set_to_none)

    def _apply(self, fn: Any, recurse: bool = True) -> LowLevelZeroModel:
        # See [Note: boosted model methods]
        refuse_moves(self._API, _API, fn, [*self.module.parameters(), *self.module.buffers()])
        return self

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        """torch's ``load_state_dict`` with ``state_dict()``'s keys: the values
        go into the parameters and into this rank's piece of their fp32
        masters, so the next step starts from them (see [Note: boosted model
        methods]). A collective-free call."""
        own, stray = without_prefix(self._API, state_dict, strict, assign)
        self.load_full_state_dict(own, strict=strict)
        return incompatible(self._facts.dtypes, own, stray)

    @torch.no_grad()
    def full_state_dict(self, only_rank_0: bool = True) -> dict[str, torch.Tensor]:
        """The whole model with the fp32 masters gathered from every rank
        (every rank takes part); see [Note: full state format]."""
        zero = self.zero
        if zero is not None:
            zero.wait_updates()  # the masters are read below (the device lane's copies back too)
        state = self.module.state_dict()
        if zero is not None:
            for s in zero.shards:
                whole = _gather_master(zero, s)
                for name in self._aliases.get(id(s.param), ()):
                    state[name] = whole
        if only_rank_0 and rank_and_world()[0] != 0:
            return {}
        return self._facts.export_model(state)

    @torch.no_grad()
    def load_full_state_dict(
        self, state_dict: dict[str, torch.Tensor], strict: bool = True
    ) -> None:
        """Load the whole model: parameters (cast) and this rank's piece of
        every fp32 master."""
        zero = self.zero
        if zero is not None:
            zero.drop_batch_for_load()
            zero.wait_updates()  # no CPU update may write after the load
        self.module.load_state_dict(state_dict, strict=strict)
        if zero is None:
            return
        for s in zero.shards:
            value = next(
                (state_dict[n] for n in self._aliases[id(s.param)] if n in state_dict), None
            )
            if value is None:
                continue
            start, end = shard_bounds(s.param.numel(), zero.world, zero.rank)
            s.master.zero_()  # the padding stays zero (see zerostack.shard's [Note: per-parameter pieces])
            s.master[: end - start].copy_(value.detach().reshape(-1)[start:end])
        zero.masters_written()
        self._drop_window_for_load()

    def _first_names(self) -> dict[int, str]:
        return {id(p): n for n, p in self.module.named_parameters()}

    def local_ranges(self) -> dict[str, tuple[int, int, int]]:
        """ZeRO's pieces for parameters with fp32 masters; the others and the
        buffers whole (every rank holds them)."""
        names = self._first_names()
        out = {n: (0, p.numel(), p.numel()) for n, p in self.module.named_parameters()}
        zero = self.zero
        if zero is not None:
            for s, (start, end) in zip(zero.shards, zero.local_ranges(), strict=True):
                out[names[id(s.param)]] = (start, end, s.param.numel())
        return {**out, **buffer_ranges(self.module)}

    def sharded_state_dict(self) -> dict[str, Any]:
        """This rank's pieces of the fp32 masters (no gather); parameters
        without masters and buffers whole. See [Note: sharded state format]."""
        names = self._first_names()
        if self.zero is not None:
            self.zero.wait_updates()
        out: dict[str, Any] = {
            n: p.detach().reshape(-1).float() for n, p in self.module.named_parameters()
        }
        zero = self.zero
        if zero is not None:
            local = zero.local_state_dict()["params"]
            for s, (start, _), entry in zip(zero.shards, zero.local_ranges(), local, strict=True):
                out[names[id(s.param)]] = Piece(entry["master"], start, s.param.numel())
        out.update(buffer_state(self.module, self._facts.dtypes))
        return out

    @torch.no_grad()
    def load_sharded_state_dict(self, values: dict[str, torch.Tensor]) -> None:
        """This rank's master pieces (then the parameters are all-gathered: a
        collective), whole parameters without masters, buffers."""
        names = self._first_names()
        zero = self.zero
        sharded = {id(s.param) for s in zero.shards} if zero is not None else set()
        for n, p in self.module.named_parameters():
            if id(p) not in sharded and n in values:
                p.copy_(values[n].reshape(p.shape))
        if zero is not None:
            entries = [
                {"master": values[names[id(s.param)]]} if names[id(s.param)] in values else {}
                for s in zero.shards
            ]
            zero.load_local_state_dict({"params": entries, "param_groups": None, "scaler": None})
        load_buffers(self.module, values)
        self._drop_window_for_load()

    def _drop_window_for_load(self) -> None:
        """Under a DeepSpeed config, a loaded model starts a gradient
        accumulation window (see DeepSpeedZeroOptimizer.drop_window_for_load)."""
        owner = self.window_owner() if self.window_owner is not None else None
        if owner is not None:
            owner.drop_window_for_load()


def _gather_master(zero: ZeroOptimizer, s: Any) -> torch.Tensor:
    """The whole fp32 master of shard ``s``, on the CPU (a collective)."""
    src = s.master.detach().reshape(-1).to(zero.device)
    full = torch.empty(zero.world * s.piece, dtype=src.dtype, device=zero.device)
    all_gather_into(full, src, zero.group)
    return full[: s.param.numel()].view(s.param.shape).cpu()


def _cast(obj: Any, dtype: torch.dtype) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.is_floating_point() else obj
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cast(o, dtype) for o in obj)
    if isinstance(obj, dict):
        return {k: _cast(v, dtype) for k, v in obj.items()}
    return obj


class LowLevelZeroOptimizer(BoostedOptimizer):
    """The zerostack.shard.ZeroOptimizer of a LowLevelZeroModel (``.optim``)."""

    _API = "LowLevelZeroOptimizer"

    def __init__(self, optimizer: ZeroOptimizer, model: LowLevelZeroModel) -> None:
        super().__init__(optimizer)
        self._model = model

    def backward(self, loss: torch.Tensor, inputs: Any = None, retain_graph: bool = False) -> None:
        """``loss.backward(retain_graph=...)``, scaled for fp16.

        Raises:
            NotImplementedError: ``inputs`` is not None.
        """
        refuse_backward_inputs(f"{self._API}.backward", inputs)
        self.optim.backward(loss, retain_graph=retain_graph)

    def get_grad_norm(self, norm_type: float = 2.0, **kwargs: Any) -> float | None:
        """The gradients' total 2-norm (unscaled, before clipping) that the
        last ``step()`` computed, as ColossalAI's LowLevelZero optimizer
        gives it; None before the first step.

        Raises:
            NotImplementedError: ``norm_type`` other than 2.
        """
        return self._last_step_norm(norm_type)

    def wait_updates(self) -> None:
        """With ``cpu_offload``: finish the last step's CPU updates and write
        them back, so that the model's parameters hold the step's values
        before the next forward (an EMA or a log of the weights right after
        ``step()``). Every rank calls it at the same point: the write-back
        all-gathers. Without ``cpu_offload`` a no-op."""
        self.optim.wait_updates()

    def _step(self, closure: Callable[[], Any] | None = None) -> Any:
        return self._step_closure(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optim.zero_grad(set_to_none)

    def clip_grad_by_norm(
        self,
        max_norm: float,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = False,
        foreach: bool | None = None,
    ) -> torch.Tensor:
        """ZeroOptimizer.clip_grad_by_norm: the norm over every rank's reduced
        pieces; the step applies the clip (see BoostedOptimizer.clip_grad_by_norm)."""
        return self.optim.clip_grad_by_norm(max_norm, norm_type, error_if_nonfinite)

    def _names(self) -> list[str]:
        names = param_names(self._model.unwrap())
        return [names[id(s.param)] for s in self.optim.shards]

    def full_state_dict(self) -> dict[str, Any]:
        """See [Note: full state format]: ZeroOptimizer's per-parameter list
        (with its numels) keyed by name; every rank takes part."""
        zero = self.optim
        full = zero.full_state_dict()
        names = self._names()
        state = {}
        for s, name, entry in zip(zero.shards, names, full["params"], strict=True):
            if set(entry) - {"master"}:  # a parameter that never stepped has no state
                state[name] = export_entry(entry, s.param.shape)
        groups = [
            {
                **{k: v for k, v in g.items() if k != "params"},
                "params": [names[i] for i in g["params"]],
            }
            for g in full["param_groups"]
        ]
        return {"state": state, "param_groups": groups, "loss_scaler": full["scaler"]}

    def local_ranges(self) -> dict[str, tuple[int, int, int]]:
        return self._model.local_ranges()

    def sharded_state_dict(self) -> dict[str, Any]:
        """ZeroOptimizer.local_state_dict as pieces (no gather); see [Note:
        sharded state format]."""
        zero = self.optim
        local = zero.local_state_dict()
        names = self._names()
        per_param = {
            name: entry
            for name, entry in zip(names, local["params"], strict=True)
            if set(entry) - {"master"}
        }
        groups = [
            {
                **{k: v for k, v in g.items() if k != "params"},
                "params": [names[i] for i in g["params"]],
            }
            for g in local["param_groups"]
        ]
        return {
            "state": optimizer_pieces(per_param, self.local_ranges()),
            "param_groups": groups,
            "loss_scaler": local["scaler"],
        }

    def load_sharded_state_dict(self, state_dict: dict[str, Any]) -> None:
        """ZeroOptimizer.load_local_state_dict from this rank's ranges of a
        checkpoint of any plugin and world size; the masters keep their values.

        Raises:
            KeyError: the state names a parameter this optimizer lacks.
            ValueError: the state's parameter groups list other parameters than
                this optimizer's (a state of another model); nothing is loaded.
        """
        zero = self.optim
        names = self._names()
        check_names(self._API, state_dict["state"], set(names))
        groups = self._merged_groups(state_dict["param_groups"], names)
        entries = [
            {k: v for k, v in state_dict["state"].get(name, {}).items() if k != "master"}
            for name in names
        ]
        own = zero.scaler.state_dict() if zero.scaler is not None else None
        zero.load_local_state_dict(
            {
                "params": entries,
                "param_groups": groups,
                "scaler": scaler_state(own, state_dict.get("loss_scaler")),
            }
        )

    def _merged_groups(self, saved: list[dict[str, Any]], names: list[str]) -> list[dict]:
        current = self.optim.optimizer.state_dict()["param_groups"]
        current_names = [[names[i] for i in g["params"]] for g in current]
        check_group_params(self._API, saved, current_names, frozen_names(self._model.unwrap()))
        check_same_groups(self._API, saved, current_names)
        return [
            {**merge_hyper(g, saved_group(saved, group_names)), "params": g["params"]}
            for g, group_names in zip(current, current_names, strict=True)
        ]

    @torch.no_grad()
    def load_full_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load the [Note: full state format] (from any plugin and world size).

        The masters keep their values (the model state carries the weights):
        each rank hands ZeroOptimizer its own piece at its place.

        Raises:
            KeyError: the state names a parameter this optimizer lacks.
            ValueError: the state's parameter groups list other parameters than
                this optimizer's (a state of another model); nothing is loaded.
            ValueError: a state tensor's size differs from its parameter's.
        """
        zero = self.optim
        zero.wait_updates()  # its masters are read below: no update may still write them
        names = self._names()
        check_names(self._API, state_dict["state"], set(names))
        groups = self._merged_groups(state_dict["param_groups"], names)
        params = []
        for s, name in zip(zero.shards, names, strict=True):
            numel = s.param.numel()
            entry = state_dict["state"].get(name)
            mine = import_entry(self._API, name, entry, numel) if entry else {}
            # ZeroOptimizer slices whole tensors: only this rank's slice matters.
            master = torch.zeros(numel, dtype=s.master.dtype)
            start, end = shard_bounds(numel, zero.world, zero.rank)
            master[start:end] = s.master[: end - start].cpu()
            mine["master"] = master
            params.append(mine)
        own = zero.scaler.state_dict() if zero.scaler is not None else None
        zero.load_full_state_dict(
            {
                "params": params,
                "param_groups": groups,
                "scaler": scaler_state(own, state_dict.get("loss_scaler")),
                "numels": [s.param.numel() for s in zero.shards],
            }
        )


class LowLevelZeroPlugin(Plugin):
    """ZeRO stage 1 or 2: fp32 master weights and optimizer states sharded
    over the ranks (and gradients, stage 2), parameters whole on every rank
    in ``precision``. Wraps the optimizer in zerostack.shard.ZeroOptimizer.
    The arguments build a zerostack.shard ZeroConfig (``plugin.zero_config``)
    and LossScalerConfig (``plugin.scaler_config``), whose defaults they
    take but for ColossalAI's own stage 1, 12M-element buckets and first
    loss scale 2**32.

    Args:
        stage: 1 or 2. Default 1.
        precision: "fp16", "bf16" or "fp32"; parameters are cast to it.
            Default "fp16".
        initial_scale: the fp16 loss scaler's first scale; min_scale,
            growth_factor, backoff_factor, growth_interval, hysteresis and
            max_scale are its other settings (defaults 2**32, 1, 2, 0.5,
            1000, 2, 2**32).
        max_norm: clip the global gradient norm (0: off). Default 0.0.
        norm_type: 2.0 only. Default 2.0.
        reduce_bucket_size_in_m: gradient bucket size in millions (2**20)
            of elements. Default 12.
        communication_dtype: the dtype gradients travel in. Default None
            (the parameters').
        overlap_communication: reduce during backward. Default True.
        overlap_allgather: False only. Default False.
        cpu_offload: masters and optimizer states on the CPU (Adam through
            zerostack's CPU kernel). Default False.
        gpu_update_fraction: keyword-only; with cpu_offload, about this share of the
            offloaded parameters (the first buckets the forward uses) is
            updated by the GPU's fused Adam, their masters and states
            streamed from the host and back (ZeroOptimizer's argument; not a
            ColossalAI one). In [0, 1], or "auto": the share the step-time
            model finds fastest on this machine (0.0 where none can run; the
            log says why). Default None: "auto" with cpu_offload; 0.0 keeps
            every update (and every gradient) on the host.
        master_weights: keep fp32 masters. Default True.
        verbose: log the configuration at WARNING (else DEBUG). Default False.
        cast_inputs: cast floating forward inputs to ``precision``. Default True.
        fp8_communication, use_fp8: ColossalAI's fp8 options; False only.
        extra_dp_size: ColossalAI's second data-parallel dimension; 1 only.
        cpu_update_numel: keyword-only; with cpu_offload, a CPU Adam call
            steps consecutive buckets until it holds this many elements of
            this rank's pieces (ZeroOptimizer's argument; not a ColossalAI
            one). 1 makes one call per bucket. Default 2**26.

    Raises:
        ValueError: a bad stage, precision, bucket size, max_norm,
            cpu_update_numel or loss scaler setting (ZeroConfig's and
            LossScalerConfig's checks).
        TypeError: a setting of the wrong type (e.g. cpu_offload not a bool).
        NotImplementedError: stage 3 (GeminiPlugin), norm_type other than 2,
            overlap_allgather=True, fp8_communication or use_fp8 True,
            extra_dp_size other than 1.
    """

    def __init__(
        self,
        stage: int = _ZERO.stage,
        precision: str = "fp16",
        initial_scale: float = _SCALER.initial_scale,
        min_scale: float = _SCALER.min_scale,
        growth_factor: float = _SCALER.growth_factor,
        backoff_factor: float = _SCALER.backoff_factor,
        growth_interval: int = _SCALER.growth_interval,
        hysteresis: int = _SCALER.hysteresis,
        max_scale: float = _SCALER.max_scale,
        max_norm: float = _ZERO.max_norm,
        norm_type: float = 2.0,
        reduce_bucket_size_in_m: float = _ZERO.reduce_bucket_size / 2**20,
        communication_dtype: torch.dtype | None = _ZERO.communication_dtype,
        overlap_communication: bool = _ZERO.overlap_communication,
        overlap_allgather: bool = False,
        cpu_offload: bool = _ZERO.cpu_offload,
        master_weights: bool = _ZERO.master_weights,
        verbose: bool = False,
        cast_inputs: bool = True,
        fp8_communication: bool = False,
        use_fp8: bool = False,
        extra_dp_size: int = 1,
        *,
        gpu_update_fraction: float | str | None = _ZERO.gpu_update_fraction,
        cpu_update_numel: int = _ZERO.cpu_update_numel,
    ) -> None:
        refuse_not_built(
            _API,
            fp8_communication=(fp8_communication, False),
            use_fp8=(use_fp8, False),
            extra_dp_size=(extra_dp_size, 1),
        )
        if stage == 3:
            raise NotImplementedError(
                f"{_API}: stage 3 (parameters sharded too) is GeminiPlugin's (got stage=3); "
                "use GeminiPlugin() for ZeRO-3"
            )
        check_zero_options(_API, precision, norm_type, max_norm)
        if overlap_allgather:
            raise NotImplementedError(
                f"{_API}: overlap_allgather=True is not implemented (parameters are all-gathered "
                "at the end of step); pass overlap_allgather=False"
            )
        if not reduce_bucket_size_in_m > 0:
            raise ValueError(
                f"{_API}: reduce_bucket_size_in_m must be > 0 (got {reduce_bucket_size_in_m})"
            )
        self.zero_config = ZeroConfig(
            stage=stage, reduce_bucket_size=max(1, int(reduce_bucket_size_in_m * 2**20)),
            overlap_communication=overlap_communication, communication_dtype=communication_dtype,
            cpu_offload=cpu_offload, gpu_update_fraction=gpu_update_fraction,
            cpu_update_numel=cpu_update_numel, master_weights=master_weights, max_norm=max_norm,
            api=_API,
        )  # fmt: skip
        self.scaler_config = scaler_config(_API, locals())
        self.stage = stage
        self.precision = precision
        self.dtype = _DTYPES[precision]
        self.cast_inputs = cast_inputs
        self.verbose = verbose
        self.deepspeed: Any = None  # a DeepSpeedTraining under from_deepspeed_config

    @property
    def zero_kwargs(self) -> dict[str, Any]:
        """ZeroOptimizer's keywords: ``zero_config``'s fields."""
        return as_kwargs(self.zero_config)

    @property
    def scaler_kwargs(self) -> dict[str, Any]:
        """The fp16 loss scaler's keywords: ``scaler_config``'s fields."""
        return as_kwargs(self.scaler_config)

    @classmethod
    def from_deepspeed_config(
        cls, config: Mapping[str, Any] | str | os.PathLike, **kwargs: Any
    ) -> LowLevelZeroPlugin:
        """A plugin that trains as a DeepSpeed ZeRO-1/2 ``ds_config.json`` says:
        its batch keys set ``prepare_dataloader``'s batch size,
        gradient_accumulation_steps makes ``optimizer.step()`` step every N
        micro-steps as DeepSpeed's engine does, its optimizer and scheduler
        sections are built at ``boost`` when it gets none, and
        ``activation_checkpointing.cpu_checkpointing`` keeps checkpoint
        inputs in pinned host memory. docs/migration/deepspeed.md has every
        key; see [Note: DeepSpeed keys] and [Note: DeepSpeed gradient
        accumulation]. Warns once listing every key that has no effect here.

        Args:
            config: the DeepSpeed config, a dict or the path of a JSON file.
            **kwargs: more LowLevelZeroPlugin arguments (e.g. verbose); they
                override the mapped ones.

        Raises:
            TypeError: ``config`` is neither a dict nor a JSON file's path.
            DeepSpeedConfigError: every key that cannot be honoured and every
                bad value, together in one error (a ValueError and a
                NotImplementedError).
        """
        from zerostack.booster._plugins._deepspeed import read_deepspeed_config
        from zerostack.booster._plugins._deepspeed_train import DeepSpeedTraining

        # torchrun's WORLD_SIZE when the process group is not up yet
        world = rank_and_world()[1] if torch.distributed.is_initialized() else None
        mapped, settings = read_deepspeed_config(
            config, world_size=world or int(os.environ.get("WORLD_SIZE", "1"))
        )
        plugin = cls(**{**mapped, **kwargs})
        plugin.deepspeed = DeepSpeedTraining(settings, "reduce_bucket_size_in_m" in kwargs)
        return plugin

    def prepare_dataloader(
        self, dataset: Any, batch_size: int | None = None, *args: Any, **kwargs: Any
    ):
        """Plugin.prepare_dataloader; under a DeepSpeed config ``batch_size``
        defaults to its micro batch size per rank (a different one is a
        ValueError).

        Raises:
            ValueError: ``batch_size`` disagrees with the DeepSpeed config, or
                neither gives one.
        """
        if self.deepspeed is not None:
            batch_size = self.deepspeed.loader_batch_size(batch_size)
        return super().prepare_dataloader(dataset, batch_size, *args, **kwargs)  # type: ignore[arg-type]

    def supported_precisions(self) -> list[str]:
        return list(_DTYPES)

    def control_precision(self) -> bool:
        return True

    def support_no_sync(self) -> bool:
        return True

    def configure(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | LowLevelZeroOptimizer | None = None,
        criterion: Callable | None = None,
        dataloader: Any = None,
        lr_scheduler: Any = None,
    ) -> tuple:
        """Cast the model to ``precision`` on the current device and wrap the
        optimizer in ZeroOptimizer."""
        log = logger.warning if self.verbose else logger.debug
        if self.deepspeed is not None:
            self.deepspeed.check_boost(optimizer)
        if not isinstance(model, LowLevelZeroModel):
            warn_rank_local_running_stats(_API, model)
            if is_lazy(model):
                LazyInitContext.materialize(model)  # on its default_device, then moved
            model = model.to(device=default_compute_device(), dtype=self.dtype)
            model = LowLevelZeroModel(model, self.dtype, self.cast_inputs)
        ds, zero_kwargs, wrap = self.deepspeed, self.zero_kwargs, LowLevelZeroOptimizer
        if ds is not None:  # the config's optimizer, scheduler, "auto" buckets
            optimizer, lr_scheduler, zero_kwargs = ds.before_zero(
                model, optimizer, lr_scheduler, zero_kwargs
            )
            wrap = ds.wrap_optimizer
        if optimizer is not None and not isinstance(optimizer, LowLevelZeroOptimizer):
            user = optimizer
            zero = ZeroOptimizer(
                optimizer, module=model.unwrap(), **zero_kwargs,
                **scaler_kwargs(_API, self.precision, self.scaler_config, _SCALER),
            )  # fmt: skip
            model.zero = zero
            optimizer = wrap(zero, model)
            attach_scheduler(lr_scheduler, optimizer, user)
        elif optimizer is None:  # ZeroOptimizer would; see [Note: rank 0's initial values]
            net = model.unwrap()
            sync_from_rank0([*net.named_parameters(), *net.named_buffers()], api=_API)
        if ds is not None:
            lr_scheduler = ds.after_zero(model, optimizer, lr_scheduler)
        log("%s: stage %d, %s, %s", _API, self.stage, self.precision, zero_kwargs)
        return model, optimizer, criterion, dataloader, lr_scheduler

    def no_sync(self, model: nn.Module | None = None, optimizer: Any = None):
        """ZeroOptimizer's no_sync (stage 1 and 2).

        Raises:
            ValueError: ``optimizer`` is not one boosted by this plugin.
        """
        if not isinstance(optimizer, LowLevelZeroOptimizer):
            raise ValueError(
                f"{_API}.no_sync: pass the boosted optimizer (got {type(optimizer).__name__}); "
                "booster.no_sync(model, optimizer)"
            )
        return optimizer.optim.no_sync()
