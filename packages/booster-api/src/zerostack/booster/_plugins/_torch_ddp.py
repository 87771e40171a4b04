"""TorchDDPPlugin: torch's DistributedDataParallel behind the Booster, and the
plain path the Booster takes without a plugin."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from zerostack.booster import _exit
from zerostack.booster._interface import ModelWrapper
from zerostack.booster._plugins._base import (
    BoostedOptimizer,
    Plugin,
    attach_scheduler,
    check_clip_value,
    nothing,
    refuse_not_built,
)
from zerostack.booster._plugins._lazy import is_lazy
from zerostack.booster._plugins._sharded import (
    buffer_ranges,
    buffer_state,
    load_buffers,
    whole_pieces,
)
from zerostack.booster._plugins._state import (
    ModelFacts,
    frozen_names,
    full_to_positional,
    param_name,
    param_names,
    positional_to_full,
    scaler_state,
)
from zerostack.chunk import LazyInitContext, default_compute_device, rank_and_world
from zerostack.shard import check_clip_args, clip_grads_

_DDP_DEFAULTS = dict(
    broadcast_buffers=True, bucket_cap_mb=25, find_unused_parameters=False,
    check_reduction=False, gradient_as_bucket_view=False, static_graph=False,
)  # fmt: skip


class TorchDDPModel(ModelWrapper):
    """A model under torch DDP (or plain, in one process without a plugin).

    ``autocast_dtype`` (set by ``Booster(mixed_precision=...)``) runs
    forward under ``torch.autocast``.
    """

    def __init__(self, module: nn.Module, ddp_kwargs: dict[str, Any] | None) -> None:
        facts = ModelFacts.of(module)
        super().__init__(DDP(module, **ddp_kwargs) if ddp_kwargs is not None else module)
        if ddp_kwargs is not None:
            _exit.track_ddp(self.module)  # See [Note: exit code under gloo]
        self._facts = facts
        self.device_type = next(module.parameters(), torch.empty(0)).device.type
        self.autocast_dtype: torch.dtype | None = None
        # See [Note: a backward that raised under DDP]. Built once: no closure per step.
        self._backward_open = False
        self._on_backward = _BackwardWatch(self)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        ddp = isinstance(self.module, DDP)
        if ddp and self._backward_open:
            raise RuntimeError(
                "TorchDDPModel.forward: the last backward raised before it finished (DDP's "
                "gradient reduction is left half done); call optimizer.zero_grad() to drop that "
                "batch, then forward again"
            )
        if self.autocast_dtype is None:
            out = self.module(*args, **kwargs)
        else:
            with torch.autocast(self.device_type, dtype=self.autocast_dtype):
                out = self.module(*args, **kwargs)
        if ddp and torch.is_grad_enabled():
            self._on_backward.watch(out)
        return out

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``nn.Module.zero_grad``, after resetting DDP when the last
        backward raised (see [Note: a backward that raised under DDP])."""
        self.drop_backward()
        super().zero_grad(set_to_none)

    def drop_backward(self) -> None:
        """After a backward that raised: reset DDP's reducer, whose
        reduction of that backward never finished (optimizer.zero_grad()
        calls this, then drops the gradients)."""
        if not self._backward_open:
            return
        self._backward_open = False
        # [Note: a backward that raised under DDP] torch's DDP counts the
        # gradients of a backward as its hooks see them; one that raises
        # leaves that count unfinished, and every later forward raises
        # "Expected to have finished reduction in the prior iteration" (which
        # blames unused parameters), even after zero_grad() or loading a
        # checkpoint. The reducer's _reset_state() (what DDP's own
        # _update_process_group calls) lets forward run again; with the
        # gradients dropped, the steps that follow equal bitwise those of a
        # run without the batch (tested at world sizes 1 and 2 on gloo). A
        # backward "raised" when its autograd pass started through the model's
        # outputs and never reached its end (an engine callback queued from a
        # hook on the outputs): a backward that ended with parameters DDP saw
        # no gradient for is DDP's own error and is left to it.
        self.module.reducer._reset_state()  # type: ignore[union-attr,operator]  # DDP's Reducer

    def unwrap(self, unwrap_peft: bool = True) -> nn.Module:
        return self.module.module if isinstance(self.module, DDP) else self.module

    def full_state_dict(self, only_rank_0: bool = True) -> dict[str, torch.Tensor]:
        """The whole model (every rank holds it whole); see [Note: full state format]."""
        if only_rank_0 and rank_and_world()[0] != 0:
            return {}
        return self._facts.export_model(self.unwrap().state_dict())

    def load_full_state_dict(
        self, state_dict: dict[str, torch.Tensor], strict: bool = True
    ) -> None:
        """Load the whole model on this rank (every rank passes the same dict);
        after a backward that raised, its batch is dropped first."""
        self._drop_for_load()
        self.unwrap().load_state_dict(state_dict, strict=strict)

    def _drop_for_load(self) -> None:
        if self._backward_open:  # See [Note: a backward that raised under DDP]
            self.zero_grad()

    def local_ranges(self) -> dict[str, tuple[int, int, int]]:
        """Everything whole: every rank holds the whole model."""
        module = self.unwrap()
        out = {n: (0, p.numel(), p.numel()) for n, p in module.named_parameters()}
        return {**out, **buffer_ranges(module)}

    def sharded_state_dict(self) -> dict[str, Any]:
        """The whole model as plain flat tensors (the same on every rank: DCP
        writes each once, spread over the ranks); see [Note: sharded state format]."""
        module = self.unwrap()
        out: dict[str, Any] = {
            n: p.detach().reshape(-1).float() for n, p in module.named_parameters()
        }
        out.update(buffer_state(module, self._facts.dtypes))
        return out

    @torch.no_grad()
    def load_sharded_state_dict(self, values: dict[str, torch.Tensor]) -> None:
        """Whole flat tensors into the parameters and buffers they name
        (after a backward that raised, its batch is dropped first)."""
        self._drop_for_load()
        module = self.unwrap()
        for n, p in module.named_parameters():
            if n in values:
                p.copy_(values[n].reshape(p.shape))
        load_buffers(module, values)

    @contextlib.contextmanager
    def no_sync(self):
        """DDP's no_sync (nothing to skip in a single process)."""
        with self.module.no_sync() if isinstance(self.module, DDP) else nothing():
            yield


