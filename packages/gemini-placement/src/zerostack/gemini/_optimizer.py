"""GeminiOptimizer: steps the fp32 master chunks of a GeminiDDP model."""

from __future__ import annotations

import inspect
import logging
import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from zerostack.chunk import Chunk
from zerostack.fused_adam import HybridAdam
from zerostack.gemini._ddp import GeminiDDP
from zerostack.shard import DynamicLossScaler, clip_coefficient, grad_stats

logger = logging.getLogger(__name__)
_API = "GeminiOptimizer"


class GeminiOptimizer:
    """The optimizer of a :class:`GeminiDDP` model.

    ``optimizer`` is built on the model's parameters (one parameter group);
    its parameters are replaced by this rank's fp32 master shards, one per
    chunk, so its states are sharded like the chunks.

    A step first updates the master chunks on the compute device (CUDA
    kernel, launched asynchronously), then the CPU-held ones (CPU kernel).
    Gradients of CPU-held chunks are copied to pinned host buffers when
    backward ends; with ``overlap_cpu_step`` the CPU updates run on a worker
    thread, chunk by chunk in compute order, while the next forward starts:
    each chunk's forward waits only for that chunk's update, and its new
    fp16/bf16 values go to the device then. The math is the same as a
    synchronous step, never a step late. Only the fp16 loss scaler skips
    steps on overflow; bf16 and fp32 gradients are applied as torch's
    optimizers would, inf/nan included.

    Args:
        optimizer: e.g. ``HybridAdam(model.parameters(), lr=...)``. Step
            learning-rate schedulers on this object (its ``param_groups``),
            not on ``optimizer``: the worker thread reads the inner groups.
        module: the GeminiDDP model.
        max_norm: clip the global gradient norm (0: off). Default 0.0.
        overlap_cpu_step: run the CPU part of the step on a worker thread,
            overlapped with the next forward; without clipping and without an
            fp16 loss scale, a CPU-held chunk's update starts during backward,
            with the hyperparameters ``param_groups`` hold then (step lr
            schedulers after ``step()``, as usual). Default True.
        initial_scale ... max_scale: the fp16 loss scaler (fp16 models only),
            with zerostack.shard's defaults.

    Raises:
        NotImplementedError: several parameter groups.
        ValueError: the optimizer is not built on the module's parameters.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        module: GeminiDDP,
        *,
        max_norm: float = 0.0,
        overlap_cpu_step: bool = True,
        initial_scale: float = 2.0**16,
        min_scale: float = 1.0,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 1000,
        hysteresis: int = 2,
        max_scale: float = 2.0**32,
    ) -> None:
        if len(optimizer.param_groups) != 1:
            raise NotImplementedError(
                f"{_API}: {len(optimizer.param_groups)} parameter groups; one group is supported for now "
                "(a chunk holds parameters of any group)"
            )
        ids = {id(p) for p in optimizer.param_groups[0]["params"]}
        trainable = [p for p in module.params if p.requires_grad]
        missing = [module.param_names[p] for p in trainable if id(p) not in ids]
        if missing:
            raise ValueError(
                f"{_API}: the optimizer lacks parameters of the module (got none for {missing[:3]})"
            )
        self.module = module
        self.manager = module.chunk_manager
        self.max_norm = max_norm
        self.optimizer = optimizer
        self.pairs = [(c, c.paired_chunk) for c in module.grad_chunks]
        # What users (and lr schedulers) see and change; copied into the
        # inner group at each step, when no worker is reading it.
        self.param_groups = [{**optimizer.param_groups[0], "params": trainable}]
        self._bind_masters()
        self.scaler = None
        if module.mixed_precision == torch.float16:
            self.scaler = DynamicLossScaler(
                initial_scale=initial_scale,
                min_scale=min_scale,
                growth_factor=growth_factor,
                backoff_factor=backoff_factor,
                growth_interval=growth_interval,
                hysteresis=hysteresis,
                max_scale=max_scale,
            )
        self._div_scale = "div_scale" in inspect.signature(optimizer.step).parameters
        self._copy_out = hasattr(optimizer, "set_copy_out")
        self._executor = (
            ThreadPoolExecutor(1, thread_name_prefix="gemini-cpu-step")
            if overlap_cpu_step
            else None
        )
        self._host_grads: dict[Chunk, torch.Tensor] = {}
        self._staged: dict[int, torch.cuda.Event] = {}
        self._index = {c: i for i, (c, _) in enumerate(self.pairs)}
        # CPU-held chunks whose update started during this backward.
        self._early: set[int] = set()
        self._lock = threading.Lock()  # one optimizer.step() at a time
        self.cpu_step_s = 0.0  # worker time in CPU updates (hidden unless forward waits)
        module.backward_end_callbacks.append(self._stage_grads)
        module.chunk_reduced_callbacks.append(self._on_chunk_reduced)

    def _bind_masters(self) -> None:
        """Point the inner optimizer at the master shards where they now are."""
        self.masters = [m.shard for _, m in self.pairs]
        for m in self.masters:
            if hasattr(m, "grad_dtype"):
                m.grad_dtype = None  # torch >= 2.10: fp16/bf16 grads stepped as they are
        self.optimizer.param_groups[0]["params"] = self.masters
        offloaded = self.module.offloaded_masters
        self._host = [i for i, (_, m) in enumerate(self.pairs) if m in offloaded]
        self._host_set = set(self._host)
        self._device = [i for i, (_, m) in enumerate(self.pairs) if m not in offloaded]
        # fp16/bf16 results of CPU-held masters, on their way to the chunks.
        pin = self.module.compute_device.type == "cuda"
        self._host_params = {}
        for i in self._host:
            chunk, master = self.pairs[i]
            buf = torch.empty(chunk.shard_size, dtype=chunk.dtype, pin_memory=pin)
            self._host_params[i] = buf
            if hasattr(self.optimizer, "set_copy_out"):
                self.optimizer.set_copy_out(master.shard, buf)

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, scaled for fp16."""
        if self.scaler is not None:
            loss = loss * self.scaler.scale
        self.module.backward_via_optimizer = True
        loss.backward()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to do: gradients live in the chunks and are consumed by
        ``step`` (kept for the torch.optim interface)."""

    # -- gradients of CPU-held chunks ------------------------------------------------

    def _stage_grads(self) -> None:
        """End of backward: start copying the reduced gradients of CPU-held
        chunks into pinned host buffers (the CPU step waits for them)."""
        for i in self._host:
            if i not in self._early:
                self._stage_one(i)

    def _stage_one(self, i: int) -> None:
        chunk = self.pairs[i][0]
        share = _grad_share(chunk.grad_chunk if chunk.grad_chunk is not None else chunk)
        if share.device.type == "cpu":
            return
        buf = self._host_grads.get(chunk)
        if buf is None:
            buf = torch.empty(share.numel(), dtype=share.dtype, pin_memory=True)
            self._host_grads[chunk] = buf
        buf.copy_(share, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._staged[i] = event

    def _on_chunk_reduced(self, chunk: Chunk, complete: bool) -> None:
        """Start a CPU-held chunk's update during backward, as soon as its
        gradient is reduced, when nothing global can change it: no clipping,
        no fp16 loss scale, every tensor of the chunk had a gradient."""
        i = self._index.get(chunk)
        module = self.module
        if (
            i is None
            or not complete
            or i not in self._host_set
            or self.max_norm > 0
            or self.scaler is not None
            or self._executor is None
            or module._no_sync
            or chunk.keep_gathered  # its write-back is a collective: at a fixed point
            or (module.auto is not None and not module.auto.planned)
        ):
            return
        if not self._early:  # the first of this backward: this step's hyperparameters
            self._sync_hyper()
        self._stage_one(i)
        grad = _grad_share(chunk.grad_chunk if chunk.grad_chunk is not None else chunk)
        future = self._executor.submit(self._cpu_update, i, grad, -1.0, None)
        module.pending_updates[chunk] = partial(self._finish_async, i, future)
        self._early.add(i)

    def _sync_hyper(self) -> None:
        inner = self.optimizer.param_groups[0]
        inner.update({k: v for k, v in self.param_groups[0].items() if k != "params"})

    def _host_grad(self, i: int, grad: torch.Tensor) -> torch.Tensor:
        return grad if grad.device.type == "cpu" else self._host_grads[self.pairs[i][0]]

    # -- the step ---------------------------------------------------------------------

    def step(self) -> bool:
        """Clip, unscale, step the masters, write the parameters back into
        their chunks. Returns False when skipped for fp16 overflow."""
        module = self.module
        early = self._early
        self._early = set()
        for chunk in list(module.pending_updates):  # the previous step's CPU updates
            if self._index.get(chunk) not in early:
                module.await_update(chunk)
        if module.auto is not None and not module.auto.planned:
            masters = dict(self.pairs)
            before = list(self.masters)
            module.auto.plan(masters, _state_bytes_per_element(self.optimizer))
            module.offloaded_masters = {
                m for m in masters.values() if m not in module.auto.on_device
            }
            self._bind_masters()
            # State loaded before the plan (a resumed run) moves with its master.
            for old, new in zip(before, self.masters, strict=True):
                if old is not new and old in self.optimizer.state:
                    self.optimizer.state[new] = {
                        k: v.to(new.device) if torch.is_tensor(v) and v.dim() > 0 else v
                        for k, v in self.optimizer.state.pop(old).items()
                    }
            self._stage_grads()  # the plan moved shards: stage from where the gradients are now
        if module.used and not module.backward_via_optimizer:
            module.used.clear()
            raise RuntimeError(
                f"{_API}.step: run backward as optimizer.backward(loss), not loss.backward() "
                "(it scales fp16 losses and marks the step's gradients)"
            )
        module.backward_via_optimizer = False
        # The reduced gradients: in the grad chunk (gradient accumulation) or
        # over the parameter shard.
        grads = [
            _grad_share(c.grad_chunk if c.grad_chunk is not None else c) for c, _ in self.pairs
        ]
        device = module.compute_device
        trainable = [p for p in module.params if p.requires_grad]
        used = torch.tensor([float(p in module.used) for p in trainable], device=device)
        stats = grad_stats(grads, used, module.process_group)
        module.used.clear()
        # Only an fp16 loss scale skips steps; bf16/fp32 gradients are applied
        # as they are, inf/nan included, as torch's optimizers do (chunks
        # started during backward could not be taken back anyway).
        found_inf = self.scaler is not None and not math.isfinite(stats[0])
        scale = self.scaler.scale if self.scaler is not None else 1.0
        if self.scaler is not None:
            self.scaler.update(found_inf)
        if found_inf:
            logger.warning(
                "Gemini: gradient overflow, step skipped; loss scale now %s", self.scaler.scale
            )
            for i in range(len(self.pairs)):
                self._write_back(i, None)
            return False
        self.last_grad_norm = stats[0] ** 0.5 / scale
        combined = clip_coefficient(self.last_grad_norm, self.max_norm) / scale
        div_scale = 1.0 / combined if combined != 1.0 else -1.0
        if not early:  # else the hyperparameters read when backward started the CPU updates
            self._sync_hyper()
        # A parameter with no gradient on any rank is left alone, as DDP leaves
        # its grad None and torch's optimizers skip it: its slices of the
        # master and of the optimizer state are put back after the step.
        unused = [p for p, u in zip(trainable, stats[1:], strict=True) if u == 0]
        saved = self._save_slices(unused)

        # Device-held masters: one launch, asynchronous on the device. (The
        # lock: a CPU update started during backward may be running; each
        # call steps exactly the masters that have a grad.)
        with self._lock:
            for i in self._device:
                self.masters[i].grad = grads[i]
            self._step_inner(div_scale)
            for i in self._device:
                self.masters[i].grad = None
        for i in self._device:
            _restore(saved.get(i))
            self._write_back(i, None)

        # CPU-held masters, chunk by chunk in compute order (those started
        # during backward are running already).
        for i in self._cpu_order():
            if i in early:
                continue
            grad = grads[i]
            if self._executor is None:
                self._cpu_update(i, grad, div_scale, saved.get(i))
                self._write_back(i, self._host_params[i])
            else:
                future = self._executor.submit(self._cpu_update, i, grad, div_scale, saved.get(i))
                chunk = self.pairs[i][0]
                module.pending_updates[chunk] = partial(self._finish_async, i, future)
        return True

    def _cpu_order(self) -> list[int]:
        auto = self.module.auto
        if auto is None or not auto.stats.order:
            return list(self._host)
        first = {idx: k for k, idx in enumerate(auto.stats.chunk_order())}
        return sorted(self._host, key=lambda i: first.get(self.pairs[i][0].index, 1 << 30))

    def _step_inner(self, div_scale: float) -> None:
        if self._div_scale:
            self.optimizer.step(div_scale=div_scale)
            return
        if div_scale > 0:
            grads = [m.grad for m in self.masters if m.grad is not None]
            torch._foreach_mul_(grads, 1.0 / div_scale)
        self.optimizer.step()

    def _cpu_update(self, i: int, grad: torch.Tensor, div_scale: float, saved) -> None:
        """Step one CPU-held master (on the worker thread when overlapping)."""
        t0 = time.perf_counter()
        staged = self._staged.get(i)
        if grad.device.type != "cpu" and staged is not None:
            staged.synchronize()
        master = self.masters[i]
        host_grad = self._host_grad(i, grad)
        with self._lock:
            master.grad = host_grad if div_scale <= 0 or self._div_scale else host_grad.clone()
            self._step_inner(div_scale)
            master.grad = None
        _restore(saved)
        if self._copy_out:  # the kernel wrote the unused slices' stepped values out too
            for t, sl, value in saved or ():
                if t is master:
                    self._host_params[i][sl].copy_(value)
        if not self._copy_out:
            self._host_params[i].copy_(master)
        self.cpu_step_s += time.perf_counter() - t0

    def _finish_async(self, i: int, future) -> None:
        future.result()  # re-raises the worker's exception
        self._write_back(i, self._host_params[i])

    @torch.no_grad()
    def _write_back(self, i: int, host_values: torch.Tensor | None) -> None:
        """Updated master ``i`` becomes its chunk's parameter shard (cast) again:
        from ``host_values`` (the CPU step's fp16/bf16 output) or the master."""
        chunk, _ = self.pairs[i]
        if chunk.is_gathered and chunk.can_release:
            self.manager.release_chunk(chunk)  # a stale gathered copy (gradient accumulation)
        if host_values is None:
            chunk.copy_from_paired()
        else:
            chunk._my_share().copy_(host_values, non_blocking=True)
        grad = chunk.grad_chunk
        if grad is not None:  # the reduced gradient is consumed
            self.manager._apply(chunk, setattr, grad, "shard", None)
            if grad.buffer is not None:
                grad.buffer.zero_()
        if chunk.keep_gathered and chunk.world_size > 1:
            share = chunk._my_share().clone()
            dist.all_gather_into_tensor(chunk.buffer, share, group=chunk.process_group)

    def _save_slices(self, params: list[torch.Tensor]) -> dict[int, list]:
        """Copies of ``params``' elements in this rank's master shards and
        states, by pair index."""
        saved: dict[int, list] = {}
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
            for t in (master, *(v for v in state.values() if torch.is_tensor(v) and v.dim() > 0)):
                saved.setdefault(self._index[chunk], []).append((t, sl, t[sl].clone()))
        return saved

    def state_dict(self) -> dict[str, Any]:
        """This rank's shard of the optimizer state (over the master chunks)."""
        self.module.wait_updates()
        return {
            "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict() if self.scaler else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load ``state_dict()`` output of the same rank and world size."""
        self.module.wait_updates()
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scaler is not None and state["scaler"] is not None:
            self.scaler.load_state_dict(state["scaler"])

    # -- whole-model optimizer state, any world size ---------------------------------

    def _trainable(self) -> list[torch.Tensor]:
        return [p for p in self.module.params if p.requires_grad]

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, Any]:
        """Every trainable parameter's whole fp32 master and optimizer state
        (flat, on the CPU), gathered on every rank, keyed by parameter name:
        loadable at any world size and chunk size with ``load_full_state_dict``."""
        self.module.wait_updates()
        per_chunk: dict[Chunk, dict[str, Any]] = {}
        for (chunk, master_chunk), master in zip(self.pairs, self.masters, strict=True):
            state = self.optimizer.state.get(master, {})
            whole = {"master": _gather_chunk(master, master_chunk)}
            for k, v in state.items():
                if torch.is_tensor(v) and v.dim() > 0 and v.numel() == master.numel():
                    whole[k] = _gather_chunk(v, master_chunk)
                else:  # e.g. the step count
                    whole[k] = v.detach().clone() if torch.is_tensor(v) else v
            per_chunk[chunk] = whole
        params = {}
        for p in self._trainable():
            chunk = self.manager.get_chunk(p)
            info = chunk.tensors_info[p]
            params[self.module.param_names[p]] = {
                k: v[info.offset : info.end].clone() if _is_chunk_tensor(v, chunk) else v
                for k, v in per_chunk[chunk].items()
            }
        return {
            "params": params,
            "param_group": {k: v for k, v in self.param_groups[0].items() if k != "params"},
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
        }

    @torch.no_grad()
    def load_full_state_dict(self, full: dict[str, Any]) -> None:
        """Load ``full_state_dict()`` output saved at any world size: masters,
        optimizer states and parameters (cast from the masters).

        Raises:
            KeyError: a trainable parameter is missing from ``full``.
            ValueError: a parameter's size differs.
        """
        module = self.module
        module.wait_updates()
        names = [module.param_names[p] for p in self._trainable()]
        missing = [n for n in names if n not in full["params"]]
        if missing:
            raise KeyError(f"{_API}.load_full_state_dict: no state for {missing[:5]}")
        state: dict[int, dict[str, Any]] = {}
        for i, (chunk, _) in enumerate(self.pairs):
            master = self.masters[i]
            whole: dict[str, Any] = {}
            for t, info in chunk.tensors_info.items():
                entry = full["params"][module.param_names[t]]
                for k, v in entry.items():
                    if not (torch.is_tensor(v) and v.dim() == 1):
                        whole.setdefault(k, v.clone() if torch.is_tensor(v) else v)
                        continue
                    if v.numel() != info.end - info.offset:
                        raise ValueError(
                            f"{_API}.load_full_state_dict: {module.param_names[t]} has {v.numel()} "
                            f"elements in the state, {info.end - info.offset} in the model"
                        )
                    buf = whole.setdefault(k, torch.zeros(chunk.chunk_size, dtype=v.dtype))
                    buf[info.offset : info.end].copy_(v)
            lo, hi = chunk.rank * chunk.shard_size, (chunk.rank + 1) * chunk.shard_size
            mine = {
                k: v[lo:hi].to(master.device) if _is_chunk_tensor(v, chunk) else v
                for k, v in whole.items()
            }
            master.copy_(mine.pop("master"))
            if mine:
                state[i] = mine
        hyper = dict(full["param_group"])
        self.param_groups[0].update(hyper)
        inner = {
            **self.optimizer.param_groups[0],
            **hyper,
            "params": list(range(len(self.masters))),
        }
        self.optimizer.load_state_dict({"state": state, "param_groups": [inner]})
        if self.scaler is not None and full["scaler"] is not None:
            self.scaler.load_state_dict(full["scaler"])
        for i in range(len(self.pairs)):
            self._write_back(i, None)


def _gather_chunk(t: torch.Tensor, chunk: Chunk) -> torch.Tensor:
    """The whole chunk from every rank's shard ``t``, on the CPU."""
    if chunk.world_size == 1 or not dist.is_initialized():
        return t.detach().cpu().clone()
    device = chunk.compute_device
    out = torch.empty(chunk.chunk_size, dtype=t.dtype, device=device)
    dist.all_gather_into_tensor(out, t.detach().to(device), group=chunk.process_group)
    return out.cpu()


def _is_chunk_tensor(v: Any, chunk: Chunk) -> bool:
    return torch.is_tensor(v) and v.dim() == 1 and v.numel() == chunk.chunk_size


def _restore(saved) -> None:
    for t, sl, value in saved or ():
        t[sl].copy_(value)


def _state_bytes_per_element(optimizer: torch.optim.Optimizer) -> int:
    """Optimizer state bytes per fp32 master element: two moments for
    Adam-like optimizers, one momentum buffer for SGD with momentum."""
    defaults = optimizer.defaults
    if "betas" in defaults:
        return 8
    if defaults.get("momentum", 0):
        return 4
    return 0 if isinstance(optimizer, torch.optim.SGD) else 8


def _grad_share(chunk) -> torch.Tensor:
    return chunk._my_share() if chunk.keep_gathered else chunk.shard


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
