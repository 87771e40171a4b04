"""What a DeepSpeed config asks of training, applied by a LowLevelZeroPlugin
built with ``from_deepspeed_config``: the batch keys (``prepare_dataloader``),
gradient accumulation with DeepSpeed's engine contract, the optimizer and lr
scheduler of the config, "auto" bucket sizes, and ``cpu_checkpointing``.

[Note: DeepSpeed gradient accumulation] With gradient_accumulation_steps
N (gas), the boosted optimizer follows DeepSpeed's ``engine.backward`` /
``engine.step``, called on every micro-batch:
  - ``booster.backward(loss, optimizer)`` runs backward on ``loss / N`` (as
    DeepSpeed's engine scales it); on the first N - 1 micro-steps of a
    window under ZeroOptimizer's no_sync (gradients accumulate in the
    parameters' ``.grad``, no communication), on the N-th outside it (the
    accumulated sum is reduced, overlapped with backward).
  - ``optimizer.step()`` counts micro-steps, as DeepSpeed's engine does; on
    the N-th it steps (clipping and the fp16 overflow check on the
    accumulated gradient), zeroes the gradients, and steps the lr scheduler
    (unless fp16 overflow skipped the step, as in DeepSpeed); on the others
    it does nothing and returns None. A step that raises is not counted:
    ``step()`` again finishes it (ZeroOptimizer's failed CPU update), or
    ``zero_grad()`` drops the window.
  - ``optimizer.zero_grad()`` after ``step()`` inside a window does nothing
    (a loop that calls it every micro-step keeps its gradients); called
    after a backward with no ``step()`` since (a micro-batch dropped, e.g.
    after an exception in backward), it drops the whole window's gradients
    and the window starts again. The boosted model's ``zero_grad()`` is the
    optimizer's (it dropped the window's gradients, held in ``.grad``).
  - The lr scheduler (the config's, or one passed to ``boost``) is stepped
    by ``optimizer.step()`` at each boundary, as DeepSpeed's engine steps
    it; ``lr_scheduler.step()`` on the scheduler ``boost`` returns does
    nothing, with one warning.
The micro-step count is not checkpointed: save at a boundary (after the N-th
``step()``), as DeepSpeed programs do. A load (of the model or of the
optimizer) starts a window, dropping one open before it, as a fresh process
resuming the checkpoint does.
"""

from __future__ import annotations

import logging
import math
import warnings
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from zerostack.booster._plugins._base import refuse_backward_inputs
from zerostack.booster._plugins._contract import run_closure
from zerostack.booster._plugins._deepspeed import (
    BATCH_KEYS,
    DeepSpeedSettings,
    bucket_elements,
)
from zerostack.booster._plugins._low_level_zero import LowLevelZeroModel, LowLevelZeroOptimizer
from zerostack.chunk import rank_and_world
from zerostack.shard import ZeroOptimizer

logger = logging.getLogger(__name__)
_API = "LowLevelZeroPlugin"


