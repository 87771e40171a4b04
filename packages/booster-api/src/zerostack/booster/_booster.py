"""Booster: one object that boosts a model, optimizer, criterion, dataloader
and lr scheduler for a plugin, runs backward, and saves and loads
checkpoints (ColossalAI's ``colossalai.booster.Booster``)."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from typing import Any, cast, overload

import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset

from zerostack.booster import _exit
from zerostack.booster._interface import ModelWrapper, OptimizerWrapper
from zerostack.booster._plugins import DefaultPlugin, MixedPrecision, Plugin
from zerostack.booster._plugins._base import lora_refusal
from zerostack.chunk import rank_and_world
from zerostack.shard import check_clip_args

_API = "Booster"


class Booster:
    """Training with a plugin (TorchDDPPlugin, LowLevelZeroPlugin,
    GeminiPlugin), or without one: the model on ``device``, under torch DDP
    when a process group of more than one rank exists.

    ```python
    launch_from_torch()
    plugin = GeminiPlugin(precision="bf16", max_norm=1.0)
    booster = Booster(plugin=plugin)
    model = GPT2LMHeadModel(config)
    optimizer = HybridAdam(model.parameters(), lr=1e-3)
    model, optimizer, criterion, dataloader, lr_scheduler = booster.boost(
        model, optimizer, criterion, dataloader, lr_scheduler
    )
    for batch in dataloader:
        loss = criterion(model(**batch), batch)
        booster.backward(loss, optimizer)
        optimizer.step()
        optimizer.zero_grad()
        lr_scheduler.step()
    ```

    Args:
        device: where the model trains without a plugin (or with one that
            does not place it). Default None: "cuda" when available, else "cpu".
        mixed_precision: "fp16" (torch.amp autocast and GradScaler), "bf16"
            (autocast), a MixedPrecision, or None. Only without a plugin or
            with TorchDDPPlugin: the others choose the precision themselves
            (their ``precision`` argument). Default None.
        plugin: the strategy. Default None. A plugin passed as the first
            positional argument, as in ``Booster(plugin)`` (ColossalAI's NVMe
            offload guide), is taken as ``plugin``.

    Raises:
        TypeError: ``plugin`` is not a Plugin, or ``mixed_precision`` has the wrong type.
        ValueError: an unknown mixed_precision.
        NotImplementedError: ColossalAI's "fp16_apex", "fp16_naive" or "fp8".
    """

    def __init__(
        self,
        device: str | torch.device | None = None,
        mixed_precision: str | MixedPrecision | None = None,
        plugin: Plugin | None = None,
    ) -> None:
        if isinstance(device, Plugin) and plugin is None:
            # ColossalAI's NVMe offload guide writes Booster(plugin).
            device, plugin = None, device
        if plugin is not None and not isinstance(plugin, Plugin):
            raise TypeError(
                f"{_API}: plugin must be a Plugin (got {type(plugin).__name__}); pass e.g. "
                "GeminiPlugin() or TorchDDPPlugin()"
            )
        if plugin is not None and plugin.control_device():
            if device is not None:
                warnings.warn(
                    f"{_API}: device={device!r} has no effect: {type(plugin).__name__} places "
                    "the model on the current device itself",
                    UserWarning,
                    stacklevel=2,
                )
        else:
            device = _check_device(device)
        self.device = device
        # Without a plugin, device went through _check_device above.
        self.plugin = plugin if plugin is not None else DefaultPlugin(cast(torch.device, device))
        if mixed_precision is not None and self.plugin.control_precision():
            warnings.warn(
                f"{_API}: mixed_precision={mixed_precision!r} has no effect: "
                f"{type(plugin).__name__} controls the precision (its precision argument)",
                UserWarning,
                stacklevel=2,
            )
            mixed_precision = None
        if isinstance(mixed_precision, str):
            mixed_precision = MixedPrecision(mixed_precision)
        elif mixed_precision is not None and not isinstance(mixed_precision, MixedPrecision):
            raise TypeError(
                f"{_API}: mixed_precision must be 'fp16', 'bf16', a MixedPrecision or None "
                f"(got {type(mixed_precision).__name__})"
            )
        self.mixed_precision = mixed_precision
        self._checkpoint_io = None

    # -- training -------------------------------------------------------------------

    # The overloads tell a type checker that what was passed comes back
    # wrapped, and None stays None: the usual call passes an optimizer (and a
    # criterion), whose results then need no None check.
    @overload
    def boost(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        criterion: Callable[..., Any],
        dataloader: Any = None,
        lr_scheduler: Any = None,
    ) -> tuple[ModelWrapper, OptimizerWrapper, Callable[..., Any], Any, Any]: ...
    @overload
    def boost(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        criterion: None = None,
        dataloader: Any = None,
        lr_scheduler: Any = None,
    ) -> tuple[ModelWrapper, OptimizerWrapper, None, Any, Any]: ...
    @overload
    def boost(
        self,
        model: nn.Module,
        optimizer: None = None,
        criterion: None = None,
        dataloader: Any = None,
        lr_scheduler: Any = None,
    ) -> tuple[ModelWrapper, None, None, Any, Any]: ...
    @overload
    def boost(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        criterion: Callable[..., Any] | None = None,
        dataloader: Any = None,
        lr_scheduler: Any = None,
    ) -> tuple[ModelWrapper, OptimizerWrapper | None, Callable[..., Any] | None, Any, Any]: ...
    def boost(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        criterion: Callable[..., Any] | None = None,
        dataloader: Any = None,
        lr_scheduler: Any = None,
    ) -> tuple[ModelWrapper, OptimizerWrapper | None, Callable[..., Any] | None, Any, Any]:
        """Wrap the model and optimizer for the plugin.

        Build the optimizer (and lr scheduler) on ``model.parameters()``
        before boosting; afterwards use only the returned objects. A boosted
        model may be boosted again with its optimizer.

        Args:
            model: the model, or one built under LazyInitContext (GeminiPlugin
                materializes it straight into its chunks; the other plugins
                materialize it, then place it).
            optimizer: a torch optimizer over the model's parameters. Default None.
            criterion: the loss function, returned as is (under autocast with
                ``mixed_precision``). Default None.
            dataloader: returned as is (see ``plugin.prepare_dataloader``). Default None.
            lr_scheduler: a torch lr scheduler on ``optimizer``; it is pointed at
                the boosted optimizer. Default None.

        Returns:
            ``(model, optimizer, criterion, dataloader, lr_scheduler)``: the
            model a ModelWrapper, the optimizer an OptimizerWrapper (or None).

        Raises:
            TypeError: ``model`` is not an nn.Module, ``optimizer`` not a torch
                optimizer, ``criterion`` not callable, ``lr_scheduler`` without
                ``step`` and ``state_dict``.
            ValueError: the optimizer holds parameters that are not the model's
                (other than the twin-model case below).

        An optimizer built on a twin of the model (every parameter another
        model's, the same number with the same shapes in the same order, no
        optimizer state yet: ColossalAI's GPT-2 demo builds its HybridAdam on
        one model and then the model it trains under LazyInitContext) is
        pointed at ``model``'s parameters in place, with one warning: the
        optimizer object stays the same, so schedulers built on it keep working.
        """
        _check_boost(model, optimizer, criterion, lr_scheduler)
        _check_dataloader(dataloader)
        if isinstance(optimizer, torch.optim.Optimizer) and isinstance(model, nn.Module):
            _own_parameters(model, optimizer)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            _exit.register()  # See [Note: exit code under gloo]
        wrapped, boosted, criterion, dataloader, lr_scheduler = self.plugin.configure(
            model, optimizer, criterion, dataloader, lr_scheduler
        )
        if self.mixed_precision is not None:
            wrapped, boosted, criterion = self.mixed_precision.configure(
                wrapped, boosted, criterion
            )
        return wrapped, boosted, criterion, dataloader, lr_scheduler

    def backward(self, loss: torch.Tensor, optimizer: OptimizerWrapper) -> None:
        """``loss.backward()`` as the plugin needs it (loss scaling, hooks).

        Raises:
            TypeError: ``optimizer`` is not one returned by ``boost``.
        """
        if not isinstance(optimizer, OptimizerWrapper):
            raise TypeError(
                f"{_API}.backward: optimizer must be the one boost returned (got "
                f"{type(optimizer).__name__}); use the optimizer from booster.boost(...)"
            )
        if not isinstance(loss, torch.Tensor):
            raise TypeError(
                f"{_API}.backward: loss must be a tensor (got {type(loss).__name__}); pass the "
                "loss before .item()"
            )
        optimizer.backward(loss)

    def clip_grad_norm_(
        self,
        model: ModelWrapper,
        optimizer: OptimizerWrapper,
        max_norm: float,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = False,
    ) -> torch.Tensor:
        """Clip the gradients of ``model`` as torch's
        ``clip_grad_norm_(model.parameters(), max_norm)`` clips the whole
        gradients of a plain or DDP model, with every plugin: call it after
        ``booster.backward`` and before ``optimizer.step()``, on every rank.
        Under LowLevelZeroPlugin and GeminiPlugin the gradients are sharded
        and ``param.grad`` holds no values (torch's own function raises
        there); the norm is taken over every rank's shards, wherever they
        live, and the step applies the clip. The norm accumulates in fp32
        in every precision (fp16: of the unscaled gradients). A plugin's
        ``max_norm=`` clips again at the step what this call left. See
        zerostack.shard's [Note: gradient clipping].

        ```python
        booster.backward(loss, optimizer)
        grad_norm = booster.clip_grad_norm_(model, optimizer, max_norm=1.0)
        optimizer.step()
        ```

        Args:
            model: the model ``boost`` returned.
            optimizer: the optimizer ``boost`` returned with it.
            max_norm: the largest total norm (> 0); ``float('inf')`` only
                reads the norm.
            norm_type: the p of the p-norm, or ``inf``. Default 2.0.
            error_if_nonfinite: raise when the norm is inf or nan (torch's).
                Default False.

        Returns:
            The total norm of the gradients before clipping (a 0-dim fp32
            tensor), as torch's returns.

        Raises:
            TypeError: ``model`` or ``optimizer`` not from ``boost``, or a
                bad argument type.
            ValueError: ``max_norm`` not > 0, ``norm_type`` not > 0, or the
                optimizer was boosted with another model.
            RuntimeError: no backward to clip (or inside ``no_sync``), or a
                non-finite norm with ``error_if_nonfinite``.
        """
        api = f"{_API}.clip_grad_norm_"
        if not isinstance(model, ModelWrapper):
            raise TypeError(
                f"{api}: model must be the one boost returned (got {type(model).__name__}); "
                "use the model from booster.boost(...)"
            )
        if not isinstance(optimizer, OptimizerWrapper):
            raise TypeError(
                f"{api}: optimizer must be the one boost returned (got "
                f"{type(optimizer).__name__}); use the optimizer from booster.boost(...)"
            )
        if getattr(optimizer, "_model", model) is not model:
            raise ValueError(
                f"{api}: the optimizer was boosted with another model (got "
                f"{type(model.unwrap()).__name__}); pass the model boost returned with it"
            )
        check_clip_args(api, max_norm, norm_type, error_if_nonfinite)
        return optimizer.clip_grad_by_norm(max_norm, norm_type, error_if_nonfinite)  # type: ignore[attr-defined]

    def no_sync(
        self, model: ModelWrapper | None = None, optimizer: OptimizerWrapper | None = None
    ) -> contextlib.AbstractContextManager:
        """A context in which backward accumulates gradients without reducing
        them (gradient accumulation): DDP's no_sync (pass the model),
        ZeroOptimizer's (pass the optimizer), GeminiDDP's (pass the model;
        needs ``enable_gradient_accumulation=True``).

        Raises:
            NotImplementedError: the plugin does not support it.
            ValueError: the object the plugin needs was not passed.
        """
        return self.plugin.no_sync(model, optimizer)

    def execute_pipeline(
        self,
        data_iter: Iterator,
        model: nn.Module,
        criterion: Callable,
        optimizer: OptimizerWrapper | None = None,
        return_loss: bool = True,
        return_outputs: bool = False,
    ) -> dict[str, Any]:
        """Pipeline parallelism: not implemented.

        Raises:
            NotImplementedError: always.
        """
        raise NotImplementedError(
            f"{_API}.execute_pipeline: pipeline parallelism is not implemented; run forward, "
            "booster.backward(loss, optimizer) and optimizer.step() yourself"
        )

    def enable_lora(
        self,
        model: nn.Module,
        pretrained_dir: str | None = None,
        lora_config: Any = None,
        bnb_quantization_config: Any = None,
        quantize: bool = False,
    ) -> nn.Module:
        """ColossalAI's LoRA (through peft): not implemented.

        Raises:
            NotImplementedError: always.
        """
        raise NotImplementedError(
            lora_refusal(f"{_API}.enable_lora", f"lora_config={lora_config!r}")
        )

    def save_lora_as_pretrained(
        self, model: ModelWrapper, checkpoint: str, use_safetensors: bool = False
    ) -> None:
        """ColossalAI's LoRA adapter save: not implemented (see :meth:`enable_lora`).

        Raises:
            NotImplementedError: always.
        """
        raise NotImplementedError(
            lora_refusal(f"{_API}.save_lora_as_pretrained", f"checkpoint={checkpoint!r}")
        )

    # -- checkpoints ------------------------------------------------------------------

    @property
    def checkpoint_io(self) -> Any:
        """The plugin's checkpoint IO (built at first use).

        Raises:
            NotImplementedError: checkpoint IO is not there yet.
        """
        if self._checkpoint_io is None:
            self._checkpoint_io = self.plugin.get_checkpoint_io()
        return self._checkpoint_io

    def save_model(
        self,
        model: ModelWrapper,
        checkpoint: str,
        shard: bool = False,
        gather_dtensor: bool = True,
        prefix: str | None = None,
        size_per_shard: int = 1024,
        use_safetensors: bool = False,
        use_async: bool = False,
    ) -> None:
        """Save the model (every rank calls it).

        Args:
            model: a boosted model.
            checkpoint: a file path, or a directory when ``shard``.
            shard: save in shards into a directory. Default False.
            gather_dtensor: ColossalAI's; passed on. Default True.
            prefix: a prefix of the file names. Default None.
            size_per_shard: the largest shard, in MB. Default 1024.
            use_safetensors: write safetensors. Default False.
            use_async: ColossalAI's background write. The save here is
                complete when this returns (every rank writes its part in
                parallel), so True warns once and saves the same. Default False.

        Raises:
            CheckpointSaveError: the write failed (on every rank, the root
                cause in the first line, e.g. ``no space left on device``),
                or another save to ``checkpoint`` is running; the previous
                checkpoint there is unchanged.
        """
        _no_effect(f"{_API}.save_model", use_async=(use_async, False))
        self.checkpoint_io.save_model(
            model,
            checkpoint=checkpoint,
            shard=shard,
            gather_dtensor=gather_dtensor,
            prefix=prefix,
            size_per_shard=size_per_shard,
            use_safetensors=use_safetensors,
        )

    def load_model(
        self,
        model: ModelWrapper,
        checkpoint: str,
        strict: bool = True,
        low_cpu_mem_mode: bool = True,
        num_threads: int = 1,
        *,
        verify: bool = True,
    ) -> Any:
        """Load a model checkpoint (every rank calls it).

        Args:
            model: a boosted model.
            checkpoint: the file or directory ``save_model`` wrote.
            strict: every key must match. With False, keys the checkpoint
                lacks keep their values and keys the model lacks are
                skipped; both are returned and logged. Default True.
            low_cpu_mem_mode: ColossalAI's (False: cache the files in RAM to
                load faster); the load here reads each file once either way,
                so False warns once and loads the same. Default True.
            num_threads: ColossalAI's reading threads with
                ``low_cpu_mem_mode=False``; another value warns once and
                loads the same. Default 1.
            verify: the checkpoint must be whole and of one save: a
                directory needs its record (``zerostack-checkpoint.json``,
                written last by the save), and every file's size and SHA-256
                are checked before any is read. Pass False only for a
                checkpoint written before zerostack wrote records (sizes
                are still checked where recorded; warns once). Default True.

        Returns:
            ``missing_keys`` and ``unexpected_keys``, as torch's
            ``nn.Module.load_state_dict`` returns them.

        Raises:
            CheckpointCorruptError: the record is missing, a file is
                damaged, or files of different saves are mixed.
            ValueError: with ``strict``, keys differ.
        """
        _no_effect(
            f"{_API}.load_model",
            low_cpu_mem_mode=(low_cpu_mem_mode, True),
            num_threads=(num_threads, 1),
        )
        return self.checkpoint_io.load_model(model, checkpoint, strict=strict, verify=verify)

    def save_optimizer(
        self,
        optimizer: OptimizerWrapper,
        checkpoint: str,
        shard: bool = False,
        gather_dtensor: bool = True,
        prefix: str | None = None,
        size_per_shard: int = 1024,
        use_async: bool = False,
    ) -> None:
        """Save the optimizer state (every rank calls it).

        Args:
            optimizer: a boosted optimizer.
            checkpoint: a file path, or a directory when ``shard``.
            shard: save in shards into a directory. Default False.
            gather_dtensor: ColossalAI's; passed on. Default True.
            prefix: a prefix of the file names. Default None.
            size_per_shard: the largest shard, in MB. Default 1024.
            use_async: as :meth:`save_model`'s. Default False.

        Raises:
            CheckpointSaveError: as :meth:`save_model`.
        """
        _no_effect(f"{_API}.save_optimizer", use_async=(use_async, False))
        self.checkpoint_io.save_optimizer(
            optimizer,
            checkpoint=checkpoint,
            shard=shard,
            gather_dtensor=gather_dtensor,
            prefix=prefix,
            size_per_shard=size_per_shard,
        )

    def load_optimizer(
        self,
        optimizer: OptimizerWrapper,
        checkpoint: str,
        low_cpu_mem_mode: bool = True,
        num_threads: int = 1,
        *,
        verify: bool = True,
    ) -> None:
        """Load an optimizer checkpoint (every rank calls it).

        Args:
            optimizer: a boosted optimizer.
            checkpoint: the file or directory ``save_optimizer`` wrote.
            low_cpu_mem_mode: as :meth:`load_model`'s. Default True.
            num_threads: as :meth:`load_model`'s. Default 1.
            verify: as :meth:`load_model`'s. Default True.

        Raises:
            CheckpointCorruptError: the record is missing, a file is
                damaged, or files of different saves are mixed.
            ValueError: the checkpoint's parameter groups list other
                parameters than the optimizer's (saved from another model,
                which torch's ``load_state_dict`` refuses too); nothing is loaded.
        """
        _no_effect(
            f"{_API}.load_optimizer",
            low_cpu_mem_mode=(low_cpu_mem_mode, True),
            num_threads=(num_threads, 1),
        )
        self.checkpoint_io.load_optimizer(optimizer, checkpoint, verify=verify)

    def save_lr_scheduler(self, lr_scheduler: Any, checkpoint: str) -> None:
        """Save the lr scheduler's state.

        Args:
            lr_scheduler: the scheduler ``boost`` returned.
            checkpoint: a file path.

        Raises:
            CheckpointSaveError: as :meth:`save_model`.
        """
        self.checkpoint_io.save_lr_scheduler(lr_scheduler, checkpoint)

    def load_lr_scheduler(self, lr_scheduler: Any, checkpoint: str, *, verify: bool = True) -> None:
        """Load the lr scheduler's state.

        Args:
            lr_scheduler: the scheduler ``boost`` returned.
            checkpoint: the file ``save_lr_scheduler`` wrote.
            verify: check the file's CRC-32s. Default True.
        """
        self.checkpoint_io.load_lr_scheduler(lr_scheduler, checkpoint, verify=verify)

    def save_state(
        self,
        checkpoint: str,
        model: ModelWrapper,
        optimizer: OptimizerWrapper | None = None,
        lr_scheduler: Any = None,
        dataloader: Any = None,
    ) -> None:
        """Save everything an exact resume needs into one directory, atomically
        (every rank calls it): the model and optimizer (each rank writes its
        own part), the lr scheduler, and per rank the RNG states (Python,
        numpy, torch CPU, every CUDA device) and the dataloader's position
        (its epoch and the batches consumed in it). See [Note: training
        state directory] in zerostack.booster._checkpoint_state. Under a
        DeepSpeed config with ``gradient_accumulation_steps``, save at a
        window's boundary: the open window's gradients are not saved (a
        save inside one warns).

        ```python
        booster.save_state("ckpt/step-100", model, optimizer, lr_scheduler, dataloader)
        # a later run, after boost:
        booster.load_state("ckpt/step-100", model, optimizer, lr_scheduler, dataloader)
        for epoch in range(dataloader.sampler.epoch, num_epochs):
            dataloader.sampler.set_epoch(epoch)
            for batch in dataloader:  # the resumed epoch skips the batches already seen
                ...
        ```

        Args:
            checkpoint: the directory to write (replaced whole).
            model: the model ``boost`` returned.
            optimizer: the optimizer ``boost`` returned. Default None.
            lr_scheduler: the lr scheduler ``boost`` returned. Default None.
            dataloader: a dataloader from ``plugin.prepare_dataloader`` (its
                sampler keeps the position). Default None.

        Raises:
            TypeError: ``model`` is not a boosted model, ``dataloader`` has no
                ``state_dict``, ``checkpoint`` is not a path.
            CheckpointSaveError: a rank failed to write its part (on every
                rank, the root cause in the first line), or another save to
                ``checkpoint`` is running; the previous state is unchanged.
        """
        from zerostack.booster._checkpoint_state import save_state

        save_state(self, checkpoint, model, optimizer, lr_scheduler, dataloader)

    def load_state(
        self,
        checkpoint: str,
        model: ModelWrapper,
        optimizer: OptimizerWrapper | None = None,
        lr_scheduler: Any = None,
        dataloader: Any = None,
        *,
        verify: bool = True,
    ) -> None:
        """Load what :meth:`save_state` wrote (every rank calls it), RNG states
        last. At the world size it was saved with, training goes on exactly as
        the uninterrupted run; at another one, with a warning, each rank
        takes the RNG states of saved rank ``rank % saved_world`` and the
        sampler position is scaled.

        Args:
            checkpoint: the directory ``save_state`` wrote.
            model: the model ``boost`` returned.
            optimizer: the optimizer ``boost`` returned; it must have been
                saved. Default None.
            lr_scheduler: the lr scheduler ``boost`` returned; it must have
                been saved. Default None.
            dataloader: the dataloader whose position was saved. Default None.
            verify: as :meth:`load_model`'s. Default True.

        Raises:
            FileNotFoundError: nothing at ``checkpoint``.
            ValueError: ``checkpoint`` is not a state directory, or lacks an
                object that was given.
            CheckpointCorruptError: the record is missing, a file is
                missing, truncated or altered, or parts of different saves
                are mixed.
        """
        from zerostack.booster._checkpoint_state import load_state

        load_state(self, checkpoint, model, optimizer, lr_scheduler, dataloader, verify)


_WARNED: set[str] = set()


def _no_effect(api: str, **given: tuple[Any, Any]) -> None:
    """Warn once per argument of ColossalAI's checkpoint methods that only
    changes how it reads or writes (``name=(value, default)``), given another
    value: the result is the same here."""
    for name, (value, default) in given.items():
        if value == default or f"{api}:{name}" in _WARNED:
            continue
        _WARNED.add(f"{api}:{name}")
        warnings.warn(
            f"{api}: {name}={value!r} has no effect (got {value!r}); zerostack writes a "
            "checkpoint before the call returns, every rank its own part, and reads each file "
            f"once: drop {name}=",
            UserWarning,
            stacklevel=3,
        )


def _check_device(device: Any) -> torch.device:
    """``device`` as a torch.device (default: cuda when present, else cpu)."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not isinstance(device, str | int | torch.device) or isinstance(device, bool):
        raise TypeError(
            f"{_API}: device must be a str, an int, a torch.device or None (got {device!r}); "
            "pass e.g. 'cuda' or 'cpu'"
        )
    try:
        device = torch.device(device)
    except RuntimeError as error:
        raise ValueError(
            f"{_API}: device is not a usable device (got {device!r}); pass e.g. 'cuda' or 'cpu'"
        ) from error
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"{_API}: device is a CUDA device but CUDA is not available (got {str(device)!r}); "
            "pass 'cpu'"
        )
    return device