class TorchDDPOptimizer(BoostedOptimizer):
    """The user's torch optimizer next to a TorchDDPModel; ``scaler`` (a
    torch.amp.GradScaler, set by ``Booster(mixed_precision="fp16")``)
    scales backward and unscales in ``step``."""

    _API = "TorchDDPOptimizer"
    _step_supports_amp_scaling = False  # torch's GradScaler works: see [Note: torch's GradScaler]

    def __init__(self, optimizer: torch.optim.Optimizer, model: TorchDDPModel) -> None:
        super().__init__(optimizer)
        self._model = model
        self.scaler: torch.amp.GradScaler | None = None
        self._unscaled = False  # the GradScaler unscaled this step's gradients already
        # An optimizer over another model's parameters fails here, not at saving.
        names = param_names(model.unwrap())
        for p in self._params():
            param_name(self._API, names, p)

    def backward(self, loss: torch.Tensor, inputs: Any = None, retain_graph: bool = False) -> None:
        """``loss.backward(inputs=..., retain_graph=...)``, scaled when a
        GradScaler is on."""
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward(
            inputs=inputs, retain_graph=retain_graph
        )

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the GradScaler's scale (ColossalAI's fp16 torch
        mixed precision optimizer's); backward it, then :meth:`unscale_grad`
        or ``step()`` unscales.

        Raises:
            NotImplementedError: no fp16 GradScaler (fp32 or bf16).
        """
        if self.scaler is None:
            raise NotImplementedError(
                f"{self._API}.scale_loss: the loss is not scaled (got no fp16 GradScaler); "
                "only Booster(mixed_precision='fp16') scales it: call loss.backward() as is"
            )
        return self.scaler.scale(loss)

    def unscale_grad(self) -> None:
        """Divide the gradients by the GradScaler's scale now (its
        ``unscale_``); ``step()`` and ``clip_grad_by_norm`` do not unscale
        them again.

        Raises:
            NotImplementedError: no fp16 GradScaler (fp32 or bf16).
        """
        if self.scaler is None:
            raise NotImplementedError(
                f"{self._API}.unscale_grad: the gradients are not scaled (got no fp16 "
                "GradScaler); only Booster(mixed_precision='fp16') scales them"
            )
        self._unscale_once()

    def _unscale_once(self) -> None:
        """With the fp16 GradScaler, its ``unscale_`` of this step's
        gradients unless done already (it refuses a second before
        ``update()``; ``step`` does not unscale them again)."""
        if self.scaler is not None and not self._unscaled:
            self.scaler.unscale_(self.optim)
            self._unscaled = True

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's ``add_param_group`` on the user's optimizer; the parameters
        must be the model's (DDP reduces only those).

        Raises:
            ValueError: a parameter that is not the model's.
        """
        names = param_names(self._model.unwrap())
        params = param_group.get("params") if isinstance(param_group, dict) else None
        for p in [params] if isinstance(params, torch.Tensor) else list(params or ()):
            param_name(self._API, names, p)
        self.optim.add_param_group(param_group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The optimizer's ``zero_grad``; after a backward that raised (caught
        on every rank) it also resets DDP, so that the batch is dropped and
        training goes on (see [Note: a backward that raised under DDP])."""
        # A step dropped after a clip: the GradScaler refuses a second
        # unscale_ before its update(), as it does in a torch loop.
        self._unscaled = False
        self._model.drop_backward()
        self.optim.zero_grad(set_to_none=set_to_none)

    def _step(self, *args: Any, **kwargs: Any) -> Any:
        if self.scaler is None:
            return self.optim.step(*args, **kwargs)
        self._unscaled = False
        out = self.scaler.step(self.optim, *args, **kwargs)
        self.scaler.update()
        return out

    @torch.no_grad()
    def clip_grad_by_norm(
        self,
        max_norm: float,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = False,
        foreach: bool | None = None,
    ) -> torch.Tensor:
        """torch's ``clip_grad_norm_`` on the model's parameters (DDP's
        all-reduced gradients), the norm accumulated in fp32; with the fp16
        GradScaler the gradients are unscaled first (``scaler.unscale_``, as
        torch's recipe does; ``step`` does not unscale them again). See
        BoostedOptimizer.clip_grad_by_norm."""
        api = f"{self._API}.clip_grad_by_norm"
        max_norm, norm_type = check_clip_args(api, max_norm, norm_type, error_if_nonfinite)
        self._unscale_once()
        params = list(self._model.unwrap().parameters())
        grads = [p.grad for p in params if p.grad is not None]
        device = grads[0].device if grads else next(iter(params), torch.empty(0)).device
        return clip_grads_(api, grads, max_norm, norm_type, device, error_if_nonfinite)

    @torch.no_grad()
    def clip_grad_by_value(self, clip_value: float, *args: Any, **kwargs: Any) -> None:
        """torch's ``clip_grad_value_`` on the model's parameters (DDP's
        all-reduced gradients); with the fp16 GradScaler the gradients are
        unscaled first, as in ``clip_grad_by_norm``. See
        BoostedOptimizer.clip_grad_by_value."""
        clip_value = check_clip_value(f"{self._API}.clip_grad_by_value", clip_value)
        self._unscale_once()
        torch.nn.utils.clip_grad_value_(
            self._model.unwrap().parameters(), clip_value, *args, **kwargs
        )

    def _params(self) -> list[torch.Tensor]:
        return [p for g in self.optim.param_groups for p in g["params"]]

    def full_state_dict(self) -> dict[str, Any]:
        """See [Note: full state format]; torch's positions become names."""
        facts = self._model._facts
        state, groups = positional_to_full(
            self._API, self.optim.state_dict(), self._params(),
            param_names(self._model.unwrap()), facts.shapes,
        )  # fmt: skip
        scaler = self.scaler.state_dict() if self.scaler is not None else None
        return {"state": state, "param_groups": groups, "loss_scaler": scaler}

    def local_ranges(self) -> dict[str, tuple[int, int, int]]:
        return self._model.local_ranges()

    def sharded_state_dict(self) -> dict[str, Any]:
        """The whole state, flat and plain (every rank holds it); see
        [Note: sharded state format]."""
        full = self.full_state_dict()
        return {**full, "state": whole_pieces(full["state"])}

    def load_sharded_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Whole flat states (this rank's ranges are whole): as
        :meth:`load_full_state_dict`."""
        self.load_full_state_dict(state_dict)

    def load_full_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load the [Note: full state format] (from any plugin and world size).

        Raises:
            KeyError: the state names a parameter this optimizer lacks.
            ValueError: the state's parameter groups list other parameters than
                this optimizer's (a state of another model); nothing is loaded.
            ValueError: a state tensor's size differs from its parameter's.
        """
        module = self._model.unwrap()
        positional = full_to_positional(
            self._API, state_dict, self.optim.state_dict(), self._params(),
            param_names(module), flat=False, frozen=frozen_names(module),
        )  # fmt: skip
        self.optim.load_state_dict(positional)
        if self.scaler is not None:
            saved = scaler_state(self.scaler.state_dict(), state_dict.get("loss_scaler"))
            if saved is not None:
                self.scaler.load_state_dict(saved)


class TorchDDPPlugin(Plugin):
    """torch DDP: every rank holds the whole model and optimizer; gradients
    are all-reduced in buckets during backward. Precision is left to
    ``Booster(mixed_precision=...)``.

    Args:
        broadcast_buffers: DistributedDataParallel's, as are bucket_cap_mb,
            find_unused_parameters, check_reduction, gradient_as_bucket_view
            and static_graph (its defaults: True, 25, False, False, False, False).
        fp8_communication: ColossalAI's fp8 gradient all-reduce; False only.
            Default False.

    Raises:
        NotImplementedError: ``fp8_communication=True``.
        RuntimeError (at configure): torch.distributed is not initialised.
    """

    def __init__(
        self,
        broadcast_buffers: bool = True,
        bucket_cap_mb: int = 25,
        find_unused_parameters: bool = False,
        check_reduction: bool = False,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
        fp8_communication: bool = False,
    ) -> None:
        refuse_not_built(type(self).__name__, fp8_communication=(fp8_communication, False))
        given = dict(
            broadcast_buffers=broadcast_buffers,
            bucket_cap_mb=bucket_cap_mb,
            find_unused_parameters=find_unused_parameters,
            check_reduction=check_reduction,
            gradient_as_bucket_view=gradient_as_bucket_view,
            static_graph=static_graph,
        )
        # Only what differs from DDP's defaults (the same as ColossalAI's):
        # torch 2.13 warns whenever broadcast_buffers is passed at all.
        self.ddp_kwargs = {k: v for k, v in given.items() if v != _DDP_DEFAULTS[k]}

    def support_no_sync(self) -> bool:
        return True

    def supported_precisions(self) -> list[str]:
        return ["fp16", "bf16", "fp32"]

    def _wrap_kwargs(self) -> dict[str, Any] | None:
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                f"{type(self).__name__}: torch.distributed is not initialised; call "
                "zerostack.booster.launch_from_torch() first (under torchrun), or use "
                "Booster() without a plugin in a single process"
            )
        return self.ddp_kwargs

    def _device(self) -> torch.device:
        return default_compute_device()

    def configure(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | TorchDDPOptimizer | None = None,
        criterion: Callable | None = None,
        dataloader: Any = None,
        lr_scheduler: Any = None,
    ) -> tuple:
        """Move the model to the current device (a lazily built model is
        materialized first) and wrap it in DDP; wrap the optimizer."""
        if not isinstance(model, TorchDDPModel):
            if is_lazy(model):
                LazyInitContext.materialize(model)  # on its default_device, then moved
            kwargs = self._wrap_kwargs()
            model = TorchDDPModel(model.to(self._device()), kwargs)
        if optimizer is not None and not isinstance(optimizer, TorchDDPOptimizer):
            user = optimizer
            optimizer = TorchDDPOptimizer(optimizer, model)
            attach_scheduler(lr_scheduler, optimizer, user)
        return model, optimizer, criterion, dataloader, lr_scheduler

    def no_sync(self, model: nn.Module | None = None, optimizer: Any = None):
        """DDP's no_sync on ``model``.

        Raises:
            ValueError: ``model`` is not a model boosted by this plugin.
        """
        if not isinstance(model, TorchDDPModel):
            raise ValueError(
                f"{type(self).__name__}.no_sync: pass the boosted model (got "
                f"{type(model).__name__}); booster.no_sync(model)"
            )
        return model.no_sync()


class DefaultPlugin(TorchDDPPlugin):
    """What ``Booster()`` does without a plugin: the model on ``device``,
    under DDP when a process group of more than one rank exists, plain
    otherwise; precision from ``Booster(mixed_precision=...)``."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device

    def control_device(self) -> bool:
        return False

    def _wrap_kwargs(self) -> dict[str, Any] | None:
        if rank_and_world()[1] > 1:
            return self.ddp_kwargs
        return None

    def _device(self) -> torch.device:
        return self.device


class _BackwardWatch:
    """Marks a TorchDDPModel's backward open when autograd reaches the
    outputs of its forward, and closed when that backward ends (a callback
    of the autograd engine, which does not run when backward raises). Holds
    the model weakly; built once."""

    __slots__ = ("__weakref__", "_ref")

    def __init__(self, model: TorchDDPModel) -> None:
        self._ref = weakref.ref(model)

    def watch(self, out: Any) -> None:
        tensors = [t for t in _tensors(out) if t.requires_grad]
        if len(tensors) == 1:
            tensors[0].register_hook(self._opened)
        elif tensors:
            torch.autograd.graph.register_multi_grad_hook(tensors, self._opened, mode="any")

    def _opened(self, _grad: Any) -> None:
        model = self._ref()
        if model is not None:
            model._backward_open = True
            torch.autograd.Variable._execution_engine.queue_callback(self._closed)

    def _closed(self) -> None:
        model = self._ref()
        if model is not None:
            model._backward_open = False


def _tensors(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (list, tuple)):
        return [t for o in out for t in _tensors(o)]
    if isinstance(out, dict):
        return [t for o in out.values() for t in _tensors(o)]
    return []
