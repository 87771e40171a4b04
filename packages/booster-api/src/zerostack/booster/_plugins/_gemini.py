"""GeminiPlugin: ZeRO-3 over chunks (zerostack.gemini) behind the Booster,
with ColossalAI's parameter table turned into one GeminiConfig."""

from __future__ import annotations

import functools
import inspect
import logging
import weakref
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
    precision_name,
    refuse_backward_inputs,
    scaler_config,
    scaler_kwargs,
    warn_rank_local_running_stats,
)
from zerostack.booster._plugins._contract import (
    incompatible,
    refuse_moves,
    with_prefix,
    without_prefix,
)
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
    export_entry,
    frozen_names,
    import_entry,
    merge_hyper,
    scaler_state,
)
from zerostack.chunk import default_compute_device
from zerostack.gemini import (
    AutoPlacementConfig,
    GeminiConfig,
    GeminiDDP,
    GeminiOptimizer,
    StaticPlacementConfig,
    load_local_model_state,
    local_model_state,
    local_ranges,
)
from zerostack.shard import LossScalerConfig, check_fraction

logger = logging.getLogger(__name__)
_API = "GeminiPlugin"
_DTYPES = PRECISION_DTYPES
# The defaults of GeminiPlugin's arguments are the configs' (GeminiConfig's
# sub-configs, LossScalerConfig: ColossalAI's GeminiPlugin has the same) and
# GeminiOptimizer's; test_plugin_defaults.py holds them to it.
_GEMINI, _SCALER = GeminiConfig(), LossScalerConfig()
_STATIC, _AUTO, _CHUNK = StaticPlacementConfig(), AutoPlacementConfig(), _GEMINI.chunk
_OPTIM = {n: p.default for n, p in inspect.signature(GeminiOptimizer).parameters.items()}
# ColossalAI's options that are not built here, with the value that means "off".
_NOT_BUILT = {
    "force_outputs_fp32": False,
    "memstats": None,
    "gpu_margin_mem_ratio": 0.0,
    "tp_size": 1,
    "extra_dp_size": 1,
    "enable_all_optimization": False,
    "enable_fused_normalization": False,
    "enable_flash_attention": False,
    "enable_sequence_parallelism": False,
    "enable_jit_fused": False,
    "enable_sequence_overlap": False,
    "use_fp8": False,
    "fp8_communication": False,
}
_HINTS = {
    "gpu_margin_mem_ratio": "placement_policy='auto' decides what steps on the GPU from the "
    "memory it measures; set steady_cuda_cap_ratio or gpu_capacity_bytes instead",
    "force_outputs_fp32": "cast the outputs (or compute the loss in fp32) in your code",
    "memstats": "placement_policy='auto' measures its own statistics in the first step",
}


