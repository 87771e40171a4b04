"""ZeroOptimizer: ZeRO stage 1/2 around any torch optimizer."""

from __future__ import annotations

import contextlib
import logging
import threading
import warnings
import weakref
from collections.abc import Iterator
from enum import Enum
from typing import Any

import torch
import torch.distributed as dist

from zerostack.chunk import (
    all_gather_into,
    debug_collectives,
    phase,
    rank_and_world,
    set_collective_label,
)
from zerostack.shard import _partition as part
from zerostack.shard import _state_dict as _formats
from zerostack.shard._bucket import (
    BufferRing,
    _Bucket,
    _Shard,
    make_buckets,
    make_shards,
    pin_offload_buffers,
)
from zerostack.shard._clip import check_clip_args, grad_stats, norm_part, record_clip
from zerostack.shard._config import CPU_UPDATE_NUMEL, ZeroConfig, check_cpu_update_numel
from zerostack.shard._cpu_pipeline import CpuUpdatePipeline, wait_event, write_failed
from zerostack.shard._device_lane import DeviceLane, lane_writable
from zerostack.shard._flat import check_flat_optimizer
from zerostack.shard._gc import CollectorSchedule
from zerostack.shard._grad_guard import ShardedGradient, say_zero_grads_are_dropped
from zerostack.shard._hooks import register_forward_hooks, register_grad_hooks
from zerostack.shard._hyper import (
    foreign_keys,
    hyperparameters,
    mark_stepped,
    refuse_user_add_param_group,
    refuse_user_state_dict,
    stepping_twin,
    with_user_step_hooks,
)
from zerostack.shard._lane import LaneProgress, check_lane_optimizer, lane_members, lane_refusal
from zerostack.shard._loss_scaler import DynamicLossScaler
from zerostack.shard._machine import resolve_gpu_update_fraction
from zerostack.shard._mixed_precision import (
    make_loss_scaler,
    plan_step,
    step_with_div_scale,
    takes_div_scale,
)
from zerostack.shard._rank0_sync import sync_from_rank0
from zerostack.shard._reduction import BucketBuffers, GradientReduction

logger = logging.getLogger(__name__)
_API = "ZeroOptimizer"
LANE_WINDOW = 2**24
"""Elements (over all ranks) of a staging slot of the device lane
(``gpu_update_fraction``), whatever ``reduce_bucket_size`` is: two slots of
14 B an element with bf16 parameters, 470 MB on one GPU, where a DeepSpeed
config's ``reduce_bucket_size`` of 5e8 would make them 14 GB."""


# Inner optimizers already wrapped by a ZeroOptimizer (whose groups now hold masters).
_WRAPPED: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()


def _check_args(
    optimizer: torch.optim.Optimizer,
    stage: int,
    reduce_bucket_size: int,
    max_norm: float,
    communication_dtype: torch.dtype | None,
    module: object,
    gpu_update_fraction: float | str | None,
) -> None:
    if isinstance(optimizer, ZeroOptimizer):
        raise TypeError(
            f"{_API}: the optimizer is a ZeroOptimizer already (got {optimizer!r}); wrap the "
            "torch optimizer once"
        )
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"{_API}: optimizer must be a torch.optim.Optimizer built on the model's parameters "
            f"(got {type(optimizer).__name__})"
        )
    check_flat_optimizer(_API, optimizer, chunks=False)  # See [Note: optimizers over flat pieces]
    if optimizer in _WRAPPED:
        raise RuntimeError(
            f"{_API}: this optimizer is wrapped by a ZeroOptimizer already (its groups hold that "
            "wrapper's master shards); build a new torch optimizer to wrap again"
        )
    ZeroConfig(stage=stage, reduce_bucket_size=reduce_bucket_size, max_norm=max_norm,
               communication_dtype=communication_dtype,
               gpu_update_fraction=gpu_update_fraction)  # fmt: skip
    if module is not None and not isinstance(module, torch.nn.Module):
        raise TypeError(
            f"{_API}: module must be an nn.Module or None (got {type(module).__name__})"
        )
    if optimizer.state:
        raise ValueError(
            f"{_API}: wrap the optimizer before its first step (it already has state: got state "
            f"for {len(optimizer.state)} tensors, from a step or optimizer.load_state_dict before "
            "the wrap); wrap a fresh optimizer (booster.boost), then load the optimizer checkpoint "
            "into the wrapper (booster.load_optimizer, as ColossalAI's Booster)"
        )


def _params_and_device(
    optimizer: torch.optim.Optimizer,
) -> tuple[list[torch.Tensor], torch.device]:
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if not params:
        raise ValueError(f"{_API}: the optimizer has no parameters")
    for i, p in enumerate(params):
        if p.is_meta:
            raise ValueError(
                f"{_API}: param {i} (shape {tuple(p.shape)}) is on the meta device; materialize "
                "the model before wrapping its optimizer"
            )
        if not p.is_floating_point():
            raise TypeError(
                f"{_API}: param {i} (shape {tuple(p.shape)}) must be floating point (got {p.dtype})"
            )
    devices = {p.device for p in params}
    if len(devices) != 1:
        raise ValueError(f"{_API}: parameters on several devices (got {sorted(map(str, devices))})")
    return params, next(iter(devices))


def _names_and_rank0_values(
    module: torch.nn.Module | None, params: list[torch.Tensor], group: dist.ProcessGroup | None
) -> dict[int, str]:
    """Parameter names by id; checks that the optimizer covers the module,
    then makes every rank hold rank 0's parameters (and the module's
    buffers), see [Note: rank 0's initial values]."""
    names: dict[int, str] = {}
    if module is not None:
        in_opt = {id(p) for p in params}
        for n, p in module.named_parameters():
            if p.requires_grad and id(p) not in in_opt:
                raise ValueError(
                    f"{_API}: parameter {n!r} of the module is missing from the wrapped "
                    "optimizer; build the optimizer on model.parameters()"
                )
        names = {id(p): n for n, p in module.named_parameters()}
    # The module's frozen parameters and buffers too, as DDP; tensors met twice count once.
    named = [*module.named_parameters(), *module.named_buffers()] if module is not None else []
    named += [(f"param {i}", p) for i, p in enumerate(params)]
    sync_from_rank0(named, group=group, api=_API)
    return names


def _offload_fraction(
    optimizer: torch.optim.Optimizer, cpu_offload: bool, overlap_cpu_step: object,
    fraction: float | str | None, params: list[torch.Tensor], group: Any,
) -> float:  # fmt: skip
    """The offload arguments checked, and ``gpu_update_fraction`` as a number
    (None: "auto" with cpu_offload, else 0.0; ``"auto"`` resolved, see
    [Note: gpu_update_fraction="auto"])."""
    asked = fraction is not None
    if not asked:
        fraction = "auto" if cpu_offload else 0.0
    why_not = _check_offload_args(optimizer, cpu_offload, overlap_cpu_step, fraction, params)
    if not cpu_offload and fraction != "auto":
        return 0.0
    return resolve_gpu_update_fraction(
        _API, fraction, params[0].device, why_not, params[0].element_size(), group=group,
        required=asked,
    )  # fmt: skip


def _check_offload_args(
    optimizer: torch.optim.Optimizer, cpu_offload: bool, overlap_cpu_step: object,
    fraction: float | str, params: list[torch.Tensor],
) -> str | None:  # fmt: skip
    """Raises for bad offload arguments; for ``gpu_update_fraction="auto"``
    returns why no split can run (None: one can)."""
    if not isinstance(overlap_cpu_step, bool):
        raise TypeError(f"{_API}: overlap_cpu_step must be a bool (got {overlap_cpu_step!r})")
    if cpu_offload:
        _check_cpu_kernel(optimizer)
    device = params[0].device
    if fraction == "auto":
        if not cpu_offload:
            return "cpu_offload is off: every update runs on the compute device already"
        odd = next((p for p in params if not lane_writable(p)), None)
        if odd is not None:
            return (
                f"a parameter (shape {tuple(odd.shape)}, stride {odd.stride()}) is not "
                "contiguous, and the device lane writes parameters as flat pieces"
            )
        return lane_refusal(_API, optimizer, device, torch_adam=True)
    if fraction == 0:
        return None
    if not cpu_offload:
        warnings.warn(
            f"{_API}: gpu_update_fraction has no effect without cpu_offload (got "
            f"gpu_update_fraction={fraction}): every update runs on the compute device already; "
            "set cpu_offload=True or leave gpu_update_fraction at 0",
            UserWarning,
            stacklevel=3,
        )
        return None
    check_lane_optimizer(_API, optimizer, device, torch_adam=True)
    return None


