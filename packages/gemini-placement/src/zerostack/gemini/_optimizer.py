"""GeminiOptimizer: steps the fp32 master chunks of a GeminiDDP model."""

from __future__ import annotations

import functools
import logging
import threading
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from zerostack.chunk import Chunk, CollectiveMismatchError, phase
from zerostack.fused_adam import HybridAdam
from zerostack.gemini._cpu_step import CpuStepError, CpuStepPipeline, write_back
from zerostack.gemini._ddp import GeminiDDP, TrainingState, _WeakCall, shard_on_host
from zerostack.gemini._device_lane import (
    GeminiLane,
    lane_staging_bytes,
    restore_unstepped,
    staging_bytes,
)
from zerostack.gemini._full_state import full_optim_state, load_full_optim_state
from zerostack.gemini._local_state import load_local_optim_state, local_optim_state
from zerostack.gemini._placement import AutoPlacement
from zerostack.shard import (
    CollectorSchedule,
    DynamicLossScaler,
    check_clip_args,
    check_flat_optimizer,
    check_fraction,
    check_lane_optimizer,
    check_max_norm,
    check_state_keys,
    grad_stats,
    hyperparameters,
    lane_refusal,
    make_loss_scaler,
    mark_stepped,
    norm_part,
    plan_step,
    record_clip,
    refuse_user_add_param_group,
    refuse_user_state_dict,
    resolve_gpu_update_fraction,
    say_zero_grads_are_dropped,
    split_beats_cpu_only,
    step_with_div_scale,
    stepping_twin,
    takes_div_scale,
    with_user_step_hooks,
    write_failed,
)

logger = logging.getLogger(__name__)
_API = "GeminiOptimizer"