class GeminiModel(ModelWrapper):
    """A GeminiDDP model (``.module``); ``unwrap()`` is the user's module,
    whose parameters are views into chunks."""

    _API = "GeminiModel"
    module: GeminiDDP

    def __init__(self, module: GeminiDDP, facts: ModelFacts) -> None:
        super().__init__(module)
        self._facts = facts
        refuse = _StateDictRefusal(_refuse_sharded_state_dict, weakref.ref(module))
        for m in module.module.modules():  # a submodule's state_dict() too (a backbone)
            m.register_state_dict_pre_hook(refuse)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def unwrap(self, unwrap_peft: bool = True) -> nn.Module:
        return self.module.module

    def zero_grad(self, set_to_none: bool = True) -> None:
        """GeminiDDP.zero_grad (after an exception in forward or backward,
        it drops the batch, as ``optimizer.zero_grad()`` does)."""
        self.module.zero_grad(set_to_none)

    def _apply(self, fn: Any, recurse: bool = True) -> GeminiModel:
        # See [Note: boosted model methods]
        refuse_moves(self._API, _API, fn, [*self.module.params, *self.unwrap().buffers()])
        return self

    def state_dict(  # type: ignore[override]  # torch.nn.Module.state_dict, whole-model
        self, *args: Any, destination: Any = None, prefix: str = "", keep_vars: bool = False
    ) -> dict[str, torch.Tensor]:
        """The whole model (fp32 parameters from the masters, buffers) keyed
        as torch keys a wrapped module (``"module." + name``), on the CPU.
        A collective: every rank calls it, as ColossalAI's GeminiDDP.state_dict
        (see [Note: boosted model methods]).

        Raises:
            NotImplementedError: ``keep_vars=True`` (the parameters are chunk views).
        """
        if args or keep_vars:
            raise NotImplementedError(
                f"{self._API}.state_dict: positional arguments and keep_vars=True are not "
                f"supported (got {len(args)} positional, keep_vars={keep_vars!r}); the "
                "parameters are views into sharded chunks: call state_dict() for their values"
            )
        return with_prefix(self.module.state_dict(), prefix, destination)

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        """torch's ``load_state_dict`` with ``state_dict()``'s keys: parameters
        and their fp32 masters (GeminiDDP.load_state_dict). Every rank passes
        the whole dict."""
        own, stray = without_prefix(self._API, state_dict, strict, assign)
        self.module.load_state_dict(own, strict=strict)
        return incompatible(self._facts.dtypes, own, stray)

    def full_state_dict(self, only_rank_0: bool = True) -> dict[str, torch.Tensor]:
        """GeminiDDP.state_dict (fp32 from the masters) in the [Note: full
        state format]; every rank takes part in the gathers."""
        state = self.module.state_dict(only_rank_0=only_rank_0)
        return self._facts.export_model(state) if state else {}

    def load_full_state_dict(
        self, state_dict: dict[str, torch.Tensor], strict: bool = True
    ) -> None:
        """GeminiDDP.load_state_dict: parameters and their fp32 masters."""
        self.module.load_state_dict(state_dict, strict=strict)

    def local_ranges(self) -> dict[str, tuple[int, int, int]]:
        """Each parameter's elements in this rank's chunk shares (see
        zerostack.gemini's [Note: local ranges]); buffers whole."""
        return {**local_ranges(self.module), **buffer_ranges(self.unwrap())}

    def sharded_state_dict(self) -> dict[str, Any]:
        """This rank's shares of the fp32 masters (frozen parameters: of their
        chunks) as pieces, buffers whole; see [Note: sharded state format]."""
        out: dict[str, Any] = {}
        for name, (start, _end, values) in local_model_state(self.module).items():
            numel = self._facts.shapes[name].numel()
            out[name] = Piece(values.float(), start, numel)
        out.update(buffer_state(self.unwrap(), self._facts.dtypes))
        return out

    def load_sharded_state_dict(self, values: dict[str, torch.Tensor]) -> None:
        """Masters and parameter chunks from this rank's ranges (a collective:
        kept-gathered chunks are synchronised), buffers whole."""
        load_local_model_state(self.module, values)
        load_buffers(self.unwrap(), values)