def resolve_batch(
    settings: DeepSpeedSettings, world: int, loader: int | None, api: str
) -> tuple[int | None, int | None, int]:
    """``(train_batch_size, micro batch, gradient_accumulation_steps)`` as
    DeepSpeed derives them: any two give the third, and
    ``train = micro x gas x world``. ``loader`` is prepare_dataloader's batch
    size: it fills in an absent or "auto" micro batch, and must equal a
    given or derived one. The micro batch is None when nothing gives it.

    Raises:
        ValueError: the keys disagree with each other, the world size or
            ``loader``; the message names every value.
    """
    t, m, g = (
        settings.train_batch_size,
        settings.micro_batch_size,
        settings.gradient_accumulation_steps,
    )
    given = {"t": t is not None, "m": m is not None, "g": g is not None}

    def shown(name: str, key: str, value: int | None) -> str:
        if value is None:
            return f"{name} not given"
        return f"{name}={value}" + ("" if given[key] else " (derived)")

    def values() -> str:
        return (
            f"{shown('train_batch_size', 't', t)}, "
            f"{shown('train_micro_batch_size_per_gpu', 'm', m)}, "
            f"{shown('gradient_accumulation_steps', 'g', g)}, world size {world}"
        )

    if m is None and t is not None:
        if g is not None:
            m = t // (g * world)
        elif loader is None:
            g, m = 1, t // world  # DeepSpeed's rule when only train_batch_size is given
    if m is None:
        m = loader
        given["m"] = loader is not None
    elif loader is not None and loader != m:
        raise ValueError(
            f"{api}: batch_size differs from the DeepSpeed config's micro batch size per rank "
            f"(got batch_size={loader}, {values()}); pass batch_size={m} or leave it out"
        )
    if m is not None and g is None:
        g = t // (m * world) if t is not None else 1
    g = 1 if g is None else g
    if m is not None and t is not None and (m < 1 or g < 1 or t != m * g * world):
        raise ValueError(
            f"{api}: train_batch_size must equal train_micro_batch_size_per_gpu x "
            f"gradient_accumulation_steps x world size, as in DeepSpeed (got {values()}); fix "
            "one of them, or leave one out and it is derived from the other two"
        )
    return (m * g * world if m is not None else t), m, g