def _check_dataloader(dataloader: Any) -> None:
    """Warn when every rank would read the same batches: a map-style
    DataLoader without a DistributedSampler in a group of several ranks."""
    if not isinstance(dataloader, DataLoader) or isinstance(dataloader.dataset, IterableDataset):
        return
    _, world = rank_and_world()
    batch_sampler = getattr(dataloader, "batch_sampler", None)
    samplers = (dataloader.sampler, getattr(batch_sampler, "sampler", None))
    if world > 1 and not any(isinstance(s, DistributedSampler) for s in samplers):
        warnings.warn(
            f"{_API}.boost: the dataloader has no DistributedSampler (got "
            f"{type(dataloader.sampler).__name__}) at {world} ranks: every rank reads the same "
            "batches; build it with plugin.prepare_dataloader(dataset, batch_size=...) (as "
            "ColossalAI's), or pass DistributedSampler(dataset) as its sampler",
            UserWarning,
            stacklevel=3,
        )


def _own_parameters(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Refuse an optimizer over parameters that are not the model's, except a
    twin model's, which it takes over (see Booster.boost)."""
    api = f"{_API}.boost"
    mine = list(model.parameters())
    ids = {id(p) for p in mine}
    held = [p for group in optimizer.param_groups for p in group["params"]]
    foreign = [p for p in held if id(p) not in ids]
    if not foreign:
        return
    twin = (
        len(foreign) == len(held) == len(mine)
        and not optimizer.state
        and all(a.shape == b.shape for a, b in zip(held, mine, strict=True))
    )
    if not twin:
        why = (
            "it has optimizer state already" if optimizer.state and len(foreign) == len(held)
            else "their number or shapes differ from the model's"
            if len(foreign) == len(held) else "some are the model's and some are not"
        )  # fmt: skip
        raise ValueError(
            f"{api}: the optimizer holds parameters that are not the model's (got "
            f"{len(foreign)} of {len(held)} foreign; {why}); build the optimizer on "
            "model.parameters() of the model you boost"
        )
    warnings.warn(
        f"{api}: the optimizer was built on another model with the same parameter shapes "
        f"({len(held)} parameters); it now steps this model's parameters (as ColossalAI's "
        "GPT-2 demo expects). Build it on model.parameters() to silence this",
        UserWarning,
        stacklevel=3,
    )
    rest = iter(mine)
    for group in optimizer.param_groups:
        group["params"] = [next(rest) for _ in group["params"]]


def _check_boost(model: Any, optimizer: Any, criterion: Any, lr_scheduler: Any) -> None:
    """Booster.boost's argument types, checked before any plugin wraps anything."""
    api = f"{_API}.boost"
    if not isinstance(model, nn.Module | ModelWrapper):
        raise TypeError(f"{api}: model must be an nn.Module (got {type(model).__name__})")
    if optimizer is not None and not isinstance(
        optimizer, torch.optim.Optimizer | OptimizerWrapper
    ):
        raise TypeError(
            f"{api}: optimizer must be a torch.optim.Optimizer or None (got "
            f"{type(optimizer).__name__}); build it on model.parameters()"
        )
    if criterion is not None and not callable(criterion):
        raise TypeError(
            f"{api}: criterion must be callable or None (got {type(criterion).__name__}); "
            "pass e.g. torch.nn.CrossEntropyLoss()"
        )
    if lr_scheduler is not None and not (
        hasattr(lr_scheduler, "step") and hasattr(lr_scheduler, "state_dict")
    ):
        raise TypeError(
            f"{api}: lr_scheduler must be a torch lr scheduler or None (got "
            f"{type(lr_scheduler).__name__})"
        )
