"""What ``param.grad`` holds once a wrapper took the gradient into its shards.

[Note: sharded param.grad] ZeroOptimizer and GeminiDDP move each
parameter's gradient into their reduced pieces as soon as backward
produces it, and left ``param.grad`` None. torch's
``clip_grad_norm_(model.parameters(), max_norm)`` then found no gradient
and returned 0.0 without clipping anything, and any code reading
``param.grad`` (a per-parameter norm, ``clip_grad_value_``) saw none, with
no warning. So ``param.grad`` holds a :class:`ShardedGradient` instead
from the moment the wrapper takes a gradient until the step (or
``zero_grad``) clears it: a tensor of the parameter's shape, dtype and
device without storage, on which every operation raises an error that
names ``booster.clip_grad_norm_(model, optimizer, max_norm)`` and the
optimizer's ``clip_grad_by_norm``. torch is not patched: its functions
meet a tensor that refuses to be read.

What still works on it, so that the wrappers' own paths and torch's
bookkeeping go on as before: ``nn.Module.zero_grad`` / ``Optimizer.zero_grad``
(``set_to_none`` either way: ``zero_()`` drops what it holds and marks it
:attr:`ShardedGradient.cleared`, so a wrapper can drop the reduced piece
too, as it does when ``param.grad`` no longer holds its guard), and
autograd's accumulation into it (a backward after the wrapper took the
gradient and before the step: ``param.grad += new`` stores ``new`` in
:attr:`ShardedGradient.local`, which the wrapper reads back through
:func:`local_grad`). One instance per parameter is made when the wrapper
is built and reused every step (nothing allocated in the hot path); it
holds no reference to the parameter or the wrapper.
"""

from __future__ import annotations

import warnings

import torch

_ZERO_OPS = frozenset({torch.ops.aten.zero_.default})
_ACCUMULATE_OPS = frozenset({torch.ops.aten.add_.Tensor})


class ShardedGradient(torch.Tensor):
    """``param.grad`` of a parameter whose gradient lives in a wrapper's
    shards (see [Note: sharded param.grad]). Every operation on it raises
    a RuntimeError saying how to clip or read the gradient instead.

    Args:
        shape, dtype, device: the parameter's (as when it holds its values).
        owner: the wrapper, named in the error.

    Attributes:
        local: a gradient autograd accumulated into ``param.grad`` after
            the wrapper took the last one (None when there is none).
        cleared: ``zero_()`` ran on it (``zero_grad(set_to_none=False)``)
            since the wrapper last took a gradient; the wrapper resets it.
    """

    __slots__ = ("cleared", "local", "owner")
    local: torch.Tensor | None
    cleared: bool
    owner: str

    @staticmethod
    def __new__(
        cls, shape: torch.Size, dtype: torch.dtype, device: torch.device, owner: str
    ) -> ShardedGradient:
        self = torch.Tensor._make_wrapper_subclass(
            cls, shape, dtype=dtype, device=device, requires_grad=False
        )
        self.local = None
        self.cleared = False
        self.owner = owner
        return self

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        me = args[0] if args and type(args[0]) is cls else None
        if me is not None and func in _ZERO_OPS:
            me.local, me.cleared = None, True
            return me
        if (
            me is not None
            and func in _ACCUMULATE_OPS
            and kwargs.get("alpha", 1) == 1
            and type(args[1]) is torch.Tensor
        ):
            # autograd's ``param.grad += new`` (a second backward before the step)
            new = args[1]
            me.local = new.detach().clone() if me.local is None else me.local.add_(new)
            return me
        if func is torch.ops.aten._amp_foreach_non_finite_check_and_unscale_.default:
            # GradScaler.unscale_ or .step: the first argument is the list of gradients
            owner = next((a.owner for a in args[0] if type(a) is cls), "the optimizer")
            raise RuntimeError(grad_scaler_refusal(owner))
        owner = next((a.owner for a in args if type(a) is cls), "the optimizer")
        raise RuntimeError(
            f"{owner}: this parameter's gradient is reduced and sharded over the ranks, so "
            f"param.grad holds no values (got {func} on it, e.g. from "
            "torch.nn.utils.clip_grad_norm_ or a gradient norm logged by hand); clip with "
            "booster.clip_grad_norm_(model, optimizer, max_norm) or "
            "optimizer.clip_grad_by_norm(max_norm), which clip the whole gradient over every "
            "rank (and the plugin's max_norm= clips at every step); to log the gradient's total "
            "norm, optimizer.clip_grad_by_norm(float('inf')) returns it before step()"
        )

    def __repr__(self, *, tensor_contents=None) -> str:  # type: ignore[override]  # torch's signature
        return (
            f"ShardedGradient(shape={tuple(self.shape)}, dtype={self.dtype}, "
            f"device={self.device}, owner={self.owner}: the gradient lives in its shards)"
        )


def local_grad(param: torch.Tensor) -> torch.Tensor | None:
    """The gradient autograd left in ``param.grad`` for the wrapper to take:
    a plain tensor, or what a :class:`ShardedGradient` accumulated."""
    g = param.grad
    if type(g) is ShardedGradient:
        return g.local
    return g


def is_sharded(grad: object) -> bool:
    """True for a :class:`ShardedGradient`."""
    return type(grad) is ShardedGradient


def say_zero_grads_are_dropped(owner: object, api: str) -> None:
    """Warn once per ``owner`` that ``zero_grad(set_to_none=False)`` drops the
    gradients, as ``set_to_none=True`` does.

    Gradients live in the wrapper's shards or chunks, which a step consumes:
    there is no zero ``.grad`` to keep. torch's optimizers step a parameter
    whose ``.grad`` is a kept zero tensor (its weight decay and momentum move
    it), so a parameter that gets no gradient in a later step moves under
    torch and not here; ColossalAI's and DeepSpeed's ZeRO optimizers do the
    same as this.
    """
    if getattr(owner, "_said_zero_grads_dropped", False):
        return
    owner._said_zero_grads_dropped = True  # type: ignore[attr-defined]
    warnings.warn(
        f"{api}(set_to_none=False): the gradients are dropped, as with set_to_none=True: "
        "they live in the shards, which each step consumes. A parameter that gets no "
        "gradient in a later step is not stepped then, where torch's optimizers step its "
        "kept zero .grad (weight decay and momentum move it), as ColossalAI's and "
        "DeepSpeed's ZeRO optimizers do",
        UserWarning,
        stacklevel=3,
    )


def grad_scaler_refusal(api: str) -> str:
    """The error for torch.amp.GradScaler over a sharded optimizer (booster-api's
    [Note: torch's GradScaler])."""
    return (
        f"{api}: torch.amp.GradScaler cannot scale this optimizer's steps (got "
        "GradScaler.unscale_ or GradScaler.step on it): the gradients live in its shards, so "
        "param.grad holds no values to unscale or check. Drop the GradScaler and call "
        "booster.backward(loss, optimizer) and optimizer.step(): the plugin's precision='fp16' "
        "scales the loss dynamically (as ColossalAI's plugins and DeepSpeed's fp16 config do), "
        "and bf16 needs no scaling"
    )
