"""GeminiOptimizer: steps the fp32 master chunks of a GeminiDDP model."""

from __future__ import annotations

import inspect
import logging
import math
from typing import Any

import torch
import torch.distributed as dist

from zerostack.gemini._ddp import GeminiDDP
from zerostack.shard import DynamicLossScaler, clip_coefficient, grad_stats

logger = logging.getLogger(__name__)
_API = "GeminiOptimizer"


class GeminiOptimizer:
    """The optimizer of a :class:`GeminiDDP` model.

    ``optimizer`` is built on the model's parameters (one parameter group);
    its parameters are replaced by this rank's fp32 master shards, one per
    chunk, so its states are sharded like the chunks (CPU shards step on the
    CPU kernel, GPU shards on the CUDA kernel when it is a HybridAdam).

    Args:
        optimizer: e.g. ``HybridAdam(model.parameters(), lr=...)``.
        module: the GeminiDDP model.
        max_norm: clip the global gradient norm (0: off). Default 0.0.
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
        self.pairs = [(c, c.paired_chunk) for c in module.grad_chunks]
        self.masters = [m.shard for _, m in self.pairs]
        for m in self.masters:
            if hasattr(m, "grad_dtype"):
                m.grad_dtype = None  # torch >= 2.10: fp16/bf16 grads stepped as they are
        optimizer.param_groups[0]["params"] = self.masters
        self.optimizer = optimizer
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

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, scaled for fp16."""
        if self.scaler is not None:
            loss = loss * self.scaler.scale
        self.module.backward_via_optimizer = True
        loss.backward()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for m in self.masters:
            m.grad = None

    def step(self) -> bool:
        """Clip, unscale, step the masters, write the parameters back into
        their chunks. Returns False when skipped for fp16 overflow."""
        # The reduced gradients: in the grad chunk (gradient accumulation) or
        # over the parameter shard.
        if self.module.used and not self.module.backward_via_optimizer:
            self.module.used.clear()
            raise RuntimeError(
                f"{_API}.step: run backward as optimizer.backward(loss), not loss.backward() "
                "(it scales fp16 losses and marks the step's gradients)"
            )
        self.module.backward_via_optimizer = False
        grads = [
            _grad_share(c.grad_chunk if c.grad_chunk is not None else c) for c, _ in self.pairs
        ]
        device = self.module.compute_device
        trainable = [p for p in self.module.params if p.requires_grad]
        used = torch.tensor([float(p in self.module.used) for p in trainable], device=device)
        stats = grad_stats(grads, used, self.module.process_group)
        self.module.used.clear()
        found_inf = not math.isfinite(stats[0])
        # A parameter with no gradient on any rank is left alone, as DDP leaves
        # its grad None and torch's optimizers skip it: its slices of the
        # master and of the optimizer state are put back after the step.
        unused = [p for p, u in zip(trainable, stats[1:], strict=True) if u == 0]
        scale = self.scaler.scale if self.scaler is not None else 1.0
        if self.scaler is not None:
            self.scaler.update(found_inf)
        if not found_inf:
            self.last_grad_norm = stats[0] ** 0.5 / scale
            combined = clip_coefficient(self.last_grad_norm, self.max_norm) / scale
            for m, g in zip(self.masters, grads, strict=True):
                m.grad = g.to(m.device, non_blocking=True) if g.device != m.device else g
            saved = self._save_slices(unused)
            if self._div_scale:
                self.optimizer.step(div_scale=1.0 / combined if combined != 1.0 else -1)
            else:
                if combined != 1.0:
                    torch._foreach_mul_([m.grad for m in self.masters], combined)
                self.optimizer.step()
            for t, sl, value in saved:
                t[sl].copy_(value)
        else:
            logger.warning(
                "Gemini: gradient overflow, step skipped; loss scale now %s", self.scaler.scale
            )
        self.zero_grad()
        self._write_back()
        return not found_inf

    def _save_slices(
        self, params: list[torch.Tensor]
    ) -> list[tuple[torch.Tensor, slice, torch.Tensor]]:
        """Copies of ``params``' elements in this rank's master shards and states."""
        saved = []
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
                saved.append((t, sl, t[sl].clone()))
        return saved

    @torch.no_grad()
    def _write_back(self) -> None:
        """Updated masters become the parameter shards (cast) again."""
        for chunk, _ in self.pairs:
            if chunk.is_gathered and chunk.can_release:
                self.manager.release_chunk(chunk)  # a stale gathered copy (gradient accumulation)
            chunk.copy_from_paired()
            grad = chunk.grad_chunk
            if grad is not None:  # the reduced gradient is consumed
                self.manager._apply(chunk, setattr, grad, "shard", None)
                if grad.buffer is not None:
                    grad.buffer.zero_()
            if chunk.keep_gathered and chunk.world_size > 1:
                share = chunk._my_share().clone()
                dist.all_gather_into_tensor(chunk.buffer, share, group=chunk.process_group)

    def state_dict(self) -> dict[str, Any]:
        """This rank's shard of the optimizer state (over the master chunks)."""
        return {
            "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict() if self.scaler else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scaler is not None and state["scaler"] is not None:
            self.scaler.load_state_dict(state["scaler"])


def _grad_share(chunk) -> torch.Tensor:
    return chunk._my_share() if chunk.keep_gathered else chunk.shard
