"""ColoInitContext: ColossalAI's legacy eager construction context, so that
programs written for it run unchanged."""

from __future__ import annotations

import contextlib
import weakref

import torch
from torch import nn
from torch.nn.modules import module as _module_hooks

from zerostack.chunk._chunk import check_device

_API = "ColoInitContext"
_CPU = torch.device("cpu")  # ColossalAI's default device


class ColoInitContext:
    """Build a model eagerly with its parameters on ``device``, as ColossalAI's
    (legacy) ``ColoInitContext``.

    Inside the ``with`` block tensors made without a device go to ``device``
    (as under ``torch.device(device)``), so that initialisation runs there;
    at the end of the block every module built in it has its parameters and
    buffers moved to ``device`` (those made with an explicit device too) and
    its floating-point parameters cast to ``dtype``. Values are drawn on
    ``device`` (ColossalAI drew them on the CPU and moved them), and the
    model is whole in memory, unlike under ``LazyInitContext``.

    Args:
        device: where the parameters live. Default ``torch.device("cpu")``.
        dtype: the floating-point parameters' dtype. Default ``torch.float``.
        default_pg: ColossalAI's tensor-parallel process group: only None.
        default_dist_spec: ColossalAI's tensor-parallel layout: only None.

    Raises:
        TypeError: ``device`` is not a device or str, or ``dtype`` not a
            floating-point torch.dtype.
        ValueError: ``device`` is not a device name, is meta, or is CUDA
            where CUDA is not available.
        NotImplementedError: ``default_pg`` or ``default_dist_spec`` given.
    """

    def __init__(
        self,
        device: torch.device | str = _CPU,
        dtype: torch.dtype = torch.float,
        default_pg: object = None,
        default_dist_spec: object = None,
    ) -> None:
        for name, value in (("default_pg", default_pg), ("default_dist_spec", default_dist_spec)):
            if value is not None:
                raise NotImplementedError(
                    f"{_API}: {name} is not implemented (got {type(value).__name__}): it "
                    "configured ColossalAI's tensor parallelism; leave it None (data "
                    "parallelism comes from the Booster's plugin)"
                )
        self.device = check_device(_API, "device", device)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"{_API}: dtype must be a floating-point torch.dtype (got {dtype!r})")
        self.dtype = dtype
        self._stack: contextlib.ExitStack | None = None
        self._built: weakref.WeakSet[nn.Module] = weakref.WeakSet()

    def __enter__(self) -> ColoInitContext:
        if self._stack is not None:
            raise RuntimeError(
                f"{_API}: this context is already entered (got a nested `with` on it); use "
                "a new ColoInitContext() for each `with`"
            )

        def remember(module: nn.Module, name: str, value: object) -> None:
            self._built.add(module)

        stack = contextlib.ExitStack()
        for register in (
            _module_hooks.register_module_parameter_registration_hook,
            _module_hooks.register_module_buffer_registration_hook,
            _module_hooks.register_module_module_registration_hook,
        ):
            stack.callback(register(remember).remove)
        stack.enter_context(torch.device(self.device))
        self._stack = stack
        return self

    def __exit__(self, *exc: object) -> None:
        stack, self._stack = self._stack, None
        stack.__exit__(*exc)
        if exc[0] is not None:
            return
        with torch.no_grad():
            for module in list(self._built):
                for p in module.parameters(recurse=False):
                    dtype = self.dtype if p.is_floating_point() else p.dtype
                    if p.device != self.device or p.dtype != dtype:
                        p.data = p.data.to(self.device, dtype)
                for b in module.buffers(recurse=False):
                    if b.device != self.device:
                        b.data = b.data.to(self.device)
        self._built = weakref.WeakSet()