def hidden_size(model: nn.Module) -> int:
    """The model's hidden size, as the Hugging Face Trainer's DeepSpeed
    integration finds it (``config.hidden_size``, or the largest of
    ``config.hidden_sizes``), else ``config.n_embd`` / ``d_model`` / ``dim``,
    else the smaller side of the largest nn.Linear.

    Raises:
        ValueError: none of them is there.
    """
    config = getattr(model, "config", None)
    for name in ("hidden_size", "n_embd", "d_model", "dim"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    sizes = getattr(config, "hidden_sizes", None)
    if isinstance(sizes, list | tuple) and sizes:
        return int(max(sizes))
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    if not linears:
        raise ValueError(
            f"{_API}: a bucket size is 'auto' but the model's hidden size is unknown (got "
            f"{type(model).__name__}, no config.hidden_size and no nn.Linear); put the bucket "
            "size in elements in the DeepSpeed config"
        )
    largest = max(linears, key=lambda m: m.weight.numel())
    return min(largest.in_features, largest.out_features)


class DeepSpeedTraining:
    """The settings of a DeepSpeed config applied by the plugin: held by
    ``plugin.deepspeed`` (None for a plugin built otherwise)."""

    def __init__(self, settings: DeepSpeedSettings, bucket_override: bool) -> None:
        self.settings = settings
        self.loader_batch: int | None = None  # prepare_dataloader's batch size per rank
        self._bucket_auto = not bucket_override and "auto" in (
            settings.reduce_bucket_size,
            settings.allgather_bucket_size,
        )

    def batch(self, api: str) -> tuple[int | None, int | None, int]:
        return resolve_batch(self.settings, rank_and_world()[1], self.loader_batch, api)

    def loader_batch_size(self, batch_size: int | None) -> int:
        """prepare_dataloader's batch size per rank: the config's micro batch,
        which a ``batch_size`` passed must equal.

        Raises:
            ValueError: ``batch_size`` differs, or neither gives one.
        """
        api = f"{_API}.prepare_dataloader"
        micro = resolve_batch(self.settings, rank_and_world()[1], batch_size, api)[1]
        if micro is None:
            raise ValueError(
                f"{api}: batch_size is required: the DeepSpeed config gives no micro batch size "
                f"(got {dict(zip(BATCH_KEYS, self._raw(), strict=True))}); pass batch_size=... "
                "or set train_micro_batch_size_per_gpu"
            )
        self.loader_batch = micro
        return micro

    def _raw(self) -> tuple[Any, ...]:
        s = self.settings
        return tuple(
            "auto" if k in s.auto_keys else v
            for k, v in zip(
                BATCH_KEYS,
                (s.train_batch_size, s.micro_batch_size, s.gradient_accumulation_steps),
                strict=True,
            )
        )

    # -- boost -------------------------------------------------------------------------

    def check_boost(self, optimizer: Any) -> None:
        """Before ``boost`` touches anything.

        Raises:
            ValueError: ``boost`` got an optimizer and the config has one too;
                the batch keys disagree with the world size.
        """
        self.batch("Booster.boost")
        if (
            self.settings.optimizer is not None
            and optimizer is not None
            and not isinstance(optimizer, LowLevelZeroOptimizer)
        ):
            raise ValueError(
                "Booster.boost: the DeepSpeed config has an optimizer section and boost got an "
                f"optimizer too (got {type(optimizer).__name__}); pass no optimizer to use the "
                "config's, or remove the section"
            )

    def before_zero(
        self, model: LowLevelZeroModel, optimizer: Any, lr_scheduler: Any, zero_kwargs: dict
    ) -> tuple[Any, Any, dict]:
        """Resolve the "auto" bucket sizes; build the config's optimizer and
        lr scheduler when ``boost`` got none (after ``check_boost``)."""
        s = self.settings
        if self._bucket_auto:
            hidden = hidden_size(model.unwrap())
            sizes = {
                k: hidden * hidden if v == "auto" else v
                for k, v in (
                    ("reduce_bucket_size", s.reduce_bucket_size),
                    ("allgather_bucket_size", s.allgather_bucket_size),
                )
                if v is not None
            }
            zero_kwargs = {**zero_kwargs, "reduce_bucket_size": bucket_elements(sizes)}  # type: ignore[arg-type]
            logger.info("%s: 'auto' bucket size of hidden size %d: %s", _API, hidden, sizes)
        if optimizer is None and s.optimizer is not None:
            optimizer = build_optimizer(s.optimizer, model.unwrap().parameters())
            if s.scheduler is not None and lr_scheduler is None:
                lr_scheduler = build_scheduler(s.scheduler, optimizer)
        elif s.scheduler is not None and lr_scheduler is None and optimizer is not None \
                and not isinstance(optimizer, LowLevelZeroOptimizer):  # fmt: skip
            lr_scheduler = build_scheduler(s.scheduler, optimizer)
        return optimizer, lr_scheduler, zero_kwargs

    def wrap_optimizer(
        self, zero: ZeroOptimizer, model: LowLevelZeroModel
    ) -> LowLevelZeroOptimizer:
        return DeepSpeedZeroOptimizer(zero, model, self.batch("Booster.boost")[2])

    def after_zero(self, model: LowLevelZeroModel, optimizer: Any, lr_scheduler: Any) -> Any:
        """The lr scheduler to return: stepped by the optimizer (see [Note:
        DeepSpeed gradient accumulation]); ``cpu_checkpointing``'s hooks."""
        if self.settings.cpu_checkpointing and getattr(model, "host_activations", None) is None:
            model.host_activations = HostActivations(model.unwrap())  # type: ignore[assignment]
        if isinstance(optimizer, DeepSpeedZeroOptimizer):  # its zero_grad is the model's
            model.window_owner = weakref.ref(optimizer)
        if isinstance(lr_scheduler, EngineSteppedScheduler):
            lr_scheduler = lr_scheduler.scheduler
        if lr_scheduler is None or not isinstance(optimizer, DeepSpeedZeroOptimizer):
            return lr_scheduler
        optimizer.lr_scheduler = lr_scheduler
        return EngineSteppedScheduler(lr_scheduler, optimizer)


class DeepSpeedZeroOptimizer(LowLevelZeroOptimizer):
    """LowLevelZeroOptimizer with DeepSpeed's engine contract; see [Note:
    DeepSpeed gradient accumulation]."""

    _API = "LowLevelZeroOptimizer"

    def __init__(self, optimizer: ZeroOptimizer, model: LowLevelZeroModel, gas: int) -> None:
        super().__init__(optimizer, model)
        self.gradient_accumulation_steps = gas
        self.micro_steps = 0  # step() calls so far, as DeepSpeed's engine counts them
        self.lr_scheduler: Any = None
        self._backward_since_step = False
        self._scheduler_epoch: Any = None  # the scheduler's last_epoch after step() stepped it
        self._warned: set[str] = set()

    def is_gradient_accumulation_boundary(self) -> bool:
        """True when the next ``step()`` steps (DeepSpeed's engine method)."""
        return (self.micro_steps + 1) % self.gradient_accumulation_steps == 0

    def backward(self, loss: torch.Tensor, inputs: Any = None, retain_graph: bool = False) -> None:
        """``loss / gradient_accumulation_steps`` backward; no communication
        before the window's last micro-step.

        Raises:
            NotImplementedError: ``inputs`` is not None.
        """
        refuse_backward_inputs(f"{self._API}.backward", inputs)
        gas = self.gradient_accumulation_steps
        if self._backward_since_step and gas > 1:
            self._warn_once(
                "backward",
                f"{self._API}.backward: a second backward with no step() between (got "
                f"gradient_accumulation_steps={gas}); as DeepSpeed's engine, optimizer.step() "
                "counts the micro-steps and steps only at the accumulation boundary: call it "
                "after every backward, or this window holds more micro-batches than the config's",
            )
        self._backward_since_step = True
        if gas == 1:
            return self.optim.backward(loss, retain_graph=retain_graph)
        loss = loss / gas
        if self.is_gradient_accumulation_boundary():
            return self.optim.backward(loss, retain_graph=retain_graph)
        with self.optim.no_sync():
            self.optim.backward(loss, retain_graph=retain_graph)

    def _step(self, closure: Any = None) -> Any:
        if closure is not None:  # torch's step(closure): the closure first, its loss back
            loss = run_closure(self._API, closure)
            self._step()
            return loss
        if not self.is_gradient_accumulation_boundary():
            self.micro_steps += 1
            self._backward_since_step = False
            return None
        # A step that raises stays the boundary: step() again finishes it (a
        # failed CPU update), zero_grad() drops the window.
        stepped = self.optim.step()
        self.micro_steps += 1
        self._backward_since_step = False
        if stepped and self.lr_scheduler is not None:
            self._step_scheduler()
        return stepped

    def _step_scheduler(self) -> None:
        scheduler = self.lr_scheduler
        epoch = getattr(scheduler, "last_epoch", None)
        if self._scheduler_epoch is not None and epoch != self._scheduler_epoch:
            self._warn_once(
                "scheduler",
                f"{self._API}.step: the lr scheduler passed to boost was stepped outside "
                f"optimizer.step() (got last_epoch {epoch}, {self._scheduler_epoch} after the "
                "last step()); under a DeepSpeed config optimizer.step() steps it at each "
                "gradient accumulation boundary, as DeepSpeed's engine.step() does, so that call "
                f"stepped {type(scheduler).__name__} twice: remove it",
            )
        scheduler.step()
        self._scheduler_epoch = getattr(scheduler, "last_epoch", None)

    def load_full_state_dict(self, state_dict: dict[str, Any]) -> None:
        """LowLevelZeroOptimizer's; then the window open before it is dropped."""
        super().load_full_state_dict(state_dict)
        self.drop_window_for_load()

    def load_sharded_state_dict(self, state_dict: dict[str, Any]) -> None:
        """LowLevelZeroOptimizer's; then the window open before it is dropped."""
        super().load_sharded_state_dict(state_dict)
        self.drop_window_for_load()

    def drop_window_for_load(self) -> None:
        """A load (of the model or of this optimizer) starts a window, as a
        fresh process resuming the checkpoint does (it holds no window, see
        ``_warn_inside_window``). Before, a run rolled back inside a window
        kept its micro-step count and its gradients, and finished that window
        early, with the micro-batches of before the load in it."""
        inside = self.micro_steps % self.gradient_accumulation_steps
        if not inside and not self._backward_since_step:
            return
        logger.info(
            "%s: a load drops the %d micro-step(s) of the open gradient accumulation window",
            self._API, inside + self._backward_since_step,
        )  # fmt: skip
        self.micro_steps -= inside
        self._backward_since_step = False
        self.optim.zero_grad(True)

    def forget_scheduler_epoch(self) -> None:
        """The lr scheduler's state was loaded: its epoch is not a stray step."""
        self._scheduler_epoch = None

    def full_state_dict(self) -> dict[str, Any]:
        """LowLevelZeroOptimizer's, with a warning when taken inside a window."""
        self._warn_inside_window()
        return super().full_state_dict()

    def sharded_state_dict(self) -> dict[str, Any]:
        """LowLevelZeroOptimizer's, with a warning when taken inside a window."""
        self._warn_inside_window()
        return super().sharded_state_dict()

    def _warn_inside_window(self) -> None:
        """A checkpoint inside a window holds neither the window's gradients
        nor its position (as DeepSpeed's): a run resumed from it shifts its
        windows and loses those micro-batches, silently (8.9e-3 off the
        uninterrupted run after 16 micro-steps). Said at every such save."""
        inside = self.micro_steps % self.gradient_accumulation_steps
        if inside:
            warnings.warn(
                f"{self._API}: an optimizer state taken inside a gradient accumulation window "
                f"(micro-step {inside} of gradient_accumulation_steps="
                f"{self.gradient_accumulation_steps}): the window's gradients and its position "
                "are not saved, so a run resumed from it shifts its windows and loses those "
                "micro-batches; save after the optimizer.step() that closes a window "
                "(is_gradient_accumulation_boundary() was True before it)",
                UserWarning,
                stacklevel=3,
            )

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, UserWarning, stacklevel=4)

    def zero_grad(self, set_to_none: bool = True) -> None:
        inside = self.micro_steps % self.gradient_accumulation_steps
        if inside and not self._backward_since_step:
            return  # the loop's call after step(): the window keeps its gradients
        if inside:
            logger.warning(
                "%s.zero_grad: a backward with no step() since: the %d micro-step(s) of this "
                "gradient accumulation window are dropped and the window starts again",
                self._API, inside + 1,
            )  # fmt: skip
        self.micro_steps -= inside
        self._backward_since_step = False
        self.optim.zero_grad(set_to_none)