class GeminiOptimizer:
    """The optimizer of a :class:`GeminiDDP` model.

    ``optimizer`` is built on the model's parameters (one parameter group);
    its parameters are replaced by this rank's fp32 master shards, one per
    chunk, so its states are sharded like the chunks.

    A step first updates the master chunks on the compute device (CUDA
    kernel, launched asynchronously), then the CPU-held ones (CPU kernel;
    with ``gpu_update_fraction`` a share of them in the device's, see
    [Note: Gemini's device lane]).
    Gradients of CPU-held chunks are copied to pinned host buffers as
    backward reduces them (see [Note: gradients leave during backward]);
    with ``overlap_cpu_step`` the CPU updates run on a worker thread, chunk by chunk in compute order, while the next forward starts:
    each chunk's forward waits only for that chunk's update, and its new
    fp16/bf16 values go to the device then (see zerostack.gemini's
    CpuStepPipeline, which this optimizer builds and closes: see [Note: who
    owns the Gemini step]). The math is the same as a synchronous step, never a
    step late. Only the fp16 loss scaler skips steps (see zerostack.shard's
    [Note: overflow policy]); bf16 and fp32 gradients are applied as torch's
    optimizers would, inf/nan included, with a warning.

    Hyperparameters (lr, weight_decay, betas, ...) are read from
    ``optimizer``'s own ``param_groups`` at every step: set them there, on
    this object's ``param_groups`` (the same dicts), or through an lr
    scheduler built on either. The wrapper steps a twin of ``optimizer``
    whose groups hold the masters and each step's values (see zerostack.shard's
    [Note: the user's hyperparameters]).

    Args:
        optimizer: e.g. ``HybridAdam(model.parameters(), lr=...)``.
        module: the GeminiDDP model.
        max_norm: clip the global gradient norm (0: off). Default 0.0.
        overlap_cpu_step: run the CPU part of the step on a worker thread,
            overlapped with the next forward. Updates start at ``step()``,
            never during backward (a batch dropped after an exception leaves
            no trace, see zerostack.shard's [Note: dropping a batch]).
            Default True.
        gpu_update_fraction: about this share of the CPU-held optimizer
            chunks' elements (whole chunks, spread through compute order) is
            updated by the compute device's fused Adam instead of CPU Adam:
            their fp32 masters and Adam states stay on the host between steps
            and are streamed to the device and back at ``step()``, their
            gradients stay on the device (see [Note: Gemini's device lane]).
            The same math, bit for bit: the CUDA kernel does CPU Adam's
            operations. In [0, 1]; needs HybridAdam (or CPUAdam)
            without NVMe. ``"auto"``: the share the step-time model finds
            fastest on this machine (measured once per process, a second
            or more, or read from the file ``ZEROSTACK_MACHINE_PROFILE``
            names), 0.0 where no split can run or, under static placement,
            parameter shards live on the host (see [Note: "auto" and
            parameter shards on the host]); the log says what it chose
            and why (see zerostack.shard's [Note: gpu_update_fraction="auto"]);
            under auto placement it also weighs, at the first step, the plan
            that keeps the share's staging free on the device against the
            plan without it, and keeps CPU Adam alone where the split would
            not step faster (zerostack.shard's [Note: a placement weighed
            with its split]). Default None: ``"auto"`` under auto placement
            (without a CUDA device, a fused-adam Adam or CPU-held chunks,
            0.0, said in the log), 0.0 under static placement: see
            [Note: Gemini's split where the model finds it faster].
        gc_every_n_steps: Python's cycle collector runs only every this many
            steps, from the first step on (see zerostack.shard's [Note:
            collector schedule]); 0 leaves the collector alone. Default 50.
        loss_scaler: the fp16 loss scaler. Default: a DynamicLossScaler built
            from ``scaler_kwargs`` (fp16 models only).
        **scaler_kwargs: DynamicLossScaler's fields (initial_scale, min_scale,
            growth_factor, backoff_factor, growth_interval, hysteresis,
            max_scale), ColossalAI's names.

    Raises:
        NotImplementedError: several parameter groups; gpu_update_fraction > 0
            (or "auto") with an optimizer other than fused-adam's Adam, or
            with Adam states on disk.
        ValueError: the optimizer is not built on the module's parameters,
            or already has state (a step or ``load_state_dict`` before the
            wrap: load optimizer checkpoints into the wrapper);
            gpu_update_fraction outside [0, 1].
        TypeError: an unknown keyword, or loss_scaler with scaler keywords.
        CpuStepError: a CPU update of the model's closed optimizer failed
            and fails again (see zerostack.shard's [Note: a failed CPU update]).
    """

    _said_dampening = False  # _say_first_momentum_dampened, per instance once set

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        module: GeminiDDP,
        *,
        max_norm: float = 0.0,
        overlap_cpu_step: bool = True,
        gpu_update_fraction: float | str | None = None,
        gc_every_n_steps: int = 50,
        loss_scaler: DynamicLossScaler | None = None,
        **scaler_kwargs: Any,
    ) -> None:
        _check_wrap(optimizer, module)
        _check_covers(optimizer, module)
        check_max_norm(_API, max_norm)
        _check_bool("overlap_cpu_step", overlap_cpu_step)
        asked = gpu_update_fraction is not None
        if not asked:  # See [Note: Gemini's split where the model finds it faster]
            gpu_update_fraction = "auto" if module.config.auto else 0.0
        self._weigh_split = module.config.auto and gpu_update_fraction == "auto"  # at the plan
        why_not = _check_fraction(optimizer, module, gpu_update_fraction)
        # A closed optimizer's failed CPU updates run before anything is
        # bound (attach_step would run them too, after this one's setup).
        module.retry_failed_updates()
        fp16 = module.mixed_precision == torch.float16
        scaler = make_loss_scaler(_API, fp16, loss_scaler, scaler_kwargs)
        collector = CollectorSchedule(_API, gc_every_n_steps)
        self._closed = False
        self._skipped: set[int] | None = set()  # no gradient at a step: _say_step_counts
        self.module = module
        self.manager = module.chunk_manager
        self.pipeline = CpuStepPipeline(self.manager, module.compute_device, overlap_cpu_step)
        self.max_norm = max_norm
        self._user = optimizer
        # What steps the masters: the user's optimizer's twin, whose group
        # gets each step's hyperparameters from the user's. See
        # zerostack.shard's [Note: the user's hyperparameters].
        self.optimizer = stepping_twin(optimizer)
        _refuse_user_calls(optimizer)
        self.pairs = [(c, c.paired_chunk) for c in module.grad_chunks]
        self._index = {c: i for i, (c, _) in enumerate(self.pairs)}
        self._chunk_of = {c.index: c for c, _ in self.pairs}
        # CPU-held chunks whose gradient the running backward staged as it
        # reduced them (see [Note: gradients leave during backward]).
        self._staged_early: set[Chunk] = set()
        self._trainable_params = [p for p in module.params if p.requires_grad]
        self.scaler = scaler
        self._div_scale = takes_div_scale(optimizer)
        self._copy_out = hasattr(optimizer, "set_copy_out")
        self.collector = collector
        # The one finalizer; it holds neither self nor the pipeline, whose
        # failed updates kept to run again hold self (then neither would ever
        # be freed). See zerostack.shard's [Note: a dropped owner is freed]
        weakref.finalize(self, _close_on_collect, self.pipeline.updates.closer(), self.collector)
        if hasattr(optimizer, "set_step_waiter"):  # its figures wait for the worker's updates
            optimizer.set_step_waiter(self.pipeline.settle)
        streamed, why_not = _lane_streamed(module, self.pairs, why_not)
        self.gpu_update_fraction = resolve_gpu_update_fraction(
            _API, gpu_update_fraction, module.compute_device, why_not,
            module.mixed_precision.itemsize, group=module.process_group, required=asked,
            streamed_bytes_per_param=streamed,
        )  # fmt: skip
        self._lane: GeminiLane | None = None
        self._bind_masters()
        if not module.config.auto:  # auto placement: at its plan (the first step)
            self._choose_lane()
            if hasattr(self.optimizer, "nvme_plan"):  # the masters it steps: states to disk now
                self.optimizer.nvme_plan([])
        self._lock = threading.Lock()  # one inner optimizer.step() at a time
        self._scaled_backward = self._warned_idle = False
        self.last_grad_norm = 0.0
        # clip_grad_by_norm: the coefficient recorded for the coming step (see
        # zerostack.shard's [Note: gradient clipping]).
        self._clip = 1.0
        module.attach_step(
            self.pipeline, _WeakCall(self, "_stage_grads"), _WeakCall(self, "_drop_batch"),
            _WeakCall(self, "_stage_reduced"),
        )  # fmt: skip
        _OPTIMIZERS[module] = weakref.ref(self)
        _WRAPPED.update((optimizer, self.optimizer))

    @property
    def param_groups(self) -> list[dict]:
        """The user's optimizer's groups (what users and lr schedulers
        change; every step reads them)."""
        return self._user.param_groups

    def _bind_masters(self) -> None:
        """Point the inner optimizer at the master shards where they now are."""
        self.masters = [m.shard for _, m in self.pairs]
        for m in self.masters:
            if hasattr(m, "grad_dtype"):
                m.grad_dtype = None  # torch >= 2.10: fp16/bf16 grads stepped as they are
        self.optimizer.param_groups[0]["params"] = self.masters
        offloaded = self.module.offloaded_masters  # the placement's decision
        self._host = [i for i, (_, m) in enumerate(self.pairs) if m in offloaded]
        self._host_set = set(self._host)
        self._device = [i for i, (_, m) in enumerate(self.pairs) if m not in offloaded]
        if hasattr(self.optimizer, "nvme_host_params"):  # See [Note: NVMe on the host tier]
            self.optimizer.nvme_host_params(
                [self.masters[i] for i in self._host], _host_hint(self.module)
            )

    @property
    def nvme_wait_s(self) -> float:
        """Seconds the CPU step waited for disk reads and writes of Adam
        states (HybridAdam's nvme_offload_fraction): the exposed I/O."""
        return getattr(self.optimizer, "nvme_wait_s", 0.0)

    def host_bytes(self) -> Any:
        """Host bytes of the model and this optimizer by owner (see
        GeminiDDP.host_bytes and [Note: host bytes])."""
        return self.module.host_bytes(self)

    @property
    def device_lane_chunks(self) -> list[int]:
        """Indices of the CPU-held chunks whose update runs in the compute
        device's Adam (``gpu_update_fraction``; under auto placement chosen
        at the first step). See [Note: Gemini's device lane]."""
        lane = self._lane
        return sorted(self.pairs[i][0].index for i in lane.homes) if lane is not None else []

    @property
    def device_lane_updates(self) -> int:
        """Chunk updates the compute device's Adam ran so far (0 without a device lane)."""
        return self._lane.updates if self._lane is not None else 0

    @property
    def device_lane_staging_bytes(self) -> int:
        """Bytes of the device lane's staging on the compute device, allocated
        at its first update (0 without a device lane)."""
        return self._lane.staging.staging_bytes() if self._lane is not None else 0

    @property
    def cpu_step_s(self) -> float:
        """Seconds spent in CPU updates (hidden unless forward waited for them)."""
        return self.pipeline.update_s

    def close(self) -> None:
        """Let running CPU updates end and stop the worker thread (also done
        when the optimizer is garbage-collected); the model still writes
        their results back before it uses the chunks. The optimizer cannot
        step any more; the model may get a new GeminiOptimizer."""
        _close(self.pipeline, self.collector)
        if self._closed:
            return
        self._closed = True
        module = self.module
        if module.step_pipeline is self.pipeline:
            module.attach_step(self.pipeline)  # no callbacks: this optimizer steps no more
        ref = _OPTIMIZERS.get(module)
        if ref is not None and ref() is self:
            del _OPTIMIZERS[module]

    def _check_open(self, api: str) -> None:
        if self._closed:
            raise RuntimeError(
                f"{_API}.{api}: the optimizer is closed; build a new GeminiOptimizer for the model"
            )

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, scaled for fp16."""
        self._check_open("backward")
        if not isinstance(loss, torch.Tensor):
            raise TypeError(
                f"{_API}.backward: loss must be a tensor (got {type(loss).__name__}); pass the "
                "loss before .item()"
            )
        if self.scaler is not None:
            loss = loss * self.scaler.scale
            self._scaled_backward = True
        loss.backward()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Between steps nothing to do: gradients live in the chunks and are
        consumed by ``step``. After a backward without a step (one that
        raised, caught by the caller on every rank) the batch is dropped, as
        after an exception in forward: the steps that follow are those of a
        run that never saw it. See GeminiDDP.zero_grad and zerostack.shard's
        [Note: dropping a batch]. A CPU update that failed in ``step()`` is
        kept (the next forward or step runs it again).

        Args:
            set_to_none: False drops the gradients too (said once).
        """
        if not set_to_none:
            say_zero_grads_are_dropped(self, f"{_API}.zero_grad")
        self.module.zero_grad(set_to_none)

    def _drop_batch(self) -> None:
        """GeminiDDP.zero_grad's first call when it drops a batch: the
        staged gradients of CPU-held chunks are given back (no update of the
        batch began: they start at ``step()``)."""
        self._scaled_backward = False
        self._staged_early.clear()
        for i in self._host:
            self.pipeline.drop_staged(self.pairs[i][0])
        self.pipeline.settle_lane()  # GeminiDDP writes chunks back from the masters next

    # -- gradients of CPU-held chunks ------------------------------------------------

    def _stage_grads(self, *, again: bool = False) -> None:
        """End of backward: start copying the reduced gradients of CPU-held
        chunks into pinned host buffers (the CPU step waits for them), those
        that backward did not stage as it reduced them (``again``: every one,
        from where the gradients are now). See [Note: gradients leave during
        backward]."""
        early = self._staged_early
        for i in self._host:
            chunk = self.pairs[i][0]
            if self._read_on_host(i) and (
                again or (chunk not in early and not _reduced_on_host(chunk))
            ):
                self.pipeline.stage_grad(chunk, _grad_share(chunk))
        early.clear()

    def _read_on_host(self, i: int) -> bool:
        """Pair ``i``'s update reads its gradient in host memory: a CPU-held
        master outside the device lane (whose Adam reads it on the device,
        see [Note: Gemini's device lane])."""
        return i in self._host_set and (self._lane is None or i not in self._lane)

    def _stage_reduced(self, chunk: Chunk) -> None:
        """Backward reduced ``chunk``: its gradient starts for the host now
        where a CPU update will read it there. See [Note: gradients leave
        during backward]."""
        i = self._index.get(chunk)
        if i is None or not self._read_on_host(i) or _reduced_on_host(chunk):
            return  # read on the device, or reduced into host memory already
        self.pipeline.stage_grad(chunk, _grad_share(chunk))
        self._staged_early.add(chunk)

    def _hyper(self) -> dict[str, Any]:
        """The user's hyperparameters now (lr, betas, ...): a step's, kept
        with each of its CPU updates."""
        return hyperparameters(self.param_groups[0])

    # -- the step ---------------------------------------------------------------------

    @with_user_step_hooks
    def step(self) -> bool:
        """Clip, unscale, step the masters, write the parameters back into
        their chunks. Returns False when skipped for fp16 overflow (or when
        no backward ran since the last step). The user's optimizer's step
        hooks run once, around it (zerostack.shard's [Note: the user's step
        hooks]).

        Raises:
            RuntimeError: no backward finished since the last step, fp16
                gradients not scaled through ``backward``.
            CpuStepError: a CPU update of this step failed twice, or one of
                an earlier step failed again (see zerostack.shard's [Note: a
                failed CPU update]).
        """
        self._check_open("step")
        mark_stepped(self._user)  # See zerostack.shard's [Note: the user's hyperparameters]
        self.module.refuse_changed_grads(f"{_API}.step")  # before anything runs
        errors: list[CpuStepError] = []  # raised at the end: the rest of the step goes on
        try:
            self.pipeline.check()
        except CpuStepError as error:
            if self.module.training_state is not TrainingState.REDUCED:
                raise  # no step to do: the error alone
            # An update of the last step failed twice: the rest of this step
            # goes on, that chunk keeps its gradient.
            errors.append(error)
        if not self._ready_to_step():
            _raise_first(errors)
            return False
        with phase("zerostack::step"):
            for chunk in self.pipeline.pending():  # the previous step's CPU updates
                try:
                    self.pipeline.await_chunk(chunk)
                except CpuStepError as error:  # kept to run again
                    errors.append(error)
            self._plan_placement()
            self._bind_disk()
            kept = set(self.pipeline.failed)
            stepped = self._step()
        self.module.finish_step()
        self.collector.tick()
        for index in self.pipeline.failed:  # this step's inline failures: once more now
            if index not in kept:
                try:
                    self.pipeline.await_chunk(self._chunk_of[index])
                except CpuStepError as error:
                    errors.append(error)
        _raise_first(errors)
        return stepped

    def retry_failed_updates(self) -> None:
        """Run the CPU updates that failed again, now (the next forward or
        step would). See zerostack.shard's [Note: a failed CPU update].

        Raises:
            CpuStepError: an update failed again; nothing else changed.
        """
        self._check_open("retry_failed_updates")
        self.pipeline.check()

    @torch.no_grad()
    def clip_grad_by_norm(
        self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> torch.Tensor:
        """Clip the gradients of the coming step as torch's ``clip_grad_norm_``
        would clip the whole gradients: call it after the backward and before
        ``step()`` (ColossalAI's ``OptimizerWrapper.clip_grad_by_norm``;
        ColossalAI's Gemini only warns there). The norm is taken over every
        rank's chunk shards wherever they are (device, host), in fp32 (fp16:
        of the unscaled gradients); the step applies the coefficient together
        with the loss scale and ``max_norm`` (see zerostack.shard's [Note:
        gradient clipping]). A collective: every rank calls it.

        Args:
            max_norm: the largest total norm; ``float('inf')`` only reads it.
            norm_type: the p of the p-norm, or ``inf``. Default 2.0.
            error_if_nonfinite: raise when the norm is inf or nan. Default False.

        Returns:
            The total norm of the gradients (before this clip), a 0-dim fp32
            tensor on the compute device, as torch's returns.

        Raises:
            TypeError, ValueError: a bad argument (``max_norm`` must be > 0).
            RuntimeError: no reducing backward since the last step (or
                inside ``no_sync``); fp16 gradients not scaled through
                ``backward``; a non-finite norm with ``error_if_nonfinite``.
        """
        api = f"{_API}.clip_grad_by_norm"
        max_norm, norm_type = check_clip_args(api, max_norm, norm_type, error_if_nonfinite)
        self._check_open("clip_grad_by_norm")
        module = self.module
        if module.training_state is not TrainingState.REDUCED:
            raise RuntimeError(
                f"{api}: the model is in state {module.training_state.name}; clip after a "
                "backward outside no_sync() and before step() (forward, optimizer.backward(loss), "
                "clip, step)"
            )
        self._check_scaled("clip_grad_by_norm")
        module.refuse_changed_grads(api)
        with phase("zerostack::reduce"):
            total, self._clip = record_clip(
                api, self._norm_part(norm_type),
                max_norm=max_norm, norm_type=norm_type, group=module.process_group,
                scale=self.scaler.scale if self.scaler is not None else 1.0,
                applied=self._clip, error_if_nonfinite=error_if_nonfinite,
            )  # fmt: skip
        return total

    def _check_scaled(self, api: str) -> None:
        if self.scaler is not None and not self._scaled_backward:
            self._drop_grads()
            raise RuntimeError(
                f"{_API}.{api}: fp16 gradients were not scaled; call optimizer.backward(loss) "
                "instead of loss.backward() (this step's gradients were dropped)"
            )

    def _ready_to_step(self) -> bool:
        state = self.module.training_state
        if state is TrainingState.IDLE:
            if not self._warned_idle:
                self._warned_idle = True
                warnings.warn(
                    f"{_API}.step: no backward since the last step; nothing to do",
                    UserWarning,
                    stacklevel=3,
                )
            return False
        if state is TrainingState.BACKWARD:
            raise RuntimeError(
                f"{_API}.step: the last backward did not finish (an exception in it?); call "
                "optimizer.zero_grad() to drop that batch"
            )
        if state is not TrainingState.REDUCED:
            raise RuntimeError(
                f"{_API}.step: the model is in state {state.name}; step after a backward outside "
                "no_sync() (forward, optimizer.backward(loss), step)"
            )
        self._check_scaled("step")
        self._scaled_backward = False
        return True

    def _drop_grads(self) -> None:
        self._clip = 1.0
        self.pipeline.settle_lane()  # the masters are read below
        for chunk, _ in self.pairs:
            _grad_target(chunk).forget_reduced_norm()
            write_back(self.manager, chunk)
        self.module.finish_step()

    def _bind_disk(self) -> None:
        """Let an optimizer with Adam states on disk choose them now, before
        any update: a disk that cannot hold them fails here, the step's
        gradients are dropped and the model is left as before the step."""
        if not hasattr(self.optimizer, "nvme_plan"):
            return
        try:
            with self._lock:
                self.optimizer.nvme_plan([])
        except OSError as error:
            if write_failed(error):  # the last step's writes: states kept in RAM
                logger.error("%s: %s", _API, error)
                return
            self._drop_grads()
            raise

    def _plan_placement(self) -> None:
        """At the first step under auto placement: the plan, and the masters
        (with any state loaded before it) where it put them."""
        before = list(self.masters)
        dtype = self.pairs[0][0].dtype if self.pairs else torch.float32
        auto = self.module.auto
        if self._weigh_split and auto is not None and not auto.planned:
            self._weigh_split = False  # once: the plan is made once
            if self.gpu_update_fraction > 0:
                self._weigh_the_split(auto, dtype)
        staging = None
        if self.gpu_update_fraction > 0:  # See [Note: Gemini's device lane]
            staging = functools.partial(lane_staging_bytes, self.gpu_update_fraction, dtype)
        if not self.module.plan_placement(
            dict(self.pairs), _state_bytes_per_element(self.optimizer), staging
        ):
            return
        self._bind_masters()
        for old, new in zip(before, self.masters, strict=True):
            if old is not new and old in self.optimizer.state:
                self.optimizer.state[new] = {
                    k: v.to(new.device) if torch.is_tensor(v) and v.dim() > 0 else v
                    for k, v in self.optimizer.state.pop(old).items()
                }
        self._choose_lane()
        auto, lane = self.module.auto, self._lane
        if auto is not None:  # what the lane's members need (none without a lane)
            auto.reserved_bytes = staging_bytes(lane.staging.window, dtype) if lane else 0
        for i in self._device:  # staged in the warm-up, stepped on the device now
            self.pipeline.drop_staged(self.pairs[i][0])
        self._stage_grads(again=True)  # the plan moved shards: from where the gradients are now

    def _weigh_the_split(self, auto: AutoPlacement, dtype: torch.dtype) -> None:
        """``gpu_update_fraction`` 0.0 where auto placement's plan with the
        split's staging would step slower than its plan without (see
        zerostack.shard's [Note: a placement weighed with its split]); a
        collective over the model's group."""
        module, f = self.module, self.gpu_update_fraction
        masters, state = dict(self.pairs), _state_bytes_per_element(self.optimizer)
        staging = functools.partial(lane_staging_bytes, f, dtype)
        alone, split = (
            module.step_amounts(*auto.preview(masters, state, s)) for s in (None, staging)
        )
        # Auto placement's lane takes no chunk whose shard lives on the host.
        split["host_value_fraction"] = 0.0
        if not split_beats_cpu_only(
            _API, module.compute_device, f, alone, split, module.process_group
        ):
            self.gpu_update_fraction = 0.0

    def _step(self) -> bool:
        module = self.module
        grads = [_grad_share(c) for c, _ in self.pairs]
        trainable = self._trainable_params
        trace = module.take_gather_trace()  # See [Note: ranks that gathered different chunks]
        used = torch.tensor(module.take_used(trainable) + trace, device=module.compute_device)
        stats = grad_stats([], used, module.process_group, norm_sq=self._norm_part(2.0))
        if trace:
            try:
                module.check_gather_traces(stats[-len(trace) :])
            except CollectiveMismatchError:
                self._drop_grads()
                raise
            stats = stats[: -len(trace)]
        for chunk, _ in self.pairs:  # the updates write new values over these shares
            _grad_target(chunk).forget_reduced_norm()
        plan = plan_step(_API, stats[0], self.scaler, self.max_norm, clip=self._clip)
        self._clip = 1.0
        if plan.skip:
            self.pipeline.settle_lane()  # the masters are read below
            for chunk, _ in self.pairs:
                write_back(self.manager, chunk)
            return False
        self.last_grad_norm = plan.grad_norm
        hyper = self._hyper()
        # A parameter with no gradient on any rank is left alone, as DDP leaves
        # its grad None and torch's optimizers skip it: its slices of the
        # master and of the optimizer state are put back after the step.
        unused = [p for p, u in zip(trainable, stats[1:], strict=True) if u == 0]
        self._say_step_counts(trainable, stats[1:], unused)
        self._home_lane_states(unused)
        saved = self._save_slices(unused)
        # Device-held masters: one launch, asynchronous on the device. (The
        # lock, as every inner step takes it; nothing else runs now: step()
        # waited for the last updates. Each call steps exactly the masters
        # that have a grad.)
        with self._lock:
            self.optimizer.param_groups[0].update(hyper)
            for i in self._device:
                # A shard kept on the host (offload_param_frac) reduced its gradient there.
                grad, master = grads[i], self.masters[i]
                master.grad = self._as_grad(grad, master)
            step_with_div_scale(self.optimizer, plan.div_scale, hooks=False)
            for i in self._device:
                self.masters[i].grad = None
        for i in self._device:
            restore_unstepped(saved.get(i), self.optimizer.state)
            write_back(self.manager, self.pairs[i][0])
        # CPU-held masters, chunk by chunk in compute order. With Adam states
        # on disk the reads run ahead across chunks, in the same order.
        failed = set(self.pipeline.failed)  # kept with their gradients, to run again
        order = [i for i in self._cpu_order() if self.pairs[i][0].index not in failed]
        if order and hasattr(self.optimizer, "nvme_plan"):
            with self._lock:
                self.optimizer.nvme_plan([self.masters[i] for i in order])
        lane = self._lane
        if lane is not None:
            lane.staging.start()
        for i in order:
            chunk = self.pairs[i][0]
            args = (i, grads[i], plan.div_scale, saved.get(i), hyper)
            if lane is not None and lane.takes(i, grads[i]):  # See [Note: Gemini's device lane]
                self.pipeline.submit(chunk, lane.update, *args, lane=lane.events(i))
            else:
                self.pipeline.submit(chunk, self._cpu_update, *args)
        return True

    def _choose_lane(self) -> None:
        """The device lane over CPU-held chunks spread through compute order,
        once the placement decided them. See [Note: Gemini's device lane]."""
        if self.gpu_update_fraction == 0 or self._lane is not None:
            return
        order = self._cpu_order()
        pageable = [i for i in order if _pageable_host_shard(self.module, self.pairs[i][0])]
        if pageable:
            warnings.warn(
                f"{_API}: {len(pageable)} of the {len(order)} CPU-held chunks keep their "
                "parameter shard in pageable host memory (pin_memory=False), which the device "
                "lane does not stream from: they step in CPU Adam, and gpu_update_fraction "
                "covers the others. Pass pin_memory=True to GeminiDDP (or GeminiPlugin) to let "
                "it cover them",
                UserWarning,
                stacklevel=3,
            )
        self._lane = GeminiLane.choose(
            self.pairs, self.masters, [i for i in order if i not in pageable],
            self.gpu_update_fraction, self.optimizer, self.module.compute_device,
            host_grads=not self.module.config.auto and self.module.compute_device.type == "cuda",
        )  # fmt: skip
        if self._lane is not None:
            self.pipeline.lane_settle = self._lane.staging.settle

    def _home_lane_states(self, unused: Sequence[torch.Tensor]) -> None:
        """Before the step saves any slice: the lane's moments in their homes
        (a loaded state copied in), and their last copies back done when a
        slice is read."""
        lane = self._lane
        if lane is None:
            return
        for i in self._host:
            if i in lane and self.masters[i] in self.optimizer.state:
                lane.home_states(i)
        if unused:
            lane.settle()

    def _norm_part(self, norm_type: float) -> torch.Tensor:
        """This rank's part of the gradients' p-norm as zerostack.shard's
        norm_part gives it (the sum of p-th powers, or the max for inf), in
        fp32 on the compute device. A 2-norm takes each share's norm from its
        reduction where that still holds (zero-chunk's [Note: the reduced
        share's norm]): a share on the host is not read there."""
        device = self.module.compute_device
        shares, known = [], []
        for chunk, _ in self.pairs:
            target = _grad_target(chunk)
            norm = target.reduced_norm() if norm_type == 2.0 else None
            if norm is None:
                shares.append(target.local_share())
            else:
                known.append(norm.to(device))
        part = norm_part(shares, norm_type, device)
        if known:
            part = part + torch.stack(known).pow(2).sum()
        return part

    def _as_grad(self, grad: torch.Tensor, master: torch.Tensor) -> torch.Tensor:
        """``grad`` as ``master``'s gradient: on its device (a shard kept on the
        host reduces its gradient there), and in its dtype for optimizers
        other than fused-adam's (torch's Adam needs the parameter's dtype;
        fused-adam reads fp16/bf16 gradients as they are)."""
        dtype = grad.dtype if self._div_scale else master.dtype
        return grad.to(device=master.device, dtype=dtype)

    def _cpu_order(self) -> list[int]:
        order = self.module.chunk_compute_order()
        if not order:
            return list(self._host)
        first = {idx: k for k, idx in enumerate(order)}
        return sorted(self._host, key=lambda i: first.get(self.pairs[i][0].index, 1 << 30))

    def _cpu_update(self, i: int, grad: torch.Tensor, div_scale: float, saved, hyper) -> None:
        """Step one CPU-held master (on the worker thread when overlapping)
        with its step's hyperparameters (a failed update may run again later)."""
        chunk = self.pairs[i][0]
        if self._lane is not None and i in self._lane:
            self._lane.settle()  # a lane chunk the lane does not take this step (takes)
        host_grad = self.pipeline.host_grad(chunk, grad)
        master = self.masters[i]
        # The new fp16/bf16 shard goes into the chunk's host share itself, or a
        # staging buffer (see [Note: CPU-step buffers]); bound for this update only.
        values = self.pipeline.host_values(chunk)
        with self._lock:
            self.optimizer.param_groups[0].update(hyper)
            # Without div_scale in the kernel the gradient is scaled in place: a copy.
            grad = self._as_grad(host_grad, master)
            own = div_scale <= 0 or self._div_scale or grad is not host_grad
            master.grad = grad if own else grad.clone()
            if self._copy_out:
                self.optimizer.set_copy_out(master, values)  # type: ignore[attr-defined]
            try:
                step_with_div_scale(self.optimizer, div_scale, hooks=False)
            except OSError as error:
                # A failed state write (zerostack.nvme's NVMeWriteError): the
                # update completed and the state stays in RAM, written again
                # at the next step; anything else fails the update.
                if not write_failed(error):
                    raise
                logger.error("%s: chunk %d: %s", _API, self.pairs[i][0].index, error)
            finally:  # a failed update must not leave its gradient (or its buffer) behind
                master.grad = None
                if self._copy_out:
                    self.optimizer.set_copy_out(master, None)  # type: ignore[attr-defined]
        restore_unstepped(saved, self.optimizer.state)
        if self._copy_out:  # the kernel wrote the unused slices' stepped values out too
            for t, sl, value in saved or ():
                if t is master and value is not None:
                    values[sl].copy_(value)
        else:
            values.copy_(master)

    def _say_step_counts(self, trainable: list, used: list, unused: list) -> None:
        """Adam counts its steps per chunk here, as in ColossalAI's Gemini,
        and torch's per parameter: a parameter that had no gradient at a
        step and has one again gets its chunk's count for its bias
        correction. Said once, when that first happens."""
        if self._skipped is None or "betas" not in self.optimizer.defaults:
            return
        back = [
            p for p, u in zip(trainable, used, strict=True) if u != 0 and id(p) in self._skipped
        ]
        if back:
            self._skipped = None
            names = [self.module.param_names[p] for p in back[:3]]
            warnings.warn(
                f"{_API}.step: {len(back)} parameter(s) have a gradient again after steps "
                f"without one (got {names}); Adam counts steps per chunk, as ColossalAI's Gemini "
                "does, so their bias correction uses their chunk's step count, not their own as "
                "in torch's Adam (LowLevelZeroPlugin counts them as torch does)",
                UserWarning,
                stacklevel=4,
            )
            return
        self._skipped.update(id(p) for p in unused)

    def _save_slices(self, params: Sequence[torch.Tensor]) -> dict[int, list]:
        """Copies of ``params``' elements in this rank's master shards and
        states, by pair index."""
        saved: dict[int, list] = {}
        keep_on_disk = getattr(self.optimizer, "keep_disk_states", None)
        for p in params:
            chunk = self.manager.get_chunk(p)
            info = chunk.tensors_info[p]
            lo = chunk.rank * chunk.shard_size
            start, end = max(info.offset, lo) - lo, min(info.end, lo + chunk.shard_size) - lo
            if start >= end:
                continue
            master = chunk.paired_chunk.shard
            sl = slice(start, end)
            state = self.optimizer.state.get(master, {})
            slices = saved.setdefault(self._index[chunk], [])
            for t in (master, *(v for v in state.values() if torch.is_tensor(v) and v.dim() > 0)):
                slices.append((t, sl, t[sl].clone()))
            if not state:  # this step creates it: see restore_unstepped
                slices.append((master, sl, None))
                self._say_first_momentum_dampened()
            if (
                keep_on_disk is not None
            ):  # moments on disk are not in the state: the optimizer keeps them
                with self._lock:
                    keep_on_disk(master, sl)
        return saved

    def _say_first_momentum_dampened(self) -> None:
        """SGD with dampening steps a parameter's first momentum undampened
        (``buf = d_p``); one whose chunk's buffer exists before its first
        gradient (zeros, see restore_unstepped) gets ``(1 - dampening) * d_p``.
        Said once."""
        group = self.optimizer.param_groups[0]
        if self._said_dampening or not (group.get("momentum") and group.get("dampening")):
            return
        self._said_dampening = True
        warnings.warn(
            f"{_API}.step: a parameter without a gradient at its chunk's first step starts its "
            "momentum buffer at zeros, so with SGD's dampening its first momentum is "
            "(1 - dampening) * its gradient, where torch's SGD starts it undampened (momentum "
            "buffers are per chunk here, as in ColossalAI's Gemini)",
            UserWarning,
            stacklevel=5,
        )

    def state_dict(self) -> dict[str, Any]:
        """This rank's shard of the optimizer state (over the master chunks)."""
        self.module.wait_updates()
        inner = self.optimizer.state_dict()
        for group in inner["param_groups"]:  # the user's values: the twin's are a step's
            group.update(hyperparameters(self.param_groups[0]))
        return {"optimizer": inner, "scaler": self.scaler.state_dict() if self.scaler else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load ``state_dict()`` output of the same rank and world size."""
        self._check_open("load_state_dict")
        check_state_keys(f"{_API}.load_state_dict", state, ("optimizer", "scaler"))
        self.module.drop_batch_for_load()
        self.module.wait_updates()
        self.optimizer.load_state_dict(state["optimizer"])
        # Into the user's groups, which every step reads (see zero-shard's
        # [Note: the user's hyperparameters]), as the other loads do.
        self.param_groups[0].update(hyperparameters(self.optimizer.param_groups[0]))
        if self.scaler is not None and state["scaler"] is not None:
            self.scaler.load_state_dict(state["scaler"])

    # -- this rank's part, by parameter name (per-rank parallel checkpoints) ----------

    def local_state_dict(self) -> dict[str, Any]:
        """This rank's part of the optimizer state by parameter name, without
        any gather: ``{"params": {name: {key: view of this rank's range of
        the flattened parameter, or the step}}, "param_group", "scaler"}``
        (ranges from ``zerostack.gemini.local_ranges``; see [Note: local
        ranges]). The masters are left out: ``local_model_state`` has them."""
        return local_optim_state(self)

    def load_local_state_dict(self, local: dict[str, Any]) -> None:
        """Load ``local_state_dict()``-shaped state whose tensors are this
        rank's ranges (read from a checkpoint of any world size and plugin).
        The masters keep their values.

        Raises:
            ValueError: a tensor is not sized as this rank's range.
        """
        load_local_optim_state(self, local)

    # -- whole-model optimizer state, any world size ---------------------------------

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, Any]:
        """Every trainable parameter's whole fp32 master and optimizer state
        (flat, on the CPU), gathered on every rank, keyed by parameter name:
        loadable at any world size and chunk size with ``load_full_state_dict``."""
        return full_optim_state(self)

    @torch.no_grad()
    def load_full_state_dict(self, full: dict[str, Any]) -> None:
        """Load ``full_state_dict()`` output saved at any world size: masters,
        optimizer states and parameters (cast from the masters).

        Raises:
            KeyError: a trainable parameter is missing from ``full``.
            ValueError: a parameter's size differs.
        """
        self._check_open("load_full_state_dict")
        load_full_optim_state(self, full)


# [Note: NVMe on the host tier] HybridAdam's nvme_offload_fraction puts on
# disk a share of the Adam states held in host memory, as ColossalAI's does:
# states of optimizer chunks on the GPU stay there. GeminiOptimizer names the
# master chunks its placement offloads (offload_optim_frac, or those auto
# placement keeps on the CPU) as the host-held ones, also on a CPU compute
# device, where every chunk is in host memory but the placement's decisions
# (and so what goes to disk) are the same as on a GPU. A placement that
# offloads none gets one warning naming the settings that would.
def _host_hint(module: GeminiDDP) -> str:
    """How to hold optimizer states on the host, for HybridAdam's warning."""
    fix = (
        "set placement_policy='static' with offload_optim_frac=1.0 (GeminiPlugin or GeminiDDP), "
        "as ColossalAI's NVMe guide places the optimizer states on the CPU"
    )
    if module.compute_device.type == "cpu":
        fix += (
            " (on a CPU compute device the chunks the placement keeps on the compute device "
            "count as device memory, as they would on a GPU)"
        )
    if module.config.auto:
        return f"placement_policy='auto' planned every optimizer chunk on the compute device; {fix}"
    frac = module.config.placement.offload_optim_frac  # type: ignore[union-attr]  # static here
    return (
        f"the static placement offloads no optimizer chunk (got offload_optim_frac={frac}); {fix}"
    )


def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{_API}: {name} must be a bool (got {value!r})")


def _check_fraction(
    optimizer: torch.optim.Optimizer, module: GeminiDDP, fraction: object
) -> str | None:
    """``gpu_update_fraction``: in [0, 1], for fused-adam's Adam without
    NVMe; a warning where no chunk is CPU-held. For ``"auto"``: why no
    split can run (None: one can)."""
    check_fraction(_API, fraction)
    placement = module.config.placement
    offloads = module.config.auto or placement.offload_optim_frac > 0  # type: ignore[union-attr]
    if fraction == "auto":
        if not offloads:
            return "the static placement offloads no optimizer chunk (offload_optim_frac=0.0)"
        return lane_refusal(_API, optimizer, module.compute_device, torch_adam=False)
    if fraction == 0:
        return None
    check_lane_optimizer(_API, optimizer, module.compute_device, torch_adam=False)
    if not offloads:
        warnings.warn(
            f"{_API}: gpu_update_fraction has no effect when no optimizer chunk is on the CPU "
            f"(got offload_optim_frac=0.0, gpu_update_fraction={fraction}); every update runs on "
            "the compute device already. Set offload_optim_frac or leave gpu_update_fraction at 0",
            UserWarning,
            stacklevel=4,
        )
    return None


def _pageable_host_shard(module: GeminiDDP, chunk: Chunk) -> bool:
    """Under static placement on CUDA, ``chunk``'s parameter shard lives in
    pageable host memory: the device lane does not take it (its copies would
    make the host wait; see [Note: Gemini's device lane])."""
    return (
        not module.config.auto
        and chunk.compute_device.type == "cuda"
        and shard_on_host(chunk)
        and not chunk.pin_memory
    )


def _lane_streamed(
    module: GeminiDDP, pairs: list[tuple[Chunk, Chunk]], why_not: str | None
) -> tuple[float, str | None]:
    """For "auto": the bytes of every parameter shard on the host (streamed
    to the GPU for each forward) per element the device lane can take (see
    zerostack.shard's [Note: step-time floor]), and ``why_not``, or why
    "auto" gives the lane none of them: the CPU-held chunks' parameter
    shards are all pageable, or some live on the host ([Note: "auto" and
    parameter shards on the host])."""
    if module.config.auto or module.compute_device.type != "cuda":
        return 0.0, why_not
    offloaded = module.offloaded_masters
    held = [(c, m) for c, m in pairs if m in offloaded]
    took = [(c, m) for c, m in held if not _pageable_host_shard(module, c)]
    if held and not took and why_not is None:
        why_not = (
            "every CPU-held chunk keeps its parameter shard in pageable host memory "
            "(pin_memory=False), which the device lane does not stream from"
        )
    hosted = sum(shard_on_host(c) for c, _ in took)
    if hosted and why_not is None:
        why_not = (
            f"{hosted} of the {len(took)} CPU-held optimizer chunks keep their parameter shard "
            "on the host (offload_param_frac), and a split of those measured slower than CPU "
            "Adam alone; pass gpu_update_fraction as a number to split them anyway"
        )
    total = sum(m.shard_size for _, m in took)
    if not total:
        return 0.0, why_not
    return module.step_amounts()["streamed_bytes"] / total, why_not


def _raise_first(errors: list[CpuStepError]) -> None:
    if errors:
        raise errors[0]


def _close(pipeline: CpuStepPipeline, collector: CollectorSchedule) -> None:
    pipeline.close()
    collector.close()


def _close_on_collect(stop_worker: Callable[[], None], collector: CollectorSchedule) -> None:
    stop_worker()
    collector.close()


def _state_bytes_per_element(optimizer: torch.optim.Optimizer) -> int:
    """Optimizer state bytes per fp32 master element: two moments for
    Adam-like optimizers, one momentum buffer for SGD with momentum."""
    defaults = optimizer.defaults
    if "betas" in defaults:
        return 8
    if defaults.get("momentum", 0):
        return 4
    return 0 if isinstance(optimizer, torch.optim.SGD) else 8


# [Note: Gemini's split where the model finds it faster] GeminiOptimizer's
# default gpu_update_fraction is "auto" under auto placement and 0.0 under
# static placement. Under auto placement "auto" weighs the plan with the
# split against the plan without it and keeps the one whose step-time floor
# is the shorter (zerostack.shard's [Note: a placement weighed with its
# split], with the measured cases): the split's gain depends on the model,
# because its staging takes GPU room from optimizer chunks (on one H100 host
# the 4.24B GPT under 24 GiB took 1.176 s split against 1.209-1.227 s alone,
# LLaMA 1.1B under 12 GiB 0.337-0.360 s against 0.306-0.331 s). Under
# static placement the plan is the user's (offload_optim_frac), so nothing
# is weighed; the split there stays opt-in: the 8.06B row of
# benchmarks/scale.py (every shard streamed) took 3.14 s and 3.40 s split
# against 3.14 s and 3.04 s alone.
# History: from the third session of 2026-12-03 to 2026-12-04 the default
# under auto placement was "auto" without the weighing; a 4.24B GPT under a
# 24 GiB cap then trained wrong in 3 of 3 runs whose lane took 38 or 39 of
# 100 chunks, from the device lane's staging allocated in the compute
# stream's pool on the CPU-step worker, a race with the next forward
# (zerostack.shard's [Note: staging allocated on its own stream]); with the
# staging on its own stream 5 of 5 runs of a 39-chunk lane matched CPU Adam
# alone, and the default stayed 0.0 until the weighing. ZeroOptimizer keeps
# "auto" as its default with ``cpu_offload``, which puts every master on the
# host: the split changes no placement there, so there is nothing to weigh.


# [Note: "auto" and parameter shards on the host] Under static placement
# with parameter shards on the host (offload_param_frac > 0, pinned), an
# asked-for "auto" gives 0.0 and says so; a number still runs the split
# there. Each lane chunk's new values go down into its host shard, the host
# waits for them, and the forward gathers them up again, over the link that
# carries the lane's masters and moments up. The step-time model counts the
# bytes and favoured the split by about 3%: the 8.06B GPT of
# benchmarks/scale.py (every shard on the host, 24 GiB cap, batch 16) had
# floors of 2.639 s split (0.27) against 2.712 s alone, and on one H100 host,
# in one call, took 3.39 s a step split (its forward 2.06 s) against 3.03 s
# alone (1.59-1.78 s), when the lane took the first chunks in compute order
# (docs/benchmarks.md, "twenty-fifth session"). With the lane's chunks spread
# through that order ([Note: the lane's units spread through the forward's
# order] in zerostack.shard) the split's forward waits less, but on another
# H100 host, in one call, the split still took 3.20 s (forward 1.86 s)
# against 2.96 s alone (1.62-1.70 s), floors 2.700 and 2.778 s
# (docs/benchmarks.md, "twenty-sixth session"); the split runs of the
# sessions before were 1.10-1.28x their floor, CPU Adam alone 1.03x-1.15x.


def _grad_target(chunk: Chunk) -> Chunk:
    """The chunk that holds ``chunk``'s reduced gradient: its grad chunk under
    gradient accumulation, else itself (written over the parameter shard)."""
    return chunk.grad_chunk if chunk.grad_chunk is not None else chunk


def _reduced_on_host(chunk: Chunk) -> bool:
    """This backward reduced ``chunk``'s gradient into host memory, where
    Chunk.reduce puts a sharded chunk's (or its grad chunk's) when the
    parameter chunk's shard lives there; a kept-gathered chunk reduces in
    its buffer on the device. Nothing to stage then, and the share is not
    read here, which would wait for its landing copy."""
    return shard_on_host(chunk)


def _grad_share(chunk: Chunk) -> torch.Tensor:
    """This rank's share of ``chunk``'s reduced gradient."""
    return _grad_target(chunk).local_share()


# Each GeminiDDP's live GeminiOptimizer, and the inner optimizers wrapped already.
_OPTIMIZERS: weakref.WeakKeyDictionary[GeminiDDP, weakref.ref] = weakref.WeakKeyDictionary()
_WRAPPED: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()


def _check_module(api: str, module: object) -> None:
    if not isinstance(module, GeminiDDP):
        raise TypeError(
            f"{api}: module must be the GeminiDDP model (got {type(module).__name__}); wrap the "
            "model in GeminiDDP first"
        )


def _check_wrap(optimizer: object, module: Any) -> None:
    if isinstance(optimizer, GeminiOptimizer):
        raise TypeError(
            f"{_API}: the optimizer is a GeminiOptimizer already; wrap the torch optimizer once"
        )
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"{_API}: optimizer must be a torch.optim.Optimizer (got {type(optimizer).__name__}); "
            "e.g. HybridAdam(model.parameters())"
        )
    _check_module(_API, module)
    # See zero-shard's [Note: optimizers over flat pieces].
    check_flat_optimizer(_API, optimizer, chunks=True)
    if optimizer in _WRAPPED:
        raise RuntimeError(
            f"{_API}: this optimizer is wrapped by a GeminiOptimizer already (its parameters are "
            "that wrapper's master shards); build a new one"
        )
    if optimizer.state:
        # Its states are keyed by the model's parameters, which the master
        # chunks replace: they were dropped, silently (Adam's moments and
        # step count started afresh after a resume).
        raise ValueError(
            f"{_API}: the optimizer already has state (got state for {len(optimizer.state)} "
            "tensors, from a step or optimizer.load_state_dict before the wrap), which the master "
            "chunks would drop; wrap a fresh optimizer (booster.boost), then load the optimizer "
            "checkpoint into the wrapper (booster.load_optimizer, as ColossalAI's Booster)"
        )
    ref = _OPTIMIZERS.get(module)
    if ref is not None and ref() is not None:
        raise RuntimeError(
            f"{_API}: the model has a GeminiOptimizer already; one optimizer per GeminiDDP (call "
            "close() on the old one first)"
        )


def _refuse_user_calls(optimizer: torch.optim.Optimizer) -> None:
    """The optimizer the user built, once wrapped: the step reads its one
    group's hyperparameters and steps the twin's masters, so its
    ``add_param_group`` raises, as under ZeroOptimizer, and so do its
    ``state_dict`` and ``load_state_dict`` (see zerostack.shard's [Note:
    the user's optimizer's state_dict])."""
    refuse_user_state_dict(optimizer, _API)
    refuse_user_add_param_group(optimizer, _API, "whose master chunks its one group steps")


def _check_covers(optimizer: torch.optim.Optimizer, module: GeminiDDP) -> None:
    if len(optimizer.param_groups) != 1:
        sizes = [len(g["params"]) for g in optimizer.param_groups]
        raise NotImplementedError(
            f"{_API}: {len(sizes)} parameter groups; one group is supported for now, a chunk "
            f"holds parameters of any group (got groups of {sizes} tensors); put every parameter "
            "in one group (e.g. HybridAdam(model.parameters(), weight_decay=...)), or use "
            "LowLevelZeroPlugin, whose groups keep their own lr and weight_decay"
        )
    ids = {id(p) for p in optimizer.param_groups[0]["params"]}
    trainable = [p for p in module.params if p.requires_grad]
    missing = [module.param_names[p] for p in trainable if id(p) not in ids]
    if missing:
        raise ValueError(
            f"{_API}: the optimizer lacks parameters of the module (got none for {missing[:3]})"
        )


class GeminiAdamOptimizer(GeminiOptimizer):
    """``GeminiOptimizer(HybridAdam(module's trainable parameters, ...), module, ...)``.

    Args:
        module: the GeminiDDP model.
        lr, betas, eps, weight_decay, adamw_mode, bias_correction: HybridAdam's.
        **kwargs: GeminiOptimizer's (max_norm, overlap_cpu_step, the scaler's).
    """

    def __init__(
        self,
        module: GeminiDDP,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        adamw_mode: bool = True,
        bias_correction: bool = True,
        **kwargs: Any,
    ) -> None:
        _check_module("GeminiAdamOptimizer", module)
        params = [p for p in module.params if p.requires_grad]
        adam = HybridAdam(
            params,
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            adamw_mode=adamw_mode,
            bias_correction=bias_correction,
        )
        super().__init__(adam, module, **kwargs)
