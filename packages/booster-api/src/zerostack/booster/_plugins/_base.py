"""Plugin: what every plugin answers (precisions, device, no_sync), the
data-parallel dataloader, and the glue every plugin's optimizer shares."""

from __future__ import annotations

import contextlib
import functools
import logging
import random
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset

from zerostack.booster._interface import ModelWrapper, OptimizerWrapper
from zerostack.booster._plugins._contract import run_closure
from zerostack.booster._plugins._data import ResumableDataLoader, StatefulDistributedSampler
from zerostack.chunk import rank_and_world
from zerostack.shard import (
    SCALER_KEYS,
    LossScalerConfig,
    as_kwargs,
    changed_fields,
    check_max_norm,
    grad_scaler_refusal,
)

logger = logging.getLogger(__name__)
# The plugins' precision names.
PRECISION_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def precision_name(dtype: torch.dtype) -> str:
    """The plugins' name of ``dtype`` (a config's default as a precision argument)."""
    return next(name for name, d in PRECISION_DTYPES.items() if d == dtype)


def check_zero_options(api: str, precision: object, norm_type: object, max_norm: object) -> None:
    """The checks the ZeRO plugins (ColossalAI's GeminiPlugin and
    LowLevelZeroPlugin arguments) share.

    Raises:
        ValueError: an unknown precision, a negative max_norm.
        TypeError: a max_norm that is not a number.
        NotImplementedError: norm_type other than 2.
    """
    if precision not in PRECISION_DTYPES:
        raise ValueError(f"{api}: precision must be 'fp16', 'bf16' or 'fp32' (got {precision!r})")
    if norm_type != 2.0:
        raise NotImplementedError(
            f"{api}: only norm_type=2.0 is implemented (got {norm_type}); clip the 2-norm"
        )
    check_max_norm(api, max_norm)


def scaler_config(api: str, arguments: dict[str, Any]) -> LossScalerConfig:
    """The LossScalerConfig of a plugin's arguments (its ``locals()``), which
    take the loss scaler's keywords under their names (SCALER_KEYS); errors
    name the plugin ``api``."""
    return LossScalerConfig(api=api, **{name: arguments[name] for name in SCALER_KEYS})


def scaler_kwargs(
    api: str, precision: str, config: LossScalerConfig, default: LossScalerConfig
) -> dict[str, Any]:
    """The loss scaler's keywords for the wrapper: ``config``'s under fp16;
    otherwise none, with a warning when ``config`` differs from the plugin's
    ``default`` (only fp16 scales the loss)."""
    if precision == "fp16":
        return as_kwargs(config)
    changed = sorted(changed_fields(config, default))
    if changed:
        warnings.warn(
            f"{api}: the loss scaler's arguments have no effect with precision={precision!r} "
            f"(got {changed}); only fp16 scales the loss",
            UserWarning,
            stacklevel=4,  # the caller of booster.boost (through configure)
        )
    return {}