class EngineSteppedScheduler:
    """The lr scheduler ``boost`` returns under a DeepSpeed config: the
    optimizer steps it at each gradient accumulation boundary (as DeepSpeed's
    engine.step() does), so ``step()`` here does nothing (one warning).
    Everything else is the scheduler's (``get_last_lr``, ``state_dict``, ...)."""

    def __init__(self, scheduler: Any, optimizer: DeepSpeedZeroOptimizer) -> None:
        self.scheduler = scheduler
        self._optimizer = weakref.ref(optimizer)
        self._warned = False

    def step(self, *args: Any, **kwargs: Any) -> None:
        if not self._warned:
            self._warned = True
            warnings.warn(
                f"{_API}: lr_scheduler.step() has no effect under a DeepSpeed config (got a call "
                f"on {type(self.scheduler).__name__}); optimizer.step() steps it at each gradient "
                "accumulation boundary, as DeepSpeed's engine.step() does: remove the call",
                UserWarning,
                stacklevel=2,
            )

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """The scheduler's; the optimizer forgets the epoch it last stepped
        it to, so that the next step() does not take the loaded epoch for a
        ``step()`` called outside it (booster.load_state rolling back a run)."""
        self.scheduler.load_state_dict(state_dict)
        optimizer = self._optimizer()
        if optimizer is not None:
            optimizer.forget_scheduler_epoch()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["scheduler"], name)