class GeminiOptimizerWrapper(BoostedOptimizer):
    """The zerostack.gemini.GeminiOptimizer of a GeminiModel (``.optim``)."""

    _API = "GeminiOptimizer"

    def __init__(self, optimizer: GeminiOptimizer, model: GeminiModel) -> None:
        super().__init__(optimizer)
        self._model = model

    def wait_updates(self) -> None:
        """Finish the last step's CPU updates and write them back: at one rank
        the model's parameters then hold the step's values before the next
        forward (at several, a sharded chunk's parameters stay empty between
        forward passes: read the weights with the model's ``state_dict()``).
        Every rank calls it at the same point: a write-back may all-gather."""
        self._model.module.wait_updates()

    def backward(self, loss: torch.Tensor, inputs: Any = None, retain_graph: bool = False) -> None:
        """``loss.backward()``, scaled for fp16.

        Raises:
            NotImplementedError: ``retain_graph=True``, or ``inputs``.
        """
        refuse_backward_inputs(f"{self._API}.backward", inputs)
        if retain_graph:
            raise NotImplementedError(
                f"{self._API}.backward: retain_graph=True is not supported (got True): GeminiDDP "
                "reduces every chunk's gradient at the end of a backward, so a second backward "
                "through the graph before step() cannot add to it; add the losses and call "
                "backward once"
            )
        self.optim.backward(loss)

    def _step(self, closure: Callable[[], Any] | None = None) -> Any:
        return self._step_closure(closure)

    def get_grad_norm(self, norm_type: float = 2.0, **kwargs: Any) -> float | None:
        """The gradients' total 2-norm (unscaled, before clipping) that the
        last ``step()`` computed, as ColossalAI's GeminiOptimizer gives it;
        None before the first step.

        Raises:
            NotImplementedError: ``norm_type`` other than 2.
        """
        return self._last_step_norm(norm_type)

    def clip_grad_by_norm(
        self,
        max_norm: float,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = False,
        foreach: bool | None = None,
    ) -> torch.Tensor:
        """GeminiOptimizer.clip_grad_by_norm: the norm over every rank's chunk
        shards wherever they live; the step applies the clip (see
        BoostedOptimizer.clip_grad_by_norm)."""
        return self.optim.clip_grad_by_norm(max_norm, norm_type, error_if_nonfinite)

    def _trainable(self) -> list[tuple[str, torch.Tensor]]:
        ddp = self._model.module
        return [(ddp.param_names[p], p) for p in ddp.params if p.requires_grad]

    def full_state_dict(self) -> dict[str, Any]:
        """GeminiOptimizer.full_state_dict in the [Note: full state format]
        (its fp32 "master" entries dropped); every rank takes part."""
        full = self.optim.full_state_dict()
        shapes = self._model._facts.shapes
        state = {
            name: export_entry(entry, shapes[name])
            for name, entry in full["params"].items()
            if set(entry) - {"master"}
        }
        names = [name for name, _ in self._trainable()]
        return {
            "state": state,
            "param_groups": [{**full["param_group"], "params": names}],
            "loss_scaler": full["scaler"],
        }

    def local_ranges(self) -> dict[str, tuple[int, int, int]]:
        return self._model.local_ranges()

    def sharded_state_dict(self) -> dict[str, Any]:
        """GeminiOptimizer.local_state_dict as pieces (no gather); see
        [Note: sharded state format]."""
        local = self.optim.local_state_dict()
        names = [name for name, _ in self._trainable()]
        return {
            "state": optimizer_pieces(
                {n: e for n, e in local["params"].items() if e}, self.local_ranges()
            ),
            "param_groups": [{**local["param_group"], "params": names}],
            "loss_scaler": local["scaler"],
        }

    def _check(self, state_dict: dict[str, Any]) -> list[str]:
        """The trainable parameters' names, once the state is one of this model's."""
        names = [name for name, _ in self._trainable()]
        check_names(self._API, state_dict["state"], set(names))
        check_group_params(
            self._API, state_dict["param_groups"], [names], frozen_names(self._model.unwrap())
        )
        return names

    def load_sharded_state_dict(self, state_dict: dict[str, Any]) -> None:
        """GeminiOptimizer.load_local_state_dict from this rank's ranges of a
        checkpoint of any plugin and world size; the masters keep their values.

        Raises:
            KeyError: the state names a parameter this optimizer lacks.
            ValueError: the state's parameter groups list other parameters than
                this optimizer's (a state of another model); nothing is loaded.
            NotImplementedError: the state's groups differ in hyperparameters.
        """
        opt = self.optim
        names = self._check(state_dict)
        hyper = _one_group(self._API, opt, state_dict["param_groups"], names)
        own = opt.scaler.state_dict() if opt.scaler is not None else None
        opt.load_local_state_dict(
            {
                "params": state_dict["state"],
                "param_group": hyper,
                "scaler": scaler_state(own, state_dict.get("loss_scaler")),
            }
        )

    @torch.no_grad()
    def load_full_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load the [Note: full state format] (from any plugin and world size).

        The masters keep their values (the model state carries the weights).
        A chunk holds one step count: its first parameter's.

        Raises:
            KeyError: the state names a parameter this optimizer lacks.
            ValueError: the state's parameter groups list other parameters than
                this optimizer's (a state of another model); nothing is loaded.
            ValueError: a state tensor's size differs from its parameter's.
            NotImplementedError: the state's parameter groups differ in
                hyperparameters (GeminiOptimizer has one group).
        """
        opt, ddp = self.optim, self._model.module
        names = self._check(state_dict)
        # Its masters are read below: no update of the last step may still
        # write them (on the CPU-step worker, or the device lane's copies back).
        ddp.drop_batch_for_load()
        ddp.wait_updates()
        params: dict[str, dict[str, Any]] = {}
        for (chunk, _), master in zip(opt.pairs, opt.masters, strict=True):
            # GeminiOptimizer slices whole tensors per chunk: each parameter's
            # master needs only the part inside this rank's shard.
            lo = chunk.rank * chunk.shard_size
            hi = lo + chunk.shard_size
            for t, info in chunk.tensors_info.items():
                name = ddp.param_names[t]
                numel = info.end - info.offset
                entry = state_dict["state"].get(name)
                mine = import_entry(self._API, name, entry, numel) if entry else {}
                whole = torch.zeros(numel, dtype=master.dtype)
                a, b = max(info.offset, lo), min(info.end, hi)
                if a < b:
                    whole[a - info.offset : b - info.offset] = master[a - lo : b - lo].cpu()
                mine["master"] = whole
                params[name] = mine
        hyper = _one_group(self._API, opt, state_dict["param_groups"], names)
        own = opt.scaler.state_dict() if opt.scaler is not None else None
        opt.load_full_state_dict(
            {
                "params": params,
                "param_group": hyper,
                "scaler": scaler_state(own, state_dict.get("loss_scaler")),
            }
        )


class _StateDictRefusal(functools.partial):
    """The state_dict pre-hook below, bound to its GeminiDDP; the first
    object ``torch.save(model.unwrap())`` pickles, where torch raised
    "cannot pickle 'weakref.ReferenceType' object". A deep copy goes on
    to GeminiDDP's hooks, which refuse it with their own message."""

    def __deepcopy__(self, memo: dict) -> _StateDictRefusal:
        return _StateDictRefusal(self.func, *self.args)  # the weak reference is shared

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise NotImplementedError(
            "GeminiModel: pickling a module wrapped by GeminiDDP is not supported (got "
            "torch.save or pickle of GeminiPlugin's model.unwrap(), the boosted model, or one "
            "of its submodules): its parameters are views into chunks, empty between steps at "
            "several ranks. Save the weights with booster.save_model(model, path), or "
            "torch.save(model.state_dict()) (call state_dict() on every rank), and rebuild the "
            "module from its class"
        )