def warn_rank_local_running_stats(api: str, model: nn.Module) -> None:
    """Say once, at several ranks, that normalization layers' running
    statistics stay per rank: as under FSDP2, ColossalAI and DeepSpeed, and
    unlike torch DDP (``broadcast_buffers=True`` sends rank 0's at every
    forward), each rank updates its own, and checkpoints hold rank 0's."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return
    names = [
        name
        for name, m in model.named_modules()
        if isinstance(m, nn.modules.batchnorm._NormBase)
        and m.track_running_stats
        and not isinstance(m, nn.SyncBatchNorm)
    ]
    if names:
        warnings.warn(
            f"{api}: the running statistics of {len(names)} normalization layer(s) (got "
            f"{names[:3]}) stay per rank, as under FSDP2, ColossalAI and DeepSpeed (torch DDP "
            "broadcasts rank 0's at every forward); checkpoints hold rank 0's. For statistics "
            "over every rank, convert them first: torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)",
            UserWarning,
            stacklevel=4,  # the caller of booster.boost (through configure)
        )


class Plugin(ABC):
    """A training strategy ``Booster.boost`` applies: it wraps the model and
    optimizer in a :class:`ModelWrapper` / :class:`OptimizerWrapper` of its
    own and hands the lower packages their configs (no training logic here).
    ColossalAI's ``colossalai.booster.plugin.Plugin`` interface."""

    def supported_precisions(self) -> list[str]:
        """Precisions the plugin trains in ("fp16", "bf16", "fp32")."""
        return ["fp16", "bf16", "fp32"]

    def control_precision(self) -> bool:
        """True when the plugin decides the precision itself (then
        ``Booster(mixed_precision=...)`` has no effect)."""
        return False

    def control_device(self) -> bool:
        """True when the plugin places the model itself (then
        ``Booster(device=...)`` has no effect)."""
        return True

    def supported_devices(self) -> list[str]:
        """Device types the plugin runs on."""
        return ["cuda", "cpu"]

    def support_no_sync(self) -> bool:
        """True when :meth:`no_sync` accumulates gradients without reducing."""
        return False

    def control_checkpoint_io(self) -> bool:
        """Always True: checkpoints go through :meth:`get_checkpoint_io`."""
        return True

    def support_lora(self) -> bool:
        """False: no plugin implements :meth:`enable_lora`."""
        return False

    def enable_lora(
        self,
        model: nn.Module,
        pretrained_dir: str | None = None,
        lora_config: Any = None,
        bnb_quantization_config: Any = None,
    ) -> nn.Module:
        """ColossalAI's ``Plugin.enable_lora``: not implemented.

        Raises:
            NotImplementedError: always.
        """
        raise NotImplementedError(
            lora_refusal(f"{type(self).__name__}.enable_lora", f"lora_config={lora_config!r}")
        )

    @abstractmethod
    def configure(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        criterion: Callable | None = None,
        dataloader: DataLoader | None = None,
        lr_scheduler: Any | None = None,
    ) -> tuple[ModelWrapper, OptimizerWrapper | None, Callable | None, DataLoader | None, Any]:
        """Wrap ``model`` and ``optimizer``; returns the 5-tuple ``boost`` returns."""

    def no_sync(
        self, model: nn.Module | None = None, optimizer: OptimizerWrapper | None = None
    ) -> contextlib.AbstractContextManager:
        """A context in which backward accumulates gradients without reducing them.

        Raises:
            NotImplementedError: the plugin does not support it (see
                :meth:`support_no_sync`).
        """
        raise NotImplementedError(
            f"{type(self).__name__}: no_sync is not supported by this plugin; accumulate "
            "gradients with TorchDDPPlugin, LowLevelZeroPlugin, or "
            "GeminiPlugin(enable_gradient_accumulation=True)"
        )

    def get_checkpoint_io(self) -> Any:
        """The object Booster's save_*/load_* methods delegate to.

        Raises:
            NotImplementedError: zerostack.booster._checkpoint is not there yet.
        """
        try:
            from zerostack.booster._checkpoint import CheckpointIO
        except ImportError as error:
            if error.name != "zerostack.booster._checkpoint":
                raise  # a missing dependency of the checkpoint code: its own message
            raise NotImplementedError(
                f"{type(self).__name__}: checkpoint IO not built yet "
                "(zerostack.booster._checkpoint is missing)"
            ) from None
        return CheckpointIO()

    def prepare_dataloader(
        self,
        dataset: Dataset,
        batch_size: int,
        shuffle: bool = False,
        seed: int = 1024,
        drop_last: bool = False,
        pin_memory: bool = False,
        num_workers: int = 0,
        distributed_sampler_cls: type | None = None,
        **kwargs: Any,
    ) -> DataLoader:
        """A DataLoader whose DistributedSampler gives each data-parallel rank
        its own samples (call ``dataloader.sampler.set_epoch(epoch)`` each
        epoch when shuffling). The sampler is a StatefulDistributedSampler:
        ``Booster.save_state`` / ``load_state`` carry its epoch and position,
        so a resumed run skips the batches it trained on (see [Note: sampler
        position]).

        Args:
            dataset: the dataset.
            batch_size: samples per rank and batch.
            shuffle: shuffle (the same permutation on every rank, from
                ``seed`` and the epoch). Default False.
            seed: the sampler's seed; worker ``i`` seeds random, numpy and
                torch with ``seed + i``. Default 1024.
            drop_last: drop the last incomplete batch. Default False.
            pin_memory: pin batches (CUDA). Default False.
            num_workers: loader processes. Default 0.
            distributed_sampler_cls: a DistributedSampler subclass. Default
                None (StatefulDistributedSampler; another class has no
                position to resume from).
            **kwargs: passed to DataLoader.

        Returns:
            The DataLoader (a ResumableDataLoader).
        """
        rank, world = rank_and_world()
        sampler_cls = distributed_sampler_cls or StatefulDistributedSampler
        sampler = sampler_cls(dataset, num_replicas=world, rank=rank, shuffle=shuffle, seed=seed)
        return ResumableDataLoader(
            dataset,
            batch_size=batch_size,
            sampler=sampler,
            worker_init_fn=functools.partial(_seed_worker, seed),
            drop_last=drop_last,
            pin_memory=pin_memory,
            num_workers=num_workers,
            **kwargs,
        )