def _check_cpu_kernel(optimizer: torch.optim.Optimizer) -> None:
    """What ``_cpu_kernel`` would reject, checked before the masters replace
    the optimizer's parameters (a failed wrap leaves the optimizer as it was)."""
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        return
    try:
        import zerostack.fused_adam  # noqa: F401
    except ImportError:
        raise ImportError(
            f"{_API}: cpu_offload with {type(optimizer).__name__} steps through zerostack-fused-adam's "
            "CPU kernel: pip install zerostack-fused-adam (or pass a CPU optimizer of your own)"
        ) from None
    _refuse_cpu_kernel_flags(optimizer.param_groups, _API)


def _refuse_cpu_kernel_flags(groups: list[dict[str, Any]], api: str) -> None:
    """fused-adam's CPU kernel has no amsgrad or maximize: refused at
    construction, and at each step where a group set one since (it would
    be dropped with the keys torch's Adam and CPUAdam do not share)."""
    for g in groups:
        if g.get("amsgrad") or g.get("maximize"):
            raise NotImplementedError(
                f"{api}: cpu_offload does not support amsgrad or maximize (got amsgrad="
                f"{g.get('amsgrad')}, maximize={g.get('maximize')}): it steps torch's Adam and "
                "AdamW through fused-adam's CPU kernel, which has neither; set them to False, or "
                "train without cpu_offload"
            )


def _cpu_kernel(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Adam/AdamW on offloaded masters steps through fused-adam's CPU kernel."""
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        return optimizer
    from zerostack.fused_adam import CPUAdam  # checked by _check_cpu_kernel

    adamw = type(optimizer) is torch.optim.AdamW
    groups = []
    for g in optimizer.param_groups:
        # torch's Adam(decoupled_weight_decay=True) is AdamW.
        decoupled = adamw or bool(g.get("decoupled_weight_decay", False))
        groups.append(
            dict(params=g["params"], lr=float(g["lr"]), betas=tuple(g["betas"]), eps=g["eps"],
                 weight_decay=g["weight_decay"], adamw_mode=decoupled)
        )  # fmt: skip
    logger.info(
        "ZeRO: cpu_offload steps %s through CPUAdam (adamw_mode=%s)",
        type(optimizer).__name__,
        adamw,
    )
    return CPUAdam(groups, adamw_mode=adamw)


def _spans(positions: list[int]) -> str:
    """Ascending ints as runs: [0, 1, 2, 5, 7, 8] -> "0-2, 5, 7-8"."""
    runs: list[list[int]] = []
    for k in positions:
        if runs and k == runs[-1][-1] + 1:
            runs[-1].append(k)
        else:
            runs.append([k])
    return ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else f"{r[0]}" for r in runs)


def _offload_pipeline(
    overlap: bool, device: torch.device, members: dict[int, list[int]]
) -> CpuUpdatePipeline:
    """cpu_offload's updates, one per CPU Adam call (``members``: its
    buckets' positions in write-back order, by the first's) or device-lane
    bucket, keyed by the first bucket's position. See [Note: offloaded step
    pipeline]."""

    def unit(key: int) -> str:  # the dict, not the optimizer: see [Note: a dropped owner is freed]
        positions = members.get(key, [key])
        if len(positions) == 1:
            return f"bucket {key} (in write-back order)"
        return f"buckets {_spans(positions)} (in write-back order, one CPU Adam call)"

    return CpuUpdatePipeline(
        _API, unit, overlap, device, retry_at="forward, backward or step",
        write_back_stream=True,
    )  # fmt: skip


def _refuse_user_steps(zero: ZeroOptimizer, optimizer: torch.optim.Optimizer) -> None:
    """The optimizer the user built, once ZeroOptimizer took its groups
    over: they hold the masters, which have a gradient only inside
    ZeroOptimizer's step, so its own ``step()`` from the user's loop (the
    object passed to ``booster.boost`` rather than the one returned) did
    nothing, silently. It raises instead; ZeroOptimizer's calls pass. Like
    torch's lr schedulers' wrapper of ``step``, which it calls when one is
    there, it holds the optimizer weakly (no cycle keeps the masters), and
    ZeroOptimizer too (see [Note: hooks hold the optimizer weakly]); marked
    as theirs, so a scheduler built later does not wrap it (ZeroOptimizer
    marks the user's optimizer stepped: ``mark_stepped``). Its
    ``add_param_group`` raises too: a group added now would hold no
    master, and its gradients would pile up, never cleared or stepped."""
    me, opt_ref = weakref.ref(zero), weakref.ref(optimizer)
    inner = optimizer.__dict__.get("step")  # a scheduler's wrapper, or None: the class's
    method = type(optimizer).step

    def step(*args: Any, **kwargs: Any) -> Any:
        owner, opt = me(), opt_ref()
        if owner is not None and not owner._stepping:
            raise RuntimeError(
                f"{type(opt).__name__}.step: this optimizer was handed to {_API} (through "
                "booster.boost or directly), whose shards hold the gradients; its own step() "
                "would change nothing. Step the optimizer booster.boost returned (or the "
                f"{_API})"
            )
        return inner(*args, **kwargs) if inner is not None else method(opt, *args, **kwargs)

    step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.step = step  # type: ignore[method-assign]
    refuse_user_add_param_group(optimizer, _API, "which replaced its parameters by fp32 masters")


class TrainingState(Enum):
    """Where a ZeroOptimizer is in a training step (changed only by ``_transition``)."""

    IDLE = 0  # no gradient since the last step: the shards and buckets hold none
    ACCUMULATED = 1  # a backward under no_sync() ran: its gradients sit unreduced in param.grad
    REDUCING = 2  # a backward outside no_sync() ran: its buckets reduce (or wait for step())
    CLIPPED = 3  # clip_grad_by_norm reduced every bucket: the shards hold the reduced pieces
    UNFINISHED = 4  # a CPU update or write-back of step() raised: its buckets wait for a retry


T = TrainingState
# [Note: ZeRO training state table] The first gradient of a backward moves
# IDLE to ACCUMULATED (inside no_sync()) or REDUCING, and ACCUMULATED to
# REDUCING (outside no_sync()); other gradients move nothing (a backward
# under no_sync() after a reduced one stays REDUCING: the reduced pieces are
# kept, and step() adds the next reduction to them). clip_grad_by_norm moves
# every state but UNFINISHED to CLIPPED, where a backward is refused. A
# synchronous CPU step (overlap_cpu_step=False, or no module) is UNFINISHED
# until every update is written back. step() and zero_grad() end in IDLE
# from every state (see [Note: dropping a batch]). no_sync() is a scope, not
# a state: it decides where a backward's gradients go and, as in torch's
# DDP, outlasts a zero_grad() or step() inside it.
_MOVES: dict[TrainingState, frozenset[TrainingState]] = {
    T.IDLE: frozenset({T.ACCUMULATED, T.REDUCING, T.CLIPPED, T.UNFINISHED}),
    T.ACCUMULATED: frozenset({T.REDUCING, T.CLIPPED, T.UNFINISHED, T.IDLE}),
    T.REDUCING: frozenset({T.CLIPPED, T.UNFINISHED, T.IDLE}),
    T.CLIPPED: frozenset({T.UNFINISHED, T.IDLE}),
    T.UNFINISHED: frozenset({T.IDLE}),
}