def _refuse_sharded_state_dict(
    ddp_ref: Any, module: nn.Module, prefix: str, keep_vars: bool
) -> None:
    """state_dict pre-hook of the user's module under Gemini: its parameters
    are chunk views, empty while their chunk is sharded, and from a backward
    until its step's values are written back (see zerostack.chunk's
    ``Chunk.reduce``)."""
    ddp = ddp_ref()
    if ddp is None:
        return
    manager = ddp.chunk_manager
    for p in module.parameters():
        chunk = manager.tensor_chunk_map.get(p)
        if chunk is not None and p.numel() != chunk.tensors_info[p].shape.numel():
            raise RuntimeError(
                f"{_API}: model.unwrap().state_dict() would hold empty tensors (got "
                f"{ddp.param_names[p]} of shape {tuple(p.shape)}): the parameters are sharded "
                "over the ranks between forward passes, and hold no values from a backward "
                "until the next forward writes the step's back (a submodule's state_dict() too); "
                "call the boosted model's "
                "state_dict() on every rank (it gathers them, as ColossalAI's "
                "GeminiDDP.state_dict) or booster.save_model(model, path)"
            )


def _one_group(api: str, opt: GeminiOptimizer, saved: list[dict], names: list[str]) -> dict:
    """The saved hyperparameters of the groups holding ``names`` (one set:
    GeminiOptimizer holds one group), merged into the current ones."""
    groups = {
        repr(sorted(merged.items())): merged
        for merged in (
            merge_hyper(opt.param_groups[0], g) for g in saved if set(g["params"]) & set(names)
        )
    }
    if len(groups) > 1:
        raise NotImplementedError(
            f"{api}: the state's parameter groups differ in hyperparameters (got "
            f"{len(groups)} different groups); GeminiOptimizer holds one group"
        )
    return next(iter(groups.values()), merge_hyper(opt.param_groups[0], None))