def _seed_worker(seed: int, worker_id: int) -> None:
    random.seed(seed + worker_id)
    torch.manual_seed(seed + worker_id)
    try:
        import numpy as np
    except ImportError:
        return
    np.random.seed(seed + worker_id)


class BoostedOptimizer(OptimizerWrapper):
    """What every plugin's optimizer shares: ``step`` counts for lr
    schedulers (see :func:`attach_scheduler`); ``step(closure)`` runs the
    closure; ``add_param_group`` refuses (the plugin has taken the
    parameters apart)."""

    _API = "BoostedOptimizer"
    # [Note: torch's GradScaler] torch.amp.GradScaler unscales and checks the
    # param.grad of the optimizer's groups. Under the sharded plugins those
    # hold no values (the gradients live in the plugin's shards), so it
    # recorded nothing and failed with its own "No inf checks were recorded
    # for this optimizer" (LowLevelZero), or the gradients' guard named
    # clipping (Gemini, AutoOffload). With this mark, as on torch's fused
    # optimizers, GradScaler.step hands the step its scale and inf flag
    # (``grad_scale``, ``found_inf``) instead, and the step refuses, naming
    # the plugin's own loss scaling. TorchDDPOptimizer clears the mark: there
    # the gradients are torch's and GradScaler works.
    _step_supports_amp_scaling = True

    def step(self, *args: Any, **kwargs: Any) -> Any:
        self._refuse_grad_scaler()
        self._opt_called = True  # torch's LRScheduler checks it at its first step
        out = self._step(*args, **kwargs)
        self._stepped = True  # get_grad_norm has a step's norm to give
        return out

    def _refuse_grad_scaler(self) -> None:
        """See [Note: torch's GradScaler]; the marks go, so the next step runs."""
        if "found_inf" not in self.__dict__ and "grad_scale" not in self.__dict__:
            return
        self.__dict__.pop("found_inf", None)
        self.__dict__.pop("grad_scale", None)
        raise RuntimeError(grad_scaler_refusal(f"{self._API}.step"))

    # torch's LRScheduler warns unless optimizer.step carries this mark (it
    # sets it when it wraps an optimizer's step; ours counts itself).
    step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]

    def _step(self, *args: Any, **kwargs: Any) -> Any:
        return self.optim.step(*args, **kwargs)

    def _step_closure(self, closure: Callable[[], Any] | None) -> Any:
        """torch's ``step(closure)`` around a plugin step that takes no closure:
        the closure runs first; the step returns its loss (else the plugin's
        return value)."""
        loss = run_closure(self._API, closure)
        stepped = self.optim.step()
        return stepped if closure is None else loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optim.zero_grad(set_to_none=set_to_none)

    # -- ColossalAI's OptimizerWrapper (colossalai/interface/optimizer.py) --------------

    @property
    def parameters(self) -> list[torch.Tensor]:
        """Every tensor of ``param_groups``, group by group (ColossalAI's
        ``OptimizerWrapper.parameters``, a property there too). Under the
        sharding plugins these are what the groups step: the fp32 masters,
        or the model's parameters where they are the masters."""
        return [p for group in self.param_groups for p in group["params"]]

    @property
    def defaults(self) -> dict[str, Any]:
        """The ``defaults`` of the optimizer passed to ``boost``."""
        return self.unwrap().defaults

    def unwrap(self) -> Any:
        """The torch optimizer passed to ``boost`` (ColossalAI's
        ``OptimizerWrapper.unwrap``). Under LowLevelZeroPlugin's
        ``cpu_offload`` and GeminiPlugin its own ``state_dict`` refuses: save
        with ``booster.save_optimizer``."""
        return self._user_optimizer if self._user_optimizer is not None else self.optim

    _user_optimizer: Any = None  # set by attach_scheduler at boost
    _stepped = False  # a step() returned

    def backward_by_grad(
        self,
        tensor: torch.Tensor,
        grad: torch.Tensor,
        inputs: Any = None,
        retain_graph: bool = False,
    ) -> None:
        """``torch.autograd.backward(tensor, grad)`` as :meth:`backward` runs
        a loss's (ColossalAI's ``OptimizerWrapper.backward_by_grad``): the
        plugin's loss scaling and gradient reduction apply. It is the
        backward of ``sum(tensor * grad)`` with ``grad`` held constant, whose
        gradient at ``tensor`` is ``grad`` exactly.

        Args:
            tensor: a non-leaf output of the boosted model.
            grad: the gradient of the objective at ``tensor`` (its shape).
            inputs: as :meth:`backward`'s. Default None.
            retain_graph: as :meth:`backward`'s. Default False.

        Raises:
            ValueError: ``grad`` is not shaped like ``tensor``.
        """
        if not isinstance(grad, torch.Tensor) or grad.shape != tensor.shape:
            shape = tuple(grad.shape) if isinstance(grad, torch.Tensor) else type(grad).__name__
            raise ValueError(
                f"{self._API}.backward_by_grad: grad must be a tensor shaped like tensor "
                f"{tuple(tensor.shape)} (got {shape}); pass dy of the same shape as y"
            )
        objective = torch.sum(tensor.float() * grad.detach().float())
        self.backward(objective, inputs=inputs, retain_graph=retain_graph)  # type: ignore[call-arg]

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """ColossalAI's ``OptimizerWrapper.scale_loss``: only where the loss
        is scaled by torch's GradScaler (TorchDDPPlugin or no plugin, with
        fp16 mixed precision).

        Raises:
            NotImplementedError: here.
        """
        raise NotImplementedError(
            f"{self._API}.scale_loss: the loss is scaled inside booster.backward(loss, "
            f"optimizer) by the plugin's loss scaler (got a {type(loss).__name__}); call that, "
            "and the step unscales"
        )

    def unscale_grad(self) -> None:
        """ColossalAI's ``OptimizerWrapper.unscale_grad``: as :meth:`scale_loss`.

        Raises:
            NotImplementedError: here.
        """
        raise NotImplementedError(
            f"{self._API}.unscale_grad: the gradients are unscaled by the plugin at "
            "clip_grad_by_norm() and step() (got no GradScaler to unscale); read the norm "
            "with optimizer.clip_grad_by_norm(float('inf'))"
        )

    def get_grad_norm(self, norm_type: float = 2.0, **kwargs: Any) -> float | None:
        """ColossalAI's ``get_grad_norm``: the gradients' total norm that the
        last ``step()`` computed (its LowLevelZero and Gemini optimizers).

        Raises:
            NotImplementedError: a plugin whose step computes no norm.
        """
        raise NotImplementedError(
            f"{self._API}.get_grad_norm: this plugin's step computes no gradient norm (got "
            f"norm_type={norm_type!r}); call optimizer.clip_grad_by_norm(float('inf'), "
            "norm_type) before step(), which returns it"
        )

    def _last_step_norm(self, norm_type: float) -> float | None:
        """``last_grad_norm`` of the plugin optimizer after a step, else None."""
        if norm_type != 2.0:
            raise NotImplementedError(
                f"{self._API}.get_grad_norm: the step computes the 2-norm (got "
                f"norm_type={norm_type!r}); call optimizer.clip_grad_by_norm(float('inf'), "
                "norm_type) before step() for another"
            )
        if not self._stepped:
            return None
        norm = getattr(self.optim, "last_grad_norm", None)
        return None if norm is None else float(norm)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's ``add_param_group``: not after boost (the plugin has taken
        the optimizer's parameters apart); every group goes in before.

        Raises:
            NotImplementedError: always (TorchDDPOptimizer adds the group).
        """
        params = param_group.get("params") if isinstance(param_group, dict) else None
        count = 1 if isinstance(params, torch.Tensor) else len(list(params or ()))
        raise NotImplementedError(
            f"{self._API}.add_param_group: adding a parameter group after boost is not "
            f"supported (got a group of {count} tensors); the plugin has replaced the "
            "optimizer's parameters by its fp32 masters: build the optimizer with every group "
            "before booster.boost"
        )

    def clip_grad_by_norm(
        self,
        max_norm: float,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = False,
        foreach: bool | None = None,
    ) -> torch.Tensor:
        """Clip the gradients of the coming step as torch's ``clip_grad_norm_``
        clips the model's whole gradients (ColossalAI's
        ``OptimizerWrapper.clip_grad_by_norm``; ``booster.clip_grad_norm_``
        calls it). Call it after the backward, before ``step()``; every rank
        calls it. The norm accumulates in fp32 (fp16: of the unscaled
        gradients). See zerostack.shard's [Note: gradient clipping].

        Args:
            max_norm: the largest total norm; ``float('inf')`` only reads it.
            norm_type: the p of the p-norm, or ``inf``. Default 2.0.
            error_if_nonfinite: raise when the norm is inf or nan. Default False.
            foreach: torch's choice of kernel (ColossalAI passes it on to
                torch's ``clip_grad_norm_``); the result is the same either
                way, so it is accepted and has no effect. Default None.

        Returns:
            The total norm before clipping, a 0-dim fp32 tensor.

        Raises:
            TypeError, ValueError: a bad argument (``max_norm`` must be > 0).
            NotImplementedError: the plugin cannot clip on request.
        """
        raise NotImplementedError(
            f"{type(self).__name__}.clip_grad_by_norm: not implemented for this plugin (got "
            f"max_norm={max_norm!r}); pass max_norm= to the plugin, which clips at every step"
        )

    def clip_grad_by_value(self, clip_value: float, *args: Any, **kwargs: Any) -> None:
        """Clamp every gradient element of the coming step into
        ``[-clip_value, clip_value]``, as torch's ``clip_grad_value_``
        (ColossalAI's ``OptimizerWrapper.clip_grad_by_value``). Call it after
        the backward, before ``step()``.

        Args:
            clip_value: the largest magnitude an element keeps, > 0.
            *args, **kwargs: passed to ``torch.nn.utils.clip_grad_value_``
                (``foreach``).

        Raises:
            TypeError, ValueError: ``clip_value`` is not a number > 0.
            NotImplementedError: the plugin shards the gradients
                (GeminiPlugin, LowLevelZeroPlugin, AutoOffloadPlugin), as
                ColossalAI's Gemini and LowLevelZero optimizers do not clip
                by value either.
        """
        check_clip_value(f"{type(self).__name__}.clip_grad_by_value", clip_value)
        raise NotImplementedError(
            f"{type(self).__name__}.clip_grad_by_value: clipping by value is not supported by "
            f"this plugin, whose gradients are sharded over the ranks (got clip_value="
            f"{clip_value!r}); clip by norm: the plugin's max_norm=, or "
            "optimizer.clip_grad_by_norm(max_norm) after the backward"
        )

    def state_dict(self) -> dict[str, Any]:
        """The plugin optimizer's own state dict: this rank's shard under
        ZeRO and Gemini, loadable only at the same rank and world size; use
        ``full_state_dict`` for one that loads anywhere."""
        return self.optim.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load ``state_dict()`` output (same plugin, rank and world size)."""
        self.optim.load_state_dict(state_dict)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({type(self.optim).__name__})"


def refuse_not_built(api: str, **given: tuple[Any, Any]) -> None:
    """Refuse ColossalAI's options that are not built here (``name=(value,
    off)``), unless off: fp8 and the extra parallel dimensions.

    Raises:
        NotImplementedError: an option is not off.
    """
    for name, (value, off) in given.items():
        if value is not off and value != off:
            raise NotImplementedError(
                f"{api}: {name} is not implemented (got {value!r}); leave {name}={off!r} "
                "(data parallelism in fp32, bf16 or fp16 is what is built)"
            )


def lora_refusal(api: str, got: str) -> str:
    """The message of every LoRA entry point (ColossalAI's peft-based LoRA)."""
    return (
        f"{api}: LoRA is not implemented (got {got}); add the LoRA modules to the model "
        "before booster.boost and freeze its base weights with requires_grad_(False) (every "
        "plugin trains a model with frozen parameters), then save it with booster.save_model"
    )


def refuse_backward_inputs(api: str, inputs: Any) -> None:
    """``backward(loss, inputs=...)`` where the plugin reduces every gradient.

    Raises:
        NotImplementedError: ``inputs`` is not None.
    """
    if inputs is not None:
        raise NotImplementedError(
            f"{api}: inputs= is not supported by this plugin, which reduces the gradient of "
            f"every trainable parameter at each backward (got {type(inputs).__name__}); freeze "
            "what should get no gradient with requires_grad_(False) before booster.boost"
        )


def check_clip_value(api: str, clip_value: object) -> float:
    """``clip_value`` of ``clip_grad_by_value`` as a float.

    Raises:
        TypeError: not a number.
        ValueError: not > 0 (torch's clip would zero, or flip, every gradient).
    """
    if isinstance(clip_value, bool) or not isinstance(clip_value, int | float):
        raise TypeError(f"{api}: clip_value must be a number (got {clip_value!r}); e.g. 1.0")
    if not clip_value > 0:
        raise ValueError(
            f"{api}: clip_value must be > 0 (got {clip_value}); torch's clip_grad_value_ would "
            "zero every gradient at 0 and flip them below it"
        )
    return float(clip_value)


def attach_scheduler(lr_scheduler: Any, optimizer: BoostedOptimizer, user: Any) -> None:
    """Record the user's optimizer (what ``optimizer.unwrap()`` returns), and
    point an lr scheduler built on it at the boosted one (whose
    ``param_groups`` are the user's optimizer's own, see zerostack.shard's
    [Note: the user's hyperparameters]), so that its step counts the
    boosted optimizer's steps."""
    optimizer._user_optimizer = user
    if lr_scheduler is None or getattr(lr_scheduler, "optimizer", None) is not user:
        return
    lr_scheduler.optimizer = optimizer
    base_lrs = getattr(lr_scheduler, "base_lrs", None)
    if base_lrs is not None:
        for group, base in zip(optimizer.param_groups, base_lrs, strict=False):
            group.setdefault("initial_lr", base)


@contextlib.contextmanager
def nothing() -> Iterator[None]:
    """A context that does nothing (no_sync of a single process)."""
    yield