# -- the config's optimizer and scheduler ------------------------------------------------


def build_optimizer(spec: dict[str, Any], params: Iterator[nn.Parameter]) -> torch.optim.Optimizer:
    """The ``optimizer`` section's optimizer: Adam / AdamW as DeepSpeed builds
    them (zerostack's HybridAdam for DeepSpeed's FusedAdam; ``adam_w_mode``
    default true; ``torch_adam`` -> torch.optim.Adam / AdamW), any other name
    the torch.optim class of that name."""
    kind, params_cfg = spec["type"], dict(spec["params"])
    if kind.lower() not in ("adam", "adamw"):
        return getattr(torch.optim, kind)(params, **params_cfg)
    decoupled = params_cfg.pop("adam_w_mode", True) or kind.lower() == "adamw"
    torch_adam = params_cfg.pop("torch_adam", False)
    params_cfg.pop("amsgrad", None)  # false here: the reader refuses true
    if "betas" in params_cfg:
        params_cfg["betas"] = tuple(params_cfg["betas"])
    if torch_adam:
        bias = params_cfg.pop("bias_correction", True)
        if not bias:
            raise ValueError(
                f"{_API}: optimizer.params.bias_correction false needs DeepSpeed's fused Adam "
                "(got torch_adam true); remove torch_adam"
            )
        cls = torch.optim.AdamW if decoupled else torch.optim.Adam
        return cls(params, **params_cfg)
    from zerostack.fused_adam import HybridAdam

    return HybridAdam(params, adamw_mode=decoupled, **params_cfg)