class GeminiPlugin(Plugin):
    """ZeRO-3 over chunks: parameters, gradients, fp32 masters and optimizer
    states sharded over the ranks in chunks that live on the GPU or the CPU
    as the placement says. The arguments build one zerostack.gemini
    GeminiConfig (``GeminiConfig.from_kwargs``), handed to GeminiDDP
    (``plugin.gemini_config``), and the fp16 loss scaler's
    zerostack.shard LossScalerConfig (``plugin.scaler_config``); their
    defaults are those configs' (and GeminiOptimizer's for max_norm,
    overlap_cpu_step, gpu_update_fraction and gc_every_n_steps).

    A model built under ``LazyInitContext`` is materialized by ``boost``
    straight into chunks, one module at a time, with the values an eager
    build would have (any module: transformers models, modules without
    ``reset_parameters``).

    Args:
        chunk_config_dict: ``{dp size: {"chunk_size": int, "keep_gathered":
            bool}}``, skipping the search. Default None.
        chunk_init_device: where chunks are made: only the compute device
            (the current CUDA device, else the CPU). Default None (that one).
        device: ColossalAI's older name for the device the model trains on
            (``GeminiPlugin(device=torch.cuda.current_device())`` in its NVMe
            offload guide): the same as chunk_init_device. Default None.
        placement_policy: "static" or "auto"; ColossalAI's older "cpu"
            (static with shard_param_frac, offload_optim_frac and
            offload_param_frac 1.0) and "cuda" (static, everything on the
            GPU) are taken as those shares. Default "static".
        enable_gradient_accumulation: gradients in chunks of their own, so
            that ``booster.no_sync`` works. Default False.
        max_prefetch: chunks gathered ahead (either policy). Default 0.
        shard_param_frac, offload_optim_frac, offload_param_frac: "static"
            placement shares. Defaults 1.0, 0.0, 0.0.
        warmup_non_model_data_ratio, steady_cuda_cap_ratio: "auto"
            placement ratios. Defaults 0.8, 0.9.
        gpu_capacity_bytes: the device memory "auto" plans for. Default
            None (the CUDA device's; required on a CPU).
        precision: "fp16", "bf16" or "fp32" (ColossalAI has no "fp32"). Default "fp16".
        master_weights: True only. Default True.
        pin_memory: pin CPU chunk shards. Default False.
        search_range_m, hidden_dim, min_chunk_size_m: the chunk search.
            Defaults 32, None, 32.
        initial_scale: the fp16 loss scaler's first scale; min_scale,
            growth_factor, backoff_factor, growth_interval, hysteresis and
            max_scale are its other settings (defaults 2**16, 1, 2, 0.5,
            1000, 2, 2**32).
        max_norm: clip the global gradient norm (0: off). Default 0.0.
        norm_type: 2.0 only. Default 2.0.
        enable_async_reduce: reduce chunks asynchronously. Default True.
        scatter_after_inference: release chunks after a no-grad forward.
            Default True.
        strict_ddp_mode: accepted either way (only data parallelism exists here).
        verbose: log the configuration at WARNING (else DEBUG). Default False.
        overlap_cpu_step, gc_every_n_steps: GeminiOptimizer's. Defaults True, 50.
        gpu_update_fraction: GeminiOptimizer's: about this share of the
            CPU-held optimizer chunks (``offload_optim_frac``, or what auto
            placement leaves on the CPU) is updated by the GPU's Adam, their
            masters and states streamed from the host and back; HybridAdam
            only. In [0, 1], or "auto": the share the step-time model finds
            fastest on this machine (0.0 where none can run; the log says
            why), under auto placement weighed against CPU Adam alone at the
            first step. Default None: "auto" under auto placement, 0.0 under
            static (see GeminiOptimizer).
        force_outputs_fp32: ColossalAI's, not implemented, as are memstats,
            gpu_margin_mem_ratio, tp_size, extra_dp_size,
            enable_all_optimization, enable_fused_normalization,
            enable_flash_attention, enable_sequence_parallelism,
            enable_jit_fused, enable_sequence_overlap, use_fp8 and
            fp8_communication: anything but their default raises.

    Raises:
        ValueError: a bad precision, share, policy, max_norm or loss scaler
            setting (the configs' checks).
        NotImplementedError: one of the options above that are not built,
            norm_type other than 2, master_weights=False.
    """

    def __init__(
        self,
        chunk_config_dict: Mapping[int, Mapping[str, Any]] | None = _CHUNK.chunk_config_dict,
        chunk_init_device: torch.device | str | None = None,
        placement_policy: str = "static",
        enable_gradient_accumulation: bool = _CHUNK.enable_gradient_accumulation,
        max_prefetch: int = _AUTO.max_prefetch,
        shard_param_frac: float = _STATIC.shard_param_frac,
        offload_optim_frac: float = _STATIC.offload_optim_frac,
        offload_param_frac: float = _STATIC.offload_param_frac,
        warmup_non_model_data_ratio: float = _AUTO.warmup_non_model_data_ratio,
        steady_cuda_cap_ratio: float = _AUTO.steady_cuda_cap_ratio,
        precision: str = precision_name(_GEMINI.precision.param_dtype),
        master_weights: bool = True, pin_memory: bool = _CHUNK.pin_memory,
        force_outputs_fp32: bool = False, strict_ddp_mode: bool = False,
        search_range_m: int = _CHUNK.search_range_m, hidden_dim: int | None = _CHUNK.hidden_dim,
        min_chunk_size_m: float = _CHUNK.min_chunk_size_m,
        memstats: Any = None, gpu_margin_mem_ratio: float = 0.0,
        initial_scale: float = _SCALER.initial_scale, min_scale: float = _SCALER.min_scale,
        growth_factor: float = _SCALER.growth_factor,
        backoff_factor: float = _SCALER.backoff_factor,
        growth_interval: int = _SCALER.growth_interval, hysteresis: int = _SCALER.hysteresis,
        max_scale: float = _SCALER.max_scale,
        max_norm: float = _OPTIM["max_norm"], norm_type: float = 2.0,
        tp_size: int = 1, extra_dp_size: int = 1, enable_all_optimization: bool = False,
        enable_fused_normalization: bool = False, enable_flash_attention: bool = False,
        enable_sequence_parallelism: bool = False, enable_jit_fused: bool = False,
        enable_sequence_overlap: bool = False,
        enable_async_reduce: bool = _GEMINI.enable_async_reduce,
        use_fp8: bool = False, verbose: bool = False, fp8_communication: bool = False,
        *,
        device: torch.device | str | int | None = None,
        gpu_capacity_bytes: int | None = _AUTO.gpu_capacity_bytes,
        scatter_after_inference: bool = _GEMINI.scatter_after_inference,
        overlap_cpu_step: bool = _OPTIM["overlap_cpu_step"],
        gpu_update_fraction: float | str | None = _OPTIM["gpu_update_fraction"],
        gc_every_n_steps: int = _OPTIM["gc_every_n_steps"],
    ) -> None:  # fmt: skip
        _refuse_not_built(dict(
            force_outputs_fp32=force_outputs_fp32, memstats=memstats,
            gpu_margin_mem_ratio=gpu_margin_mem_ratio, tp_size=tp_size,
            extra_dp_size=extra_dp_size, enable_all_optimization=enable_all_optimization,
            enable_fused_normalization=enable_fused_normalization,
            enable_flash_attention=enable_flash_attention,
            enable_sequence_parallelism=enable_sequence_parallelism,
            enable_jit_fused=enable_jit_fused, enable_sequence_overlap=enable_sequence_overlap,
            use_fp8=use_fp8, fp8_communication=fp8_communication,
        ))  # fmt: skip
        check_zero_options(_API, precision, norm_type, max_norm)
        self.precision = precision
        self.chunk_init_device = _init_device(chunk_init_device, device)
        self.enable_gradient_accumulation = enable_gradient_accumulation
        self.verbose = verbose
        self.gemini_config = GeminiConfig.from_kwargs(
            placement_policy=placement_policy, shard_param_frac=shard_param_frac,
            offload_optim_frac=offload_optim_frac, offload_param_frac=offload_param_frac,
            warmup_non_model_data_ratio=warmup_non_model_data_ratio,
            steady_cuda_cap_ratio=steady_cuda_cap_ratio, gpu_capacity_bytes=gpu_capacity_bytes,
            max_prefetch=max_prefetch, search_range_m=search_range_m, hidden_dim=hidden_dim,
            min_chunk_size_m=min_chunk_size_m, pin_memory=pin_memory,
            chunk_config_dict=chunk_config_dict,
            enable_gradient_accumulation=enable_gradient_accumulation,
            mixed_precision=_DTYPES[precision], enable_async_reduce=enable_async_reduce,
            scatter_after_inference=scatter_after_inference, master_weights=master_weights,
        )  # fmt: skip
        self.scaler_config = scaler_config(_API, locals())
        if gpu_update_fraction is not None:  # None: GeminiOptimizer's default
            check_fraction(_API, gpu_update_fraction)
        self.optim_kwargs: dict[str, Any] = dict(
            max_norm=max_norm, overlap_cpu_step=overlap_cpu_step,
            gpu_update_fraction=gpu_update_fraction, gc_every_n_steps=gc_every_n_steps,
        )  # fmt: skip

    def supported_precisions(self) -> list[str]:
        return list(_DTYPES)

    def control_precision(self) -> bool:
        return True

    def support_no_sync(self) -> bool:
        return self.enable_gradient_accumulation

    def _device(self) -> torch.device:
        device = default_compute_device()
        if self.chunk_init_device is not None:
            wanted = torch.device(self.chunk_init_device)
            same = wanted.type == device.type and (
                wanted.index is None or wanted.index == device.index
            )
            if not same:
                raise NotImplementedError(
                    f"{_API}: chunk_init_device other than the compute device is not implemented "
                    f"(got {wanted}, the compute device is {device}); leave chunk_init_device=None "
                    "(offload with offload_param_frac / offload_optim_frac)"
                )
        return device

    def configure(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | GeminiOptimizerWrapper | None = None,
        criterion: Callable | None = None,
        dataloader: Any = None,
        lr_scheduler: Any = None,
    ) -> tuple:
        """Wrap the model in GeminiDDP (a lazily built model is materialized
        into the chunks) and the optimizer in GeminiOptimizer."""
        log = logger.warning if self.verbose else logger.debug
        if not isinstance(model, GeminiModel):
            warn_rank_local_running_stats(_API, model)
            facts = ModelFacts.of(model)
            ddp = GeminiDDP(model, self.gemini_config, compute_device=self._device())
            model = GeminiModel(ddp, facts)
            log("%s: %s", _API, self.gemini_config)
        if optimizer is not None and not isinstance(optimizer, GeminiOptimizerWrapper):
            user = optimizer
            scaler = scaler_kwargs(_API, self.precision, self.scaler_config, _SCALER)
            gemini = GeminiOptimizer(optimizer, model.module, **self.optim_kwargs, **scaler)
            optimizer = GeminiOptimizerWrapper(gemini, model)
            attach_scheduler(lr_scheduler, optimizer, user)
        return model, optimizer, criterion, dataloader, lr_scheduler

    def no_sync(self, model: nn.Module | None = None, optimizer: Any = None):
        """GeminiDDP's no_sync (gradients accumulate in their chunks).

        Raises:
            NotImplementedError: built without enable_gradient_accumulation.
            ValueError: ``model`` is not one boosted by this plugin.
        """
        if not self.enable_gradient_accumulation:
            raise NotImplementedError(
                f"{_API}: no_sync needs gradient chunks (got enable_gradient_accumulation=False); "
                "build GeminiPlugin(enable_gradient_accumulation=True)"
            )
        if not isinstance(model, GeminiModel):
            raise ValueError(
                f"{_API}.no_sync: pass the boosted model (got {type(model).__name__}); "
                "booster.no_sync(model)"
            )
        return model.module.no_sync()