class ZeroOptimizer:
    """ZeRO stage 1 or 2 around a torch optimizer built on the model's params.

    Each rank keeps an fp32 master copy of its piece of every parameter (see
    [Note: per-parameter pieces]) and the inner optimizer's state for it: the
    optimizer states are 1/N per rank (stage 1), and so are the reduced
    gradients (stage 2). Gradients are reduced in buckets from
    ``register_post_accumulate_grad_hook`` during backward, all-reduced
    (stage 1) or reduce-scattered (stage 2), asynchronously and on a side
    stream on CUDA. After the inner step the updated pieces are all-gathered
    back into the parameters.

    Only the fp16 loss scaler skips steps: a non-finite gradient norm with
    fp16 parameters skips the step on every rank and backs the scale off;
    bf16/fp32 gradients are applied as they are, inf/nan included, as torch's
    optimizers would, with a warning (see [Note: overflow policy]).

    Args:
        optimizer: a torch optimizer over the model's parameters, before its
            first step (e.g. ``torch.optim.AdamW(model.parameters())``).
        stage: 1 or 2. Default 2.
        reduce_bucket_size: elements per gradient bucket. Default 2**24.
        overlap_communication: reduce during backward (side stream on CUDA);
            False reduces everything at ``step``. Default True.
        communication_dtype: dtype gradients travel in. Default: the params'.
        cpu_offload: keep masters and optimizer states on the CPU; Adam/AdamW
            then steps through zerostack-fused-adam's CPU kernel. Default False.
        overlap_cpu_step: with ``cpu_offload``, update the buckets on a
            worker thread, consecutive ones in one CPU Adam call of
            ``cpu_update_numel`` elements, while the updated ones go to the
            device (see [Note: offloaded step pipeline]); with ``module``
            given, ``step()`` returns before the updates finish and each
            module's forward waits for the calls holding its parameters.
            Read the parameters in forward, through ``model.state_dict()``, or after
            ``wait_updates()``; step lr schedulers on this object's
            ``param_groups``. Updates start at ``step()``, never during
            backward (see [Note: dropping a batch]). Default True.
        gpu_update_fraction: with ``cpu_offload``, about this share of the
            offloaded elements (whole buckets, spread through the order the
            next forward uses them) is updated by the compute device's fused Adam
            instead of CPU Adam: their fp32 masters and Adam states stay on
            the host between steps and are streamed to the device and back
            at ``step()``, their gradients stay on the device (see [Note:
            Adam where the bandwidth is]). The same math, bit for bit: the
            CUDA kernel does CPU Adam's operations. ``step_floor``'s
            ``split.gpu_fraction`` gives the share a measured machine favours.
            In [0, 1]; needs Adam/AdamW. ``"auto"``: that share, from this
            machine's profile (measured once per process, a second or more, or
            read from the file ``ZEROSTACK_MACHINE_PROFILE`` names), 0.0
            where no split can run; the log says what it chose and why (see
            [Note: gpu_update_fraction="auto"]). Default None: "auto" with
            ``cpu_offload`` (a profile that cannot be taken gives 0.0 with a
            warning), else 0.0. The GPU's share keeps its gradients on the
            device until ``step()`` (2 bytes per bf16/fp16 element of this
            rank's pieces): pass 0.0 to keep every gradient on the host.
        cpu_update_numel: with ``cpu_offload``, a CPU Adam call steps
            consecutive buckets (in write-back order) until it holds this
            many elements of this rank's pieces; 1 makes one call per bucket.
            Also a property, read at each ``step()`` (see [Note: CPU Adam
            calls span buckets]). Default 2**26.
        master_weights: keep fp32 masters for fp16/bf16 params. Default True.
        max_norm: clip the global gradient norm to this (0: off). Default 0.0.
        gc_every_n_steps: Python's cycle collector runs only every this many
            steps, from the first step on (see [Note: collector schedule]); 0
            leaves the collector alone. Default 50.
        loss_scaler: the fp16 loss scaler to use. Default None: a
            ``DynamicLossScaler`` built from ``scaler_kwargs``. Used only when
            a parameter is fp16 (a warning says so otherwise).
        process_group: the data-parallel group. Default: the default group.
        module: the model, optional; when given, every trainable parameter of
            it must be in ``optimizer`` and messages use its parameter names.
        debug_collectives: True: before every collective, check that all
            ranks issue the same one, and raise CollectiveMismatchError on
            every rank instead of hanging (a blocking exchange per collective;
            for debugging). Switches it for the whole process. Default None:
            the ``ZEROSTACK_DEBUG_COLLECTIVES`` environment variable decides.
        **scaler_kwargs: ``initial_scale``, ``min_scale``, ``growth_factor``,
            ``backoff_factor``, ``growth_interval``, ``hysteresis``,
            ``max_scale`` of the ``DynamicLossScaler`` (its defaults when
            left out), instead of ``loss_scaler``.

    Raises:
        ValueError: stage not 1 or 2, an optimizer that already stepped, a
            trainable module parameter missing from the optimizer, mixed
            devices, gpu_update_fraction outside [0, 1], cpu_update_numel
            below 1.
        TypeError: an unknown keyword, ``loss_scaler`` and scaler keywords
            together, or a cpu_update_numel that is not an int.
        ImportError: cpu_offload with Adam/AdamW but no zerostack-fused-adam.
        NotImplementedError: gpu_update_fraction > 0 with an optimizer other
            than Adam/AdamW or with Adam states on disk.
    """

    _warned_idle = False  # step() without a gradient, said once
    _end_queued = False  # _end_backward queued for the running backward
    _ended = False  # _end_backward ran since the last step: every parameter has its guard

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        stage: int = 2,
        reduce_bucket_size: int = 2**24,
        overlap_communication: bool = True,
        communication_dtype: torch.dtype | None = None,
        cpu_offload: bool = False,
        overlap_cpu_step: bool = True,
        gpu_update_fraction: float | str | None = None,
        cpu_update_numel: int = CPU_UPDATE_NUMEL,
        master_weights: bool = True,
        max_norm: float = 0.0,
        gc_every_n_steps: int = 50,
        loss_scaler: DynamicLossScaler | None = None,
        process_group: dist.ProcessGroup | None = None,
        module: torch.nn.Module | None = None,
        debug_collectives: bool | None = None,
        **scaler_kwargs: Any,
    ) -> None:
        _check_args(optimizer, stage, reduce_bucket_size, max_norm, communication_dtype, module,
                    gpu_update_fraction)  # fmt: skip
        self._take_cpu_update_numel(cpu_update_numel, cpu_offload)
        params, self.device = _params_and_device(optimizer)
        names = _names_and_rank0_values(module, params, process_group)
        self.fp16 = any(p.dtype == torch.float16 for p in params)
        self.scaler = make_loss_scaler(_API, self.fp16, loss_scaler, scaler_kwargs)
        self.collector = CollectorSchedule(_API, gc_every_n_steps)
        # After the cheap checks: "auto" may measure the machine for a second.
        offload = (optimizer, cpu_offload, overlap_cpu_step, gpu_update_fraction)
        self.gpu_update_fraction = _offload_fraction(*offload, params, process_group)
        if debug_collectives is not None:
            _set_debug(debug_collectives)
        self.stage = stage
        self.group = process_group
        self.rank, self.world = rank_and_world(process_group)
        self.max_norm = max_norm
        self.overlap = overlap_communication
        self.cpu_offload = cpu_offload
        weakref.finalize(self, self.collector.close)
        self.comm_dtype = communication_dtype
        master_device = torch.device("cpu") if cpu_offload else self.device
        # Masters replace the params inside the inner optimizer's groups.
        self.shards: list[_Shard] = make_shards(
            optimizer, world=self.world, rank=self.rank, master_device=master_device,
            master_weights=master_weights, names=names,
        )  # fmt: skip
        self._take_optimizer(optimizer, cpu_offload)
        self._lay_out_buckets(reduce_bucket_size)
        self._pipe: CpuUpdatePipeline | None = None
        if cpu_offload:
            self._pipe = _offload_pipeline(overlap_cpu_step, self.device, self._members)
            # Not the pipeline: its failed updates, kept, hold self. See [Note: a dropped owner is freed]
            weakref.finalize(self, self._pipe.closer())
            if hasattr(self.optimizer, "set_step_waiter"):  # its figures wait for the worker
                self.optimizer.set_step_waiter(self._pipe.settle)
            if self._pipe.stream is not None:
                for bucket in self.buckets:
                    # The host waits for these two (blocking: no spinning
                    # next to CPU Adam's threads); streams wait for `written`.
                    bucket.copied = torch.cuda.Event(blocking=True)
                    bucket.written = torch.cuda.Event()
        self._defer = self._pipe is not None and self._pipe.overlapping and module is not None
        self._state = T.IDLE  # See [Note: ZeRO training state table]
        self._no_sync = False  # inside no_sync(): a scope, not a state
        # Whether this step's gradients came through backward(), which scales
        # the loss (fp16 gradients that did not, _unscaled, are refused at step()).
        self._scaled_backward = self._unscaled = False
        # clip_grad_by_norm (see [Note: gradient clipping]): the coefficient
        # recorded for the coming step, and this step's squared norm it took.
        self._clip = 1.0
        self._clip_norm_sq: torch.Tensor | None = None
        self._update_lock = threading.Lock()  # see _cpu_update
        self._hooked: set[int] = set()  # See [Note: parameters read outside their module]
        self._await_all = False
        self._hooks = register_grad_hooks(self)
        if self._defer:
            self._hooks += register_forward_hooks(self, module)
        self._log_layout(master_device)

    def _take_optimizer(self, optimizer: torch.optim.Optimizer, cpu_offload: bool) -> None:
        """Take over ``optimizer`` (its groups hold the masters now) and pick
        the one that steps the masters: the same, or with ``cpu_offload``
        fused-adam's CPUAdam for Adam/AdamW, else a twin of the user's
        optimizer, whose groups follow the user's."""
        _WRAPPED.add(optimizer)
        self.optimizer = optimizer
        # What users see and change (see [Note: the user's hyperparameters]):
        # their optimizer's groups; with cpu_offload, updates read the groups
        # of another optimizer, filled from these when no update runs.
        self._groups: list[dict] | None = None
        self._foreign: frozenset[str] = frozenset()
        if cpu_offload:
            inner = _cpu_kernel(optimizer)
            self.optimizer = inner if inner is not optimizer else stepping_twin(optimizer)
            self._groups = optimizer.param_groups
            self._foreign = foreign_keys(optimizer, self.optimizer)
            _WRAPPED.add(self.optimizer)
            refuse_user_state_dict(optimizer, _API)  # See [Note: the user's optimizer's state_dict]
        self._user = optimizer
        if hasattr(self.optimizer, "nvme_host_params"):
            # Only host-held states go to disk, on a CPU compute device as on a GPU.
            self.optimizer.nvme_host_params(
                [s.master for s in self.shards] if cpu_offload else [],
                f"{_API} keeps the fp32 masters and their states on the compute device (got "
                "cpu_offload=False); set cpu_offload=True (LowLevelZeroPlugin(cpu_offload=True), "
                "DeepSpeed's offload_optimizer device 'cpu')",
            )
        if hasattr(self.optimizer, "nvme_plan"):
            # fused-adam's optimizers put Adam states on disk for the tensors
            # they step: the masters, from now on (a full disk fails here).
            self.optimizer.nvme_plan([])
        self._div_scale = takes_div_scale(self.optimizer)
        # The CPU kernel writes the updated fp16/bf16 pieces into host_params itself.
        self._copy_out = cpu_offload and self._div_scale and hasattr(self.optimizer, "set_copy_out")
        self._stepping = False  # in _step_inner: the user's optimizer's step() is ours
        _refuse_user_steps(self, optimizer)

    def _lay_out_buckets(self, reduce_bucket_size: int) -> None:
        """The buckets, their reusable buffers and their reduction; with
        cpu_offload, each bucket's pinned host buffers."""
        self.buckets: list[_Bucket] = make_buckets(self.shards, self.world, reduce_bucket_size)
        self.buffers = BucketBuffers(self.buckets, self.device)
        self.reduction = GradientReduction(
            self.buckets, self.buffers, stage=self.stage, group=self.group, rank=self.rank,
            world=self.world, comm_dtype=self.comm_dtype, overlap=self.overlap,
            host_grads_as_sent=self._div_scale,
        )  # fmt: skip
        # Each parameter's version counter when this optimizer last wrote it;
        # see [Note: parameters written in place].
        self._versions = [s.param._version for s in self.shards]
        # Each parameter's storage: ``p.data = t`` moves no version counter.
        self._storages = [s.param.data_ptr() for s in self.shards]
        self._warned_dropped = False
        # Write-back order: the order forward uses the buckets (buckets are
        # in backward order). See [Note: offloaded step pipeline].
        self._order = self.buckets[::-1]
        # See [Note: CPU Adam calls span buckets]; the positions of each
        # queued call's buckets, by its key.
        self._members: dict[int, list[int]] = {}
        self._unwritten: list[int] = []  # positions whose update is done, not yet written back
        self._lane: DeviceLane | None = None
        if self.gpu_update_fraction > 0:  # See [Note: Adam where the bandwidth is]
            members = lane_members([b.piece_total for b in self._order], self.gpu_update_fraction)
            lane = [self._order[k] for k in members]
            if lane:
                self._lane = DeviceLane(
                    lane, self.optimizer, self.device, self.world, self.rank,
                    pin=torch.cuda.is_available(),
                    window=-(-min(reduce_bucket_size, LANE_WINDOW) // self.world),
                )  # fmt: skip
        if self.cpu_offload:
            pin_offload_buffers(
                self.buckets, self.optimizer, self.comm_dtype,
                pin=torch.cuda.is_available(),
                copy_out=self._copy_out,
            )  # fmt: skip

    @property
    def cpu_update_numel(self) -> int:
        """With ``cpu_offload``: a CPU Adam call steps consecutive buckets (in
        write-back order) until it holds this many elements of this rank's
        pieces; default 2**26, 1 makes one call per bucket. Read at each
        ``step()``. See [Note: CPU Adam calls span buckets]."""
        return self._cpu_update_numel

    @cpu_update_numel.setter
    def cpu_update_numel(self, value: int) -> None:
        check_cpu_update_numel(_API, value)
        self._cpu_update_numel = value

    def _take_cpu_update_numel(self, numel: int, cpu_offload: bool) -> None:
        """The constructor's ``cpu_update_numel``: checked (the setter), and
        a warning when it cannot matter."""
        self.cpu_update_numel = numel
        if not cpu_offload and numel != CPU_UPDATE_NUMEL:
            warnings.warn(
                f"{_API}: cpu_update_numel has no effect without cpu_offload (got "
                f"cpu_update_numel={numel}): no update runs in CPU Adam; set cpu_offload=True or "
                "leave cpu_update_numel at its default",
                UserWarning,
                stacklevel=3,
            )

    def _log_layout(self, master_device: torch.device) -> None:
        state_bytes = sum(s.master.numel() * s.master.element_size() for s in self.shards)
        logger.info(
            "ZeRO-%d: %d params in %d buckets; rank %d/%d holds %.1f MB of master weights on "
            "%s%s%s", self.stage, len(self.shards), len(self.buckets), self.rank, self.world,
            state_bytes / 2**20, master_device, ", fp16 loss scaling" if self.fp16 else "",
            f"; {self._lane.describe()}" if self._lane is not None else "",
        )  # fmt: skip
        if self._defer:
            logger.info(
                "ZeRO: the CPU updates overlap the next forward (overlap_cpu_step): after "
                "step() the parameters hold the step's values once that forward wrote them "
                "back; read them before it (an EMA, a log of the weights) through "
                "model.state_dict() or after wait_updates()"
            )

    @property
    def training_state(self) -> TrainingState:
        """Where this optimizer is in the training step. See [Note: ZeRO
        training state table]."""
        return self._state

    def _transition(self, new: TrainingState) -> None:
        """The only place the training state changes. See [Note: ZeRO training state table]."""
        if new not in _MOVES[self._state]:
            raise RuntimeError(
                f"{_API} rank {self.rank}: illegal transition {self._state.name} -> {new.name}"
            )
        self._state = new

    def _ring(self, kind: str, dtype: torch.dtype, rows: int) -> BufferRing:
        """The two-slot ring of ``kind`` buffers (the write-back's gathers)."""
        return self.buffers.ring(kind, dtype, rows)

    @property
    def param_groups(self) -> list[dict]:
        """The parameter groups whose hyperparameters the next step uses:
        those of the optimizer the user built (see [Note: the user's
        hyperparameters])."""
        return self._groups if self._groups is not None else self.optimizer.param_groups

    def _push_hyper(self) -> None:
        """The users' hyperparameters into the groups the CPU kernel reads
        (no update is running: called after ``wait_updates``)."""
        if self._groups is None:
            return
        for user, inner in zip(self._groups, self.optimizer.param_groups, strict=True):
            inner.update(hyperparameters(user, self._foreign))

    def _pull_hyper(self) -> None:
        """The inner groups' hyperparameters (just loaded) into the users'."""
        if self._groups is None:
            return
        for user, inner in zip(self._groups, self.optimizer.param_groups, strict=True):
            user.update(hyperparameters(inner, self._foreign))

    # -- gradients ---------------------------------------------------------------

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients in the parameters without reducing them
        (gradient accumulation, at stage 1 and 2); the first backward outside
        reduces the accumulated sum."""
        before, self._no_sync = self._no_sync, True
        try:
            yield
        finally:
            self._no_sync = before

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> None:
        """``loss.backward()``, scaled by the loss scale for fp16."""
        if not isinstance(loss, torch.Tensor):
            raise TypeError(
                f"{_API}.backward: loss must be a tensor (got {type(loss).__name__}); pass the "
                "loss before .item()"
            )
        self._refuse_unfinished(f"{_API}.backward")
        self._refuse_after_clip("backward")
        self._write_back_pending()
        if self.scaler is not None:
            loss = loss * self.scaler.scale
            self._scaled_backward = True
        loss.backward(retain_graph=retain_graph)

    def _refuse_after_clip(self, api: str) -> None:
        if self._state is T.CLIPPED:
            raise RuntimeError(
                f"{_API}.{api}: a backward after clip_grad_by_norm() and before step(); the "
                "recorded clip would scale its gradients too; clip after the last backward of "
                "the step (or call zero_grad() to drop this step's gradients)"
            )

    def _refuse_unfinished(self, api: str) -> None:
        """A synchronous step whose CPU update failed is finished by
        ``step()`` (or dropped by ``zero_grad()``) before anything else: a
        backward in between would see its gradients dropped by that step."""
        if self._state is T.UNFINISHED:
            raise RuntimeError(
                f"{api}: the last step did not finish (its CPU update, or the write-back of the "
                "updated parameters, raised); remove the cause and call step() again first (or "
                "zero_grad() to drop it)"
            )

    # [Note: parameters read outside their module] With deferred CPU
    # updates, a parameter's update is written back when a forward pre-hook
    # of the module that owns it runs (``_await_positions``). A forward that
    # reads a parameter outside its module's forward (a parent's
    # ``x + self.child.bias``, ``F.linear(x, self.head.weight)`` where
    # ``self.head`` is never called) read the values from before the last
    # step, silently (or autograd raised that a saved tensor was modified in
    # place, when the write-back came at backward). So each module's hook
    # notes its parameters, the root module's hook starts the note afresh,
    # and a gradient for a parameter no hook noted in the forward turns on
    # waiting for every update at the root's forward (``_await_all``), with
    # one warning. The first step's forward reads nothing stale (no update
    # is pending), so a model that always reads the parameter so is exact;
    # one whose forwards differ may have read it stale once, as the warning
    # says. Ranks that run the same program turn it on at the same step.

    def _note_unhooked(self, s: _Shard) -> None:
        if self._await_all or not self._defer or s.index in self._hooked:
            return
        self._await_all = True
        warnings.warn(
            f"{_API}: parameter {s.name} was used in forward outside its module's forward (got a "
            "gradient for it, but its module's forward did not run), where its update is "
            "waited for; from the next forward on, every update of the step is waited for "
            "when the model's forward starts (less of the CPU step overlaps the forward). "
            "Call its module instead of reading the parameter to keep the overlap; a forward "
            "that read it before its last update (not the first step's) used the values "
            "before that update",
            UserWarning,
            stacklevel=2,
        )

    def _on_grad(self, s: _Shard) -> None:
        self._note_unhooked(s)
        self._refuse_unfinished(f"{_API}.backward")  # loss.backward() called directly
        self._refuse_after_clip("backward")
        if self._pipe is not None and self._pipe.round_open:
            self._write_back_pending()  # loss.backward() called directly: before any reduction
        if self.scaler is not None and not self._scaled_backward:
            self._unscaled = True
        if self._state is T.IDLE or (self._state is T.ACCUMULATED and not self._no_sync):
            self._transition(T.ACCUMULATED if self._no_sync else T.REDUCING)
        if self.reduction.bucket_of[s.index].launched:  # reduced in this step: a new backward
            self.reduction.restart()
            self._forget_dropped()
        if self._no_sync:
            return  # local gradients in param.grad, as DDP's no_sync leaves them
        if not self._end_queued:
            self._end_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        if not self.overlap:
            # Reduced at step: until then the guard holds the local gradient
            # (see [Note: sharded param.grad]). A plain param.grad means the
            # guard was dropped (model.zero_grad()): what it held goes too.
            g = s.param.grad
            if type(g) is not ShardedGradient:
                s.guard.local = g
                s.param.grad = s.guard
            return
        s.ready = True
        self.reduction.launch_ready()

    def _end_backward(self) -> None:
        """The end of a backward that reduces (autograd's last callback): a
        trainable parameter without a gradient on this rank gets its guard
        too, as torch DDP hands every rank the reduced gradient of a
        parameter used on any rank. The piece the other ranks reduce into it
        is then this rank's to step, and a ``model.zero_grad()`` before the
        step drops it here as on the ranks that used it (see
        ``_forget_dropped``). Parameters no rank used are told by the step's
        counts, as before. (Under reentrant activation checkpointing this runs
        at the end of each segment's inner backward too: a guard handed out
        early takes what autograd accumulates into it, as in a second
        backward; so nothing here launches a reduction, which would then run
        once a segment.)"""
        self._end_queued, self._ended = False, True
        for s in self.shards:
            if s.param.requires_grad and s.param.grad is None:
                s.guard.local, s.guard.cleared = None, False
                s.param.grad = s.guard

    # -- the step -----------------------------------------------------------------

    @with_user_step_hooks
    def step(self) -> bool:
        """Reduce what is left, clip, unscale, step the masters, all-gather the
        parameters. See [Note: overflow policy] and [Note: the user's step hooks].

        Returns:
            False when the step was skipped (fp16 overflow, or no gradient
            since the last step: one warning), else True.

        Raises:
            RuntimeError: fp16 gradients that were not scaled through
                ``backward``.
            CpuStepError: a CPU update that failed twice (the step stays
                unfinished: ``step()`` again finishes it, see [Note: a failed
                CPU update]).
        """
        mark_stepped(self._user)  # See [Note: the user's hyperparameters]
        if self._state is T.UNFINISHED:  # the last step's update failed: finish it now
            self.wait_updates()
            self._transition(T.IDLE)
            self.zero_grad()
            self.collector.tick()
            return True
        self._check_scaled("step")
        self._refuse_replaced_grads(f"{_API}.step")
        if self._groups is not None and self._foreign & {"amsgrad", "maximize"}:
            _refuse_cpu_kernel_flags(self._groups, f"{_API}.step")  # torch Adam over CPUAdam
        self._write_back_pending()  # the last step's, when no forward ran since
        for bucket in self.buckets:
            self._adopt_writes(bucket.shards)
        self._scaled_backward = False
        with phase("zerostack::reduce"):
            # clip_grad_by_norm reduced everything already (no backward since).
            clipped = self._state is T.CLIPPED
            device_norm_sq = self._clip_norm_sq if clipped else self.reduction.finish()
            if self._forget_dropped():
                device_norm_sq = None  # taken from the pieces left
            used = torch.tensor([float(s.used) for s in self.shards], device=self.device)
            grads = [s.grad for s in self.shards if s.grad is not None]
            stats = grad_stats(grads, used, self.group, norm_sq=device_norm_sq)
        if not any(stats[1:]):  # no rank has a gradient: every rank returns here
            self._say_nothing_to_do()
            self.zero_grad()
            self.collector.tick()
            return False
        plan = plan_step(_API, stats[0], self.scaler, self.max_norm, clip=self._clip)
        self.last_grad_norm = plan.grad_norm
        if plan.skip:
            self.zero_grad()
            self.collector.tick()
            return False
        if self._pipe is not None:
            self._queue_cpu_updates(plan.div_scale, stats[1:])
            if not self._defer:
                self._transition(T.UNFINISHED)
                self._write_back_pending()
                if self._lane is not None:  # a synchronous step: masters and states on the
                    self._lane.settle()  # host are the step's when it returns, as at f = 0
                self._transition(T.IDLE)
        else:
            self._device_step(plan.div_scale, stats[1:])
        self.zero_grad()
        self.collector.tick()
        return True

    def _say_nothing_to_do(self) -> None:
        if not self._warned_idle:
            self._warned_idle = True
            warnings.warn(
                f"{_API}.step: no gradient since the last step on any rank (no backward, one "
                "that reached no parameter, or gradients dropped by zero_grad()); nothing to "
                "do: a step consumes its gradients, as DeepSpeed's and ColossalAI's ZeRO "
                "optimizers do",
                UserWarning,
                stacklevel=4,
            )

    def _forget_dropped(self) -> bool:
        """What torch does to a ``.grad`` the user dropped or zeroed since
        it was reduced (``model.zero_grad()``, the module's own or the
        boosted model's, ``p.grad = None``), done to its reduced piece
        (on a rank that handed out the guard: see ``_end_backward``):
        dropped (``set_to_none=True``), the parameter steps only with what a
        later backward gives it, and not at all without one; zeroed
        (``set_to_none=False``), the piece is zeros. True when a piece
        changed (the norm is then taken from the pieces)."""
        changed = False
        for s in self.shards:
            if s.grad is None:
                continue
            # A guard never handed out here (no backward on this rank reached a
            # parameter) cannot have been dropped: the piece the others reduced stays.
            if (s.used or self._ended) and s.param.grad is not s.guard:
                s.grad, s.used, changed = None, False, True
            elif s.guard.cleared:
                s.grad, s.guard.cleared, changed = torch.zeros_like(s.grad), False, True
        return changed

    def _refuse_replaced_grads(self, api: str) -> None:
        """Raise, before any collective, where the user put a tensor of their
        own in the ``.grad`` of a parameter whose gradient was reduced
        already (``p.grad = g`` after the backward, a gradient surgery): the
        reduced piece is this optimizer's and ``.grad`` only its placeholder,
        so the tensor was dropped and the parameter did not move, silently.
        (A bucket not reduced yet takes what ``.grad`` holds when it is;
        after ``clip_grad_by_norm`` every piece is reduced.)
        ``None`` (drop it) is what ``_forget_dropped`` handles."""
        bucket_of, clipped = self.reduction.bucket_of, self._state is T.CLIPPED
        replaced = [
            s.name
            for s in self.shards
            if (bucket_of[s.index].launched or (clipped and s.grad is not None))
            and s.param.grad is not None
            and s.param.grad is not s.guard
        ]
        if replaced:
            raise RuntimeError(
                f"{api}: .grad of {replaced[:3]}{' ...' if len(replaced) > 3 else ''} was "
                "replaced by another tensor after the backward reduced it; the reduced gradient "
                f"lives in {_API}'s shards (.grad only stands for it), so that tensor cannot be "
                "stepped. Set .grad = None to drop a parameter's gradient, or "
                "optimizer.zero_grad() to drop the batch; change gradients before they are "
                "reduced with a tensor hook (param.register_hook)"
            )

    def drop_batch_for_load(self) -> None:
        """A load (of the model or of this optimizer) drops the batch whose
        backward ran since the last step, as ``zero_grad()`` does (see [Note:
        dropping a batch]): its reduced gradients would otherwise reach the
        loaded values at the next step. Nothing to drop: nothing done."""
        if self._state is not T.IDLE:
            self.zero_grad()

    def _check_scaled(self, api: str) -> None:
        if self._unscaled:
            self._unscaled = False
            self.zero_grad()
            raise RuntimeError(
                f"{_API}.{api}: fp16 gradients were not scaled; call optimizer.backward(loss) "
                "instead of loss.backward() (this step's gradients were dropped)"
            )

    @torch.no_grad()
    def clip_grad_by_norm(
        self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> torch.Tensor:
        """Clip the gradients of the coming step as torch's ``clip_grad_norm_``
        would clip the whole (all-reduced) gradients: call it after the last
        backward and before ``step()`` (ColossalAI's
        ``OptimizerWrapper.clip_grad_by_norm``). The norm is taken over every
        rank's pieces in fp32 (fp16: of the unscaled gradients); the
        coefficient is applied by the step, together with the loss scale and
        ``max_norm`` (see [Note: gradient clipping]). A collective: every
        rank calls it.

        Args:
            max_norm: the largest total norm; ``float('inf')`` only reads it.
            norm_type: the p of the p-norm, or ``inf``. Default 2.0.
            error_if_nonfinite: raise when the norm is inf or nan. Default False.

        Returns:
            The total norm of the gradients (before this clip), a 0-dim fp32
            tensor on the parameters' device, as torch's returns.

        Raises:
            TypeError, ValueError: a bad argument (``max_norm`` must be > 0).
            RuntimeError: inside ``no_sync()``; fp16 gradients not scaled
                through ``backward``; a non-finite norm with
                ``error_if_nonfinite``.
        """
        api = f"{_API}.clip_grad_by_norm"
        max_norm, norm_type = check_clip_args(api, max_norm, norm_type, error_if_nonfinite)
        self._refuse_unfinished(api)
        self._refuse_replaced_grads(api)
        if self._no_sync:
            raise RuntimeError(
                f"{api}: called inside no_sync(), where gradients are not reduced yet; clip "
                "after the backward outside no_sync(), before step()"
            )
        self._check_scaled("clip_grad_by_norm")
        self._write_back_pending()  # the last step's write-backs come before any reduction
        with phase("zerostack::reduce"):
            if self._state is not T.CLIPPED:
                self._clip_norm_sq = self.reduction.finish()
                if self._forget_dropped():
                    self._clip_norm_sq = None  # taken from the pieces left
                self._transition(T.CLIPPED)
            if norm_type == 2.0 and self._clip_norm_sq is not None:
                part = self._clip_norm_sq.clone()
            else:
                part = norm_part(
                    [s.grad for s in self.shards if s.grad is not None], norm_type, self.device
                )
            total, self._clip = record_clip(
                api, part, max_norm=max_norm, norm_type=norm_type, group=self.group,
                scale=self.scaler.scale if self.scaler is not None else 1.0,
                applied=self._clip, error_if_nonfinite=error_if_nonfinite,
            )  # fmt: skip
        return total

    def _device_step(self, div_scale: float, used: list[float]) -> None:
        """Step every master on the device at once, then all-gather."""
        with phase("zerostack::step"):
            for s, u in zip(self.shards, used, strict=True):
                s.master.grad = s.grad if u > 0 else None
            try:
                self._step_inner(div_scale)
            finally:
                for s in self.shards:
                    s.master.grad = None
        self._gather_params(from_masters=False)

    def _step_inner(self, div_scale: float) -> None:
        """The inner optimizer's step over the masters that have a ``.grad``;
        an NVMe write that failed after the update (the states stay in RAM)
        is logged, not raised."""
        self._stepping = True
        try:
            step_with_div_scale(self.optimizer, div_scale, hooks=self.optimizer is self._user)
        except OSError as error:
            if not write_failed(error):
                raise
            logger.error("%s: %s", _API, error)
        finally:
            self._stepping = False

    def _queue_cpu_updates(self, div_scale: float, used: list[float]) -> None:
        """Queue the update of every bucket with a used parameter, in
        write-back order: in CPU Adam, consecutive buckets together, a call
        closing once it holds ``cpu_update_numel`` elements or at a
        device-lane bucket (see [Note: CPU Adam calls span buckets]), or each
        in the device's Adam for the device lane. See [Note: offloaded step
        pipeline]."""
        pipe = self._pipe
        self._push_hyper()
        if pipe.stream is not None:
            # The write-backs may overwrite parameters only after the work
            # queued so far (the last backward) is done with them.
            pipe.stream.wait_stream(torch.cuda.current_stream(self.device))
        if self._lane is not None:
            self._lane.start()
        pipe.round_open = True
        self._members.clear()  # the pipeline's messages read this dict
        call: list[int] = []  # positions of the CPU Adam call being gathered
        numel = 0  # its elements
        for k, bucket in enumerate(self._order):
            shards = [s for s in bucket.shards if used[s.index] > 0]
            if not shards:  # nothing changes: every rank skips it (used is global)
                continue
            if bucket.lane is not None:  # See [Note: Adam where the bandwidth is]
                if call:  # keys ascend: the CPU Adam call of the buckets before it first
                    self._submit_cpu(call, used, div_scale)
                    call, numel = [], 0
                pairs = [(s, s.grad) for s in shards]
                pipe.submit(
                    k, self._lane.update, bucket, pairs, div_scale, self._versions,
                    LaneProgress(), lane="device",
                )  # fmt: skip
                continue
            call.append(k)
            numel += bucket.piece_total
            if numel >= self._cpu_update_numel:
                self._submit_cpu(call, used, div_scale)
                call, numel = [], 0
        if call:
            self._submit_cpu(call, used, div_scale)

    # [Note: CPU Adam calls span buckets] A CPU Adam call has a fixed cost
    # beside its bytes. On the 2-core CPU machine, with 576 one-parameter
    # buckets, it was 0.18 ms a bucket, most of it the inner optimizer's pass
    # over all 576 parameters (docs/benchmarks.md, sixth session). On an H200
    # host the update phase of GPT-2 1.5B's 1.56e9 elements, the GPU idle,
    # took 0.447 s in 145 calls of 2**24-element buckets, 0.380 s in 25 of
    # 2**26 and 0.352 s in 6 of 2**28: about 0.56 ms a call from 145 calls to
    # 25 (docs/benchmarks.md, fifth session). So the calls follow the bytes,
    # not reduce_bucket_size (which sets the gradients' collectives, and which
    # LowLevelZeroPlugin sets to ColossalAI's 12M): consecutive CPU-lane
    # buckets in write-back order are stepped in one call until it holds
    # ``cpu_update_numel`` elements (default 2**26: about 1.9 GB of host
    # traffic, 14 ms at 130 GB/s, a small share of the step for the first
    # write-back to wait). A call is one pipeline key, its first bucket's
    # position; its write-back writes every bucket of it, in order, and a
    # failure keeps and retries the whole call (see [Note: a failed CPU
    # update]). The results are those of one call per bucket, bit for bit:
    # each element's update depends on nothing but its own values. Measured
    # in one process on an H200 (sixth session): 12-20% off the overlapped
    # step of GPT-2 1.5B with every update in CPU Adam.

    def _submit_cpu(self, positions: list[int], used: list[float], div_scale: float) -> None:
        """Queue one CPU Adam call over the buckets at ``positions``, under
        the first's key."""
        buckets = [self._order[k] for k in positions]
        pairs = [(s.master, s.grad) for b in buckets for s in b.shards if used[s.index] > 0]
        self._members[positions[0]] = positions
        self._pipe.submit(positions[0], self._cpu_update, buckets, pairs, div_scale)

    def _cpu_update(self, buckets: list[_Bucket], pairs: list, div_scale: float) -> None:
        """Step the masters of ``buckets`` on the CPU, in one call (on the
        worker when overlapping); their fp16/bf16 values land in each
        bucket's ``host_params``."""
        for bucket in buckets:
            if bucket.copied is not None:
                wait_event(bucket.copied)  # the last H2D copy out of host_params is done
        # One update at a time: the inner optimizer steps every master with a
        # .grad, and a failed update's retry runs on the main thread while
        # the worker may be running another call's.
        with phase("zerostack::cpu_update"), self._update_lock:
            for master, grad in pairs:
                # torch's optimizers want the master's dtype; fused-adam's read bf16/fp16 as is.
                master.grad = grad if self._div_scale else grad.to(master.dtype)
            try:
                self._step_inner(div_scale)
            finally:  # a failed update must not leave its gradients to the next one
                for master, _ in pairs:
                    master.grad = None
            if not self._copy_out:
                for bucket in buckets:
                    self._refresh_host(bucket)

    def _write_back_key(self, key: int) -> None:
        """Write back the buckets of the update finished under ``key``. One
        whose write-back raises (a collective's error) stays, with the rest
        of its call, in ``_unwritten``: the next write-back writes them first,
        so no parameter is left behind its master."""
        self._unwritten += self._members.pop(key, [key])
        self._write_back_unwritten()

    def _write_back_unwritten(self) -> None:
        while self._unwritten:
            self._write_back(self._order[self._unwritten[0]])
            del self._unwritten[0]

    def _refresh_host(self, bucket: _Bucket) -> None:
        for s, off in zip(bucket.shards, bucket.offsets, strict=True):
            bucket.host_params[off : off + s.piece].copy_(s.master)

    def wait_updates(self) -> None:
        """Finish the CPU updates still running from the last step and write
        their parameters back (``cpu_offload`` with ``overlap_cpu_step``);
        after it the parameters hold the step's values, and the masters and
        states on the host too (with ``gpu_update_fraction``, the device's
        copies back are waited for). The state-dict methods and
        ``module.state_dict()`` call it; forward, backward and an overlapped
        ``step`` write back without waiting for those copies (a synchronous
        one waits for them).

        Raises:
            CpuStepError: a CPU update failed twice; it runs again at the next
                call (see [Note: a failed CPU update]).
        """
        self._write_back_pending()
        if self._lane is not None:
            self._lane.settle()

    def _write_back_pending(self) -> None:
        """``wait_updates`` but for the device lane's copies back to the host,
        which only host readers of the masters and states wait for (see
        [Note: Adam where the bandwidth is])."""
        pipe = self._pipe
        if pipe is None or not pipe.round_open:
            return
        self._write_back_unwritten()
        while pipe.held:
            self._write_back_key(pipe.pop())
        if pipe.stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(pipe.stream)
        pipe.round_open = False

    @torch.no_grad()
    def masters_written(self) -> None:
        """Call after writing the masters (``shards[i].master``) directly, with
        the parameters already holding the same values: with ``cpu_offload``
        the pinned low-precision copies that the next write-back sends to the
        device are refreshed from the masters (no collective)."""
        self.wait_updates()
        for bucket in self.buckets:
            if bucket.host_params is not None:
                if bucket.copied is not None:
                    bucket.copied.synchronize()
                self._refresh_host(bucket)
        self._versions = [s.param._version for s in self.shards]
        self._storages = [s.param.data_ptr() for s in self.shards]

    @torch.no_grad()
    def _adopt_writes(self, shards: list[_Shard], dropping_update: bool = False) -> None:
        """Parameters written in place since this optimizer last wrote them
        become their masters' values. See [Note: parameters written in place].

        [Note: parameters written in place] A user who writes a parameter
        (``p.mul_()``, ``p.copy_()``, ``module.load_state_dict``, an embedding's
        ``max_norm``) expects the next step to start from it, as with a torch
        optimizer; the fp32 master would write the old value back. Every write
        bumps the tensor's version counter, so each parameter's counter is
        kept after this optimizer's own writes (the write-back,
        ``masters_written``) and a parameter whose counter moved has this
        rank's piece copied into its master (and its pinned copy) before its
        next update, at ``step()``. ``p.data = t`` (torch's
        ``vector_to_parameters``) moves no counter but gives the parameter
        another storage, so each parameter's ``data_ptr()`` is kept too and
        a new one counts as a write (the next forward used ``t`` and the
        step wrote the old master plus its update back, 0.59 off torch).
        A write that comes after the update of
        that step started (between ``step()`` and the write-back of a
        deferred CPU update) replaces the update's result for that
        parameter, with a warning. Writes through ``p.data`` in place
        (``p.data.clamp_()``) are still not seen."""
        dropped = []
        for s in shards:
            ptr = s.param.data_ptr()
            if s.param._version == self._versions[s.index] and ptr == self._storages[s.index]:
                continue
            start, end = part.shard_bounds(s.param.numel(), self.world, self.rank)
            bucket = self.reduction.bucket_of[s.index]
            if bucket.lane is not None:
                self._lane.settle()  # no copy back to the masters' home in flight
            s.master[: end - start].copy_(s.param.detach().reshape(-1)[start:end])
            if bucket.host_params is not None:
                if bucket.copied is not None:
                    bucket.copied.synchronize()  # the last H2D copy out of host_params
                off = self.reduction.offset_of[s.index]
                bucket.host_params[off : off + s.piece].copy_(s.master)
            self._versions[s.index], self._storages[s.index] = s.param._version, ptr
            dropped.append(s.name)
        if dropped and dropping_update and not self._warned_dropped:
            self._warned_dropped = True
            warnings.warn(
                f"{_API}: parameters written in place after their update of this step had "
                f"started (got {dropped[:3]}): the written values are kept and that update "
                "is dropped for them; with cpu_offload call wait_updates() after step() "
                "before writing parameters, and write them before backward",
                UserWarning,
                stacklevel=4,
            )

    def _await_positions(self, positions: tuple[int, ...]) -> None:
        """A forward is about to use the buckets at ``positions``: write back
        every pending bucket up to the last of them and the rest of its CPU
        Adam call, in order, and make the compute stream wait for them. On
        one rank (no collective in a write-back) the later calls whose
        updates are done go too, so their H2D copies start early; on several,
        write-backs stay at points of the program that are the same on every
        rank, so that they keep their place among any collectives the model
        issues in forward."""
        pipe = self._pipe
        last = positions[-1]
        eager = self.world == 1
        self._write_back_unwritten()
        while pipe.held and (pipe.held[0] <= last or (eager and pipe.next_done())):
            self._write_back_key(pipe.pop())
        if pipe.stream is not None:
            stream = torch.cuda.current_stream(self.device)
            for k in positions:
                stream.wait_event(self._order[k].written)

    @torch.no_grad()
    def _gather_params(self, from_masters: bool = True) -> None:
        """Write every bucket's master pieces back into the parameters
        (``from_masters``: read the masters, e.g. just loaded, not the
        step's low-precision copy-out)."""
        self.wait_updates()
        for bucket in self._order:
            self._write_back(bucket, from_masters=from_masters)
        if self._pipe is not None and self._pipe.stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._pipe.stream)

    @torch.no_grad()
    def _write_back(self, bucket: _Bucket, from_masters: bool = False) -> None:
        """The updated pieces of ``bucket`` to the device, all-gathered into
        the parameters: on the write-back stream with cpu_offload on CUDA,
        else on the current stream. See [Note: offloaded step pipeline]."""
        # The same buckets carry the pieces back (params, not grads, this time).
        set_collective_label("parameter all-gather after the step")
        stream = self._pipe.stream if self._pipe is not None else None
        ctx = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
        dtype, total = bucket.shards[0].param.dtype, bucket.piece_total
        if not from_masters:  # a write since step(): see [Note: parameters written in place]
            self._adopt_writes(bucket.shards, dropping_update=True)
        with phase("zerostack::gather"), ctx:
            on_device = bucket.lane is not None and not from_masters
            if on_device and stream is not None:
                stream.wait_event(bucket.lane.updated)  # the device's Adam wrote the pieces
            if self.world == 1 and bucket.host_params is None and bucket.lane is None:
                # One rank, masters on the device: each parameter from its master, in one copy.
                for s in bucket.shards:
                    s.param.copy_(s.master[: s.param.numel()].view_as(s.param))
                    self._versions[s.index] = s.param._version
            elif not (on_device and self.world == 1):  # else the parameters hold the step already
                mine = self._ring("gather_in", dtype, 1).take(total)
                self._gather_input(bucket, mine, from_masters, stream)
                if self.world > 1:
                    full = self._ring("gather_out", dtype, self.world).take(self.world * total)
                    all_gather_into(full, mine, self.group)
                    full = full.view(self.world, total)
                else:
                    full = mine.view(1, total)
                for s, off in zip(bucket.shards, bucket.offsets, strict=True):
                    n = s.param.numel()
                    s.param.copy_(full[:, off : off + s.piece].reshape(-1)[:n].view_as(s.param))
                    self._versions[s.index] = s.param._version
            if bucket.written is not None:
                bucket.written.record(stream)

    def _gather_input(
        self, bucket: _Bucket, mine: torch.Tensor, from_masters: bool, stream: Any
    ) -> None:
        """This rank's pieces of ``bucket`` into ``mine``: from the pinned
        copy-out (CPU lane), the parameters (device lane, see [Note: Adam
        where the bandwidth is]; the padding is left as it is, the gather
        drops it) or the masters."""
        if bucket.host_params is not None:
            if from_masters:
                if bucket.copied is not None:
                    bucket.copied.synchronize()
                self._refresh_host(bucket)
            mine.copy_(bucket.host_params, non_blocking=True)
            if bucket.copied is not None:
                bucket.copied.record(stream)
        elif bucket.lane is not None and not from_masters:
            for s, off in zip(bucket.shards, bucket.offsets, strict=True):
                start, end = part.shard_bounds(s.param.numel(), self.world, self.rank)
                mine[off : off + end - start].copy_(s.param.detach().view(-1)[start:end])
        else:
            for s, off in zip(bucket.shards, bucket.offsets, strict=True):
                mine[off : off + s.piece].copy_(s.master)

    # [Note: dropping a batch] After an exception in forward or backward
    # that the user catches, optimizer.zero_grad() drops the batch: the steps
    # that follow equal, bitwise, those of a run that never saw it. A forward
    # changes nothing but activations and gathered copies; a backward leaves
    # gradients (in the parameters, the buckets, GeminiDDP's chunks, where a
    # reduced gradient sits in place of the parameter shard until the step)
    # and reductions in flight, which zero_grad() waits for and drops. No
    # optimizer update begins before step() (CPU updates included: see
    # [Note: offloaded step pipeline]), so nothing of the batch reaches the
    # masters or the optimizer states, in any placement. Collectives: every
    # rank must catch the exception at the same point (as with torch's DDP);
    # a rank alone leaves the others in a collective until the timeout.
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the model's gradients and the reduced pieces (and finish any
        reduction still in flight, so no collective is left pending). CPU
        updates still running keep what they read; the failed updates of an
        unfinished step are dropped (their parameters keep their values).

        After an exception in forward or backward that the caller caught
        (on every rank), this drops the batch: the steps that follow are
        those of a run that never saw it. See [Note: dropping a batch].
        ``set_to_none=False`` drops them too (said once).
        """
        if not set_to_none:
            say_zero_grads_are_dropped(self, f"{_API}.zero_grad")
        if self._state is T.UNFINISHED:
            dropped = [k for key in self._pipe.drop_failed() for k in self._members.pop(key, [key])]
            logger.warning(
                "%s.zero_grad: the failed CPU updates of buckets %s (in write-back order) are "
                "dropped: their parameters keep the values before that step", _API,
                _spans(dropped) or "none",
            )  # fmt: skip
            self._transition(T.IDLE)
            self.wait_updates()
        self.reduction.reset()
        self._end_queued = self._ended = False  # a backward that raised never ran its callback
        for s in self.shards:
            s.param.grad = None
            s.guard.local = None
            s.grad = None
            s.ready = s.used = False
        self._clip, self._clip_norm_sq = 1.0, None
        self._scaled_backward = self._unscaled = False
        if self._state is not T.IDLE:
            self._transition(T.IDLE)

    # -- state ---------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """This rank's shard: the inner optimizer's state over the masters, the
        masters themselves, the loss scaler, and what identifies the layout."""
        return _formats.rank_state_dict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load a ``state_dict()`` saved by the same rank at the same world size.

        Raises:
            ValueError: another model, or another world size or rank (use
                ``full_state_dict`` / ``load_full_state_dict`` for that).
        """
        self.drop_batch_for_load()
        _formats.load_rank_state_dict(self, state)

    def full_state_dict(self) -> dict[str, Any]:
        """Every parameter's whole master and optimizer state, gathered on
        every rank: loadable at any world size with ``load_full_state_dict``."""
        return _formats.full_state_dict(self)

    def load_full_state_dict(self, full: dict[str, Any]) -> None:
        """Load ``full_state_dict()`` output, saved at any world size."""
        self.drop_batch_for_load()
        _formats.load_full_state_dict(self, full)

    def local_ranges(self) -> list[tuple[int, int]]:
        """Per parameter (``shards`` order): the ``[start, end)`` of its
        flattened elements this rank's piece holds (the padding left out)."""
        return _formats.local_ranges(self)

    def local_state_dict(self) -> dict[str, Any]:
        """This rank's part without any gather: ``{"params": [per parameter
        {"master": view, key: view of the inner optimizer's state, or the
        step}], "param_groups", "scaler"}``, each view holding the
        :meth:`local_ranges` elements (no copy)."""
        return _formats.local_state_dict(self)

    def load_local_state_dict(self, local: dict[str, Any]) -> None:
        """Load :meth:`local_state_dict`-shaped state whose tensors hold this
        rank's :meth:`local_ranges` (read from a checkpoint of any world size):
        a parameter's ``master``, when given, replaces its piece (then the
        parameters are all-gathered); the other keys become the inner
        optimizer's state. ``param_groups`` None keeps the current ones.

        Raises:
            ValueError: another number of parameters, or a tensor not sized
                as this rank's range.
        """
        self.drop_batch_for_load()
        _formats.load_local_state_dict(self, local)

    def _settle(self) -> None:
        """Before reading the inner optimizer: no update running, and the
        users' hyperparameters in its groups."""
        self.wait_updates()
        self._push_hyper()


_set_debug = debug_collectives  # ZeroOptimizer's argument shadows the function