class WarmupLR(torch.optim.lr_scheduler.LRScheduler):
    """DeepSpeed's WarmupLR: the learning rate goes from ``warmup_min_lr``
    to ``warmup_max_lr`` over ``warmup_num_steps`` steps (``warmup_type``
    "log": by log(i + 1) / log(N); "linear": by i / N), then stays. As in
    DeepSpeed, it is ``warmup_min_lr`` from construction until the second
    ``step()`` (DeepSpeed's iteration i is this scheduler's last_epoch - 1).

    Args:
        optimizer: the optimizer.
        warmup_min_lr: the first learning rate. Default 0.0.
        warmup_max_lr: the learning rate after the warmup. Default 0.001.
        warmup_num_steps: the warmup's length (at least 2). Default 1000.
        warmup_type: "log" or "linear". Default "log".
        last_epoch: torch's. Default -1.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        warmup_min_lr: float = 0.0,
        warmup_max_lr: float = 0.001,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_epoch: int = -1,
    ) -> None:
        if warmup_type not in ("log", "linear"):
            raise ValueError(
                f"WarmupLR: warmup_type must be 'log' or 'linear' (got {warmup_type!r})"
            )
        self.min_lrs = _per_group(optimizer, warmup_min_lr, "warmup_min_lr")
        self.max_lrs = _per_group(optimizer, warmup_max_lr, "warmup_max_lr")
        self.warmup_num_steps = max(2, int(warmup_num_steps))
        self.warmup_type = warmup_type
        super().__init__(optimizer, last_epoch)

    def _gamma(self, i: int) -> float:
        if i < self.warmup_num_steps:
            if self.warmup_type == "log":
                return math.log(i + 1) / math.log(self.warmup_num_steps)
            return i / self.warmup_num_steps
        return 1.0

    def get_lr(self) -> list[float]:  # type: ignore[override]
        i = self.last_epoch - 1
        if i < 0:
            return list(self.min_lrs)
        gamma = self._gamma(i)
        return [lo + (hi - lo) * gamma for lo, hi in zip(self.min_lrs, self.max_lrs, strict=True)]


class WarmupDecayLR(WarmupLR):
    """DeepSpeed's WarmupDecayLR: WarmupLR's warmup, then a linear decay to
    ``warmup_min_lr`` at ``total_num_steps`` (DeepSpeed's formula: the lr is
    ``warmup_min_lr + (warmup_max_lr - warmup_min_lr) * gamma`` with ``gamma``
    falling from 1 to 0).

    Args:
        optimizer: the optimizer.
        total_num_steps: the step at which the learning rate reaches ``warmup_min_lr``.
        warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, last_epoch:
            as WarmupLR's.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        total_num_steps: int,
        warmup_min_lr: float = 0.0,
        warmup_max_lr: float = 0.001,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_epoch: int = -1,
    ) -> None:
        self.total_num_steps = int(total_num_steps)
        super().__init__(
            optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, last_epoch
        )

    def _gamma(self, i: int) -> float:
        if i < self.warmup_num_steps:
            return super()._gamma(i)
        left = float(self.total_num_steps - i)
        return max(0.0, left / float(max(1.0, self.total_num_steps - self.warmup_num_steps)))