def _init_device(
    chunk_init_device: torch.device | str | None, device: torch.device | str | int | None
) -> torch.device | str | None:
    """``device=`` (ColossalAI's older argument) as chunk_init_device; an int is
    a CUDA index, as ``torch.cuda.current_device()`` returns."""
    if device is None:
        return chunk_init_device
    if isinstance(device, bool) or not isinstance(device, int | str | torch.device):
        raise TypeError(
            f"{_API}: device must be a torch.device, a str or a CUDA index (got "
            f"{type(device).__name__}); pass e.g. torch.cuda.current_device()"
        )
    wanted = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if chunk_init_device is not None and torch.device(chunk_init_device) != wanted:
        raise ValueError(
            f"{_API}: device and chunk_init_device name the same thing and disagree (got "
            f"device={wanted}, chunk_init_device={chunk_init_device!r}); pass one of them"
        )
    return wanted


def _refuse_not_built(given: dict[str, Any]) -> None:
    """Refuse ColossalAI's options that are not built here, unless off."""
    for name, off in _NOT_BUILT.items():
        if given[name] is not off and given[name] != off:
            hint = _HINTS.get(name, f"leave {name}={off!r} (only data parallelism is built)")
            raise NotImplementedError(
                f"{_API}: {name} is not implemented (got {given[name]!r}); {hint}"
            )