def _per_group(optimizer: torch.optim.Optimizer, value: Any, name: str) -> list[float]:
    groups = len(optimizer.param_groups)
    if isinstance(value, list | tuple):
        if len(value) != groups:
            raise ValueError(
                f"WarmupLR: {name} must have one value per param group (got {len(value)} for "
                f"{groups} groups); pass one number or {groups}"
            )
        return [float(v) for v in value]
    return [float(value)] * groups


def build_scheduler(spec: dict[str, Any], optimizer: torch.optim.Optimizer) -> WarmupLR:
    cls = WarmupLR if spec["type"] == "WarmupLR" else WarmupDecayLR
    return cls(optimizer, **spec["params"])


# -- cpu_checkpointing -------------------------------------------------------------------


class HostActivations:
    """DeepSpeed's ``activation_checkpointing.cpu_checkpointing``: during the
    model's forward, every tensor autograd saves for backward outside the
    checkpointed regions goes to pinned host memory (asynchronous copies on
    the current stream) and comes back when backward needs it.

    [Note: cpu_checkpointing] torch.utils.checkpoint (reentrant or not)
    saves a region's inputs through the saved-tensor hooks active around the
    call, and inside the region its own hooks replace ours: so the hooks
    installed around the model's forward see the checkpoint inputs (what
    DeepSpeed moves to the host) and, besides, the activations of the layers
    that are not checkpointed, which go to the host too. Turn it on for a
    model whose blocks are checkpointed (e.g. gradient_checkpointing_enable()
    in transformers); a model without checkpointing would send every
    activation to the host. Parameters (and views of them) stay where they
    are: they are in memory anyway. ``saved_tensors`` / ``saved_bytes`` count
    what the last forward kept on the host (moved there, or there already).
    """

    def __init__(self, module: nn.Module) -> None:
        self.pin = torch.cuda.is_available()
        self.saved_tensors = 0
        self.saved_bytes = 0
        self._open: list[Any] = []
        # id -> (weak reference, version, packed): a tensor saved by two ops
        # (log_softmax's output, by nll_loss too) goes to the host once.
        self._seen: dict[int, tuple[weakref.ref, int, Any]] = {}
        self._handles = [
            module.register_forward_pre_hook(self._enter),
            module.register_forward_hook(self._exit, always_call=True),
        ]

    def _enter(self, module: nn.Module, args: Any) -> None:
        if not self._open:
            self.saved_tensors = self.saved_bytes = 0
        ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        ctx.__enter__()
        self._open.append(ctx)

    def _exit(self, module: nn.Module, args: Any, output: Any) -> None:
        self._open.pop().__exit__(None, None, None)
        if not self._open:
            self._seen.clear()

    def _pack(self, t: torch.Tensor) -> tuple[torch.device | None, torch.Tensor]:
        base = t if t._base is None else t._base
        if base.is_leaf and base.requires_grad:
            return None, t  # a parameter: it stays in memory anyway
        seen = self._seen.get(id(t))
        if seen is not None and seen[0]() is t and seen[1] == t._version:
            return seen[2]
        self.saved_tensors += 1
        self.saved_bytes += t.numel() * t.element_size()
        if t.device.type == "cpu":
            packed: tuple[torch.device | None, torch.Tensor] = (None, t)
        else:
            host = torch.empty(t.size(), dtype=t.dtype, layout=t.layout, pin_memory=self.pin)
            host.copy_(t, non_blocking=self.pin)
            packed = (t.device, host)
        self._seen[id(t)] = (weakref.ref(t), t._version, packed)
        return packed

    @staticmethod
    def _unpack(packed: tuple[torch.device | None, torch.Tensor]) -> torch.Tensor:
        device, t = packed
        return t if device is None else t.to(device, non_blocking=True)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
